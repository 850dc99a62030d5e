"""Hydra/OmegaConf -> MegaSlide's typed configs, `script_main`, the Hydra entry point of every
script, and `compose_run`, the one way a script makes a run: its config (or a RunConfig) plus train.py-style
overrides, composed as train.py composes them. Nothing below experiments/ sees OmegaConf."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError

from experiments.results_io import check_result_name, check_writable_folder
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
from megaslide.models.pretrained import pretrained_config

CONF_DIR = Path(__file__).resolve().parent / "conf"  # every script's Hydra config (absolute: also when imported)
RESULT_NAME_KEYS = ("name", "results_name")   # the top-level keys that name a result file or a run folder


def script_main(config_name: str):
    """`hydra.main` for a script of experiments/ with its config experiments/conf/<config_name>.yaml.

    The project's ValueError (a bad config value, named with its key and fix) reaches the user as
    the message alone on stderr with exit status 2, not inside a Hydra traceback (so is an ImportError: an
    optional package missing, megaslide/extras.py says which extra installs it), and a training step
    refused as non-finite (FloatingPointError, megaslide.train.engine.NonFiniteStep) likewise with exit
    status 3; set HYDRA_FULL_ERROR=1 for the traceback. The script's config keeps Hydra from writing anything
    (`hydra.run.dir: .`, `hydra.output_subdir: null`, job logging disabled), so a refused config
    leaves no folder behind. A result or run name (`RESULT_NAME_KEYS`) is checked first, before the script
    does anything: a separator or '..' in it would write outside results/ and runs/."""
    def decorate(task):
        @functools.wraps(task)
        def run(cfg: DictConfig):
            try:
                for key in RESULT_NAME_KEYS:
                    if isinstance(cfg.get(key), str) and cfg.get(key) != "":   # "": the script's own default
                        check_result_name(cfg.get(key), key)
                return task(cfg)
            except (ValueError, ImportError, FloatingPointError) as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(f"error: {err}", file=sys.stderr)
                sys.exit(3 if isinstance(err, FloatingPointError) else 2)
        main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(run)

        @functools.wraps(task)
        def entry(*args, **kwargs):
            if not args and not kwargs:   # from the command line, not called with a config
                refuse_unknown_keys(config_name, sys.argv[1:])
            return main(*args, **kwargs)
        return entry
    return decorate


def refuse_unknown_keys(config_name: str, argv: list[str]) -> None:
    """Before Hydra reads the command line: a `key=value` naming a key that experiments/conf/<config_name>.yaml
    does not have exits with status 2 and a message naming the key, its closest keys and the file that lists
    them, instead of Hydra's advice to add it with '+' (which the scripts refuse in turn, as a key they would
    ignore). A command line with Hydra's own flags (`--cfg job`, `-m`, ...), and anything else Hydra would refuse,
    is left to Hydra."""
    if not argv or any(a.startswith("-") or "=" not in a for a in argv) or GlobalHydra.instance().is_initialized():
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            compose(config_name, overrides=argv)
            return
        except ConfigCompositionException as err:
            unknown = re.match(r"Could not override '([^']+)'", str(err))
            if not unknown or not isinstance(err.__cause__, ConfigAttributeError):
                return
        except Exception:  # noqa: BLE001 - any other refusal: Hydra reports it when it reads the command line
            return
        keys = _flat_keys(OmegaConf.to_container(compose(config_name)))
    key = unknown.group(1)
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    print(f"error: unknown key {key}: experiments/conf/{config_name}.yaml has no such key{hint}; its keys are "
          f"listed there", file=sys.stderr)
    sys.exit(2)


def trial_preset(cfg: DictConfig | dict, **presets: dict) -> dict | None:
    """The preset of the first trial flag set in `cfg` (e.g. smoke=SMOKE, quick=QUICK: sizes that replace the
    script's), or None. A key given on the command line that the preset would replace is refused, naming both,
    rather than lost without a word."""
    for flag, preset in presets.items():
        if cfg.get(flag):
            replaced = _flat_keys(preset)
            clash = [key for key in command_line_keys()
                     if any(key == k or k.startswith(key + ".") or key.startswith(k + ".") for k in replaced)]
            if clash:
                raise ValueError(f"{flag}=true sets {', '.join(clash)} itself (its own small sizes): drop "
                                 f"{', '.join(clash)} from the command line, or drop {flag}=true to run your sizes")
            return preset
    return None


def command_line_keys(*, added: bool = False) -> list[str]:
    """The keys (and groups) this run's command line sets, without Hydra's +/++/~ prefixes ([] outside Hydra);
    with `added`, only those it adds with `+key=value` (keys the config does not declare)."""
    lines = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    if added:
        lines = [line for line in lines if line.startswith("+") and not line.startswith("++")]
    return [line.lstrip("+~").split("=", 1)[0] for line in lines]


def _flat_keys(tree: dict, prefix: str = "") -> list[str]:
    return [k for key, value in tree.items()
            for k in (_flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])]


def require_ranges(cfg, *, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = (),
                   fraction: tuple[str, ...] = (), finite: tuple[str, ...] = (), prefix: str = "") -> None:
    """A script config's numeric keys in range, each error naming the key (`prefix` + its field name, e.g.
    `video.` for a nested group): `positive` > 0, `non_negative` >= 0 (where 0 means "measure it" or "none"),
    `fraction` in (0, 1], `finite` > 0 and finite (a bandwidth, a time limit). NaN fails every one of them."""
    rules = [(positive, lambda v: v > 0, "> 0"), (non_negative, lambda v: v >= 0, ">= 0 (0: see its comment)"),
             (fraction, lambda v: 0 < v <= 1, "in (0, 1]"), (finite, lambda v: 0 < v < math.inf, "> 0 and finite")]
    for names, ok, wanted in rules:
        for name in names:
            value = getattr(cfg, name)
            if not ok(value):
                raise ValueError(f"{prefix}{name}={value} must be {wanted}; see experiments/conf/ for its meaning "
                                 f"and default")


def require_sizes(key: str, values: list[int], *, allow_empty: bool = False) -> None:
    """A list key of sizes (lengths, counts) in range, named as typed: each entry >= 1, and at least one unless
    `allow_empty` ([] then skips what the list drives)."""
    if not values and not allow_empty:
        raise ValueError(f"{key}=[] must list at least one value >= 1; see experiments/conf/ for its default")
    bad = [v for v in values if not v >= 1]
    if bad:
        raise ValueError(f"{key}={values}: {bad} must be >= 1 each; see experiments/conf/ for its meaning")


def refuse_repeats(key: str, values) -> None:
    """A list key whose entries each name one run (a variant, a seed, a candidate): an entry given twice would train
    two runs into one folder at once and count them twice, so it is refused, naming the key and the entry."""
    values = list(values)
    repeated = sorted({repr(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{key}={list(values)} lists {', '.join(repeated)} more than once; each entry is one run, "
                         f"give each once")


def model_config(model: dict, attention: dict) -> DiTConfig:
    """A preset (`model.preset`; with `model.pretrained`, that folder's config instead) with any other `model.*`
    keys and the attention group applied, validated.
    A key set to null keeps the preset's value (every model group file lists each DiTConfig field as
    null, conf/model/fields.yaml, so that `model.depth=22` needs no `+`)."""
    model = {k: v for k, v in model.items() if v is not None}
    refuse_moved(model, DiTConfig.moved_keys, prefix="model.", why="how the blocks run, not the model")
    preset = model.pop("preset", "tiny")
    if preset not in DIT_PRESETS:
        raise ValueError(f"model.preset={preset!r} is unknown; known: {sorted(DIT_PRESETS)}")
    pretrained = model.get("pretrained")   # a diffusers-format folder: its config.json is the architecture
    base = dataclasses.asdict(pretrained_config(pretrained) if pretrained else DIT_PRESETS[preset])
    base.pop("attention")
    merged = {**base, **model, "attention": from_dict(AttentionConfig, attention)}
    config = from_dict(DiTConfig, merged, key="model")
    config.validate()
    return config


def refuse_moved(given: dict, moved: dict[str, str], *, prefix: str = "", why: str = "") -> None:
    """Refuse keys of `given` that have moved (`moved`: old key -> new key) and are set (not null), with an
    error naming each one's new key: a config file keeps a moved key as null so that an old command line
    reaches this error and not Hydra's unknown-key one."""
    found = [k for k in moved if given.get(k) is not None]
    if found:
        raise ValueError(f"{'; '.join(f'{prefix}{k} is now {moved[k]}' for k in found)}{f' ({why})' if why else ''}"
                         f": set {', '.join(moved[k] + '=...' for k in found)}")


