"""Dense (global) self-attention over all tokens: SDPA, which is flash attention on GPU."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megaslide.attention import register_attention
from megaslide.attention.base import AttendMemory, Grid, SelfAttention

_aten = torch.ops.aten


class DenseSplit:
    """SDPA's fused kernel as a `SplitOp` (megaslide/attention/kept.py) on q, k, v (B, heads, N, d): on the CPU
    the flash kernel that SDPA takes there; on CUDA flash attention (fp16, bf16) or the memory-efficient kernel
    (fp32). out (B, heads, N, d), lse as the kernel keeps it (fp32, per query and head)."""

    def forward(self, q, k, v):
        if q.device.type != "cuda":
            return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
        if q.dtype in (torch.float16, torch.bfloat16):
            out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)
            return out, lse
        out, lse, *_ = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False)
        return out, lse

    def backward(self, inputs, out, lse, dout, needs):
        q, k, v = inputs
        if q.device.type != "cuda":
            return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, False)
        # no dropout: the kernels read no RNG state (placeholders of the forward's shapes); not varlen: no offsets
        if q.dtype in (torch.float16, torch.bfloat16):
            rng, unused = (torch.empty(shape, dtype=torch.uint64, device=q.device) for shape in ((2,), ()))
            return _aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, None, None, q.shape[2],
                                                                      k.shape[2], 0.0, False, rng, unused)
        seed, offset = (torch.empty((), dtype=torch.int64) for _ in range(2))
        grads = _aten._scaled_dot_product_efficient_attention_backward(dout, q, k, v, None, out, lse, seed, offset,
                                                                       0.0, [True, True, True, False], False)
        return grads[:3]


@register_attention
class DenseAttention(SelfAttention):
    name = "dense"
    sp_form = "global"

    @classmethod
    def keys_per_query(cls, options, grid: Grid) -> int:
        return math.prod(grid)

    @classmethod
    def keep_reason(cls, options, device_type: str) -> str:
        return ""

    @classmethod
    def attend_memory(cls, options, dim: int, num_heads: int, act: int, chunked: bool) -> AttendMemory:
        # SDPA's fused kernels (flash, cuDNN) keep q, k, v as passed, the output and lse (fp32 per
        # head); the backward makes dq, dk, dv, an fp32 dq accumulator in low precision and the
        # fp32 row sums of dO * O
        accumulator = 4 * dim if act < 4 else 0
        return AttendMemory("as_passed", act * dim + 4 * num_heads, 0, 3 * act * dim + accumulator + 4 * num_heads)

    def attend(self, q, k, v, x, grid, keep=None):
        """As `SelfAttention.attend`; with `keep` (kept.py) through SDPA's kernel split at its lse."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                        # (B, h, N, d) each
        if keep is None:
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)    # (B, N, h, d)
        device = q.device.type
        if torch.is_autocast_enabled(device):   # as autocast casts SDPA's inputs; the split kernels are not cast
            q, k, v = (t.to(torch.get_autocast_dtype(device)) for t in (q, k, v))
        o = keep(DenseSplit(), q, k, v)
        return o.transpose(1, 2)  # (B, N, h, d)
