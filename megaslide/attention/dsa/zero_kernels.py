"""Triton kernels of 3D neighbourhood attention: 3D-DSA with offsets exactly zero (`dsa_zero`).

With zero offsets every sample sits on an integer position, so it is one key row, not 8
trilinear corners: query n = (t, y, x) attends to the kt x kh x kw tokens of its clamped
window (along an axis of size S with kernel k the window of query i starts at
clamp(i - k // 2, 0, S - k)), and there is no offset gradient.

Layout (as forward.py). q, k, v, out and their gradients are contiguous
(B, T, H, W, heads, d): token rows are heads * d apart. The log-sum-exp of the forward is
fp32 (B, heads, N) with N = T * H * W, in log2 units; the backward's delta = <dO, out> has
the same layout. Dot products, softmax and accumulators are fp32 whatever the input dtype
(fp32, fp16, bf16); head dims are padded to a power of two (at least 16) with masked columns.
Rows and their offsets as rows.py (`_token_rows`, `_load_rows`): clamped query rows, int32 offsets
within a (batch, head) while they fit, no load mask where the rows are valid tokens and d fills BLOCK_D.

Work split. Every kernel's program owns BLOCK_Q consecutive tokens (row-major over (t, y, x))
of one (batch, head); the launch grid is (cdiv(N, BLOCK_Q), B * heads).
- forward: a block of queries runs an online softmax over its K = kt * kh * kw window keys,
  one K row and one V row load per sample; it writes out and (unless forward-only) the lse.
- backward dq: a block of queries recomputes p = exp2(s - lse) over its window and sums
  dq = scale * sum_j ds_j K_j, ds_j = p_j (<dO, V_j> - delta); it also writes delta
  (from the stored out, rounded to the input dtype, as flash-attention does) for the next kernel.
- backward dk, dv: a block of KEYS gathers over the queries that attend to them:
  dK_j = scale * sum_n ds_nj q_n and dV_j = sum_n p_nj dO_n, accumulated in registers and
  written once in the input dtype.

Why no atomics. Without offsets the sampling map is fixed, so its inverse is closed form:
along an axis of size S with kernel k = 2r + 1, the queries whose clamped window contains
key j are the range
    lo = 0 if j < k else j - r,    hi = S - 1 if j >= S - k else j + r
(k queries in the interior, at most 2k - 1 near the edges, where clamped windows pile up).
The queries of key (jt, jy, jx) are the product of its three ranges, and each such query
reaches the key exactly once. So the dk/dv program owns its keys' gradients outright: no
other program writes them, no float atomics, no fp32 scratch, and a fixed summation order:
the backward is deterministic (bit-identical from run to run).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from megaslide.attention.dsa.constants import LOG2E
from megaslide.attention.dsa.launch import LaunchConfig, launch_config, query_programs
from megaslide.attention.dsa.rows import _load_rows, _token_rows, row_flags
from megaslide.attention.dsa.sampling import _query_block, _softmax_step
from megaslide.backends import device_guard


@triton.jit
def _window_starts(t, y, x, T, H, W, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr):
    """First index of the clamped window of queries (t, y, x) along each axis: (BLOCK_Q,) int32 each."""
    return (tl.minimum(tl.maximum(t - KT // 2, 0), T - KT),
            tl.minimum(tl.maximum(y - KH // 2, 0), H - KH),
            tl.minimum(tl.maximum(x - KW // 2, 0), W - KW))


@triton.jit
def _load_pair(a_ptr, b_ptr, rows, col_ok, EVEN_D: tl.constexpr):
    """The tiles at `rows` (valid tokens: `rows._load_rows`) of two tensors, fp32."""
    return (_load_rows(a_ptr + rows, col_ok, EVEN_D).to(tl.float32),
            _load_rows(b_ptr + rows, col_ok, EVEN_D).to(tl.float32))


@triton.jit
def _inverse_range(j, k: tl.constexpr, size):
    """The queries whose clamped window (kernel k) contains keys j along an axis of length size:
    (first index, count), both (BLOCK_Q,) int32."""
    lo = tl.where(j < k, 0, j - k // 2)
    hi = tl.where(j >= size - k, size - 1, j + k // 2)
    return lo, hi - lo + 1


@triton.jit
def _na_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
                   T, H, W, HEADS, D, stride_tok, qk_scale,
                   KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
                   WIDE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_Y: tl.constexpr):
    b, h, N, n, q_valid, t, y, x = _query_block(T, H, W, HEADS, BLOCK_Q, BLOCK_Y)
    cols = tl.arange(0, BLOCK_D)  # (BD,)
    col_ok = (cols < D)[None, :]  # (1, BD)
    tile_mask = q_valid[:, None] & col_ok  # (BQ, BD) the stores

    head_off = b * N * stride_tok + h * D  # element offset of (b, token 0, h)
    q_ptr, k_ptr, v_ptr, out_ptr = q_ptr + head_off, k_ptr + head_off, v_ptr + head_off, out_ptr + head_off
    own_rows = _token_rows(n, stride_tok, cols, WIDE)  # (BQ, BD)
    q = _load_rows(q_ptr + own_rows, col_ok, EVEN_D).to(tl.float32) * qk_scale  # (BQ, BD), log2 units
    t_start, y_start, x_start = _window_starts(t, y, x, T, H, W, KT, KH, KW)  # (BQ,) each

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_Q], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)  # running numerator
    for it in range(KT):
        for iy in range(KH):
            for ix in range(KW):
                tok = ((t_start + it) * H + y_start + iy) * W + x_start + ix  # (BQ,) key token
                k_j, v_j = _load_pair(k_ptr, v_ptr, _token_rows(tok, stride_tok, cols, WIDE), col_ok, EVEN_D)
                s = tl.sum(q * k_j, axis=1)  # (BQ,)
                m_i, l_i, alpha, p = _softmax_step(m_i, l_i, s)
                acc = acc * alpha[:, None] + p[:, None] * v_j  # (BQ, BD)

    out = acc / l_i[:, None]  # (BQ, BD)
    tl.store(out_ptr + own_rows, out.to(out_ptr.dtype.element_ty), mask=tile_mask)
    if STORE_LSE:
        tl.store(lse_ptr + (b * HEADS + h) * N + n, m_i + tl.log2(l_i), mask=q_valid)


@triton.jit
def _na_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, out_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr,
                      T, H, W, HEADS, D, stride_tok, scale, qk_scale,
                      KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr, EVEN_D: tl.constexpr,
                      BLOCK_Y: tl.constexpr):
    b, h, N, n, q_valid, t, y, x = _query_block(T, H, W, HEADS, BLOCK_Q, BLOCK_Y)
    cols = tl.arange(0, BLOCK_D)  # (BD,)
    col_ok = (cols < D)[None, :]  # (1, BD)
    tile_mask = q_valid[:, None] & col_ok  # (BQ, BD) the stores

    head_off = b * N * stride_tok + h * D
    q_ptr, k_ptr, v_ptr, out_ptr = q_ptr + head_off, k_ptr + head_off, v_ptr + head_off, out_ptr + head_off
    dout_ptr, dq_ptr = dout_ptr + head_off, dq_ptr + head_off
    own_rows = _token_rows(n, stride_tok, cols, WIDE)  # (BQ, BD)
    q, do = _load_pair(q_ptr, dout_ptr, own_rows, col_ok, EVEN_D)  # (BQ, BD) each
    o = _load_rows(out_ptr + own_rows, col_ok, EVEN_D).to(tl.float32)  # (BQ, BD)
    delta = tl.sum(do * o, axis=1)  # (BQ,) <dO, out>
    stat = (b * HEADS + h) * N + n  # (BQ,) index into (B, heads, N)
    tl.store(delta_ptr + stat, delta, mask=q_valid)
    lse = tl.load(lse_ptr + stat)  # (BQ,) log2 units
    t_start, y_start, x_start = _window_starts(t, y, x, T, H, W, KT, KH, KW)  # (BQ,) each

    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for it in range(KT):
        for iy in range(KH):
            for ix in range(KW):
                tok = ((t_start + it) * H + y_start + iy) * W + x_start + ix  # (BQ,) key token
                k_j, v_j = _load_pair(k_ptr, v_ptr, _token_rows(tok, stride_tok, cols, WIDE), col_ok, EVEN_D)
                p = tl.exp2(tl.sum(q * k_j, axis=1) * qk_scale - lse)  # (BQ,) softmax probability
                ds = p * (tl.sum(do * v_j, axis=1) - delta)  # (BQ,) d loss / d score, over scale
                dq += ds[:, None] * k_j  # (BQ, BD)

    tl.store(dq_ptr + own_rows, (dq * scale).to(dq_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit
def _na_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                        T, H, W, HEADS, D, stride_tok, scale, qk_scale,
                        KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr, EVEN_D: tl.constexpr,
                      BLOCK_Y: tl.constexpr):
    # this program's tokens are KEYS: n, t, y, x below are key indices and coordinates
    b, h, N, n, k_valid, t, y, x = _query_block(T, H, W, HEADS, BLOCK_Q, BLOCK_Y)
    cols = tl.arange(0, BLOCK_D)  # (BD,)
    col_mask = (cols < D)[None, :]  # (1, BD)
    tile_mask = k_valid[:, None] & col_mask  # (BQ, BD) the stores

    head_off = b * N * stride_tok + h * D
    q_ptr, k_ptr, v_ptr, dout_ptr = q_ptr + head_off, k_ptr + head_off, v_ptr + head_off, dout_ptr + head_off
    dk_ptr, dv_ptr = dk_ptr + head_off, dv_ptr + head_off
    own_rows = _token_rows(n, stride_tok, cols, WIDE)  # (BQ, BD)
    k_j, v_j = _load_pair(k_ptr, v_ptr, own_rows, col_mask, EVEN_D)  # (BQ, BD) each
    stat_bh = (b * HEADS + h) * N  # offset of (b, h) in the (B, heads, N) statistics

    t_lo, t_count = _inverse_range(t, KT, T)  # (BQ,) each
    y_lo, y_count = _inverse_range(y, KH, H)
    x_lo, x_count = _inverse_range(x, KW, W)
    # the block's loops run to its longest range; shorter ones are masked. While loops: the
    # interpreter cannot take a reduced tensor as a range bound
    t_steps = tl.max(tl.where(k_valid, t_count, 0), axis=0)
    y_steps = tl.max(tl.where(k_valid, y_count, 0), axis=0)
    x_steps = tl.max(tl.where(k_valid, x_count, 0), axis=0)

    dk = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    a = 0
    while a < t_steps:
        c = 0
        while c < y_steps:
            e = 0
            while e < x_steps:
                hit = k_valid & (a < t_count) & (c < y_count) & (e < x_count)  # (BQ,)
                qn = ((t_lo + a) * H + y_lo + c) * W + x_lo + e  # (BQ,) query token
                rows = _token_rows(qn, stride_tok, cols, WIDE)  # (BQ, BD); qn may lie off the grid where not hit
                row_mask = hit[:, None] & col_mask  # (BQ, BD)
                q_n = tl.load(q_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)  # (BQ, BD)
                do_n = tl.load(dout_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)  # (BQ, BD)
                lse = tl.load(lse_ptr + stat_bh + qn, mask=hit, other=0.0)  # (BQ,)
                delta = tl.load(delta_ptr + stat_bh + qn, mask=hit, other=0.0)  # (BQ,)
                p = tl.where(hit, tl.exp2(tl.sum(q_n * k_j, axis=1) * qk_scale - lse), 0.0)  # (BQ,)
                ds = p * (tl.sum(do_n * v_j, axis=1) - delta)  # (BQ,) d loss / d score, over scale
                dk += ds[:, None] * q_n  # (BQ, BD)
                dv += p[:, None] * do_n  # (BQ, BD)
                e += 1
            c += 1
        a += 1

    tl.store(dk_ptr + own_rows, (dk * scale).to(dk_ptr.dtype.element_ty), mask=tile_mask)
    tl.store(dv_ptr + own_rows, dv.to(dv_ptr.dtype.element_ty), mask=tile_mask)


def _stat_shape(q: torch.Tensor) -> tuple[int, int, int]:
    """(B, heads, N) of q (B, T, H, W, heads, d): the layout of the lse and delta."""
    B, T, H, W, heads, _ = q.shape
    return B, heads, T * H * W


def na_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: Sequence[int],
               scale: float, store_lse: bool = True,
               config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward. q, k, v: contiguous (B, T, H, W, heads, d). Returns out (B, T, H, W, heads, d)
    in q's dtype and, if `store_lse`, the fp32 log-sum-exp (B, heads, T*H*W) in log2 units for
    `na_backward` (else None: the forward-only path allocates and writes none). `config`
    overrides the default tiles (for tuning)."""
    B, heads, N = _stat_shape(q)
    out = torch.empty_like(q)  # (B, T, H, W, heads, d)
    lse = torch.empty((B, heads, N), dtype=torch.float32, device=q.device) if store_lse else None
    cfg = config or launch_config(N, q.shape[-1])
    grid = (query_programs(q.shape[1:4], cfg), B * heads)
    with device_guard(q):
        _na_fwd_kernel[grid](
            q, k, v, out, lse if store_lse else out,  # never written without STORE_LSE
            *q.shape[1:4], heads, q.shape[-1], q.stride(3), scale * LOG2E,
            KT=kernel_size[0], KH=kernel_size[1], KW=kernel_size[2],
            BLOCK_Q=cfg.block_q, BLOCK_D=cfg.block_d, STORE_LSE=store_lse, BLOCK_Y=cfg.block_y, num_warps=cfg.num_warps,
            maxnreg=cfg.maxnreg, **row_flags(N, q.stride(3), q.shape[-1], cfg.block_d),
        )
    return out, lse


