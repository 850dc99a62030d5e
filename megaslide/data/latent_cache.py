"""A latent cache: a video folder encoded once by a VAE and a text encoder, which training reads.

Layout (written by experiments/precompute.py)::

    root/
      manifest.json        what made the cache ("sources": VAE, text encoder, clip size, text_len), the latent
                           shape (C, T', H', W'), text_dim, the VAE's latent statistics, and the clips in order
      null.safetensors     "context" (L, text_dim), "context_mask" (L,): the empty caption (dropped captions, CFG)
      clips/00000.safetensors ...   per clip: "latent" (C, T', H', W') normalised as (mu - mean) / std,
                           "context", "context_mask"; the caption and source file in the file's metadata
      prompts/0.safetensors ...     prompts to sample with (precompute's prompts=), with the null caption's

Every file is written to a temporary name and renamed, so an interrupted run leaves whole files only; a rerun
keeps each clip file that opens and matches its manifest entry and encodes the rest. The manifest's
"complete" turns true when every clip is there; `LatentCache` reads complete caches only.

This module imports no config and nothing heavy (safetensors on first use): megaslide.config reads manifests.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from megaslide.extras import require

MANIFEST = "manifest.json"
NULL = "null.safetensors"
CLIPS = "clips"
PROMPTS = "prompts"
FORMAT = "megaslide-latent-cache-1"


def safetensors_torch():
    return require("safetensors.torch", "a latent cache")


def read_manifest(root: str | Path, key: str = "root") -> dict[str, Any]:
    """The manifest of the cache at `root`; a missing or foreign one is a ValueError naming `key`."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{key}={str(root)!r} is not a latent cache (no {MANIFEST}); make one with "
                         f"experiments/precompute.py")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}; precompute the cache again")
    return manifest


def write_atomic(path: Path, write) -> Path:
    """`write(tmp)` then rename tmp to `path`: readers see the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
    return path


def write_manifest(root: Path, manifest: dict) -> Path:
    return write_atomic(root / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1) + "\n"))


def clip_file(root: Path, index: int) -> Path:
    return root / CLIPS / f"{index:05d}.safetensors"


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    st = safetensors_torch()
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return write_atomic(path, lambda tmp: st.save_file(tensors, str(tmp), metadata=metadata or {}))


def entry_shapes(manifest: dict, latent: bool = True) -> dict[str, list[int]]:
    """The tensor shapes of a clip file of the cache (`latent=False`: of the null caption's file)."""
    text = {"context": [manifest["text_len"], manifest["text_dim"]], "context_mask": [manifest["text_len"]]}
    return {"latent": list(manifest["latent_shape"]), **text} if latent else text


def is_cached(path: Path, entry: dict, shapes: dict[str, list[int]]) -> bool:
    """Whether `path` holds the finished entry ({"file", "caption"}): it opens, its metadata names the same
    source file and caption, and its tensors have `shapes`. A damaged file counts as absent."""
    if not path.is_file():
        return False
    try:
        with safetensors_torch().safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            found = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:   # safetensors raises its own errors for a truncated or foreign file
        return False
    return meta.get("file") == entry["file"] and meta.get("caption") == entry["caption"] and found == shapes


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch().load_file(str(path))


class LatentCache(Dataset):
    """The clips of a complete latent cache. Item i: "video" float32 (C, T', H', W') latents (named as the
    pixel datasets' clips, which `make_batch` stacks alike), "context" (L, text_dim) float32 caption
    embeddings, "context_mask" (L,) bool, "caption" str. `null_context`: the empty caption's (context, mask)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest = read_manifest(self.root, key="data.root")
        if not self.manifest["complete"]:
            raise ValueError(f"data.root={str(self.root)!r}: the latent cache is incomplete (precompute was "
                             f"interrupted); run experiments/precompute.py again with the same settings to finish it")
        self.entries = self.manifest["clips"]
        null = load_tensors(self.root / NULL)
        self.null_context = (null["context"].float(), null["context_mask"].bool())

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = load_tensors(clip_file(self.root, index))
        return {"video": item["latent"].float(), "context": item["context"].float(),
                "context_mask": item["context_mask"].bool(), "caption": self.entries[index]["caption"]}
