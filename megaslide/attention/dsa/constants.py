"""Numbers the 3D-DSA op, its kernels and the DSA module's memory model share; no Triton here, so that the
op and the memory model read them without importing it."""
from __future__ import annotations

LOG2E = 1.4426950408889634
"""log2(e): the kernels run their softmax in log2 units (exp2), with scores scaled by scale * LOG2E."""

SCRATCH_BYTES = 1 << 30
"""Bound on the fused backward's scratch (backward.py: fp32 ds, p and the key tiles' entry lists), kept
through head groups (`backward.heads_per_group`)."""
MAX_TILES_PER_ENTRY = 8
"""Key tiles one (query, sample) can touch: one per trilinear corner (backward.py)."""
ENTRY_FLOATS = 8
"""fp32 words of a (query, sample)'s scratch entry: ds, p, the clamped (t, y, x) position and 3 words of
padding, so that one entry is one aligned 32-byte sector (backward.py)."""

MAX_HALO_REACH = 2
"""The widest halo reach the halo forward takes (halo.py): a program holds its halo's K rows, then its V rows
(shared memory for its two dots) and its tile x halo scores and softmax weights (fp32 registers); at a
3 x 3 x 3 window and reach 2 the halo of a 1 x 4 x 4 tile is 7 x 10 x 10 tokens (1024 padded), whose sm_90
build at d 64 and bf16 takes 192 KiB of shared memory, near an H200 SM's 227 KiB; reach 3 doubles the halo."""


def backward_scratch_bytes(num_samples: int) -> int:
    """Upper bound of the fused backward's scratch per token and head for K = num_samples: an entry of
    ENTRY_FLOATS fp32 words per sample, an int32 record per key tile a sample touches (at most 8), and
    three int32 per key tile (at most one tile per token): a cursor, a start and a fill cursor (backward.py)."""
    return num_samples * (4 * ENTRY_FLOATS + 4 * MAX_TILES_PER_ENTRY) + 3 * 4
