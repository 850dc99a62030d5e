"""3D-DSA through whole score matrices: the fast backend for small token grids off CUDA.

On a small grid every key is cheap to score: per (batch, head) the matrices Q K^T and
dO V^T, (N, N) over the N tokens, are a few small matmuls. A sample's score is then its 8
trilinear weights times 8 scalars gathered from its query's row, and its value read is a
scatter of attention x weight into a row of P, out = P V. The backward reuses the forward's
corners and weights: dP = dO V^T gives each sample's attention gradient, dS (the score
gradient scattered like P) gives dq = dS K and dk = dS^T Q, dv = P^T dO, and the offsets'
gradient is the weights' derivatives times the gathered S and dP entries, no further reads
of K or V. Samples are kept in the matrices' row order (batch, head, token), and P and dS
are written over the S and dP they were read from: of the score-sized matrices, only S
(then P) and dP (then dS) are ever allocated. Memory is O(B heads N^2), so
`can_run_scores` admits only small grids; the gather backend (O(N K)) takes the rest.

No padding: a sample clamped to the last index of an axis reads it as the upper neighbour of
the one before, with weight 1 (the definition's lower neighbour there, with the same weight),
and its position gradient along that axis is 0 as in the definition (there the definition's
upper neighbour is the lower one). An axis of size 1 has no upper neighbour: its weight is 0.

With offsets exactly zero (`neighborhood_attention`) every sample is one token of its window:
the op is dense attention with the window as a mask, and runs as PyTorch's fused
`scaled_dot_product_attention`, no corners at all.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megaslide.attention.dsa.gather import BITS, corner_weights
from megaslide.attention.dsa.reference import base_positions, window_starts

MAX_SCORES = 2 ** 24
"""Largest B * heads * N * N this backend takes (each score-sized matrix is that many floats)."""


def score_elements(q: torch.Tensor) -> int:
    """B * heads * N * N of q (B, T, H, W, heads, d): the size of one score matrix."""
    B, T, H, W, heads, _ = q.shape
    return B * heads * (T * H * W) ** 2


def per_head(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, W, heads, ...) -> (B, heads, T, H, W, ...): the score matrices' row order, a view."""
    return x.movedim(4, 1)


