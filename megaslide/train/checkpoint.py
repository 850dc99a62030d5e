"""Atomic checkpoints: write to a temporary file in the same folder, fsync, then rename."""
from __future__ import annotations

import os
from pathlib import Path

import torch


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


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist; pass the path of a .pt file written by training")
    return torch.load(path, map_location=map_location, weights_only=False)


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest `step_*.pt` in a folder, or None."""
    files = sorted(Path(folder).glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return files[-1] if files else None
