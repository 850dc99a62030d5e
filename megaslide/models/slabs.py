"""Frame slabs: the runs of whole frames a block of bounded temporal reach runs over (see chunking.py,
"Frame slabs"), and how a slab's tokens are cut from the clip's."""
from __future__ import annotations

import torch


def frame_slabs(frames: int, slab: int, reach: int | None,
                own: tuple[int, int] | None = None) -> list[tuple[int, int, int, int]]:
    """The slabs (a, t0, t1, b) that cover the frames `own` = [s0, s1) (default: the whole clip of `frames`
    token frames; a sequence-parallel rank passes its own): slab i keeps frames [t0, t1) = [s0 + i * slab,
    s0 + (i + 1) * slab) (cut at s1) and reads [a, b), those padded by `reach` frames on each side (cut at
    the clip's ends). One slab when `slab` is 0 or covers `own`: (0, 0, T, T) for the whole clip."""
    s0, s1 = own if own is not None else (0, frames)
    step = slab if slab and slab < s1 - s0 else s1 - s0
    pad = reach or 0
    return [(max(0, t0 - pad), t0, min(t0 + step, s1), min(frames, min(t0 + step, s1) + pad))
            for t0 in range(s0, s1, step)]


def slab_view(x: torch.Tensor, rope, grid, slab: tuple[int, int, int, int]):
    """Slab (a, t0, t1, b) of tokens x (B, N, D) as `BlockRunner.attend_slab` takes it: (its rows
    x[:, a*fr:b*fr], their rope, its grid (b - a, H, W), the kept rows within it)."""
    a, t0, t1, b = slab
    _, H, W = grid
    fr = H * W                                                                       # tokens per frame
    cos, sin = rope                                                                  # (N, d/2) each
    rows = slice(a * fr, b * fr)
    return x[:, rows], (cos[rows], sin[rows]), (b - a, H, W), slice((t0 - a) * fr, (t1 - a) * fr)
