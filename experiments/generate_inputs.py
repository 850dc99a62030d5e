"""What generate_full.py and generate_causal.py build alike from their Hydra config: the model, the
noise and the caption ids (the same on every rank), and the sampler's typed config."""
from __future__ import annotations

import dataclasses

import torch

from experiments.hydra_config import model_config
from megaslide.config import from_dict
from megaslide.device import precision_dtype
from megaslide.inference.weights import caption_input, load_model


def build_inputs(c: dict, device: torch.device):
    """(model, noise (1, C, T, H, W), the caption as ids (1, L) or embeddings (`caption_input`)), the same on
    every rank, from a generate_* config."""
    model = load_model(model_config(c["model"], c["attention"]), checkpoint=c["checkpoint"], seed=c["seed"],
                       device=device, dtype=precision_dtype(c["dtype"], device, key="dtype"))
    gen = torch.Generator().manual_seed(c["seed"])
    noise = torch.randn(1, model.cfg.in_channels, c["frames"], c["height"], c["width"], generator=gen)
    return model, noise, caption_input(model, [c["caption"]], device)


def sampler_config(cls, c: dict):
    """The sampler's typed config from the keys of the Hydra config that name its fields."""
    return from_dict(cls, {f.name: c[f.name] for f in dataclasses.fields(cls) if f.name in c})
