"""Hydra/OmegaConf -> MegaSlide's typed configs, and `script_main`, the Hydra entry point of every
script. Nothing below experiments/ sees OmegaConf."""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from megaslide.config import (
    AttentionConfig,
    DataConfig,
    DiTConfig,
    ExecutionConfig,
    OffloadConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    from_dict,
)
from megaslide.device import resolve_device
from megaslide.models.dit import DIT_PRESETS

CONF_DIR = Path(__file__).resolve().parent / "conf"  # every script's Hydra config (absolute: also when imported)


def script_main(config_name: str):
    """`hydra.main` for a script of experiments/ with its config experiments/conf/<config_name>.yaml.

    The project's ValueError (a bad config value, named with its key and fix) reaches the user as
    the message alone on stderr with exit status 2, not inside a Hydra traceback, and a training step
    refused as non-finite (FloatingPointError, megaslide.train.engine.NonFiniteStep) likewise with exit
    status 3; set HYDRA_FULL_ERROR=1 for the traceback. The script's config keeps Hydra from writing anything
    (`hydra.run.dir: .`, `hydra.output_subdir: null`, job logging disabled), so a refused config
    leaves no folder behind."""
    def decorate(task):
        @functools.wraps(task)
        def run(cfg: DictConfig):
            try:
                return task(cfg)
            except (ValueError, FloatingPointError) as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(f"error: {err}", file=sys.stderr)
                sys.exit(2 if isinstance(err, ValueError) else 3)
        return hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(run)
    return decorate


def model_config(model: dict, attention: dict) -> DiTConfig:
    """A preset (`model.preset`) with any other `model.*` keys and the attention group applied, validated.
    A key set to null keeps the preset's value (every model group file lists each DiTConfig field as
    null, conf/model/fields.yaml, so that `model.depth=22` needs no `+`)."""
    model = {k: v for k, v in model.items() if v is not None}
    moved = [f"model.{k} is now {where}" for k, where in DiTConfig.moved_keys.items() if k in model]
    if moved:
        raise ValueError(f"{'; '.join(moved)} (how the blocks run, not the model): set "
                         f"{', '.join(DiTConfig.moved_keys[k] + '=...' for k in DiTConfig.moved_keys if k in model)}")
    preset = model.pop("preset", "tiny")
    if preset not in DIT_PRESETS:
        raise ValueError(f"model.preset={preset!r} is unknown; known: {sorted(DIT_PRESETS)}")
    base = dataclasses.asdict(DIT_PRESETS[preset])
    base.pop("attention")
    merged = {**base, **model, "attention": from_dict(AttentionConfig, attention)}
    config = from_dict(DiTConfig, merged, key="model")
    config.validate()
    return config


def script_config(cls, cfg: DictConfig, overrides: dict | None = None):
    """A table script's typed config `cls` from its Hydra config, `overrides` (a smoke preset) merged
    over it: a `wandb` group, where the script logs a run, becomes `wandb_dir` and `wandb_project`;
    a `model` group, where the script builds a model, becomes a DiTConfig in `model` (with
    `attention`, dense when absent) and its preset name in `model_preset`. Field types are checked
    (from_dict), and the config's own `validate()`, where it has one, runs before the script does anything."""
    c = OmegaConf.to_container(OmegaConf.merge(cfg, overrides or {}), resolve=True)
    fields = dict(c)
    if "wandb" in c:
        wandb = fields.pop("wandb")
        fields.update(wandb_dir=wandb["dir"], wandb_project=wandb["project"])
    if "model" in c:
        model, attention = fields.pop("model"), fields.pop("attention", {})
        fields.update(model=model_config(model, attention), model_preset=model.get("preset", "tiny"))
    config = from_dict(cls, fields)
    if hasattr(config, "validate"):
        config.validate()
    return config


RUN_GROUPS = ("model", "attention", "execution", "data", "train", "offload", "parallel")  # RunConfig's groups


def run_config(cfg: DictConfig | dict, *, check_device: bool = True) -> RunConfig:
    """The `RunConfig` of a script's Hydra config (the groups of train.yaml), completely validated
    (`RunConfig.validate` and, with `check_device`, train.device on this machine): a training script
    calls it before it writes anything; experiments/plan.py, which only predicts, without `check_device`."""
    c = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    parts = {key: from_dict(cls, c.get(key, {}), key=key) for key, cls in
             (("execution", ExecutionConfig), ("data", DataConfig), ("train", TrainConfig),
              ("offload", OffloadConfig), ("parallel", ParallelConfig))}
    run = RunConfig(model=model_config(c["model"], c["attention"]), **parts)
    run.validate()
    if check_device:
        resolve_device(run.train.device, key="train.device")
    return run


def typed_configs(cfg: DictConfig) -> tuple[DiTConfig, DataConfig, TrainConfig, OffloadConfig]:
    """(model, data, train, offload) of `run_config(cfg)`: for study scripts that run the blocks whole."""
    run = run_config(cfg)
    return run.model, run.data, run.train, run.offload