def na_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                dout: torch.Tensor, kernel_size: Sequence[int], scale: float,
                config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward, deterministic (no atomics). Inputs as `na_forward` (contiguous) plus its out and
    lse and the output gradient dout (B, T, H, W, heads, d). Returns dq, dk, dv in the dtype and
    shape of q, k, v. Two launches: dq (which also writes delta = <dO, out>, fp32 (B, heads, N)),
    then the dk/dv gather that reads it. `config` overrides the default tiles (for tuning)."""
    B, heads, N = _stat_shape(q)
    dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # (B, T, H, W, heads, d)
    delta = torch.empty((B, heads, N), dtype=torch.float32, device=q.device)  # (B, heads, N)
    cfg = config or launch_config(N, q.shape[-1])
    grid = (query_programs(q.shape[1:4], cfg), B * heads)
    sizes = (*q.shape[1:4], heads, q.shape[-1], q.stride(3), scale, scale * LOG2E)
    tiles = dict(KT=kernel_size[0], KH=kernel_size[1], KW=kernel_size[2],
                 BLOCK_Q=cfg.block_q, BLOCK_D=cfg.block_d, BLOCK_Y=cfg.block_y, num_warps=cfg.num_warps,
                 maxnreg=cfg.maxnreg, **row_flags(N, q.stride(3), q.shape[-1], cfg.block_d))
    with device_guard(q):
        _na_bwd_dq_kernel[grid](q, k, v, out, dout, lse, delta, dq, *sizes, **tiles)
        _na_bwd_dkdv_kernel[grid](q, k, v, dout, lse, delta, dk, dv, *sizes, **tiles)
    return dq, dk, dv
