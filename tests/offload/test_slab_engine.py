"""The offload engine trains a DSA model over frame slabs (`execution.slab_frames`) with token chunks and
activation offload as it trains the same model whole: the long-clip configuration, checked on CPU."""
import collections
import dataclasses
import functools

import pytest
import torch

from megaslide.attention.dsa.module import DSAAttention
from megaslide.config import ExecutionConfig, OffloadConfig
from megaslide.models.block_grad import autograd_block_grad
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

pytestmark = pytest.mark.usefixtures("torch_adamw")


def _trainer(tmp_path, name, activation_offload=None, **execution):
    model_cfg = dataclasses.replace(tiny_model_cfg("dsa", max_offset=1.5), depth=4)
    parked = bool(execution) if activation_offload is None else activation_offload
    offload = OffloadConfig(enabled=True, activation_offload=parked)
    return Trainer(model_cfg, tiny_data_cfg(frames=12, height=8, width=8, shape_size=4),
                   tiny_train_cfg(steps=3, weight_decay=0.01),
                   tmp_path / name, offload_cfg=offload, execution=ExecutionConfig(**execution))


def test_slabbed_chunked_parked_engine_equals_the_whole_clip_engine(tmp_path):
    """12 frames in 2-frame slabs (DSA's reach: 3 + 2 frames each side), 40-token slices, parked inputs:
    losses, gradient norms and weights agree with the unchunked engine to fp32 rounding."""
    whole = _trainer(tmp_path, "whole")
    slabbed = _trainer(tmp_path, "slabbed", slab_frames=2, chunk_tokens=40)
    for _ in range(3):
        a, b = whole.train_step(), slabbed.train_step()
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-4, atol=0)
    theirs, mine = whole.engine.model_state_dict(), slabbed.engine.model_state_dict()
    for name, p in theirs.items():
        torch.testing.assert_close(mine[name], p, rtol=1e-4, atol=1e-6)
    learned = [p for n, p in mine.items() if "offset_proj.weight" in n]
    assert learned and all(p.abs().max() > 0 for p in learned)   # the offsets moved: their gradients flowed


@pytest.mark.parametrize("parked", [False, True])
def test_block_grad_engine_equals_the_recompute_engine(tmp_path, monkeypatch, parked):
    """The streamed blocks' gradients by `BlockRunner.block_grad` (the engine's) and by autograd through their
    recompute (the streamer's default): 3 steps, 2-frame slabs, 40-token slices, with and without parked inputs.
    Losses, gradient norms and weights agree to fp32 summation order (the same products summed over slices, slabs
    and halo rows in another order; 1e-5 is ~80 ulps); the attention runs 2 times per slab and step, not 3."""
    attends = collections.Counter()
    attend = DSAAttention.attend
    monkeypatch.setattr(DSAAttention, "attend",
                        lambda self, *a, **k: attends.update([self.layer_idx]) or attend(self, *a, **k))
    trainers = {}
    for name in ("recompute", "block_grad"):
        trainers[name] = _trainer(tmp_path, name, slab_frames=2, chunk_tokens=40, activation_offload=parked)
    streamer = trainers["recompute"].engine.streamer
    streamer.grad = functools.partial(autograd_block_grad, streamer.run)
    slabs = 6                                                          # 12 frames
    for _ in range(3):
        attends.clear()
        a = trainers["recompute"].train_step()
        assert set(attends.values()) == {3 * slabs}                    # per block: forward, recompute, slab re-run
        attends.clear()
        b = trainers["block_grad"].train_step()
        assert set(attends.values()) == {2 * slabs}                    # per block: forward, slab pass
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-5, atol=0)
    theirs, mine = (trainers[n].engine.model_state_dict() for n in ("recompute", "block_grad"))
    for name, p in theirs.items():
        torch.testing.assert_close(mine[name], p, rtol=1e-5, atol=1e-7, msg=name)
