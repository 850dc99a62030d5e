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
import shutil
from collections.abc import Callable
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
    naming the file and the keys. The model is built on the meta device and only initialised (as `VideoDiT`
    initialises it, under the current seed) when the files lack some of its parameters."""
    device = torch.get_default_device()
    folder, model = meta_model(path, **overrides)
    weights = WeightFiles(folder, model)
    model.to_empty(device=device)
    if not all(weights.saved(name) for name, _ in model.named_parameters()):
        model.initialize_weights()
    with weights, torch.no_grad():
        for name, param in model.named_parameters():
            weights.copy_(name, param)
    return model


def meta_model(path: str | Path, **overrides) -> tuple[Path, VideoDiT]:
    """The folder and the model that `load_pretrained(path, **overrides)` loads, on the meta device."""
    folder, raw = read_config(path)
    cfg = config_from_diffusers(raw, str(folder / CONFIG))
    with torch.device("meta"):
        return folder, build_dit(cfg, **{**raw.get(EXTRA, {}), **overrides})


def read_config(path: str | Path) -> tuple[Path, dict]:
    """The folder and its config.json's dict, or an error saying what a diffusers-format folder holds."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder; give a diffusers-format "
                                f"WanTransformer3DModel folder (config.json and *.safetensors), e.g. the transformer/ "
                                f"folder of a Wan 2.x diffusers pipeline")
    config_file = folder / CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no {CONFIG}; a diffusers-format folder holds config.json and "
                                f"the *.safetensors weights")
    return folder, json.loads(config_file.read_text())


_FROM_DIFFUSERS = ("dim", "num_heads", "depth", "ffn_dim", "in_channels", "patch_size", "text_dim", "freq_dim",
                   "block", "qk_norm")
"""The DiTConfig fields that a diffusers config.json decides (`config_from_diffusers`)."""


def check_pretrained(cfg: DiTConfig) -> None:
    """That `cfg.pretrained` (a diffusers-format folder) holds a model of `cfg`'s architecture; an error naming
    each model.* key that differs, and the folder's value, otherwise."""
    folder, raw = read_config(cfg.pretrained)
    theirs = config_from_diffusers(raw, str(folder / CONFIG))
    differ = [f"model.{k}={getattr(cfg, k)} (the folder: {getattr(theirs, k)})" for k in _FROM_DIFFUSERS
              if getattr(cfg, k) != getattr(theirs, k)]
    if differ:
        preset = next((name for name, p in DIT_PRESETS.items()
                       if all(getattr(p, k) == getattr(theirs, k) for k in _FROM_DIFFUSERS)), None)
        fix = f"model={preset}" if preset else " ".join(f"model.{k}={getattr(theirs, k)}" for k in _FROM_DIFFUSERS)
        raise ValueError(f"model.pretrained={cfg.pretrained!r} holds another architecture: {'; '.join(differ)}; "
                         f"set {fix}")


