"""The offload engine trains a DSA model over frame slabs (`execution.slab_frames`) with token chunks and
activation offload as it trains the same model whole: the long-clip configuration, checked on CPU."""
import dataclasses

import pytest
import torch

from megaslide.config import ExecutionConfig, OffloadConfig
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

pytestmark = pytest.mark.usefixtures("torch_adamw")


def _trainer(tmp_path, name, **execution):
    model_cfg = dataclasses.replace(tiny_model_cfg("dsa", max_offset=1.5), depth=4)
    offload = OffloadConfig(enabled=True, activation_offload=bool(execution))
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
