"""The fused Triton forward of 3D Deformable Slide Attention (its backward: backward.py).

Layout. q, k, v, out and their gradients are contiguous (B, T, H, W, heads, d): one
token's head vector is d contiguous elements and token rows are heads * d apart. offsets
and their gradient are contiguous (B, T, H, W, heads, K, 3). The log-sum-exp saved for
backward is fp32 (B, heads, N) with N = T * H * W, in log2 units.

Work split. One program owns BLOCK_Q consecutive query tokens (row-major over (t, y, x), so neighbouring
queries sample overlapping tokens and share cache lines) of one (batch, head), or a patch of a few rows of one
frame (`launch.LaunchConfig.block_y`); the launch grid is (`launch.query_programs`, B * heads), and programs
take the blocks in an order that keeps the running programs' K / V rows in L2 (`sampling._query_block`). It
loops over the K samples of the window. For each sample it computes every query's clamped position, the 8
surrounding tokens and their trilinear weights, gathers those 8 rows of K (a split row of BLOCK_Q tokens each:
rows.py; a corner of weight 0 is loaded too: a per-element mask to skip it skips nothing on non-integer
offsets) and combines them into the sampled key; the same corners give the sampled value. Every gathered row
is a valid token (clamped positions, clamped query rows: `sampling._query_block`), so the gathers need no mask
unless the head dim is padded, and their offsets are int32 while a (batch, head)'s span fits
(`rows.row_flags`). The forward runs an online softmax over the K samples, so the N x K x d sampled keys and
values never exist in memory; it writes only out and the log-sum-exp (O(N x heads)). Every dot product,
interpolation and softmax runs in fp32 whatever the input dtype (fp32, fp16, bf16).
Head dims are padded to the next power of two (at least 16) with masked columns.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from megaslide.attention.dsa.constants import LOG2E
from megaslide.attention.dsa.launch import LaunchConfig, forward_launch_config, query_programs
from megaslide.attention.dsa.rows import (_load_split, _split_axpy, _split_dot, _split_scale, _split_zeros,
                                          _store_split, row_flags)
from megaslide.attention.dsa.sampling import _corner_axes, _query_block, _sample_axes, _softmax_step, _window_start
from megaslide.backends import device_guard


@triton.jit
def _dsa_fwd_kernel(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, lse_ptr,
                    T, H, W, HEADS, D, stride_tok, stride_off_tok, qk_scale,
                    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
                    WIDE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_Y: tl.constexpr):
    b, h, _, n, q_valid, t, y, x = _query_block(T, H, W, HEADS, BLOCK_Q, BLOCK_Y)
    _forward_queries(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, lse_ptr, b, h, n, q_valid, t, y, x,
                     T, H, W, HEADS, D, stride_tok, stride_off_tok, qk_scale, KT, KH, KW,
                     BLOCK_D, STORE_LSE, WIDE, EVEN_D)


@triton.jit
def _forward_queries(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, lse_ptr, b, h, n, q_valid, t, y, x,
                     T, H, W, HEADS, D, stride_tok, stride_off_tok, qk_scale,
                     KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                     BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr, WIDE: tl.constexpr, EVEN_D: tl.constexpr):
    """The forward of queries n (BQ,) at grid coordinates t, y, x (valid tokens; stores masked by q_valid) of
    (batch b, head h): sample gathers and an online softmax; stores out and, with STORE_LSE, the lse. The
    halo kernel's fallback for tiles whose samples leave the halo (halo.py) runs it too."""
    BLOCK_Q: tl.constexpr = n.shape[0]
    N = T * H * W
    head_off = b * N * stride_tok + h * D  # element offset of (b, token 0, h)
    k_bh = k_ptr + head_off
    v_bh = v_ptr + head_off
    q = _load_split(q_ptr + head_off, n, stride_tok, D, BLOCK_D, WIDE, EVEN_D)  # split row of this block's queries
    off_q = off_ptr + b * N * stride_off_tok + h * (KT * KH * KW * 3) + n.to(tl.int64) * stride_off_tok  # (BQ,)

    t_start = _window_start(t, KT, T)  # (BQ,)
    y_start = _window_start(y, KH, H)  # (BQ,)
    x_start = _window_start(x, KW, W)  # (BQ,)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_Q], tl.float32)  # running softmax denominator
    acc = _split_zeros(BLOCK_Q, BLOCK_D)  # running numerator
    for it in range(KT):
        for iy in range(KH):
            for ix in range(KW):
                j = (it * KH + iy) * KW + ix
                st, sy, sx = _sample_axes(off_q, j, (t_start, y_start, x_start), (it, iy, ix), (T, H, W))
                t_idx, y_idx, x_idx, t_w, y_w, x_w = _corner_axes(st, sy, sx)

                k_sample = _split_zeros(BLOCK_Q, BLOCK_D)
                v_sample = _split_zeros(BLOCK_Q, BLOCK_D)
                for ct in tl.static_range(2):
                    for cy in tl.static_range(2):
                        for cx in tl.static_range(2):
                            tok = (t_idx[ct] * H + y_idx[cy]) * W + x_idx[cx]  # (BQ,)
                            w = t_w[ct] * y_w[cy] * x_w[cx]  # (BQ,)
                            k_sample = _split_axpy(k_sample, w, _load_split(k_bh, tok, stride_tok, D, BLOCK_D,
                                                                            WIDE, EVEN_D))
                            v_sample = _split_axpy(v_sample, w, _load_split(v_bh, tok, stride_tok, D, BLOCK_D,
                                                                            WIDE, EVEN_D))
                s = _split_dot(q, k_sample) * qk_scale  # (BQ,) log2 units
                m_i, l_i, alpha, p = _softmax_step(m_i, l_i, s)
                acc = _split_axpy(_split_scale(acc, alpha), p, v_sample)

    _store_split(out_ptr + head_off, n, stride_tok, D, _split_scale(acc, 1.0 / l_i), q_valid, BLOCK_D, WIDE)
    if STORE_LSE:
        tl.store(lse_ptr + (b * HEADS + h) * N + n, m_i + tl.log2(l_i), mask=q_valid)


