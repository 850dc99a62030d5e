"""Dense (global) self-attention over all tokens: SDPA, which is flash attention on GPU."""
from __future__ import annotations

import math

import torch.nn.functional as F

from megaslide.attention import register_attention
from megaslide.attention.base import Grid, SelfAttention


@register_attention
class DenseAttention(SelfAttention):
    name = "dense"

    @classmethod
    def keys_per_query(cls, options, grid: Grid) -> int:
        return math.prod(grid)

    def attend(self, q, k, v, x, grid):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, h, N, d)
        return o.transpose(1, 2)  # (B, N, h, d)