def script_config(cls, cfg: DictConfig, overrides: dict | None = None):
    """A table script's typed config `cls` from its Hydra config, `overrides` (a smoke preset) merged
    over it: a `wandb` group, where the script logs a run, becomes `wandb_dir` and `wandb_project`;
    a `model` group, where the script builds a model, becomes a DiTConfig in `model` (with
    `attention`, dense when absent) and its preset name in `model_preset`. A script whose config holds
    RunConfig's groups (`run_groups` in its defaults; they become its runs, compose_run) leaves them out:
    `cls` holds its own keys, and those in `cls.moved_keys` (now RunConfig fields) are refused when set.
    Field types are checked (from_dict), and the config's own `validate()`, where it has one, runs before the
    script does anything (it calls its nested groups' own, e.g. swiftfusion.py's `sim` and `step`)."""
    c = OmegaConf.to_container(OmegaConf.merge(cfg, overrides or {}), resolve=True)
    if "execution" in c:
        c = {k: v for k, v in c.items() if k not in RUN_GROUPS}
    refuse_moved(c, getattr(cls, "moved_keys", {}), why="a field of the run, as on train.py")
    fields = dict(c)
    if "wandb" in c:
        wandb = fields.pop("wandb")
        check_writable_folder(wandb["dir"], "wandb.dir")
        fields.update(wandb_dir=wandb["dir"], wandb_project=wandb["project"])
    if "model" in c:
        model, attention = fields.pop("model"), fields.pop("attention", {})
        fields.update(model=model_config(model, attention), model_preset=model.get("preset", "tiny"))
    config = from_dict(cls, fields)
    if hasattr(config, "validate"):
        config.validate()
    return config


