"""3D rotary position embedding with an explicit (global) temporal index.

The head dimension is split into three groups of rotation pairs, one per axis (t, h, w).
Positions are passed in, never inferred, so a caller can use a *global* frame index:
chunked generation uses `t = chunk_start + local_frame`, and a sequence-parallel rank
looks up exactly the rows of its own token shard. The cos/sin tables are built once per
axis (`RopeTable`) and gathered per token, which needs no communication.
"""
from __future__ import annotations

import torch


def axis_pairs(head_dim: int) -> tuple[int, int, int]:
    """Rotation pairs given to (t, h, w): h and w get a third each, t the rest."""
    pairs = head_dim // 2
    hw = pairs // 3
    return pairs - 2 * hw, hw, hw


def _axis_table(pairs: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = theta ** (-torch.arange(pairs, dtype=torch.float64) / max(pairs, 1))  # (pairs,)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (length, pairs)
    return angles.cos().float(), angles.sin().float()


class RopeTable:
    """Per-axis cos/sin tables for positions up to (max_t, max_h, max_w), built once."""

    def __init__(self, head_dim: int, max_t: int, max_h: int, max_w: int, theta: float = 10000.0):
        self.head_dim = head_dim
        self.max_sizes = (max_t, max_h, max_w)
        self.tables = [_axis_table(p, n, theta) for p, n in zip(axis_pairs(head_dim), self.max_sizes)]
        self._copies: dict[torch.device, list] = {torch.device("cpu"): self.tables}   # the tables per device

    def lookup(self, t: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (N, head_dim // 2) for tokens at integer positions t, y, x (each (N,)), gathered on
        the positions' device (the per-axis tables are copied there once)."""
        for name, idx, limit in zip("tyx", (t, y, x), self.max_sizes):
            if idx.numel() and int(idx.max()) >= limit:
                raise ValueError(f"RoPE position {name}={int(idx.max())} is outside the table (size {limit}); "
                                 f"build the RopeTable for the longest video")
        tables = self._copies.get(t.device)
        if tables is None:
            tables = self._copies[t.device] = [(c.to(t.device), s.to(t.device)) for c, s in self.tables]
        cos = torch.cat([c[i] for (c, _), i in zip(tables, (t, y, x))], dim=-1)  # (N, d/2)
        sin = torch.cat([s[i] for (_, s), i in zip(tables, (t, y, x))], dim=-1)  # (N, d/2)
        return cos, sin

    def grid(self, grid: tuple[int, int, int], t_start: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a full (T, H, W) token grid in row-major order, frames from `t_start`, made on `device`
        (a long clip's tables are large: gathered there, they cross no bus)."""
        return self.lookup(*grid_positions(grid, t_start, device))


def grid_positions(grid: tuple[int, int, int], t_start: int = 0,
                   device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer (t, y, x) of every token of a row-major (T, H, W) grid, t offset by t_start, on `device`."""
    T, H, W = grid
    t = torch.arange(t_start, t_start + T, device=device).repeat_interleave(H * W)  # (N,)
    y = torch.arange(H, device=device).repeat_interleave(W).repeat(T)               # (N,)
    x = torch.arange(W, device=device).repeat(T * H)                                # (N,)
    return t, y, x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (B, N, heads, d) by angles with cos/sin (N, d/2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)   # (B, N, h, d/2) each
    c, s = cos[:, None, :], sin[:, None, :]                # (N, 1, d/2)
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)  # (B, N, h, d/2, 2)
    return out.flatten(-2).type_as(x)
