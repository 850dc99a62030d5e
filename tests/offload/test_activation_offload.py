"""Activation offload (offload.activation_offload) in the offload engine, on CPU.

The CPU path runs the engine's real scheduling: every saved block input but the last two
streamed blocks' is copied into its host buffer on the D2H lane and back on the H2D lane,
so the parity tests check the data path, the bookkeeping tests the device-side footprint.
"""
import dataclasses

import pytest
import torch

from megaslide.config import OffloadConfig
from megaslide.offload.host_state import InputBuffers
from megaslide.perf.stream_schedule import parked_inputs
from megaslide.train import trainer as trainer_module
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

STEPS = 3
CLIP = 0.05  # below the tiny model's gradient norm: clipping triggers on every step

pytestmark = pytest.mark.usefixtures("torch_adamw")


def _trainer(tmp_path, name, depth, *, activation_offload, resident_blocks=0, overlap=True, optimizer_device="cpu",
             **train):
    model_cfg = dataclasses.replace(tiny_model_cfg(), depth=depth)
    offload = OffloadConfig(enabled=True, resident_blocks=resident_blocks, activation_offload=activation_offload,
                            overlap=overlap, optimizer_device=optimizer_device)
    return Trainer(model_cfg, tiny_data_cfg(), tiny_train_cfg(**{"steps": STEPS, "weight_decay": 0.01, **train}),
                   tmp_path / name, offload_cfg=offload)


def _input_bytes(trainer) -> int:
    """One block input (B, N, D) in fp32."""
    d = trainer.data_cfg
    tokens = trainer.model_cfg.token_grid(d.frames, d.height, d.width)
    return trainer.cfg.batch_size * tokens[0] * tokens[1] * tokens[2] * trainer.model_cfg.dim * 4


@pytest.mark.parametrize("depth,resident_blocks,grad_clip,modes", [
    (1, 0, CLIP, {}), (3, 0, CLIP, {}), (3, 0, 0.0, {}), (5, 0, CLIP, {}), (5, 0, 0.0, {}), (5, 1, CLIP, {}),
    (6, 2, 0.0, {}), (5, 0, CLIP, {"overlap": False, "optimizer_device": "gpu"})])
def test_bit_identical_to_the_engine_without_it(tmp_path, depth, resident_blocks, grad_clip, modes):
    """fp32 on CPU: losses, gradient norms and every weight equal after several steps (also in
    the serial and GPU-optimizer ablations, whose updates share the H2D and D2H lanes)."""
    plain = _trainer(tmp_path, "plain", depth, activation_offload=False, resident_blocks=resident_blocks,
                     grad_clip=grad_clip, **modes)
    parked = _trainer(tmp_path, "parked", depth, activation_offload=True, resident_blocks=resident_blocks,
                      grad_clip=grad_clip, **modes)
    expected = max(0, depth - resident_blocks - 2)
    assert parked.engine.host.inputs.count == parked_inputs(depth, resident_blocks) == expected
    for _ in range(STEPS):
        a, b = plain.train_step(), parked.train_step()
        assert a["loss"].item() == b["loss"].item() and a["grad_norm"].item() == b["grad_norm"].item()
        if grad_clip:
            assert a["grad_norm"].item() > grad_clip
    mine, theirs = parked.engine.model_state_dict(), plain.engine.model_state_dict()
    for name, p in theirs.items():
        assert torch.equal(p, mine[name]), name


@pytest.mark.parametrize("activation_offload,expected", [(True, 2), (False, 6)])
def test_device_holds_at_most_two_saved_inputs(tmp_path, activation_offload, expected):
    """The saved inputs on the device (the streamer's bookkeeping), sampled at every block call
    of the forward and of the backward's recompute: two with activation offload, whatever the
    depth; every block's without."""
    trainer = _trainer(tmp_path, "eng", 6, activation_offload=activation_offload)
    eng = trainer.engine
    live = eng.streamer.inputs.live
    counts = []
    for block in eng.model.blocks:
        block.register_forward_pre_hook(lambda module, args: counts.append(len(live)))
    for _ in range(2):
        counts.clear()
        trainer.train_step()
        assert len(counts) == 2 * 6                    # 6 forward calls, 6 recomputes
        assert max(counts) == eng.streamer.inputs.peak == expected
        assert not live                                # the backward released every input


def test_transfers_and_host_buffers(tmp_path):
    """Per step each parked input goes D2H once and H2D once, beside the weights; its host
    buffer holds exactly one block input, allocated once."""
    depth = 5
    plain = _trainer(tmp_path, "plain", depth, activation_offload=False)
    parked = _trainer(tmp_path, "parked", depth, activation_offload=True)
    for _ in range(4):
        plain.train_step()
        parked.train_step()
    parts = {name: t.engine.breakdown(range(1, 3)) for name, t in (("plain", plain), ("parked", parked))}
    extra = (depth - 2) * _input_bytes(parked)
    assert parts["parked"].d2h_bytes == parts["plain"].d2h_bytes + extra
    assert parts["parked"].h2d_bytes == parts["plain"].h2d_bytes + extra
    inputs = parked.engine.host.inputs
    assert inputs.capacity == _input_bytes(parked) and len(inputs.buffers) == depth - 2
    arena = inputs.arena
    parked.train_step()
    assert inputs.arena is arena


def test_input_buffers_grow_only():
    buffers = InputBuffers(3, pin=False)
    buffers.reserve(1000)
    arena = buffers.arena
    buffers.reserve(600)
    assert buffers.arena is arena and buffers.capacity == 1000
    x = torch.randn(2, 5, 7)
    view = buffers.view(2, x)
    view.copy_(x)
    assert torch.equal(buffers.view(2, x), x) and view.data_ptr() == buffers.buffers[2].data_ptr()
    buffers.reserve(4096)
    assert buffers.arena is not arena and buffers.capacity == 4096
    assert all(b.numel() == 4096 for b in buffers.buffers)
    with pytest.raises(ValueError, match="does not fit"):
        buffers.view(0, torch.zeros(2000))


def test_activation_offload_without_the_engine_is_refused_before_building(tmp_path, monkeypatch):
    def build_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the configs were checked")
    monkeypatch.setattr(trainer_module, "build_engine", build_engine)
    with pytest.raises(ValueError, match=r"offload.activation_offload=true .* set offload.enabled=true"):
        Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(), tmp_path,
                offload_cfg=OffloadConfig(activation_offload=True))
