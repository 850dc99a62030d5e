"""Boundary stride (offload.boundary_stride) in the offload engine, on CPU.

Stride k keeps the inputs of blocks 0, k, 2k, ... and re-runs each segment's forward in the
backward: the same ops on the same inputs as stride 1, so fp32 losses, gradient norms and weights
are bit-identical; the counts the planner uses (`parked_inputs`, `inputs_on_device`,
`weight_loads`) are checked against what the streamer does.
"""
import dataclasses

import pytest
import torch

from megaslide.config import OffloadConfig
from megaslide.perf.stream_schedule import backward_ops, inputs_on_device, parked_inputs, weight_loads
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

STEPS = 3
CLIP = 0.05  # below the tiny model's gradient norm: clipping triggers on every step

pytestmark = pytest.mark.usefixtures("torch_adamw")


def _trainer(tmp_path, name, depth, stride, *, activation_offload=False, resident_blocks=0, overlap=True,
             optimizer_device="cpu", **train):
    model_cfg = dataclasses.replace(tiny_model_cfg(), depth=depth)
    offload = OffloadConfig(enabled=True, resident_blocks=resident_blocks, activation_offload=activation_offload,
                            boundary_stride=stride, overlap=overlap, optimizer_device=optimizer_device)
    return Trainer(model_cfg, tiny_data_cfg(), tiny_train_cfg(**{"steps": STEPS, "weight_decay": 0.01, **train}),
                   tmp_path / name, offload_cfg=offload)


def _input_bytes(trainer) -> int:
    """One block input (B, N, D) in fp32."""
    d = trainer.data_cfg
    t, h, w = trainer.model_cfg.token_grid(d.frames, d.height, d.width)
    return trainer.cfg.batch_size * t * h * w * trainer.model_cfg.dim * 4


@pytest.mark.parametrize("stride,activation_offload,grad_clip,resident_blocks,modes", [
    (2, False, CLIP, 0, {}), (2, False, 0.0, 0, {}), (2, True, CLIP, 0, {}), (2, True, 0.0, 0, {}),
    (3, False, CLIP, 0, {}), (3, False, 0.0, 0, {}), (3, True, CLIP, 0, {}), (3, True, 0.0, 0, {}),
    (2, True, CLIP, 1, {}), (3, False, 0.0, 2, {}), (7, True, CLIP, 0, {}),
    (2, True, CLIP, 0, {"overlap": False, "optimizer_device": "gpu"})])
def test_bit_identical_to_stride_one(tmp_path, stride, activation_offload, grad_clip, resident_blocks, modes):
    """fp32 on CPU, depth 5 (a multiple of neither stride): losses, gradient norms and every weight
    equal stride 1's after several steps; also beside a resident tail, with one segment holding
    every block (stride > depth) and in the serial and GPU-optimizer ablations."""
    depth = 5
    kw = {"activation_offload": activation_offload, "resident_blocks": resident_blocks, "grad_clip": grad_clip,
          **modes}
    plain, strided = _trainer(tmp_path, "plain", depth, 1, **kw), _trainer(tmp_path, "strided", depth, stride, **kw)
    for _ in range(STEPS):
        a, b = plain.train_step(), strided.train_step()
        assert a["loss"].item() == b["loss"].item() and a["grad_norm"].item() == b["grad_norm"].item()
        if grad_clip:
            assert a["grad_norm"].item() > grad_clip
    mine, theirs = strided.engine.model_state_dict(), plain.engine.model_state_dict()
    for name, p in theirs.items():
        assert torch.equal(p, mine[name]), name


@pytest.mark.parametrize("depth,stride,resident_blocks,activation_offload", [
    (5, 2, 0, True), (5, 2, 0, False), (7, 3, 0, True), (7, 3, 0, False), (8, 4, 0, True), (8, 2, 2, True),
    (6, 1, 0, True), (6, 1, 0, False), (4, 6, 0, True)])