def dsa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                kernel_size: Sequence[int], scale: float, store_lse: bool = True,
                config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused forward. q, k, v: contiguous (B, T, H, W, heads, d); offsets: contiguous
    (B, T, H, W, heads, K, 3); kernel_size (kt, kh, kw), checked (`op.check_kernel_size`). Returns out
    (B, T, H, W, heads, d) in q's dtype and, if `store_lse`, the fp32 log-sum-exp (B, heads, T*H*W) in
    log2 units, both for `dsa_backward` (else None: the forward-only path allocates and writes none).
    `config` overrides the default tiles (`forward_launch_config`; for tuning)."""
    B, T, H, W, heads, d = q.shape
    N = T * H * W
    kt, kh, kw = kernel_size
    out = torch.empty_like(q)  # (B, T, H, W, heads, d)
    lse = torch.empty((B, heads, N), dtype=torch.float32, device=q.device) if store_lse else None  # (B, heads, N)
    cfg = config or forward_launch_config(N, d)
    grid = (query_programs((T, H, W), cfg), B * heads)
    with device_guard(q):
        _dsa_fwd_kernel[grid](
            q, k, v, offsets, out, lse if store_lse else out,  # never written without STORE_LSE
            T, H, W, heads, d, q.stride(3), offsets.stride(3), scale * LOG2E,
            KT=kt, KH=kh, KW=kw, BLOCK_Q=cfg.block_q, BLOCK_D=cfg.block_d, STORE_LSE=store_lse,
            BLOCK_Y=cfg.block_y, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
            **row_flags(N, q.stride(3), d, cfg.block_d),
        )
    return out, lse
