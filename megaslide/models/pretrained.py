"""Load and save Wan 2.x transformers in the diffusers format: a folder with config.json and the weights in
`diffusion_pytorch_model.safetensors`, or in shards listed by `diffusion_pytorch_model.safetensors.index.json`.

Needs only `safetensors` (the `wan` extra: pip install -e ".[wan]"), not diffusers. Names and layouts are
mapped by megaslide/models/wan.py. A model with parameters that diffusers' Wan lacks (a DSA self-attention's
offset net, the built-in text encoder) saves them under their MegaSlide names and its MegaSlide-only config
fields under config.json's "megaslide" key, so `load_pretrained` restores it whole; diffusers ignores both
(with a warning) and runs the dense Wan model. Loading a folder without them leaves them as MegaSlide
initialises them: a DSA offset net starts at zero, so the model starts as neighbourhood attention.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path

import torch

from megaslide.config import AttentionConfig, DiTConfig
from megaslide.models.dit import DIT_PRESETS, VideoDiT, build_dit
from megaslide.models.wan import config_from_diffusers, diffusers_config, diffusers_names, from_diffusers, to_diffusers

CONFIG = "config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
SHARD = re.compile(r"diffusion_pytorch_model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
EXTRA = "megaslide"
"""config.json key of the MegaSlide-only config fields (`_extra_fields`)."""
_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError('reading and writing diffusers-format folders needs safetensors: pip install -e ".[wan]"') \
            from None
    return safetensors


def _listed(keys) -> str:
    keys = sorted(keys)
    return str(keys[:8])[:-1] + (f", ... {len(keys) - 8} more]" if len(keys) > 8 else "]")


def load_pretrained(path: str | Path, **overrides) -> VideoDiT:
    """A `VideoDiT` (fp32, on the current device) from a diffusers-format `WanTransformer3DModel` folder.

    `overrides` are `build_dit`'s: e.g. `attention="dsa"` (or "dsa_zero", an AttentionConfig, a dict) swaps
    self-attention for DSA with the checkpoint's q, k, v and output weights and a zero offset net;
    `chunk_tokens=` and the other execution fields say how blocks run. For the loaded model,
    `model(x, t, context)` equals diffusers' `WanTransformer3DModel(x, t, context).sample`. A missing folder or
    config.json, another architecture, or weights missing, unexpected or of the wrong shape raise an error
    naming the file and the keys."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"load_pretrained: {str(folder)!r} is not a folder; give a diffusers-format "
                                f"WanTransformer3DModel folder (config.json and *.safetensors), e.g. the transformer/ "
                                f"folder of a Wan 2.x diffusers pipeline")
    config_file = folder / CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no {CONFIG}; a diffusers-format folder holds config.json and "
                                f"the *.safetensors weights")
    raw = json.loads(config_file.read_text())
    cfg = config_from_diffusers(raw, str(config_file))
    files = _weight_files(folder)
    model = build_dit(cfg, **{**raw.get(EXTRA, {}), **overrides})
    _load_weights(model, files)
    return model


def pretrained_config(path: str | Path) -> DiTConfig:
    """The `DiTConfig` of a diffusers-format folder (its config.json, MegaSlide-only fields included) with
    `pretrained` naming the folder: what `build_model` loads it into."""
    config_file = Path(path) / CONFIG
    if not config_file.is_file():
        raise ValueError(f"model.pretrained={str(path)!r} has no {CONFIG}; give a diffusers-format "
                         f"WanTransformer3DModel folder (config.json and *.safetensors)")
    raw = json.loads(config_file.read_text())
    extra = raw.get(EXTRA, {})
    if "attention" in extra:
        extra = {**extra, "attention": AttentionConfig.parse(extra["attention"])}
    return dataclasses.replace(config_from_diffusers(raw, str(config_file)), **extra, pretrained=str(path))


def build_model(cfg: DiTConfig) -> VideoDiT:
    """`VideoDiT(cfg)` on the current device, its weights read from `cfg.pretrained` when set (the folder's
    architecture must be cfg's: a mismatch is an error naming the file and the keys)."""
    model = VideoDiT(cfg)
    if cfg.pretrained:
        _load_weights(model, _weight_files(Path(cfg.pretrained)))
    return model


