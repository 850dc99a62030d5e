"""Triton kernels of the offset net's depthwise Conv3d on channels-last tokens (depthwise.py is the op).

Layout. x and y are (B, T, H, W, C) with tokens contiguous within a batch (token stride C, channel
stride 1) and a batch stride of their own, so a frame slab of the block input (B, N, C) is read in
place. taps is the fp32 weight as (KT * KH * KW, C): a tap's C weights are contiguous, tap order
(t, y, x) row-major as in the (C, 1, KT, KH, KW) Conv3d weight.

`_conv_kernel` computes y[b, t, yy, xx, c] = bias[c] + sum over taps (i, j, k) of
taps[(i, j, k), c] * x[b, t + shift + i - KT // 2, yy + j - KH // 2, xx + k - KW // 2, c], reading 0
outside x (zero padding). With shift = lo it is the forward of output frames [lo, lo + frames); with the
taps reversed and shift = -lo it is the input gradient (the transposed conv of the output gradient).
One program owns BLOCK_X tokens of one (b, t, yy) row and BLOCK_C channels, and accumulates in fp32.

`_wgrad_kernel` computes the weight gradient: per tap, the sum over output tokens of dy * (shifted
x). One program owns ROWS consecutive (b, t, yy) rows and BLOCK_C channels; it reads each dy tile once,
adds its product with every tap's shifted x tile to that tap's own (BLOCK_X, BLOCK_C) fp32 register
tile, and at the end reduces each over the tokens and writes it once to its own slice of `part`
(programs x taps x C); the op sums the programs' slices: no atomics, the same bits every run.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""True when these kernels were built for the CPU interpreter (TRITON_INTERPRET=1)."""


@triton.jit
def _shifted_tile(x_ptr, row_base, t, yy, xs, cs, c_ok, TX, H, W, C,
                  di: tl.constexpr, dj: tl.constexpr, dk: tl.constexpr):
    """The (BLOCK_X, BLOCK_C) fp32 tile of x at frame t + di, row yy + dj, columns xs + dk of one batch
    (row_base: its first element), 0 outside x."""
    ti, yj, xk = t + di, yy + dj, xs + dk  # scalar, scalar, (BX,)
    ok = (ti >= 0) & (ti < TX) & (yj >= 0) & (yj < H)
    tok = ((ti * H + yj) * W + xk).to(tl.int64)  # (BX,)
    mask = ok & ((xk >= 0) & (xk < W))[:, None] & c_ok[None, :]  # (BX, BC)
    return tl.load(x_ptr + row_base + tok[:, None] * C + cs[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _conv_kernel(x_ptr, taps_ptr, bias_ptr, y_ptr, TX, H, W, C, shift, stride_xb, stride_yb,
                 KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_X: tl.constexpr, BLOCK_C: tl.constexpr):
    x_blocks = tl.cdiv(W, BLOCK_X)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    xs = p % x_blocks * BLOCK_X + tl.arange(0, BLOCK_X)  # (BX,)
    yy = (p // x_blocks) % H
    t = p // (x_blocks * H)  # output frame
    cs = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,)
    c_ok = cs < C
    acc = tl.zeros([BLOCK_X, BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cs, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(KT):
        for j in tl.static_range(KH):
            for k in tl.static_range(KW):
                w = tl.load(taps_ptr + ((i * KH + j) * KW + k) * C + cs, mask=c_ok, other=0.0)  # (BC,) fp32
                tile = _shifted_tile(x_ptr, b * stride_xb, t + shift, yy, xs, cs, c_ok, TX, H, W, C,
                                     i - KT // 2, j - KH // 2, k - KW // 2)
                acc += tile * w[None, :]
    tok = ((t * H + yy) * W + xs).to(tl.int64)  # (BX,)
    mask = (xs < W)[:, None] & c_ok[None, :]
    tl.store(y_ptr + b * stride_yb + tok[:, None] * C + cs[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wgrad_kernel(x_ptr, dy_ptr, part_ptr, B, TX, TY, H, W, C, shift, stride_xb, stride_yb, ROWS,
                  KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                  BLOCK_X: tl.constexpr, BLOCK_C: tl.constexpr):
    p = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,)
    c_ok = cs < C
    acc = ()  # per tap, the (BX, BC) fp32 running sum of dy * shifted x (a tuple: one register tile each)
    for tap in tl.static_range(KT * KH * KW):
        acc = acc + (tl.zeros([BLOCK_X, BLOCK_C], tl.float32),)
    r = 0
    while r < ROWS:  # while loops: the interpreter cannot range() over a runtime int
        row = p * ROWS + r  # a (b, t, yy) row of the output
        row_ok = row < B * TY * H
        row = tl.minimum(row, B * TY * H - 1)  # past the end: the last row again, its dy read as 0
        b = (row // (TY * H)).to(tl.int64)
        t = (row // H) % TY
        yy = row % H
        x0 = 0
        while x0 < W:
            xs = x0 + tl.arange(0, BLOCK_X)  # (BX,)
            tok = ((t * H + yy) * W + xs).to(tl.int64)
            mask = row_ok & (xs < W)[:, None] & c_ok[None, :]
            dy = tl.load(dy_ptr + b * stride_yb + tok[:, None] * C + cs[None, :], mask=mask,
                         other=0.0).to(tl.float32)  # (BX, BC)
            summed = ()
            for i in tl.static_range(KT):
                for j in tl.static_range(KH):
                    for k in tl.static_range(KW):
                        tile = _shifted_tile(x_ptr, b * stride_xb, t + shift, yy, xs, cs, c_ok, TX, H, W, C,
                                             i - KT // 2, j - KH // 2, k - KW // 2)
                        summed = summed + (acc[(i * KH + j) * KW + k] + dy * tile,)
            acc = summed
            x0 += BLOCK_X
        r += 1
    for tap in tl.static_range(KT * KH * KW):
        out = part_ptr + (p * (KT * KH * KW) + tap).to(tl.int64) * C + cs
        tl.store(out, tl.sum(acc[tap], axis=0), mask=c_ok)
