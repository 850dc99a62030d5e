"""Triton kernels of the offset net's depthwise Conv3d on channels-last tokens (depthwise.py is the op).

Layout. x and y are (B, T, H, W, C) with tokens contiguous within a batch (token stride C, channel
stride 1) and a batch stride of their own, so a frame slab of the block input (B, N, C) is read in
place. taps is the fp32 weight as (KT * KH * KW, C): a tap's C weights are contiguous, tap order
(t, y, x) row-major as in the (C, 1, KT, KH, KW) Conv3d weight.

Both kernels walk along t. A program owns BLOCK_X tokens of one (b, yy) row and BLOCK_C channels for a run
of frames, and reads each input frame's KH x KW shifted tiles once: they serve all KT temporal taps, through
KT rolling fp32 tiles (output frames a - KT // 2 .. a + KT // 2 when input frame a + shift is read). That is
KH * KW tile loads per output frame instead of KT * KH * KW.

`_conv_kernel` computes y[b, t, yy, xx, c] = bias[c] + sum over taps (i, j, k) of
taps[(i, j, k), c] * x[b, t + shift + i - KT // 2, yy + j - KH // 2, xx + k - KW // 2, c], reading 0
outside x (zero padding). With shift = lo it is the forward of output frames [lo, lo + frames); with the
taps reversed and shift = -lo it is the input gradient (the transposed conv of the output gradient).
With GELU it also writes the pre-activation to pre_ptr and y = gelu(pre) (exact, erf) to y_ptr, from the
fp32 sum.

`_wgrad_kernel` computes the weight gradient, per tap the sum over output tokens of dy * (shifted x), and
the bias gradient, the sum of dy. A program owns COLS consecutive (b, yy, x block) columns and BLOCK_C
channels; along each column it keeps the last KT dy tiles, so every dy and shifted x tile is loaded once,
and adds each product to its tap's own (BLOCK_X, BLOCK_C) fp32 register tile. At the end it reduces each
over the tokens and writes it once to its own slice of `part` (programs x (taps + 1) x C, the bias last);
the op sums the programs' slices: no atomics, the same bits every run.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""True when these kernels were built for the CPU interpreter (TRITON_INTERPRET=1)."""


