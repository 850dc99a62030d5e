"""Optional path through the real VBench package (``pip install vbench``).

Our weight-free formulas in ``megaslide.eval.video`` stand in for VBench during
development; for numbers comparable with published ones, run VBench itself on mp4 files
written with ``megaslide.data.video_io.write_mp4``. VBench reads its checkpoints from
``$VBENCH_CACHE_DIR`` (default ``~/.cache/vbench``); this machine cannot download them,
so they must be placed there beforehand. ``vbench_unavailable`` says what is missing.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

# Checkpoints each dimension loads from the cache dir (VBench's own layout);
# temporal_flickering needs none.
VBENCH_WEIGHTS: dict[str, tuple[str, ...]] = {
    "temporal_flickering": (),
    "dynamic_degree": ("raft_model/models/raft-things.pth",),
    "motion_smoothness": ("amt_model/amt-s.pth",),
    "subject_consistency": ("dino_model/dino_vitbase16_pretrain.pth",),
    "background_consistency": ("clip_model/ViT-B-32.pt",),
}


def vbench_cache_dir() -> Path:
    """Where VBench looks for checkpoints: $VBENCH_CACHE_DIR or ~/.cache/vbench."""
    return Path(os.environ.get("VBENCH_CACHE_DIR", Path.home() / ".cache" / "vbench"))


def vbench_unavailable(dimensions: Sequence[str] = ("temporal_flickering",)) -> str | None:
    """None if VBench can score ``dimensions`` here, else a message saying what to install or place."""
    unknown = [d for d in dimensions if d not in VBENCH_WEIGHTS]
    if unknown:
        raise ValueError(f"dimensions: {unknown} are not wired here; choose from {list(VBENCH_WEIGHTS)}")
    if importlib.util.find_spec("vbench") is None:
        return "the vbench package is not installed: pip install vbench"
    cache = vbench_cache_dir()
    missing = [str(cache / rel) for d in dimensions for rel in VBENCH_WEIGHTS[d] if not (cache / rel).is_file()]
    if missing:
        return f"VBench checkpoints missing: {missing}; place them there or set VBENCH_CACHE_DIR to their folder"
    return None


def _require(dimensions: Sequence[str]) -> None:
    reason = vbench_unavailable(dimensions)
    if reason is not None:
        raise RuntimeError(reason)


def vbench_temporal_flickering(video_path: str | Path) -> float:
    """VBench's own temporal flickering score of one mp4 (all frames, decoded by OpenCV)."""
    _require(["temporal_flickering"])
    from vbench.temporal_flickering import cal_score

    return float(cal_score(str(video_path)))
