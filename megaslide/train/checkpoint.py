"""Atomic checkpoints, in two formats under <out_dir>/checkpoints/:
- one file `step_N.pt` (the resident engine; also what experiments/sample.py reads);
- a sharded folder `step_N/` of one file per shard plus `state.pt` (the offload engine).

A file is written to a temporary name in the same folder, fsynced, then renamed; a folder is
written as `.step_N.tmp/` with `state.pt` last and then renamed, so a reader sees a complete
checkpoint or none.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

SHARDED_STATE = "state.pt"  # written last into a sharded folder: its presence marks a complete checkpoint


def checkpoint_path(folder: str | Path, step: int, *, sharded: bool) -> Path:
    return Path(folder) / (f"step_{step}" if sharded else f"step_{step}.pt")


def save_checkpoint(path: str | Path, state: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
    return path


def save_sharded_checkpoint(folder: str | Path, shards: Iterable[tuple[str, dict]], state: dict) -> Path:
    """Write `folder`/<name>.pt for each (name, shard), then `folder`/state.pt; returns `folder`."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, shard in shards:
        save_checkpoint(tmp / f"{name}.pt", shard)
    save_checkpoint(tmp / SHARDED_STATE, state)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist; pass the path of a .pt file written by training")
    return torch.load(path, map_location=map_location, weights_only=False)


def latest_checkpoint(folder: str | Path, *, sharded: bool = False) -> Path | None:
    """The newest `step_N.pt` in `folder`, or with `sharded` the newest complete `step_N/`; None if none."""
    if sharded:
        found = [p for p in Path(folder).glob("step_*") if (p / SHARDED_STATE).is_file()]
    else:
        found = [p for p in Path(folder).glob("step_*.pt") if p.is_file()]
    return max(found, key=lambda p: int(p.name.removesuffix(".pt").split("_")[1]), default=None)
