"""Generate a video for a caption from a checkpoint written by experiments/train.py.

    python experiments/sample.py checkpoint=runs/train/checkpoints/step_200.pt caption="a blue square moving up"
"""
from __future__ import annotations

import hydra
import torch
from omegaconf import DictConfig

from megaslide.config import DataConfig, DiTConfig, from_dict
from megaslide.data.video_io import write_mp4
from megaslide.device import resolve_device
from megaslide.diffusion.samplers import euler_sample
from megaslide.models.dit import VideoDiT
from megaslide.train.checkpoint import load_checkpoint


def generate(checkpoint: str, caption: str, steps: int, cfg_scale: float, seed: int, device: str) -> torch.Tensor:
    """One video (C, T, H, W) in [-1, 1] at the training clip size."""
    state = load_checkpoint(checkpoint)
    model_cfg, data_cfg = from_dict(DiTConfig, state["model_cfg"]), from_dict(DataConfig, state["data_cfg"])
    dev = resolve_device(device)
    model = VideoDiT(model_cfg)
    model.load_state_dict(state["ema"] or state["model"])
    model.to(dev).eval()
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, model_cfg.in_channels, data_cfg.frames, data_cfg.height, data_cfg.width, generator=g)
    ids, null = model.tokenizer([caption]).to(dev), model.tokenizer([""]).to(dev)
    x = euler_sample(model, noise.to(dev), ids, null, steps=steps, cfg_scale=cfg_scale)
    return x[0].float().clamp(-1, 1).cpu()


@hydra.main(version_base="1.3", config_path="conf", config_name="sample")
def main(cfg: DictConfig) -> None:
    video = generate(cfg.checkpoint, cfg.caption, cfg.steps, cfg.cfg_scale, cfg.seed, cfg.device)
    print(f"wrote {write_mp4(cfg.out, video)}")


if __name__ == "__main__":
    main()
