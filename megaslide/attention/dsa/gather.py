"""3D-DSA on plain gathers: the fast backend where the fused kernels do not run (CPU).

Trilinear sampling is a sparse interpolation: every sample reads the 8 tokens around its
position. K and V are padded by one replicated token at the end of each axis, so a
sample's upper neighbour is always its lower corner + 1 (as the clamp of the definition
makes it) and its 8 corners are its lower corner's row in the padded table plus 8 fixed
row shifts. Rows and trilinear weights are computed once per forward and reused by the
hand-written backward, built from weighted gathers (`F.embedding_bag`, which sums weighted
rows without materialising them):
- forward: each sample reads its 8 corners of [K | V];
- dk, dv: each padded token gathers, per corner, the queries of the samples whose lower
  corner it is (samples sorted once per forward), weighted by trilinear weight times the
  sample's score gradient (dk) or attention probability (dv);
- offsets: each sample reads the forward differences of K and V along t, y and x at the 4
  corners of its lower face.
Autograd never differentiates an indexing op here: that scatter backward is what makes the
reference slow.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megaslide.attention.dsa.reference import base_positions

BITS = tuple(itertools.product((0, 1), repeat=3))  # the 8 corners (t, y, x), row-major


def corner_weights(frac: torch.Tensor, bits, skip_axis: int | None = None) -> torch.Tensor:
    """Trilinear weights (len(bits), M) from fractions frac (3, M): per corner the product over
    the axes (but `skip_axis`) of frac if its bit is 1, else 1 - frac."""
    rows = []
    for corner in bits:
        factors = [f if bit else 1 - f for axis, (f, bit) in enumerate(zip(frac, corner)) if axis != skip_axis]
        rows.append(factors[0] * factors[1] * factors[2] if len(factors) == 3 else factors[0] * factors[1])
    return torch.stack(rows)  # (n, M)


class Corners(NamedTuple):
    """Where the M = B * T * H * W * heads * K samples read the padded table
    (B, T+1, H+1, W+1, heads) of K or V.

    lower (M,) long: row of each sample's lower corner; strides (3,): row step along t, y, x;
    frac (3, M): position - lower corner per axis; inside (3, M) bool: the unclamped
    position lay inside the grid (the clamp passes the offsets' gradient only there).
    """

    lower: torch.Tensor
    strides: tuple[int, int, int]
    frac: torch.Tensor
    inside: torch.Tensor

    def shifts(self, bits=BITS) -> list[int]:
        """Row shift from the lower corner to each corner of `bits` ((t, y, x) in {0, 1})."""
        return [sum(b * s for b, s in zip(corner, self.strides)) for corner in bits]

    def rows(self, bits=BITS) -> torch.Tensor:
        """(M, len(bits)) table rows of the corners `bits`."""
        return self.lower[:, None] + torch.tensor(self.shifts(bits), device=self.lower.device)  # (M, n)


def trilinear_corners(offsets: torch.Tensor, kernel_size: tuple[int, int, int]) -> Corners:
    """The corners of every sample; offsets (B, T, H, W, heads, K, 3). Positions and
    fractions are computed in at least float32, as in the reference."""
    B, T, H, W, heads, K, _ = offsets.shape
    device = offsets.device
    coord_dtype = torch.promote_types(offsets.dtype, torch.float32)
    base = base_positions((T, H, W), kernel_size, device).to(coord_dtype)  # (T, H, W, K, 3)
    pos = base[None, :, :, :, None] + offsets.to(coord_dtype)  # (B, T, H, W, heads, K, 3)
    pos = pos.movedim(-1, 0).reshape(3, -1)  # (3, M)
    hi = torch.tensor([T - 1, H - 1, W - 1], dtype=coord_dtype, device=device)[:, None]  # (3, 1)
    inside = (pos >= 0) & (pos <= hi)  # (3, M)
    pos = torch.clamp(pos, min=torch.zeros_like(hi), max=hi)  # (3, M)
    lower = torch.floor(pos)  # (3, M)
    strides = (H + 1) * (W + 1) * heads, (W + 1) * heads, heads
    first = torch.arange(B, device=device)[:, None] * ((T + 1) * strides[0]) + torch.arange(heads, device=device)
    first = first.view(B, 1, 1, 1, heads, 1).expand(B, T, H, W, heads, K).reshape(-1)  # (M,)
    lower_long = lower.long()  # (3, M)
    row = first + lower_long[0] * strides[0] + lower_long[1] * strides[1] + lower_long[2] * strides[2]  # (M,)
    return Corners(row, strides, pos - lower, inside)


def pad_replicate(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, W, ...) -> (B, T+1, H+1, W+1, ...): the last index of each axis repeated."""
    for dim in (1, 2, 3):
        x = torch.cat([x, x.narrow(dim, x.shape[dim] - 1, 1)], dim=dim)
    return x


def sum_shifted(per_corner: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """(8, R, w) -> (R, w): sum over corners c of per_corner[c] moved down by shifts[c] rows."""
    _, R, width = per_corner.shape
    out = torch.zeros(R * width, dtype=per_corner.dtype, device=per_corner.device)
    for part, shift in zip(per_corner.reshape(len(shifts), -1), shifts):
        out[shift * width:] += part[:(R - shift) * width]  # lower-corner row r adds to row r + shift
    return out.view(R, width)


class DSAGatherFunction(torch.autograd.Function):
    """3D-DSA forward by weighted gathers; the backward by hand, reusing the forward's corners."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, kernel_size: tuple[int, int, int], scale: float):
        B, T, H, W, heads, d = q.shape
        queries = B * T * H * W * heads
        corners = trilinear_corners(offsets, kernel_size)
        table = pad_replicate(torch.cat([k, v], dim=-1)).reshape(-1, 2 * d)  # (R, 2d), R = B*(T+1)*(H+1)*(W+1)*heads
        weights = corner_weights(corners.frac, BITS).t().to(k.dtype)  # (M, 8)
        samples = F.embedding_bag(corners.rows(), table, per_sample_weights=weights, mode="sum")  # (M, 2d)
        samples = samples.view(queries, -1, 2 * d)  # (B*N*heads, K, 2d)
        scores = torch.bmm(samples[..., :d], q.reshape(queries, d, 1)).squeeze(-1) * scale  # (B*N*heads, K)
        attn = torch.softmax(scores, dim=-1)  # (B*N*heads, K)
        out = torch.bmm(attn[:, None, :], samples[..., d:]).view(q.shape)  # (B, T, H, W, heads, d)
        order = torch.argsort(corners.lower, stable=True)  # (M,) samples grouped by lower corner
        ctx.save_for_backward(q, table, corners.lower, corners.frac, corners.inside, order, samples, attn)
        ctx.strides = corners.strides
        ctx.scale = scale
        ctx.offsets_dtype = offsets.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, table, lower, frac, inside, order, samples, attn = ctx.saved_tensors
        corners = Corners(lower, ctx.strides, frac, inside)
        B, T, H, W, heads, d = q.shape
        queries, K = attn.shape
        q_rows = q.reshape(queries, d)  # (B*N*heads, d)
        dout = dout.reshape(queries, d)  # (B*N*heads, d)
        d_attn = torch.bmm(samples[..., d:], dout[:, :, None]).squeeze(-1)  # (B*N*heads, K)
        d_scores = attn * (d_attn - (attn * d_attn).sum(-1, keepdim=True)) * ctx.scale  # (B*N*heads, K)
        dq = torch.bmm(d_scores[:, None, :], samples[..., :d]).view(q.shape)  # (B, T, H, W, heads, d)

        # dk, dv: d sample = d_scores * q (key) or attn * dout (value); each padded token sums, per
        # corner, the weighted queries of the samples whose lower corner it is
        R = table.shape[0]
        counts = torch.bincount(lower, minlength=R)  # (R,)
        starts = (torch.cumsum(counts, 0) - counts)[None] + torch.arange(8, device=q.device)[:, None] * len(order)
        weights = corner_weights(frac[:, order], BITS).to(q.dtype)  # (8, M), samples sorted
        query = (order // K).repeat(8)  # (8M,) query of each sorted sample, once per corner
        d_table = []
        for rows, per_sample in ((q_rows, d_scores), (dout, attn)):
            bag_weights = (weights * per_sample.reshape(-1)[order]).reshape(-1)  # (8M,)
            per_corner = F.embedding_bag(query, rows, starts.reshape(-1), per_sample_weights=bag_weights,
                                         mode="sum")  # (8R, d)
            d_table.append(sum_shifted(per_corner.view(8, R, d), corners.shifts()))  # (R, d)
        d_kv = [x.view(B, T + 1, H + 1, W + 1, heads, d)[:, :T, :H, :W] for x in d_table]  # (B, T, H, W, heads, d)

        d_offsets = None
        if ctx.needs_input_grad[3]:
            grid = table.view(B, T + 1, H + 1, W + 1, heads, 2 * d)
            d_pos = []
            for axis in range(3):  # d sample / d position: forward differences at the lower face's 4 corners
                diff = torch.diff(grid, dim=1 + axis, append=grid.narrow(1 + axis, grid.shape[1 + axis] - 1, 1))
                face = [bits for bits in BITS if bits[axis] == 0]
                face_weights = corner_weights(frac, face, skip_axis=axis).t().to(q.dtype)  # (M, 4)
                slope = F.embedding_bag(corners.rows(face), diff.reshape(-1, 2 * d), per_sample_weights=face_weights,
                                        mode="sum").view(queries, K, 2 * d)  # (B*N*heads, K, 2d)
                d_key = torch.bmm(slope[..., :d], q_rows[:, :, None]).squeeze(-1)  # (B*N*heads, K)
                d_value = torch.bmm(slope[..., d:], dout[:, :, None]).squeeze(-1)  # (B*N*heads, K)
                d_pos.append((d_scores * d_key + attn * d_value).reshape(-1))  # (M,)
            d_pos = torch.where(inside, torch.stack(d_pos).to(frac.dtype), 0)  # (3, M)
            d_offsets = d_pos.t().reshape(B, T, H, W, heads, K, 3).to(ctx.offsets_dtype)
        return dq, d_kv[0], d_kv[1], d_offsets, None, None


def deformable_slide_attention_gather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                      kernel_size: tuple[int, int, int], scale: float) -> torch.Tensor:
    """3D-DSA by weighted gathers; inputs are assumed validated. Shapes as the reference:
    q, k, v (B, T, H, W, heads, d), offsets (B, T, H, W, heads, K, 3) -> (B, T, H, W, heads, d)."""
    return DSAGatherFunction.apply(q, k, v, offsets, kernel_size, scale)
