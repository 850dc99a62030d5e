"""Sequences whose length N is not a multiple of the SP group size P.

Every rank holds a shard of n = ceil(N / P) tokens; the tail of the sequence is padded, so the
padding sits on the last rank (or ranks, when N is short). Pass `seq_len=N` to
`sequence_parallel_attention` and no query attends to a padded key; the outputs at padded
positions are meaningless and `unpad_shard` drops them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def shard_len(seq_len: int, world: int) -> int:
    """Tokens per rank once the sequence is padded: ceil(seq_len / world)."""
    if seq_len < 1 or world < 1:
        raise ValueError(f"seq_len and world must be >= 1, got {seq_len}, {world}")
    return -(-seq_len // world)


def valid_len(seq_len: int, world: int, rank: int) -> int:
    """How many of rank `rank`'s shard_len tokens are real (not padding)."""
    n = shard_len(seq_len, world)
    return max(0, min(n, seq_len - rank * n))


def pad_shard(x: torch.Tensor, seq_len: int, world: int, dim: int = 1) -> torch.Tensor:
    """Pad this rank's real tokens x (..., valid_len, ...) along `dim` with zeros to shard_len."""
    n = shard_len(seq_len, world)
    if x.shape[dim] > n:
        raise ValueError(f"pad_shard: the shard has {x.shape[dim]} tokens along dim {dim}, more than "
                         f"shard_len={n} for seq_len={seq_len} over {world} ranks")
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, n - x.shape[dim]]
    return F.pad(x, pad)


def shard_sequence(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's padded shard (..., shard_len, ...) of a full sequence x (..., N, ...)."""
    seq_len = x.shape[dim]
    n = shard_len(seq_len, world)
    start = min(rank * n, seq_len)
    return pad_shard(x.narrow(dim, start, valid_len(seq_len, world, rank)), seq_len, world, dim)


def unpad_shard(x: torch.Tensor, seq_len: int, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Drop the padded positions of this rank's shard (..., shard_len, ...) -> (..., valid_len, ...)."""
    return x.narrow(dim, 0, valid_len(seq_len, world, rank))
