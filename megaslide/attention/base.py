"""Shared shell of every self-attention variant: projections, QK-norm, RoPE, output.

A variant implements only `attend(q, k, v, x, grid)`, the token mixing itself. Callers
that need the projected heads (the KV-cached causal generator, sequence parallelism)
use `project_qkv` and `project_out` around their own attention.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from megaslide.nn import RMSNorm, apply_rope


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, **_):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide dim={dim}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(dim, eps=1e-6) if qk_norm else nn.Identity()

    def project_qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x (B, N, D) -> q, k, v (B, N, heads, d), RoPE applied to q and k."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)                                       # (B, N, D) each
        q = apply_rope(self.q_norm(q).view(B, N, self.num_heads, self.head_dim), *rope)  # (B, N, h, d)
        k = apply_rope(self.k_norm(k).view(B, N, self.num_heads, self.head_dim), *rope)  # (B, N, h, d)
        return q, k, v.view(B, N, self.num_heads, self.head_dim)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.out(o.flatten(2))  # (B, N, h, d) -> (B, N, D)

    def attend(self, q, k, v, x, grid):
        """q, k, v (B, N, h, d); x (B, N, D) the block input; grid (T, H, W) -> (B, N, h, d)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, rope, grid: tuple[int, int, int]) -> torch.Tensor:
        q, k, v = self.project_qkv(x, rope)       # (B, N, h, d) each
        o = self.attend(q, k, v, x, grid)         # (B, N, h, d)
        return self.project_out(o)                # (B, N, D)