def test_counts_match_the_streamer(tmp_path, depth, stride, resident_blocks, activation_offload):
    """What the planner is told (parked inputs, inputs on the device, weight copies) is what the
    streamer does: host buffers, `SavedInputs.peak` and the live inputs after the forward, the
    block calls (a forward each, plus the re-runs and the recomputes), and the H2D / D2H bytes."""
    trainer = _trainer(tmp_path, "eng", depth, stride, activation_offload=activation_offload,
                       resident_blocks=resident_blocks)
    eng = trainer.engine
    streamed = depth - resident_blocks
    parked = parked_inputs(depth, resident_blocks, stride) if activation_offload else 0
    after, _, peak = inputs_on_device(depth, resident_blocks, stride, parked > 0)
    assert eng.host.inputs.count == parked
    live, calls, after_forward = eng.streamer.inputs.live, [], []
    for block in eng.model.blocks:
        block.register_forward_pre_hook(lambda module, args: calls.append(len(live)))
    eng.model.final.register_forward_pre_hook(lambda module, args: after_forward.append(len(live)))
    reruns = sum(not grad for _, grad in backward_ops(streamed, stride))
    for _ in range(4):
        calls.clear()
        trainer.train_step()
        assert len(calls) == depth + reruns + streamed
        assert eng.streamer.inputs.peak == max(calls) == peak and after_forward[-1] == after
        assert not live
    parts = eng.breakdown(range(1, 3))
    weights, grads = weight_loads(depth, resident_blocks, stride) * eng.layout.numel * 4, depth * eng.layout.numel * 4
    assert parts.h2d_bytes == weights + parked * _input_bytes(trainer)
    assert parts.d2h_bytes == grads + parked * _input_bytes(trainer)


@pytest.mark.parametrize("depth,stride", [(5, 2), (8, 4), (7, 3), (6, 1)])
def test_consecutive_blocks_alternate_shells(tmp_path, depth, stride):
    """Each block call runs in the other shell than the call before it if that was another block (so
    the next block's H2D overlaps it); also where the backward jumps from block s to the re-run of
    block s-k with k even."""
    trainer = _trainer(tmp_path, "eng", depth, stride, activation_offload=True)
    calls = []
    for index, block in enumerate(trainer.engine.model.blocks):
        block.register_forward_pre_hook(
            lambda module, args, index=index: calls.append((index, next(module.parameters()).data_ptr())))
    for _ in range(2):
        trainer.train_step()
    assert len({shell for _, shell in calls}) == 2
    for (a, shell_a), (b, shell_b) in zip(calls, calls[1:]):
        assert a == b or shell_a != shell_b, (a, b)


def test_backward_ops_and_weight_loads():
    assert backward_ops(5, 2) == [(4, True), (2, False), (3, True), (2, True), (0, False), (1, True), (0, True)]
    assert backward_ops(5, 1) == [(i, True) for i in reversed(range(5))]
    assert backward_ops(3, 5) == [(2, True), (1, True), (0, True)]
    for depth in range(1, 9):
        for resident in range(depth + 1):
            assert weight_loads(depth, resident) == depth + max(0, depth - resident - 2)
            assert parked_inputs(depth, resident) == max(0, depth - resident - 2)
    # the last segment's blocks but one are still in the shells; a full segment before it re-runs k - 1
    # blocks and recomputes k, the last re-run one still in its shell
    assert weight_loads(9, 0, 3) == 9 + 1 + 4 + 4 and parked_inputs(9, 0, 3) == 1
    assert parked_inputs(32, 0, 5) == 5 and inputs_on_device(32, 0, 5, True) == (3, 5, 5)


def test_a_stride_below_one_is_refused():
    with pytest.raises(ValueError, match=r"offload.boundary_stride=0 must be >= 1"):
        OffloadConfig(enabled=True, boundary_stride=0).validate()