def rows_per_head(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, W, heads, d) -> (B*heads, N, d)."""
    return per_head(x).reshape(-1, math.prod(x.shape[1:4]), x.shape[-1])


def from_per_head(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """(B*heads, N, d) -> (B, T, H, W, heads, d) of `shape`, a view."""
    B, T, H, W, heads, d = shape
    return x.view(B, heads, T, H, W, d).movedim(1, 4)


class RowCorners(NamedTuple):
    """The corners of the M = R * K samples, R = B * heads * N query rows in per-head order.

    lower (R, K) long: each sample's lower corner token in its (batch, head) grid; shifts: per
    corner of BITS, its token step from the lower corner; factors (3, 2, R, K): per axis the
    weights (1 - frac, frac) of the lower and upper neighbour; inside (3, R, K) bool: the
    position gradient passes (the unclamped position lay in [0, S - 1) on that axis)."""

    lower: torch.Tensor
    shifts: list[int]
    factors: torch.Tensor
    inside: torch.Tensor


def row_corners(offsets: torch.Tensor, kernel_size: tuple[int, int, int]) -> RowCorners:
    """The 8 corners of every sample; offsets (B, T, H, W, heads, K, 3). Positions
    and weights in at least float32, as in the reference."""
    B, T, H, W, heads, K, _ = offsets.shape
    coord_dtype = torch.promote_types(offsets.dtype, torch.float32)
    base = base_positions((T, H, W), kernel_size, offsets.device).to(coord_dtype)  # (T, H, W, K, 3)
    # axis first, samples last: (3, B, heads, T, H, W, K) -> (3, R, K); the permuted offsets copied first (an add
    # that reads them at their permuted strides is several times slower on the CPU); no out= buffer, which
    # torch.compile may give the permuted strides of offsets
    pos = offsets.permute(6, 0, 4, 1, 2, 3, 5).contiguous() + base.permute(4, 0, 1, 2, 3)[:, None, None]
    pos = pos.reshape(3, -1, K)  # (3, R, K)
    factors = offsets.new_empty((3, 2, *pos.shape[1:]), dtype=coord_dtype)  # (3, 2, R, K)
    lower, inside, steps = 0, [], []
    for axis, (p, size, stride) in enumerate(zip(pos, (T, H, W), (H * W, W, 1))):
        inside.append((p >= 0) & (p < size - 1))  # (R, K)
        p = p.clamp(0, size - 1)  # (R, K)
        floor = p.floor().clamp_(max=max(size - 2, 0))  # (R, K) the last index: upper neighbour of the one before
        torch.sub(p, floor, out=factors[axis, 1])
        torch.sub(1, factors[axis, 1], out=factors[axis, 0])
        # (R, K) whole numbers below N, exact in the coordinate dtype (N * N scores fit in memory: N << 2**24);
        # one conversion to long at the end, as int64 arithmetic is slow on the CPU
        lower = lower + floor * stride
        steps.append(stride if size > 1 else 0)
    shifts = [sum(b * s for b, s in zip(corner, steps)) for corner in BITS]
    return RowCorners(lower.long(), shifts, factors, torch.stack(inside))


def live_bits(factors: torch.Tensor) -> tuple:
    """The corners of nonzero weight for some sample, from factors (3, 2, R, K): along an axis
    where every position is an integer below the last (zero offsets, say) the upper neighbours
    weigh 0 and are skipped."""
    integer = (factors[:, 1] == 0).flatten(1).all(1).tolist()  # (3,)
    return tuple(bits for bits in BITS if not any(b and flat for b, flat in zip(bits, integer)))


def gather_corners(s: torch.Tensor, lower: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """(n, R, K): s (R, N) at each sample's corner tokens, lower (R, K) + shifts (n); one gather
    per corner from s shifted by its step (a corner token is always inside the grid)."""
    out = s.new_empty(len(shifts), *lower.shape)  # (n, R, K)
    for c, shift in enumerate(shifts):
        torch.gather(s[:, shift:], 1, lower, out=out[c])
    return out


def scatter_corners(s: torch.Tensor, lower: torch.Tensor, shifts: list[int], per_sample: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """s (R, N) plus per_sample (R, K) x weights (n, R, K) added at each sample's corner tokens
    (gather_corners' adjoint), in place; a corner at a time, so that the products stay in cache."""
    for shift, weight in zip(shifts, weights):
        s[:, shift:].scatter_add_(1, lower, per_sample * weight)
    return s


def weighted_sum(tables: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(R, K): the sum over corners of tables x weights (n, R, K) each, a corner at a time."""
    out = torch.zeros_like(tables[0])  # (R, K)
    for table, weight in zip(tables, weights):
        out.addcmul_(table, weight)
    return out


class DSAScoresFunction(torch.autograd.Function):
    """3D-DSA through per-(batch, head) score matrices; the backward by hand from the forward's corners.

    Corner tables are (n, R, K), corner-major: every elementwise product and sum over corners
    runs along the M samples."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, kernel_size: tuple[int, int, int], scale: float):
        B, T, H, W, heads, d = q.shape
        K, N = offsets.shape[-2], T * H * W
        corners = row_corners(offsets, kernel_size)
        bits = BITS if ctx.needs_input_grad[3] else live_bits(corners.factors)  # the offsets' gradient reads all 8
        shifts = [corners.shifts[BITS.index(corner)] for corner in bits]
        weights = corner_weights(corners.factors.flatten(2), bits).to(q.dtype).view(len(bits), -1, K)  # (n, R, K)
        qh, kh, vh = (rows_per_head(x) for x in (q, k, v))  # (B*heads, N, d) each, R = B*heads*N
        s = torch.bmm(qh, kh.transpose(1, 2)).view(-1, N)  # (R, N) all scores
        s_at = gather_corners(s, corners.lower, shifts)  # (n, R, K) the scores of the corners
        attn = torch.softmax(weighted_sum(s_at, weights) * scale, dim=-1)  # (R, K)
        p = scatter_corners(s.zero_(), corners.lower, shifts, attn, weights)  # (R, N)
        out = torch.bmm(p.view(B * heads, N, N), vh)  # (B*heads, N, d)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(qh, kh, vh, corners.lower, corners.factors, corners.inside, weights, s_at, attn, p)
        ctx.shifts = shifts
        ctx.scale = scale
        ctx.offsets_dtype = offsets.dtype
        return from_per_head(out, q.shape).contiguous()  # (B, T, H, W, heads, d)

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, lower, factors, inside, weights, s_at, attn, p = ctx.saved_tensors
        BH, N, d = qh.shape
        do = rows_per_head(dout)  # (B*heads, N, d)
        dp = torch.bmm(do, vh.transpose(1, 2)).view(-1, N)  # (R, N)
        dp_at = gather_corners(dp, lower, ctx.shifts)  # (n, R, K)
        d_attn = weighted_sum(dp_at, weights)  # (R, K)
        d_scores = attn * (d_attn - (attn * d_attn).sum(-1, keepdim=True)) * ctx.scale  # (R, K)
        ds = scatter_corners(dp.zero_(), lower, ctx.shifts, d_scores, weights).view(BH, N, N)  # (B*heads, N, N)
        dq, dk = torch.bmm(ds, kh), torch.bmm(ds.transpose(1, 2), qh)  # (B*heads, N, d) each
        dv = torch.bmm(p.view(BH, N, N).transpose(1, 2), do)  # (B*heads, N, d)

        d_offsets = None
        if ctx.needs_input_grad[3]:
            # d loss / d weight of each corner = d_scores * S + attn * dP there; along an axis, the
            # position moves weight from the lower to the upper corner, in proportion to the other
            # axes' weights: d pos = sum over the lower face of (upper - lower) x those weights
            # (2, 2, 2, M), BITS order
            dw = dp_at.mul_(attn).addcmul_(s_at, d_scores).to(factors.dtype).view(2, 2, 2, -1)
            t, y, x = factors.flatten(2)  # (2, M) each
            d_pos = torch.stack([((dw[1] - dw[0]) * (y[:, None] * x[None])).sum((0, 1)),
                                 ((dw[:, 1] - dw[:, 0]) * (t[:, None] * x[None])).sum((0, 1)),
                                 ((dw[:, :, 1] - dw[:, :, 0]) * (t[:, None] * y[None])).sum((0, 1))])  # (3, M)
            d_pos = d_pos.mul_(inside.view(3, -1))  # (3, M)
            B, T, H, W, heads, _ = dout.shape
            d_offsets = d_pos.view(3, B, heads, T, H, W, -1).permute(1, 3, 4, 5, 2, 6, 0).to(ctx.offsets_dtype)
        return tuple(from_per_head(x, dout.shape) for x in (dq, dk, dv)) + (d_offsets, None, None)


def deformable_slide_attention_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                      kernel_size: tuple[int, int, int], scale: float) -> torch.Tensor:
    """3D-DSA through score matrices; inputs are assumed validated and small enough
    (`score_elements(q) <= MAX_SCORES`). Shapes as the reference: q, k, v (B, T, H, W, heads, d),
    offsets (B, T, H, W, heads, K, 3) -> (B, T, H, W, heads, d)."""
    return DSAScoresFunction.apply(q, k, v, offsets, kernel_size, scale)


def window_mask(grid: tuple[int, int, int], kernel_size: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """(N, N) bool: key token m lies in query token n's clamped window (the base window of every sample)."""
    per_axis = []
    for size, kernel in zip(grid, kernel_size):
        start = window_starts(size, kernel, device)[:, None]  # (S, 1)
        key = torch.arange(size, device=device)  # (S,)
        per_axis.append((key >= start) & (key < start + kernel))  # (S query, S key)
    t, y, x = per_axis
    mask = t[:, None, None, :, None, None] & y[None, :, None, None, :, None] & x[None, None, :, None, None, :]
    return mask.view(math.prod(grid), math.prod(grid))  # (N, N)


def neighborhood_attention_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                  kernel_size: tuple[int, int, int], scale: float) -> torch.Tensor:
    """3D neighbourhood attention (DSA with zero offsets, which are not read) as masked dense
    attention; inputs are assumed validated. q, k, v (B, T, H, W, heads, d) -> (B, T, H, W, heads, d)."""
    B, T, H, W, heads, d = q.shape
    mask = window_mask((T, H, W), kernel_size, q.device)  # (N, N)
    qh, kh, vh = (x.reshape(B, -1, heads, d).transpose(1, 2) for x in (q, k, v))  # (B, heads, N, d) each
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)  # (B, heads, N, d)
    return out.transpose(1, 2).reshape(q.shape)  # (B, T, H, W, heads, d)