@triton.jit
def _tile(ptr, batch_base, offs, xs, c_ok, t, yy, dx, T, H, W, C):
    """The (BLOCK_X, BLOCK_C) fp32 tile at frame t, row yy, columns xs + dx of one batch (batch_base: its
    first element), 0 outside the grid. offs (BX, BC) = xs * C + channel: the part every tile shares, so
    that only a scalar offset changes between tiles (no per-element addresses kept across the frame loop)."""
    ok = (t >= 0) & (t < T) & (yy >= 0) & (yy < H)
    base = batch_base + (((t * H + yy) * W + dx).to(tl.int64) * C)  # scalar
    mask = ok & ((xs + dx >= 0) & (xs + dx < W))[:, None] & c_ok[None, :]  # (BX, BC)
    return tl.load(ptr + base + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _conv_kernel(x_ptr, taps_ptr, bias_ptr, y_ptr, pre_ptr, TX, TY, H, W, C, shift, stride_xb, stride_yb,
                 FRAMES, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
                 GELU: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_C: tl.constexpr):
    PT: tl.constexpr = KT // 2
    x_blocks = tl.cdiv(W, BLOCK_X)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    xs = p % x_blocks * BLOCK_X + tl.arange(0, BLOCK_X)  # (BX,)
    yy = (p // x_blocks) % H
    t0 = p // (x_blocks * H) * FRAMES  # this program's output frames [t0, t1)
    t1 = tl.minimum(t0 + FRAMES, TY)
    cs = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,)
    c_ok = cs < C
    offs = xs[:, None] * C + cs[None, :]  # (BX, BC) within a frame row
    bias = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cs, mask=c_ok, other=0.0)
    acc = ()  # acc[m]: output frame a - PT + m, (BX, BC) fp32
    for m in tl.static_range(KT):
        acc = acc + (tl.zeros([BLOCK_X, BLOCK_C], tl.float32),)
    a = t0 - PT
    while a < t1 + PT:  # input frame a + shift reaches output frames a - PT .. a + PT
        for j in tl.static_range(KH):
            for k in tl.static_range(KW):
                tile = _tile(x_ptr, b * stride_xb, offs, xs, c_ok, a + shift, yy + j - KH // 2, k - KW // 2,
                             TX, H, W, C)
                summed = ()
                for m in tl.static_range(KT):  # temporal tap KT - 1 - m
                    w = tl.load(taps_ptr + (((KT - 1 - m) * KH + j) * KW + k) * C + cs, mask=c_ok, other=0.0)
                    summed = summed + (acc[m] + tile * w[None, :],)
                acc = summed
        t = a - PT  # acc[0] is complete
        out = acc[0] + bias[None, :]
        mask = (t >= t0) & (xs < W)[:, None] & c_ok[None, :]
        ptrs = b * stride_yb + ((t * H + yy) * W).to(tl.int64) * C + offs
        if GELU:
            tl.store(pre_ptr + ptrs, out.to(pre_ptr.dtype.element_ty), mask=mask)
            out = 0.5 * out * (1.0 + tl.math.erf(out * 0.7071067811865476))
        tl.store(y_ptr + ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
        rolled = ()
        for m in tl.static_range(1, KT):
            rolled = rolled + (acc[m],)
        acc = rolled + (tl.zeros([BLOCK_X, BLOCK_C], tl.float32),)
        a += 1


@triton.jit
def _wgrad_kernel(x_ptr, dy_ptr, part_ptr, B, TX, TY, H, W, C, shift, stride_xb, stride_yb, COLS,
                  KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                  BLOCK_X: tl.constexpr, BLOCK_C: tl.constexpr):
    PT: tl.constexpr = KT // 2
    TAPS: tl.constexpr = KT * KH * KW
    p = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,)
    c_ok = cs < C
    x_blocks = tl.cdiv(W, BLOCK_X)
    acc = ()  # per tap (j, k, i), the (BX, BC) fp32 running sum of dy * shifted x (a tuple: one register tile each)
    for tap in tl.static_range(TAPS):
        acc = acc + (tl.zeros([BLOCK_X, BLOCK_C], tl.float32),)
    acc_bias = tl.zeros([BLOCK_X, BLOCK_C], tl.float32)
    r = 0
    while r < COLS:  # while loops: the interpreter cannot range() over a runtime int
        col = p * COLS + r  # a (b, yy, x block) column
        col_ok = col < B * H * x_blocks
        col = tl.minimum(col, B * H * x_blocks - 1)  # past the end: the last column again, its dy read as 0
        b = (col // (H * x_blocks)).to(tl.int64)
        yy = (col // x_blocks) % H
        xs = col % x_blocks * BLOCK_X + tl.arange(0, BLOCK_X)  # (BX,)
        offs = xs[:, None] * C + cs[None, :]  # (BX, BC) within a frame row
        dys = ()  # dys[m]: dy of output frame a - PT + m
        for m in tl.static_range(KT):
            dys = dys + (tl.zeros([BLOCK_X, BLOCK_C], tl.float32),)
        a = -PT
        while a < TY + PT:  # x frame a + shift meets dy frames a - PT .. a + PT
            newest = _tile(dy_ptr, b * stride_yb, offs, xs, c_ok & col_ok, a + PT, yy, 0, TY, H, W, C)
            acc_bias += newest
            rolled = ()
            for m in tl.static_range(1, KT):
                rolled = rolled + (dys[m],)
            dys = rolled + (newest,)
            summed = ()
            for j in tl.static_range(KH):
                for k in tl.static_range(KW):
                    tile = _tile(x_ptr, b * stride_xb, offs, xs, c_ok, a + shift, yy + j - KH // 2, k - KW // 2,
                                 TX, H, W, C)
                    for i in tl.static_range(KT):
                        summed = summed + (acc[(j * KW + k) * KT + i] + dys[KT - 1 - i] * tile,)
            acc = summed
            a += 1
        r += 1
    for i in tl.static_range(KT):
        for j in tl.static_range(KH):
            for k in tl.static_range(KW):
                out = part_ptr + (p * (TAPS + 1) + (i * KH + j) * KW + k).to(tl.int64) * C + cs
                tl.store(out, tl.sum(acc[(j * KW + k) * KT + i], axis=0), mask=c_ok)
    tl.store(part_ptr + (p * (TAPS + 1) + TAPS).to(tl.int64) * C + cs, tl.sum(acc_bias, axis=0), mask=c_ok)
