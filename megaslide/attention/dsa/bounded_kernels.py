"""Triton kernels of the offset bound y = max_offset * tanh(o) (bounded.py is the op).

Elementwise over flat contiguous tensors: the forward reads o (the offset Linear's output, any float
dtype) and writes y in fp32; the backward reads the output gradient and y and writes the gradient of
o in o's dtype, d y / d o = max_offset * (1 - tanh(o)^2) = max_offset - y^2 / max_offset (max_offset > 0;
bounded.py handles 0). All arithmetic in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""True when these kernels were built for the CPU interpreter (TRITON_INTERPRET=1)."""

@triton.jit
def _bound_fwd_kernel(o_ptr, y_ptr, n, max_offset, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    o = tl.load(o_ptr + i, mask=ok, other=0.0).to(tl.float32)
    o = tl.minimum(tl.maximum(o, -30.0), 30.0)  # tanh(30) rounds to 1 in fp32; exp2 stays finite
    tanh = 1.0 - 2.0 / (tl.exp2(o * 2.8853900817779268) + 1.0)  # exp(2 o) = exp2(2 log2(e) o)
    tl.store(y_ptr + i, max_offset * tanh, mask=ok)


@triton.jit
def _bound_bwd_kernel(dy_ptr, y_ptr, do_ptr, n, max_offset, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    dy = tl.load(dy_ptr + i, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + i, mask=ok, other=0.0)
    tl.store(do_ptr + i, (dy * (max_offset - y * y / max_offset)).to(do_ptr.dtype.element_ty), mask=ok)
