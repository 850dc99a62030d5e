"""Config -> dataset. The datasets take plain arguments; this is the only place that reads DataConfig."""
from __future__ import annotations

from megaslide.config import DataConfig


def build_dataset(cfg: DataConfig, in_channels: int = 3):
    cfg.validate()
    cfg.check_channels(in_channels)
    if cfg.name == "moving_shapes":
        from megaslide.data.moving_shapes import MovingShapes
        return MovingShapes(num_videos=cfg.num_videos, frames=cfg.frames, height=cfg.height, width=cfg.width,
                            num_shapes=cfg.num_shapes, speed=cfg.speed, shape_size=cfg.shape_size, seed=cfg.seed)
    if cfg.name == "latent_cache":
        from megaslide.data.latent_cache import LatentCache
        return LatentCache(cfg.root)
    from megaslide.data.video_folder import VideoFolder
    return VideoFolder(cfg.root, frames=cfg.frames, height=cfg.height, width=cfg.width)
