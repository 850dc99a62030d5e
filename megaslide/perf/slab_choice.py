"""`execution.slab_frames=auto`: the fewest frame slabs whose training step fits the device.

A slab reads `temporal_reach` frames of halo on each side it shares with a neighbour, and each block's
attention and pre-attention work run over those halo frames once more (megaslide/models/chunking.py, "Frame
slabs"). With DSA's default reach (3 x 3 x 3 window, offsets up to 4 tokens: 7 frames), 256 frames in slabs of
32 run that work over 354 frames; in three slabs of 86, over 284. Fewer, larger slabs cost less time and more
HBM (one slab's q, k, v, attention output and what the attention saves). So the choice is the fewest slabs, of
balanced sizes (ceil(T' / n) frames each), whose planned step fits the budget: `fits` is the planner's check
(the offload plan's or the resident plan's peak HBM within the usable budget). One slab is the unslabbed run
(slab_frames 0). An attention of unbounded reach (dense, swin) cannot be slabbed: auto gives 0 there. If not
even one-frame slabs fit, the choice is one-frame slabs, and the caller's fit check refuses the run with its
numbers.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from megaslide.config import SLAB_AUTO, RunConfig


def slab_candidates(frames: int) -> list[int]:
    """Slab sizes in frames for 1, 2, 3, ... balanced slabs of `frames` token frames (ceil(frames / n), each size
    once, largest first); one slab is 0 (unslabbed)."""
    sizes = []
    for n in range(1, frames + 1):
        size = -(-frames // n)
        if not sizes or size < sizes[-1]:
            sizes.append(size)
    return [0, *sizes[1:]]


def choose_slab_frames(run: RunConfig, fits: Callable[[RunConfig], bool]) -> RunConfig:
    """`run` with execution.slab_frames resolved when it is auto (module docstring): the first size of
    `slab_candidates` for which `fits(run with that size)` holds; `run` itself otherwise."""
    if run.execution.slab_frames != SLAB_AUTO:
        return run
    attention = run.model.attention
    bounded = attention.variant.temporal_reach(attention.options) is not None
    sizes = slab_candidates(run.grid[0]) if bounded else [0]
    for size in sizes:
        chosen = dataclasses.replace(run, execution=dataclasses.replace(run.execution, slab_frames=size))
        if fits(chosen):
            return chosen
    return chosen
