"""The two baselines as DiT configs: dense 3D-DiT and Swin-DiT, on any MegaSlide preset."""
from __future__ import annotations

import dataclasses

from megaslide.config import DiTConfig
from megaslide.models.dit import DIT_PRESETS


def dense_dit(preset: str = "tiny") -> DiTConfig:
    """Dense 3D-DiT: global SDPA (flash attention on GPU) over all tokens."""
    cfg = DIT_PRESETS[preset]
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, name="dense"))


def swin_dit(preset: str = "tiny", window: tuple[int, int, int] = (2, 4, 4)) -> DiTConfig:
    """Swin-DiT: Video-Swin 3D windows with alternating half-window shifts."""
    cfg = DIT_PRESETS[preset]
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, name="swin", window=window))
