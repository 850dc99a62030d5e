"""Generate a video for a caption from a checkpoint written by experiments/train.py.

    python experiments/sample.py checkpoint=runs/train/checkpoints/step_200.pt caption="a blue square moving up"

Either checkpoint format: a step_N.pt file (EMA weights when the run kept them) or a sharded
step_N/ folder of the offload engine. The video has the training clip's size; the model must be
a pixel-space (RGB) one, as every model experiments/train.py trains is.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from experiments.hydra_config import script_config, script_main
from megaslide.config import DataConfig, DiTConfig, from_dict
from megaslide.data.video_io import write_mp4
from megaslide.device import resolve_device
from megaslide.diffusion.samplers import euler_sample
from megaslide.models.dit import VideoDiT
from megaslide.inference.weights import sampling_weights


@dataclass
class SampleConfig:
    """The keys of experiments/conf/sample.yaml."""

    checkpoint: str
    caption: str
    steps: int
    cfg_scale: float
    seed: int
    device: str
    out: str

    def validate(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1 (Euler steps of the sampler)")
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale={self.cfg_scale} must be >= 0 (1: no guidance)")
        if Path(self.out).suffix.lower() != ".mp4":
            raise ValueError(f"out={self.out!r}: sample.py writes mp4 video only; give a name ending in .mp4")
        folder = next(p for p in Path(self.out).absolute().parents if p.exists())   # the nearest that exists
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ValueError(f"out={self.out!r}: {folder} is not a folder this user can write; give an out path "
                             f"in a writable folder")
        resolve_device(self.device, key="device")
        if not Path(self.checkpoint).exists():
            raise ValueError(f"checkpoint={self.checkpoint!r} does not exist; pass a checkpoint of "
                             f"experiments/train.py (checkpoints/step_N.pt or checkpoints/step_N/)")


def generate(cfg: SampleConfig) -> torch.Tensor:
    """One video (C, T, H, W) in [-1, 1] at the training clip size."""
    dev = resolve_device(cfg.device, key="device")
    weights, state = sampling_weights(cfg.checkpoint)
    model_cfg, data_cfg = from_dict(DiTConfig, state["model_cfg"]), from_dict(DataConfig, state["data_cfg"])
    data_cfg.check_channels(model_cfg.in_channels)
    model = VideoDiT(model_cfg)
    model.load_state_dict(weights)
    model.to(dev).eval()
    g = torch.Generator().manual_seed(cfg.seed)
    noise = torch.randn(1, model_cfg.in_channels, data_cfg.frames, data_cfg.height, data_cfg.width, generator=g)
    ids, null = model.tokenizer([cfg.caption]).to(dev), model.tokenizer([""]).to(dev)
    x = euler_sample(model, noise.to(dev), ids, null, steps=cfg.steps, cfg_scale=cfg.cfg_scale)
    return x[0].float().clamp(-1, 1).cpu()


@script_main("sample")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(SampleConfig, hydra_cfg)
    video = generate(cfg)
    try:
        path = write_mp4(cfg.out, video)
    except OSError as err:   # a full disk, or a folder that turned read-only while the video was sampled
        sys.exit(f"error: {err}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