def _weight_files(folder: Path) -> dict[Path, set[str]]:
    """Every weight file of the folder and the keys it holds, checked against the index if there is one."""
    st = _safetensors()
    index = folder / INDEX
    if index.is_file():
        listed: dict[Path, set[str]] = {}
        for key, name in json.loads(index.read_text())["weight_map"].items():
            listed.setdefault(folder / name, set()).add(key)
        absent = [str(f) for f in listed if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index}: lists shards that do not exist: {absent}")
    elif (folder / WEIGHTS).is_file():
        listed = {folder / WEIGHTS: None}
    else:
        found = sorted(folder.glob("*.safetensors"))
        if len(found) != 1:
            raise FileNotFoundError(f"{str(folder)!r} has no {WEIGHTS} and no {INDEX}, and {len(found)} other "
                                    f"*.safetensors files {[f.name for f in found]}; give one weight file or an index")
        listed = {found[0]: None}
    files = {}
    for file, keys in listed.items():
        with st.safe_open(file, framework="pt") as f:
            files[file] = set(f.keys())
        if keys is not None and keys - files[file]:
            raise ValueError(f"{file}: lacks keys that {index.name} places in it: {_listed(keys - files[file])}")
    return files


def _load_weights(model: VideoDiT, files: dict[Path, set[str]]) -> None:
    """Copy every parameter from the files; MegaSlide-only ones (no diffusers name) only if present."""
    params = dict(model.named_parameters())
    names = {n: diffusers_names(n) for n in params}
    where = {key: file for file, keys in files.items() for key in keys}
    needed = {k for ks in names.values() for k in ks}
    missing = needed - set(where)
    if missing:
        raise ValueError(f"{sorted({str(f) for f in files})}: missing keys {_listed(missing)} (the config asks for "
                         f"{model.cfg.depth} blocks of width {model.cfg.dim}); is the checkpoint complete?")
    own = {n for n, ks in names.items() if not ks}
    for file, keys in files.items():
        unexpected = keys - needed - own
        if unexpected:
            raise ValueError(f"{file}: unexpected keys {_listed(unexpected)}, which this model "
                             f"(attention={model.cfg.attention.name!r}) does not have")
    with contextlib.ExitStack() as stack, torch.no_grad():
        opened = {f: stack.enter_context(_safetensors().safe_open(f, framework="pt")) for f in files}
        for name, param in params.items():
            keys = names[name] or ((name,) if name in where else ())
            if not keys:
                continue                         # MegaSlide-only and not saved: keeps its initialisation
            value = from_diffusers([opened[where[k]].get_tensor(k) for k in keys], param.shape)
            if value is None:
                shapes = [tuple(opened[where[k]].get_tensor(k).shape) for k in keys]
                raise ValueError(f"{where[keys[0]]}: keys {list(keys)} have shapes {shapes}, which do not make "
                                 f"MegaSlide's {name} {tuple(param.shape)}")
            param.copy_(value)


def _extra_fields(model: VideoDiT) -> dict:
    """The model's config fields that a diffusers config cannot say, where they differ from a loaded Wan's."""
    cfg, wan = model.cfg, DIT_PRESETS["wan-1.3b"]
    extra = {k: getattr(cfg, k) for k in ("text_encoder", "text_len", "text_layers", "vocab_size")
             if getattr(cfg, k) != getattr(wan, k)}
    if cfg.attention != AttentionConfig():
        extra["attention"] = dataclasses.asdict(cfg.attention)
    return extra


def shard_bytes(size: int | str) -> int:
    """A shard size as bytes: an int, or a string such as "10GB", "500MB", "2GiB"."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B)\s*", str(size), re.IGNORECASE)
    if not match or int(match[1]) < 1:
        raise ValueError(f"max_shard_size={size!r}: give bytes (an int) or a size such as '10GB' or '500MB'")
    return int(match[1]) * _UNITS[match[2].upper()]


def save_pretrained(model: VideoDiT, path: str | Path, max_shard_size: int | str = "10GB") -> None:
    """Write `model` (a `wan` model) as a diffusers-format folder: config.json and one safetensors file, or
    shards of at most `max_shard_size` (a tensor larger than that gets a shard of its own) with their index.
    Weight files of an earlier save in the folder are replaced. `diffusers.WanTransformer3DModel
    .from_pretrained(path)` loads it (see the module docstring for MegaSlide-only parameters)."""
    st, limit = _safetensors(), shard_bytes(max_shard_size)
    config = diffusers_config(model.cfg)
    extra = _extra_fields(model)
    if extra:
        config[EXTRA] = extra
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, param))
        size += nbytes
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        if SHARD.fullmatch(old.name):
            old.unlink()
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = WEIGHTS if len(shards) == 1 else f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, param in shard:
            tensors.update(to_diffusers(name, param) if diffusers_names(name) else {name: param.detach().clone()})
        st.torch.save_file({k: t.cpu() for k, t in tensors.items()}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2, sort_keys=True) + "\n")
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
