"""Sample one video by full-sequence sampling (every latent frame at once), sequence-parallel under torchrun.

    python experiments/generate_full.py                                   # the tiny model, one CPU process
    torchrun --standalone --nproc_per_node 2 experiments/generate_full.py parallel.sp_mode=torus
    torchrun --standalone --nproc_per_node 2 experiments/generate_full.py model=wan-1.3b frames=21 height=60 width=104

Every rank builds the same model (a checkpoint of experiments/train.py, or seeded random weights
of the `model` preset) and noise; rank 0 writes the latents, and the video for a pixel-space model.
"""
from __future__ import annotations

import dataclasses

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.hydra_config import model_config, script_main
from megaslide.config import from_dict
from megaslide.inference.full import FullConfig, FullSequenceSampler
from megaslide.inference.launch import init_distributed, shutdown
from megaslide.inference.outputs import save_latents
from megaslide.device import precision_dtype
from megaslide.inference.weights import load_model


def build_inputs(c: dict, device: torch.device):
    """(model, noise (1, C, T, H, W), caption ids (1, L)), the same on every rank, from a generate_* config."""
    model = load_model(model_config(c["model"], c["attention"]), checkpoint=c["checkpoint"], seed=c["seed"],
                       device=device, dtype=precision_dtype(c["dtype"], device, key="dtype"))
    gen = torch.Generator().manual_seed(c["seed"])
    noise = torch.randn(1, model.cfg.in_channels, c["frames"], c["height"], c["width"], generator=gen)
    return model, noise, model.tokenizer([c["caption"]]).to(device)


def sampler_config(cls, c: dict):
    """The sampler's typed config from the keys of the Hydra config that name its fields."""
    return from_dict(cls, {f.name: c[f.name] for f in dataclasses.fields(cls) if f.name in c})


@script_main("generate_full")
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(cfg, resolve=True)
    ctx = init_distributed(c["device"])
    model, noise, ids = build_inputs(c, ctx.device)
    sampler = FullSequenceSampler(model, frames=c["frames"], height=c["height"], width=c["width"],
                                  config=sampler_config(FullConfig, c), group=ctx.group)
    video = sampler.sample(noise, ids)
    if ctx.is_main:
        for path in save_latents(c["out"], video):
            print(f"wrote {path}", flush=True)
    shutdown(ctx)


if __name__ == "__main__":
    main()
