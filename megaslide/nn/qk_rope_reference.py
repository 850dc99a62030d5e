"""QK-norm + RoPE as separate PyTorch ops: the eager path of `SelfAttention.project_qkv` and the reference
of the fused kernels (qk_rope_kernels.py).

RMSNorm over the whole width D = heads * d (`megaslide.nn.norm.RMSNorm`: the weight cast to the input's
dtype), a view to heads, then `apply_rope` (interleaved pairs (x[2i], x[2i+1]) rotated by the angle of
their head-local pair index). Runs on any device and dtype, float64 included.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megaslide.nn.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis of x (..., D) as `megaslide.nn.RMSNorm` computes it; weight (D,) or None (no norm)."""
    if weight is None:
        return x
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                           heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, N, D) -> RMSNorm over D -> (B, N, heads, d) -> RoPE with cos / sin (N, d/2): q, k (B, N, heads, d)."""
    B, N, D = q.shape
    q = apply_rope(rms_norm(q, q_weight, eps).view(B, N, heads, D // heads), cos, sin)  # (B, N, h, d)
    k = apply_rope(rms_norm(k, k_weight, eps).view(B, N, heads, D // heads), cos, sin)  # (B, N, h, d)
    return q, k