RUN_GROUPS = ("model", "attention", "execution", "data", "train", "offload", "parallel")  # RunConfig's groups
GROUP_CONFIGS = {"execution": ExecutionConfig, "data": DataConfig, "train": TrainConfig, "offload": OffloadConfig,
                 "parallel": ParallelConfig}   # the groups that are a RunConfig field each (model holds attention)


def run_config(cfg: DictConfig | dict, *, check_device: bool = True) -> RunConfig:
    """The `RunConfig` of a script's Hydra config (the groups of train.yaml), completely validated
    (`RunConfig.validate` and, with `check_device`, train.device on this machine): a training script
    calls it before it writes anything; experiments/plan.py, which only predicts, without `check_device`."""
    c = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    parts = {key: from_dict(cls, c.get(key, {}), key=key) for key, cls in GROUP_CONFIGS.items()}
    run = RunConfig(model=model_config(c["model"], c["attention"]), **parts)
    run.validate()
    if check_device:
        resolve_device(run.train.device, key="train.device")
    return run


def typed_configs(cfg: DictConfig) -> tuple[DiTConfig, DataConfig, TrainConfig, OffloadConfig]:
    """(model, data, train, offload) of `run_config(cfg)`: for study scripts that run the blocks whole."""
    run = run_config(cfg)
    return run.model, run.data, run.train, run.offload


# ---- one run of a script: its base config plus train.py-style overrides -----------------------------------
def compose_run(base: DictConfig | RunConfig, changes: list[str]) -> RunConfig:
    """The RunConfig of `base` changed by `changes`, train.py-style overrides (`model=7B`, `attention=dsa`,
    `offload=engine`, `execution.chunk_tokens=16320`, `data.frames=256`, ...): train.yaml composed by Hydra with
    `train_overrides(base, changes)`, so it is exactly the run that `python experiments/train.py` (and
    `python -m experiments.plan`) makes with those overrides. `base` is a script's composed config (its
    RunConfig groups, run_groups.yaml, and any keys of its own) or a RunConfig. Validated for any device."""
    return run_of(train_overrides(base, changes))


def run_of(overrides: list[str]) -> RunConfig:
    """The RunConfig that train.py makes with `overrides` (a result's recorded `run_overrides`), validated for any
    device."""
    return run_config(_compose_train(list(overrides)), check_device=False)


