"""Hydra/OmegaConf -> MegaSlide's typed configs. Nothing below experiments/ sees OmegaConf."""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from megaslide.config import AttentionConfig, DataConfig, DiTConfig, OffloadConfig, TrainConfig, from_dict
from megaslide.models.dit import DIT_PRESETS


def model_config(model: dict, attention: dict) -> DiTConfig:
    """A preset (`model.preset`) with any other `model.*` keys and the attention group applied.
    A key set to null keeps the preset's value (a script's YAML declares `model.depth: null` so
    that `model.depth=22` needs no `+`)."""
    model = {k: v for k, v in model.items() if v is not None}
    preset = model.pop("preset", "tiny")
    if preset not in DIT_PRESETS:
        raise ValueError(f"model.preset={preset!r} is unknown; known: {sorted(DIT_PRESETS)}")
    base = dataclasses.asdict(DIT_PRESETS[preset])
    base.pop("attention")
    merged = {**base, **model, "attention": from_dict(AttentionConfig, attention)}
    return from_dict(DiTConfig, merged)


def script_config(cls, cfg: DictConfig, overrides: dict | None = None):
    """A table script's typed config `cls` from its Hydra config, `overrides` (a smoke preset) merged
    over it: a `wandb` group, where the script logs a run, becomes `wandb_dir` and `wandb_project`;
    a `model` group, where the script builds a model, becomes a DiTConfig in `model` (with
    `attention`, dense when absent) and its preset name in `model_preset`."""
    c = OmegaConf.to_container(OmegaConf.merge(cfg, overrides or {}), resolve=True)
    fields = dict(c)
    if "wandb" in c:
        wandb = fields.pop("wandb")
        fields.update(wandb_dir=wandb["dir"], wandb_project=wandb["project"])
    if "model" in c:
        model, attention = fields.pop("model"), fields.pop("attention", {})
        fields.update(model=model_config(model, attention), model_preset=model.get("preset", "tiny"))
    return from_dict(cls, fields)


def typed_configs(cfg: DictConfig) -> tuple[DiTConfig, DataConfig, TrainConfig, OffloadConfig]:
    c = OmegaConf.to_container(cfg, resolve=True)
    return (model_config(c["model"], c["attention"]), from_dict(DataConfig, c["data"]),
            from_dict(TrainConfig, c["train"]), from_dict(OffloadConfig, c.get("offload", {})))
