"""Frame slabs: the runs of whole frames a block of bounded temporal reach runs over (see chunking.py,
"Frame slabs"), and how a slab's tokens are cut from the clip's."""
from __future__ import annotations

import torch


def frame_slabs(frames: int, slab: int, reach: int | None) -> list[tuple[int, int, int, int]]:
    """The slabs (a, t0, t1, b) of a clip of `frames` token frames: slab i keeps frames [t0, t1) =
    [i * slab, (i + 1) * slab) and reads [a, b), those padded by `reach` frames on each side (cut at
    the clip's ends). One slab (0, 0, T, T) when `slab` is 0 or covers the clip."""
    if not slab or slab >= frames:
        return [(0, 0, frames, frames)]
    return [(max(0, t0 - reach), t0, min(t0 + slab, frames), min(frames, t0 + slab + reach))
            for t0 in range(0, frames, slab)]


def slab_view(x: torch.Tensor, rope, grid, slab: tuple[int, int, int, int]):
    """Slab (a, t0, t1, b) of tokens x (B, N, D) as `BlockRunner.attend_slab` takes it: (its rows
    x[:, a*fr:b*fr], their rope, its grid (b - a, H, W), the kept rows within it)."""
    a, t0, t1, b = slab
    _, H, W = grid
    fr = H * W                                                                       # tokens per frame
    cos, sin = rope                                                                  # (N, d/2) each
    rows = slice(a * fr, b * fr)
    return x[:, rows], (cos[rows], sin[rows]), (b - a, H, W), slice((t0 - a) * fr, (t1 - a) * fr)
