"""Dense (global) self-attention over all tokens: SDPA, which is flash attention on GPU."""
from __future__ import annotations

import math

import torch.nn.functional as F

from megaslide.attention import register_attention
from megaslide.attention.base import AttendMemory, Grid, SelfAttention


@register_attention
class DenseAttention(SelfAttention):
    name = "dense"
    sp_form = "global"

    @classmethod
    def keys_per_query(cls, options, grid: Grid) -> int:
        return math.prod(grid)

    @classmethod
    def attend_memory(cls, options, dim: int, num_heads: int, act: int, chunked: bool) -> AttendMemory:
        # SDPA's fused kernels (flash, cuDNN) keep q, k, v as passed, the output and lse (fp32 per
        # head); the backward makes dq, dk, dv, an fp32 dq accumulator in low precision and the
        # fp32 row sums of dO * O
        accumulator = 4 * dim if act < 4 else 0
        return AttendMemory("as_passed", act * dim + 4 * num_heads, 0, 3 * act * dim + accumulator + 4 * num_heads)

    def attend(self, q, k, v, x, grid):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, h, N, d)
        return o.transpose(1, 2)  # (B, N, h, d)