def train_overrides(base: DictConfig | RunConfig, changes: list[str]) -> list[str]:
    """The train.py overrides that make `base` changed by `changes`: base_overrides(base), then `changes`; of
    two overrides of one key the later stays, at its place (a change replaces the base's value)."""
    keyed = {}
    for line, override in zip([*base_overrides(base), *changes], _parse([*base_overrides(base), *changes])):
        keyed.pop(override.key_or_group, None)
        keyed[override.key_or_group] = line
    return list(keyed.values())


def base_overrides(base: DictConfig | RunConfig) -> list[str]:
    """train.py overrides that make `base`'s run: its model, attention and offload options (`model=<preset>`,
    `attention=<name>`, `offload=engine|none`), then each value that differs from that composition: every model
    field `base` sets (a script config's non-null model keys; a RunConfig's fields that differ from its nearest
    preset), and the other groups' values that differ from train.yaml's (`+key=value` for a field train.yaml
    does not list)."""
    tree = run_tree(base)
    choices = [f"model={tree['model']['preset']}", f"attention={tree['attention']['name']}",
               f"offload={'engine' if tree['offload'].get('enabled') else 'none'}"]
    ref = _compose_train(choices)
    out = list(choices)
    for group in RUN_GROUPS:
        listed = ref[group]
        known = {**_field_defaults(GROUP_CONFIGS[group]), **listed} if group in GROUP_CONFIGS else listed
        for key, value in tree[group].items():
            if (group == "model" and value is None) or (key in known and value == known[key]):
                continue
            out.append(f"{'' if key in listed else '+'}{group}.{key}={_override_value(value)}")
    return out


def run_tree(base: DictConfig | RunConfig) -> dict[str, dict]:
    """RunConfig's groups of `base` as plain dicts, in the form of the Hydra groups: a script config's own; a
    RunConfig's with its model as its nearest preset (fewest differing fields) plus the fields that differ."""
    if not isinstance(base, RunConfig):
        c = OmegaConf.to_container(base, resolve=True) if isinstance(base, DictConfig) else base
        tree = {group: dict(c[group]) for group in RUN_GROUPS}
        tree["model"].setdefault("preset", "tiny")
        return tree
    model = _plain(dataclasses.asdict(base.model))
    attention = model.pop("attention")
    preset = min(DIT_PRESETS, key=lambda p: sum(v != model[k] for k, v in _preset_fields(p).items()))
    tree = {"model": {"preset": preset, **{k: v for k, v in model.items() if v != _preset_fields(preset)[k]}},
            "attention": {"name": attention["name"], **attention["options"]}}
    tree.update({group: _plain(dataclasses.asdict(getattr(base, group))) for group in GROUP_CONFIGS})
    return tree


def _preset_fields(preset: str) -> dict:
    fields = _plain(dataclasses.asdict(DIT_PRESETS[preset]))
    fields.pop("attention")
    return fields


def _field_defaults(cls) -> dict:
    return _plain(dataclasses.asdict(cls()))


def _plain(value):
    """Tuples as lists, recursively: values as a Hydra config holds them."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _parse(overrides: list[str]):
    return OverridesParser.create().parse_overrides(overrides)


def _override_value(value) -> str:
    """`value` as the right-hand side of an override that Hydra reads back as `value`."""
    if isinstance(value, list):
        return f"[{','.join(_override_value(v) for v in value)}]"
    if isinstance(value, str):
        try:
            if _parse([f"k={value}"])[0].value() == value:
                return value
        except OverrideParseException:   # not in the grammar unquoted
            pass
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, bool) or value is None:
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def _compose_train(overrides: list[str]) -> dict:
    """train.yaml composed by Hydra with `overrides`, as a plain dict (a fresh copy: the scripts compose a run
    per cell, mostly from the same few lists)."""
    return copy.deepcopy(_composed_train(tuple(overrides)))


@functools.lru_cache(maxsize=256)
def _composed_train(overrides: tuple[str, ...]) -> dict:
    if GlobalHydra.instance().is_initialized():    # inside a script: Hydra is set up on experiments/conf
        return OmegaConf.to_container(compose("train", overrides=list(overrides)), resolve=True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("train", overrides=list(overrides)), resolve=True)
