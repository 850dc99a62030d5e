"""The gather floor of the fused 3D-DSA kernels: a kernel that makes only their corner-row loads.

A benchmark instrument, not part of the library: the fused forward (megaslide/attention/dsa/forward.py) and
the backward's query pass (backward.py) read, for every query, head and sample, the 8 trilinear corner rows
of K and of V. `gathered_sum` runs the forward's launch, query blocks,
sample positions and corner rows, and only adds the rows up:

    out_n = sum_j sum_c w_c (K_c + V_c)        (n a query, j its K samples, c their 8 corners)

so its time is what those loads cost on a device, measured, with no softmax, no dot products and nothing
stored but one row per query: a floor under any kernel that gathers corner rows this way.
`experiments/bench_attention.py` times it beside the forward (its `gather` table and the bound "gather
floor"). Its reference (`gathered_sum_reference`) is the op itself: with q = 0 every sample gets weight
1 / K, so out = K * deformable_slide_attention(0, k, k + v, offsets) (tests/experiments/test_gather_floor.py).

Two row layouts (`layout`):
- "split": the rows load as the forward and query pass load them (megaslide/attention/dsa/rows.py): split
  rows, 4 threads on a row of 64, one instruction reading half of the rows of 8 tokens (64 bytes of each, in bf16);
- "full": each row loads as one (BLOCK_Q, BLOCK_D) tile, 8 threads on a row of 64 bf16 with one 16-byte
  vector each: an instruction reads whole 128-byte rows of 4 tokens.
Comparing the two tells what the split rows' half-row loads cost in the memory pipeline.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megaslide.attention.dsa.launch import LaunchConfig, forward_launch_config, query_programs
from megaslide.attention.dsa.op import check_inputs
from megaslide.attention.dsa.reference import deformable_slide_attention_reference
from megaslide.attention.dsa.rows import (_load_rows, _load_split, _split_axpy, _split_zeros, _store_split, _token_rows,
                                          row_flags)
from megaslide.attention.dsa.sampling import _corner_axes, _query_block, _sample_axes, _window_start
from megaslide.backends import device_guard

LAYOUTS = ("split", "full")


def gathered_sum_reference(k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                           kernel_size: tuple[int, int, int]) -> torch.Tensor:
    """`gathered_sum` in float64 by the readable reference op with q = 0 (each sample weighted 1 / K), times K."""
    k64, v64 = k.double(), v.double()
    return math.prod(kernel_size) * deformable_slide_attention_reference(torch.zeros_like(k64), k64, k64 + v64,
                                                                         offsets.double(), kernel_size, scale=1.0)


@triton.jit
def _gathered_sum_kernel(k_ptr, v_ptr, off_ptr, out_ptr, T, H, W, HEADS, D, stride_tok, stride_off_tok,
                         KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_D: tl.constexpr, WIDE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_Y: tl.constexpr,
                         SPLIT: tl.constexpr):
    b, h, N, n, q_valid, t, y, x = _query_block(T, H, W, HEADS, BLOCK_Q, BLOCK_Y)
    head_off = b * N * stride_tok + h * D  # element offset of (b, token 0, h)
    k_bh = k_ptr + head_off
    v_bh = v_ptr + head_off
    off_q = off_ptr + b * N * stride_off_tok + h * (KT * KH * KW * 3) + n.to(tl.int64) * stride_off_tok  # (BQ,)
    starts = (_window_start(t, KT, T), _window_start(y, KH, H), _window_start(x, KW, W))  # (BQ,) each
    cols = tl.arange(0, BLOCK_D)  # (BD,)
    col_ok = (cols < D)[None, :]  # (1, BD)
    if SPLIT:
        acc = _split_zeros(BLOCK_Q, BLOCK_D)
    else:
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for it in range(KT):
        for iy in range(KH):
            for ix in range(KW):
                j = (it * KH + iy) * KW + ix
                st, sy, sx = _sample_axes(off_q, j, starts, (it, iy, ix), (T, H, W))
                t_idx, y_idx, x_idx, t_w, y_w, x_w = _corner_axes(st, sy, sx)
                # the sampled key and value in two accumulators, as the forward builds them, so that the 16 loads
                # of a sample are as independent of each other as there
                if SPLIT:
                    k_sample = _split_zeros(BLOCK_Q, BLOCK_D)
                    v_sample = _split_zeros(BLOCK_Q, BLOCK_D)
                else:
                    k_sample = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
                    v_sample = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
                for ct in tl.static_range(2):
                    for cy in tl.static_range(2):
                        for cx in tl.static_range(2):
                            tok = (t_idx[ct] * H + y_idx[cy]) * W + x_idx[cx]  # (BQ,)
                            w = t_w[ct] * y_w[cy] * x_w[cx]  # (BQ,)
                            if SPLIT:
                                k_sample = _split_axpy(k_sample, w, _load_split(k_bh, tok, stride_tok, D, BLOCK_D, WIDE,
                                                                                EVEN_D))
                                v_sample = _split_axpy(v_sample, w, _load_split(v_bh, tok, stride_tok, D, BLOCK_D, WIDE,
                                                                                EVEN_D))
                            else:
                                rows = _token_rows(tok, stride_tok, cols, WIDE)  # (BQ, BD)
                                k_sample += w[:, None] * _load_rows(k_bh + rows, col_ok, EVEN_D).to(tl.float32)
                                v_sample += w[:, None] * _load_rows(v_bh + rows, col_ok, EVEN_D).to(tl.float32)
                if SPLIT:
                    acc = (acc[0] + k_sample[0] + v_sample[0], acc[1] + k_sample[1] + v_sample[1],
                           acc[2] + k_sample[2] + v_sample[2], acc[3] + k_sample[3] + v_sample[3])
                else:
                    acc += k_sample + v_sample
    if SPLIT:
        _store_split(out_ptr + head_off, n, stride_tok, D, acc, q_valid, BLOCK_D, WIDE)
    else:
        rows = _token_rows(n, stride_tok, cols, WIDE)  # (BQ, BD)
        tl.store(out_ptr + head_off + rows, acc.to(out_ptr.dtype.element_ty), mask=q_valid[:, None] & col_ok)


def gathered_sum(k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, kernel_size: tuple[int, int, int],
                 layout: str = "split", config: LaunchConfig | None = None) -> torch.Tensor:
    """sum_j sum_c w_c (K_c + V_c) of every query: k, v contiguous (B, T, H, W, heads, d), offsets contiguous
    (B, T, H, W, heads, K, 3) as `forward.dsa_forward` takes them. Returns (B, T, H, W, heads, d) in k's dtype.
    `layout` picks how rows load (module docstring); `config` the launch (default: the forward's,
    `launch.forward_launch_config`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {list(LAYOUTS)}")
    kt, kh, kw = check_inputs(k, k, v, offsets, kernel_size)  # the op's checks, k in q's place
    B, T, H, W, heads, d = k.shape
    N = T * H * W
    out = torch.empty_like(k)  # (B, T, H, W, heads, d)
    cfg = config or forward_launch_config(N, d)
    with device_guard(k):
        _gathered_sum_kernel[(query_programs((T, H, W), cfg), B * heads)](
            k, v, offsets, out, T, H, W, heads, d, k.stride(3), offsets.stride(3),
            KT=kt, KH=kh, KW=kw, BLOCK_Q=cfg.block_q, BLOCK_D=cfg.block_d, BLOCK_Y=cfg.block_y,
            SPLIT=layout == "split", num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
            **row_flags(N, k.stride(3), d, cfg.block_d))
    return out