def config_overrides(cfg: DiTConfig) -> dict:
    """`cfg`'s fields as `load_pretrained` overrides: the model it loads has exactly this config."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


class WeightFiles:
    """The weight files of a diffusers-format folder, checked against a model's parameter names (which may be
    on the meta device) when opened: a missing or unexpected key is an error naming the file and the keys.
    Inside `with`, `read` and `copy_` take one parameter at a time from the files (`safe_open` reads one
    tensor at a time), so a reader holds at most one parameter beyond its own buffers."""

    def __init__(self, folder: Path, model: VideoDiT):
        self.files = _weight_files(folder)
        params = dict(model.named_parameters())
        self.names = {n: diffusers_names(n) for n in params}
        self.where = {key: file for file, keys in self.files.items() for key in keys}
        needed = {k for ks in self.names.values() for k in ks}
        missing = needed - set(self.where)
        if missing:
            raise ValueError(f"{sorted({str(f) for f in self.files})}: missing keys {_listed(missing)} (the config "
                             f"asks for {model.cfg.depth} blocks of width {model.cfg.dim}); is the checkpoint "
                             f"complete?")
        own = {n for n, ks in self.names.items() if not ks}
        for file, keys in self.files.items():
            unexpected = keys - needed - own
            if unexpected:
                raise ValueError(f"{file}: unexpected keys {_listed(unexpected)}, which this model "
                                 f"(attention={model.cfg.attention.name!r}) does not have")
        self._stack = contextlib.ExitStack()
        self._opened: dict[Path, object] = {}

    def __enter__(self) -> WeightFiles:
        self._opened = {f: self._stack.enter_context(_safetensors().safe_open(f, framework="pt")) for f in self.files}
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._opened = {}

    def keys(self, name: str) -> tuple[str, ...]:
        """The keys that hold MegaSlide parameter `name`: its diffusers keys, or its own name where it has none
        and a MegaSlide save wrote it, or () (MegaSlide-only and not saved: it keeps its initialisation)."""
        return self.names[name] or ((name,) if name in self.where else ())

    def saved(self, name: str) -> bool:
        return bool(self.keys(name))

    def read(self, name: str, shape: torch.Size) -> torch.Tensor:
        """Parameter `name` of `shape` from the files (a saved one: `saved`)."""
        keys = self.keys(name)
        value = from_diffusers([self._opened[self.where[k]].get_tensor(k) for k in keys], shape)
        if value is None:
            shapes = [tuple(self._opened[self.where[k]].get_tensor(k).shape) for k in keys]
            raise ValueError(f"{self.where[keys[0]]}: keys {list(keys)} have shapes {shapes}, which do not make "
                             f"MegaSlide's {name} {tuple(shape)}")
        return value

    def copy_(self, name: str, param: torch.Tensor) -> None:
        """Copy parameter `name` from the files into `param` if it was saved."""
        if self.saved(name):
            param.copy_(self.read(name, param.shape))


def pretrained_config(path: str | Path) -> DiTConfig:
    """The `DiTConfig` of a diffusers-format folder (its config.json, MegaSlide-only fields included) with
    `pretrained` naming the folder: what `build_model` loads it into."""
    folder, raw = read_config(path)
    config_file = folder / CONFIG
    extra = raw.get(EXTRA, {})
    if "attention" in extra:
        extra = {**extra, "attention": AttentionConfig.parse(extra["attention"])}
    return dataclasses.replace(config_from_diffusers(raw, str(config_file)), **extra, pretrained=str(path))


def build_model(cfg: DiTConfig) -> VideoDiT:
    """`VideoDiT(cfg)` on the current device, or with cfg.pretrained that folder's model (`load_pretrained`: its
    architecture must be cfg's; a mismatch is an error naming the file and the keys)."""
    return load_pretrained(cfg.pretrained, **config_overrides(cfg)) if cfg.pretrained else VideoDiT(cfg)


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


def _extra_fields(cfg: DiTConfig) -> dict:
    """The config fields that a diffusers config cannot say, where they differ from a loaded Wan's."""
    wan = DIT_PRESETS["wan-1.3b"]
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
    """Write `model` (a `wan` model) as a diffusers-format folder: `write_pretrained` of its parameters."""
    params = dict(model.named_parameters())
    write_pretrained(model.cfg, [(n, p.shape, p.dtype) for n, p in params.items()], lambda n: params[n], path,
                     max_shard_size)


def write_pretrained(cfg: DiTConfig, params: list[tuple[str, torch.Size, torch.dtype]],
                     tensor: Callable[[str], torch.Tensor], path: str | Path, max_shard_size: int | str) -> None:
    """Write the parameters `params` (name, shape, dtype, in the model's order) of a `wan` model of `cfg` as a
    diffusers-format folder: config.json and one safetensors file, or shards of at most `max_shard_size` (a
    tensor larger than that gets a shard of its own) with their index. `tensor(name)` gives one parameter when
    its shard is written, so the writer holds one shard's copies at a time. The folder is written whole beside
    `path` and then renamed into place: an interrupted save leaves the old folder as it was. Weight files of an
    earlier save are replaced, other files of the folder kept. `diffusers.WanTransformer3DModel
    .from_pretrained(path)` loads it (see the module docstring for MegaSlide-only parameters)."""
    st, limit = _safetensors(), shard_bytes(max_shard_size)
    config = diffusers_config(cfg)
    extra = _extra_fields(cfg)
    if extra:
        config[EXTRA] = extra
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape, dtype in params:
        nbytes = shape.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    folder = Path(path)
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)        # what an interrupted save left
    partial.mkdir(parents=True)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = WEIGHTS if len(shards) == 1 else f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in shard:
            value = tensor(name)
            tensors.update(to_diffusers(name, value) if diffusers_names(name) else {name: value.detach().clone()})
        st.torch.save_file({k: t.cpu() for k, t in tensors.items()}, str(partial / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(shards) > 1:
        (partial / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2, sort_keys=True) + "\n")
    (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    _replace_folder(partial, folder)


def _replace_folder(new: Path, folder: Path) -> None:
    """Put the complete folder `new` at `folder`, keeping the files of an old `folder` that a save does not write."""
    if not folder.exists():
        new.rename(folder)
        return
    for old in folder.iterdir():
        if not (SHARD.fullmatch(old.name) or old.name == CONFIG):
            old.rename(new / old.name)
    gone = folder.with_name(f".{folder.name}.replaced")
    shutil.rmtree(gone, ignore_errors=True)
    folder.rename(gone)
    new.rename(folder)
    shutil.rmtree(gone)
