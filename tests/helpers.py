"""Small builders shared by tests: tiny configs that train in seconds on CPU."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from megaslide.config import AttentionConfig, DataConfig, TrainConfig
from megaslide.models.dit import DIT_PRESETS

# torch.compile's default backend on CPU generates C++ and builds it with g++ (torch._inductor.config.cpp.cxx)
needs_inductor = pytest.mark.skipif(shutil.which("g++") is None,
                                    reason="Inductor's CPU backend needs a C++ compiler (g++), none is installed")


def tiny_model_cfg(attention: str = "dense", **kw):
    cfg = DIT_PRESETS["tiny"]
    return dataclasses.replace(cfg, attention=AttentionConfig(attention, kw))


def tiny_data_cfg(**kw) -> DataConfig:
    return DataConfig(**{"frames": 4, "height": 16, "width": 16, "num_videos": 32, "shape_size": 6, **kw})


def tiny_train_cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"steps": 4, "batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "device": "cpu",
                          "log_every": 1, "ckpt_every": 1000, "sample_steps": 2, **kw})
