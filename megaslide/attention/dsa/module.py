"""The DSA self-attention module (`dsa`, `dsa_zero` in the registry).

Offsets are predicted from the block input: a depthwise Conv3d over the token grid, GELU,
and a Linear to heads * K * 3, bounded by `max_offset * tanh`. The Linear starts at zero,
so a fresh `dsa` layer is exactly 3D neighbourhood attention and learns to move its
samples. `dsa_zero` is the ablation: offsets fixed at exactly zero. It keeps the (inert)
offset net so both variants have the same parameter count.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaslide.attention import register_attention
from megaslide.attention.base import SelfAttention
from megaslide.attention.dsa.op import deformable_slide_attention


@register_attention("dsa")
class DSAAttention(SelfAttention):
    fixed_zero_offsets = False

    def __init__(self, dim: int, num_heads: int, kernel_size=(3, 3, 3), max_offset: float = 4.0,
                 backend: str = "auto", **kw):
        super().__init__(dim, num_heads, **kw)
        self.kernel_size = tuple(kernel_size)
        self.num_samples = math.prod(self.kernel_size)
        self.max_offset = max_offset
        self.backend = backend
        self.offset_conv = nn.Conv3d(dim, dim, kernel_size=3, padding=1, groups=dim)  # depthwise
        self.offset_proj = nn.Linear(dim, num_heads * self.num_samples * 3)

    def initialize_weights(self) -> None:
        nn.init.zeros_(self.offset_proj.weight)
        nn.init.zeros_(self.offset_proj.bias)

    @staticmethod
    def extra_params(dim: int, num_heads: int, kernel_size=(3, 3, 3), **_) -> int:
        out = num_heads * math.prod(kernel_size) * 3
        return (27 * dim + dim) + (dim * out + out)

    def offsets(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """x (B, N, D) -> offsets (B, T, H, W, heads, K, 3) in token units, |.| < max_offset."""
        B, N, D = x.shape
        # contiguous NCDHW: the strided view is channels-last, where cuDNN's bf16 depthwise
        # Conv3d weight gradient runs 15-50x slower on an H200 (experiments/profile_step.py)
        h = x.transpose(1, 2).reshape(B, D, *grid).contiguous()     # (B, D, T, H, W)
        h = F.gelu(self.offset_conv(h)).permute(0, 2, 3, 4, 1)      # (B, T, H, W, D)
        o = self.offset_proj(h)                                     # (B, T, H, W, heads*K*3)
        o = o.view(B, *grid, self.num_heads, self.num_samples, 3)  # (B, T, H, W, heads, K, 3)
        return self.max_offset * torch.tanh(o.float())

    def attend(self, q, k, v, x, grid):
        B, N, h, d = q.shape
        q6, k6, v6 = (t.reshape(B, *grid, h, d) for t in (q, k, v))  # (B, T, H, W, h, d)
        if self.fixed_zero_offsets:
            off = torch.zeros(B, *grid, h, self.num_samples, 3, device=q.device, dtype=torch.float32)
        else:
            off = self.offsets(x, grid)
        o = deformable_slide_attention(q6, k6, v6, off, self.kernel_size, backend=self.backend)
        return o.reshape(B, N, h, d)                                  # (B, N, h, d)


@register_attention("dsa_zero")
class DSAZeroAttention(DSAAttention):
    fixed_zero_offsets = True
