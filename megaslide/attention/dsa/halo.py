"""The halo forward of 3D Deformable Slide Attention: scores on tensor cores over a tile's neighbourhood.

Idea. Trilinear interpolation is linear, so a query's score against a sample is the weighted sum of its
scores against the sample's 8 corner tokens: <q, sum_c w_c K_c> = sum_c w_c <q, K_c>. A program owns a
tile of TILE_T x TILE_Y x TILE_X queries of one (batch, head). When every sample of the tile lies inside
the tile's halo (the tile grown by the window's reach kernel // 2 and by `reach` tokens of offset along
each axis), it loads the halo's K rows once and computes the scores of the tile against the whole halo
with one `tl.dot` (BQ x HALO). Each sample's trilinear weights are written as a dense (BQ, HALO) matrix
(the product of its three 1D weights, `_axis_weights`; at most 8 nonzeros a row), so its score is a row sum
of weights x scores. The softmax runs over the K samples as in forward.py, its numerator kept as weights on
the halo's tokens (BQ, HALO): the sum over samples of p_j x weights_j; one `tl.dot` with the halo's V rows
at the end gives out. So a tile reads its K and V halo rows once instead of 8 corner rows per (query,
sample). No `tl.gather` from the on-chip tiles: Triton lowers a gather from a register tile to warp shuffles,
their number the product of the source's and the result's elements per thread, which at large halos swells
the kernel past what LLVM compiles in reasonable time; the dense weights cost elementwise work linear in
BQ x HALO (test_dsa_halo.py bounds the built kernel's shuffles).

Path choice, per tile at run time. The program first computes every sample's clamped position; if one
leaves the halo (an offset past `reach`), the tile runs the gather forward of forward.py
(`forward._forward_queries`) instead. Either way the results are the same to rounding: out and the fp32
log-sum-exp in log2 units (B, heads, N), exactly what `backward.dsa_backward` reads. Each program writes
its path (1: halo, 0: gathers) to a per-tile int8 tensor, so a caller can count the tiles of each path.

Layout as forward.py: q, k, v, out contiguous (B, T, H, W, heads, d); offsets (B, T, H, W, heads, K, 3).
Scores are fp32 (tensor-core dots of the input dtype, fp32 inputs at full fp32 precision; under the CPU
interpreter bf16 operands are widened to fp32 first, as its dots would read bf16 bits as integers); the
final dot takes the fp32 weights and V widened to fp32, at full fp32 precision for fp32 inputs and at tf32
for bf16 ones (the weights rounded to tf32: finer than bf16's rounding of out); head dims are padded to the
next power of two (at least 16) with masked columns. A full-precision fp32 score dot runs on CUDA cores as one
chain of multiply-adds per score, so it is summed over chunks of FP32_DOT_CHUNK head columns, which keeps each
chain as short as a 64-wide head's (docs/dsa_kernels.md, "Where the kernels stand", says why).
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from megaslide.attention.dsa.constants import LOG2E, MAX_HALO_REACH
from megaslide.attention.dsa.forward import _forward_queries
from megaslide.attention.dsa.launch import INTERPRETED, HaloConfig, halo_config, head_dim_block
from megaslide.attention.dsa.reference import halo_extent
from megaslide.attention.dsa.rows import _token_rows, row_flags
from megaslide.attention.dsa.sampling import (_corner_axes, _query_tile, _sample_axes, _softmax_step,
                                               _window_start)
from megaslide.backends import device_guard


FP32_DOT_CHUNK = 64
"""Head columns per score dot at full fp32 precision (module docstring)."""


@triton.jit
def _halo_origin(tile_first, kernel: tl.constexpr, reach: tl.constexpr, extent: tl.constexpr, size):
    """First index of a tile's halo along an axis: the tile's first query less the window's and the offsets'
    reach, moved inside [0, size - extent] (at 0 when the halo is longer than the axis)."""
    return tl.maximum(tl.minimum(tile_first - kernel // 2 - reach, size - extent), 0)


@triton.jit
def _in_halo(sample, origin, extent: tl.constexpr):
    """Whether clamped positions (the last item of an `_axis_sample` result, (BQ,) fp32) lie in the halo."""
    return (sample[4] >= origin) & (sample[4] <= origin + extent - 1)


@triton.jit
def _axis_weights(local, idx, w, origin, extent: tl.constexpr):
    """(BQ, HALO) linear weights of samples along one axis on the halo's tokens: for each query (row) and
    halo token at halo-local index local (HALO,) along the axis (column), the sum of the 1D weights
    w = (lower, upper) of the sample's neighbours idx = (lower, upper) (grid indices, (BQ,) each) that land
    on it. An upper neighbour one past the halo has weight 0 (its position is the halo's last index) and is
    moved onto that index; padded halo tokens (local >= extent) get 0."""
    lower = tl.minimum(idx[0] - origin, extent - 1)  # (BQ,) halo-local
    upper = tl.minimum(idx[1] - origin, extent - 1)
    return (tl.where(local[None, :] == lower[:, None], w[0][:, None], 0.0)
            + tl.where(local[None, :] == upper[:, None], w[1][:, None], 0.0))


@triton.jit
def _dsa_halo_fwd_kernel(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, lse_ptr, path_ptr,
                         T, H, W, HEADS, D, stride_tok, stride_off_tok, qk_scale,
                         KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                         TILE_T: tl.constexpr, TILE_Y: tl.constexpr, TILE_X: tl.constexpr, REACH: tl.constexpr,
                         ET: tl.constexpr, EY: tl.constexpr, EX: tl.constexpr, HALO: tl.constexpr,
                         BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr, WIDE: tl.constexpr,
                         EVEN_D: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
                         DOT_CHUNK: tl.constexpr):
    BQ: tl.constexpr = TILE_T * TILE_Y * TILE_X
    pid_bh = tl.program_id(1)
    b = (pid_bh // HEADS).to(tl.int64)
    h = pid_bh % HEADS
    N = T * H * W
    p = tl.program_id(0)
    t0, y0, x0, n, q_valid, t, y, x = _query_tile(T, H, W, TILE_T, TILE_Y, TILE_X)  # (BQ,) queries of the tile

    head_off = b * N * stride_tok + h * D  # element offset of (b, token 0, h)
    off_q = off_ptr + b * N * stride_off_tok + h * (KT * KH * KW * 3) + n.to(tl.int64) * stride_off_tok  # (BQ,)
    starts = (_window_start(t, KT, T), _window_start(y, KH, H), _window_start(x, KW, W))  # (BQ,) each
    ht0 = _halo_origin(t0, KT, REACH, ET, T)
    hy0 = _halo_origin(y0, KH, REACH, EY, H)
    hx0 = _halo_origin(x0, KW, REACH, EX, W)

    inside = q_valid | True  # (BQ,) every sample of the query in the halo
    for j in range(KT * KH * KW):
        window = (j // (KH * KW), j // KW % KH, j % KW)
        st, sy, sx = _sample_axes(off_q, j, starts, window, (T, H, W))
        inside &= _in_halo(st, ht0, ET) & _in_halo(sy, hy0, EY) & _in_halo(sx, hx0, EX)
    on_halo = tl.min(inside.to(tl.int32), axis=0) == 1
    tl.store(path_ptr + pid_bh * tl.num_programs(0) + p, on_halo.to(tl.int8))

    if on_halo:
        cols = tl.arange(0, BLOCK_D)  # (BD,)
        col_ok = (cols < D)[None, :]  # (1, BD)
        hh = tl.arange(0, HALO)  # (HALO,) flat halo index, row-major over (ET, EY, EX), padded to a power of 2
        ht, hy, hx = hh // (EY * EX), hh // EX % EY, hh % EX  # (HALO,) halo-local coordinates
        h_ok = (hh < ET * EY * EX) & (ht0 + ht < T) & (hy0 + hy < H) & (hx0 + hx < W)  # (HALO,) rows on the grid
        halo_tok = tl.where(h_ok, ((ht0 + ht) * H + hy0 + hy) * W + hx0 + hx, 0)  # (HALO,)
        halo_rows = _token_rows(halo_tok, stride_tok, cols, WIDE)  # (HALO, BD)
        own_rows = _token_rows(n, stride_tok, cols, WIDE)  # (BQ, BD)
        scores = tl.zeros([BQ, HALO], tl.float32)  # (BQ, HALO) q . k, summed over column chunks of DOT_CHUNK
        for c in tl.static_range(BLOCK_D // DOT_CHUNK):
            chunk = tl.arange(0, DOT_CHUNK) + c * DOT_CHUNK  # (DC,) head columns
            chunk_ok = (chunk < D)[None, :]  # (1, DC)
            k_halo = tl.load(k_ptr + head_off + _token_rows(halo_tok, stride_tok, chunk, WIDE),
                             mask=h_ok[:, None] & chunk_ok, other=0.0)  # (HALO, DC)
            q = tl.load(q_ptr + head_off + _token_rows(n, stride_tok, chunk, WIDE), mask=chunk_ok,
                        other=0.0)  # (BQ, DC)
            if DOT_FP32:  # the same products: a bf16 value is exact in fp32
                q, k_halo = q.to(tl.float32), k_halo.to(tl.float32)
            scores += tl.dot(q, tl.trans(k_halo), input_precision=PRECISION)
        scores *= qk_scale  # log2 units

        m_i = tl.full([BQ], float("-inf"), tl.float32)  # running max (log2 units)
        l_i = tl.zeros([BQ], tl.float32)  # running softmax denominator
        p_halo = tl.zeros([BQ, HALO], tl.float32)  # running numerator's weight on each halo token
        for j in range(KT * KH * KW):
            window = (j // (KH * KW), j // KW % KH, j % KW)
            st, sy, sx = _sample_axes(off_q, j, starts, window, (T, H, W))
            t_idx, y_idx, x_idx, t_w, y_w, x_w = _corner_axes(st, sy, sx)
            weights = (_axis_weights(ht, t_idx, t_w, ht0, ET) * _axis_weights(hy, y_idx, y_w, hy0, EY)
                       * _axis_weights(hx, x_idx, x_w, hx0, EX))  # (BQ, HALO) the sample's trilinear weights
            s = tl.sum(weights * scores, axis=1)  # (BQ,)
            m_i, l_i, alpha, p_j = _softmax_step(m_i, l_i, s)
            p_halo = p_halo * alpha[:, None] + p_j[:, None] * weights

        # V after the loop: the K and V tiles are never on chip together
        v_halo = tl.load(v_ptr + head_off + halo_rows, mask=h_ok[:, None] & col_ok, other=0.0)  # (HALO, BD)
        acc = tl.dot(p_halo, v_halo.to(tl.float32), input_precision=PRECISION)  # (BQ, BD)
        out = acc / l_i[:, None]  # (BQ, BD)
        tl.store(out_ptr + head_off + own_rows, out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None] & col_ok)
        if STORE_LSE:
            tl.store(lse_ptr + (b * HEADS + h) * N + n, m_i + tl.log2(l_i), mask=q_valid)
    else:
        _forward_queries(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, lse_ptr, b, h, n, q_valid, t, y, x,
                         T, H, W, HEADS, D, stride_tok, stride_off_tok, qk_scale, KT, KH, KW,
                         BLOCK_D, STORE_LSE, WIDE, EVEN_D)


def dsa_halo_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     kernel_size: Sequence[int], scale: float, reach: int, store_lse: bool = True,
                     config: HaloConfig | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The halo forward (module docstring), inputs as `forward.dsa_forward`; `reach`: the offsets, in whole
    tokens, that the halo covers (tiles with larger offsets take the gathers). Returns out (B, T, H, W,
    heads, d) in q's dtype, the fp32 log-sum-exp (B, heads, T*H*W) in log2 units if `store_lse` (else
    None), and every tile's path (B * heads, tiles) int8: 1 halo, 0 gathers (`path_counts`). `config`
    overrides the default tile (`launch.halo_config`)."""
    if not isinstance(reach, int) or not 0 <= reach <= MAX_HALO_REACH:
        raise ValueError(f"reach={reach!r} must be an int in [0, {MAX_HALO_REACH}] (tokens of offset the halo "
                         "covers; constants.MAX_HALO_REACH says why)")
    B, T, H, W, heads, d = q.shape
    N = T * H * W
    kt, kh, kw = kernel_size
    cfg = config or halo_config(reach)
    extent = halo_extent(cfg.tile, kernel_size, reach)  # (ET, EY, EX)
    tiles = triton.cdiv(T, cfg.tile[0]) * triton.cdiv(H, cfg.tile[1]) * triton.cdiv(W, cfg.tile[2])
    out = torch.empty_like(q)  # (B, T, H, W, heads, d)
    lse = torch.empty((B, heads, N), dtype=torch.float32, device=q.device) if store_lse else None  # (B, heads, N)
    path = torch.empty((B * heads, tiles), dtype=torch.int8, device=q.device)  # (B * heads, tiles)
    block_d = head_dim_block(d)
    dot_fp32 = INTERPRETED and q.dtype == torch.bfloat16  # the interpreter's dots read bf16 as integers
    precision = "ieee" if q.dtype == torch.float32 or dot_fp32 else "tf32"
    dot_chunk = min(block_d, FP32_DOT_CHUNK) if precision == "ieee" else block_d  # module docstring
    with device_guard(q), _too_large_for_chip(reach, extent, q):
        _dsa_halo_fwd_kernel[(tiles, B * heads)](
            q, k, v, offsets, out, lse if store_lse else out, path,  # lse never written without STORE_LSE
            T, H, W, heads, d, q.stride(3), offsets.stride(3), scale * LOG2E,
            KT=kt, KH=kh, KW=kw, TILE_T=cfg.tile[0], TILE_Y=cfg.tile[1], TILE_X=cfg.tile[2], REACH=reach,
            ET=extent[0], EY=extent[1], EX=extent[2], HALO=triton.next_power_of_2(extent[0] * extent[1] * extent[2]),
            BLOCK_D=block_d, STORE_LSE=store_lse, DOT_FP32=dot_fp32, DOT_CHUNK=dot_chunk,
            PRECISION=precision,
            num_warps=cfg.num_warps, **row_flags(N, q.stride(3), d, block_d),
        )
    return out, lse, path


@contextmanager
def _too_large_for_chip(reach: int, extent: tuple[int, int, int], q: torch.Tensor):
    """Turn the compiler's out-of-resources error at launch (the halo's K rows do not fit the GPU's shared
    memory: e.g. fp32 at reach 2, or d = 128 in fp32 at reach 1) into one that names the option and the fix."""
    try:
        yield
    except OutOfResources as err:
        raise ValueError(
            f"halo_reach={reach} (attention.halo_reach): a tile's {'x'.join(map(str, extent))} halo of "
            f"{q.shape[-1]}-wide {str(q.dtype).removeprefix('torch.')} K rows does not fit this GPU's on-chip "
            f"memory ({err}); use a smaller halo_reach, bf16 inputs, or halo_reach=None (the gather forward)"
        ) from err


def path_counts(path: torch.Tensor) -> dict[str, int]:
    """Tiles of each path from `dsa_halo_forward`'s per-tile paths: {"halo": n, "gather": m}."""
    halo = int(path.sum().item())
    return {"halo": halo, "gather": path.numel() - halo}
