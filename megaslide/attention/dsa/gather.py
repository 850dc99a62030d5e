"""3D-DSA on plain gathers: the fast backend where the fused kernels do not run (CPU).

Trilinear sampling is a sparse interpolation: every sample reads the 8 tokens around its
position. K and V are padded by one replicated token at the end of each axis, so a
sample's upper neighbour is always its lower corner + 1 (as the clamp of the definition
makes it) and its 8 corners are its lower corner's row in the padded table plus 8 fixed
row shifts. Rows and trilinear weights are computed once per forward and reused by the
hand-written backward, built from weighted gathers (`F.embedding_bag`, which sums weighted
rows without materialising them):
- forward: each sample reads its 8 corners of K and of V (the lower ones only, along an axis
  where every position is an integer: zero offsets read 1 corner, as neighbourhood attention);
- dk, dv: each padded token gathers, per corner, the queries of the samples whose lower
  corner it is (samples sorted once per forward), weighted by trilinear weight times the
  sample's score gradient (dk) or attention probability (dv);
- offsets: each sample reads the forward differences of K and V along t, y and x at the 4
  corners of its lower face on that axis.
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
FACES = tuple(tuple(bits for bits in BITS if bits[axis] == 0) for axis in range(3))  # lower face per axis


class Corners(NamedTuple):
    """Where the M = B * T * H * W * heads * K samples read the padded table
    (B, T+1, H+1, W+1, heads) of K or V.

    lower (M,) long: row of each sample's lower corner; strides: row step along t, y, x;
    factors (3, 2, M): per axis the weights (1 - frac, frac) of the lower and upper
    neighbour; inside (M, 3) bool: the unclamped position lay inside the grid (the clamp
    passes the offsets' gradient only there).
    """

    lower: torch.Tensor
    strides: tuple[int, int, int]
    factors: torch.Tensor
    inside: torch.Tensor

    def shifts(self, bits=BITS) -> list[int]:
        """Row shift from the lower corner to each corner of `bits` ((t, y, x) in {0, 1})."""
        return [sum(b * s for b, s in zip(corner, self.strides)) for corner in bits]

    def rows(self, shifts: list[int]) -> torch.Tensor:
        """(M, len(shifts)) table rows at the given shifts from each sample's lower corner."""
        return self.lower[:, None] + torch.tensor(shifts, device=self.lower.device)  # (M, n)

    def live_bits(self) -> tuple:
        """The corners of nonzero weight for some sample: along an axis where every position is
        an integer (zero offsets, say) the upper neighbours weigh 0 and are skipped."""
        integer = (self.factors[:, 1] == 0).all(dim=1).tolist()  # (3,)
        return tuple(bits for bits in BITS if not any(b and flat for b, flat in zip(bits, integer)))


def trilinear_corners(offsets: torch.Tensor, kernel_size: tuple[int, int, int]) -> Corners:
    """The corners of every sample; offsets (B, T, H, W, heads, K, 3). Positions and
    weights are computed in at least float32, as in the reference."""
    B, T, H, W, heads, K, _ = offsets.shape
    device = offsets.device
    coord_dtype = torch.promote_types(offsets.dtype, torch.float32)
    base = base_positions((T, H, W), kernel_size, device).to(coord_dtype)  # (T, H, W, K, 3)
    pos = (base[None, :, :, :, None] + offsets.to(coord_dtype)).reshape(-1, 3)  # (M, 3)
    hi = torch.tensor([T - 1, H - 1, W - 1], dtype=coord_dtype, device=device)  # (3,)
    inside = (pos >= 0) & (pos <= hi)  # (M, 3)
    pos = pos.clamp_(min=torch.zeros_like(hi), max=hi)  # (M, 3)
    lower = torch.floor(pos)  # (M, 3)
    frac = pos.sub_(lower).t()  # (3, M)
    strides = (H + 1) * (W + 1) * heads, (W + 1) * heads, heads
    first = torch.arange(B, device=device)[:, None] * ((T + 1) * strides[0]) + torch.arange(heads, device=device)
    step = torch.tensor(strides, device=device)  # (3,)
    row = (lower.long() * step).sum(-1).view(B, -1, heads, K) + first.view(B, 1, heads, 1)  # (B, T*H*W, heads, K)
    return Corners(row.view(-1), strides, torch.stack([1 - frac, frac], dim=1), inside)


def corner_weights(factors: torch.Tensor, bits=BITS, skip: int | None = None) -> torch.Tensor:
    """(..., len(bits), L): per corner the product over the axes (but `skip`) of its factor, from
    the per-axis factors (..., 3, 2, L) (samples last, so that every product runs along them).
    All axes: the trilinear weights; all but one, on that axis' lower face: the derivative of the
    trilinear weights along it (up to sign)."""
    t, y, x = (torch.ones_like(f) if axis == skip else f for axis, f in enumerate(factors.unbind(-3)))  # (..., 2, L)
    every = t[..., :, None, None, :] * y[..., None, :, None, :] * x[..., None, None, :, :]  # (..., 2, 2, 2, L)
    every = every.flatten(-4, -2)  # (..., 8, L), BITS order
    return every if bits == BITS else every[..., [BITS.index(corner) for corner in bits], :]


def pad_replicate(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, W, ...) -> (B, T+1, H+1, W+1, ...): the last index of each axis repeated."""
    for dim in (1, 2, 3):
        x = torch.cat([x, x.narrow(dim, x.shape[dim] - 1, 1)], dim=dim)
    return x


def sum_shifted(per_corner: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """(n, R, w) -> (R, w): sum over corners c of per_corner[c] moved down by shifts[c] rows."""
    _, R, width = per_corner.shape
    out = torch.zeros(R * width, dtype=per_corner.dtype, device=per_corner.device)
    for part, shift in zip(per_corner.reshape(len(shifts), -1), shifts):
        out[shift * width:] += part[:(R - shift) * width]  # lower-corner row r adds to row r + shift
    return out.view(R, width)


class GatherState(NamedTuple):
    """What the backward reads of a forward: q, the padded K and V tables, the corners, the samples sorted by
    lower corner, the sampled keys and values and the attention."""

    q: torch.Tensor
    k_table: torch.Tensor
    v_table: torch.Tensor
    corners: Corners
    bits: tuple
    order: torch.Tensor
    k_s: torch.Tensor
    v_s: torch.Tensor
    attn: torch.Tensor


def gather_forward(q, k, v, offsets, kernel_size: tuple[int, int, int], scale: float,
                   lse: torch.Tensor | None = None, state: bool = True):
    """(out (B, T, H, W, heads, d), lse (B, heads, N) log-sum-exp of the scores (fp32, or q's dtype if wider),
    the backward's `GatherState` or None without `state`). The attention is exp(scores - lse); given `lse` (a
    kept one, of this forward on these inputs), the same attention comes back from it, so a backward from the
    kept out and lse reads exactly what this forward's would."""
    B, T, H, W, heads, d = q.shape
    queries = B * T * H * W * heads
    corners = trilinear_corners(offsets, kernel_size)
    bits = corners.live_bits()
    rows = corners.rows(corners.shifts(bits))  # (M, n)
    weights = corner_weights(corners.factors, bits).to(k.dtype).t().contiguous()  # (M, n)
    # K and V in tables of their own: two narrow bags run faster than one of [K | V]
    tables = [pad_replicate(x).reshape(-1, d) for x in (k, v)]  # 2 x (R, d), R = B*(T+1)*(H+1)*(W+1)*heads
    k_s, v_s = (F.embedding_bag(rows, table, per_sample_weights=weights, mode="sum").view(queries, -1, d)
                for table in tables)  # (B*N*heads, K, d) each
    scores = torch.bmm(k_s, q.reshape(queries, d, 1)).squeeze(-1) * scale  # (B*N*heads, K)
    wide = scores.to(torch.promote_types(scores.dtype, torch.float32))  # (B*N*heads, K)
    if lse is None:
        lse = torch.logsumexp(wide, dim=-1).view(B, -1, heads).transpose(1, 2)  # (B, heads, N)
    attn = torch.exp(wide - lse.transpose(1, 2).reshape(queries, 1)).to(scores.dtype)  # (B*N*heads, K)
    out = torch.bmm(attn[:, None, :], v_s).view(q.shape)  # (B, T, H, W, heads, d)
    if not state:
        return out, lse, None
    order = torch.argsort(corners.lower.int(), stable=True)  # (M,) samples grouped by lower corner
    return out, lse, GatherState(q, *tables, corners, bits, order, k_s, v_s, attn)


def gather_backward(st: GatherState, dout: torch.Tensor, scale: float, offsets_grad: bool, offsets_dtype):
    """dq, dk, dv (B, T, H, W, heads, d) and d(offsets) (None unless `offsets_grad`) from a forward's state."""
    q, k_table, corners, order, k_s, v_s, attn = st.q, st.k_table, st.corners, st.order, st.k_s, st.v_s, st.attn
    B, T, H, W, heads, d = q.shape
    queries, K = attn.shape
    q_rows = q.reshape(queries, d, 1)  # (B*N*heads, d, 1)
    dout = dout.reshape(queries, d, 1)  # (B*N*heads, d, 1)
    d_attn = torch.bmm(v_s, dout).squeeze(-1)  # (B*N*heads, K)
    d_scores = attn * (d_attn - (attn * d_attn).sum(-1, keepdim=True)) * scale  # (B*N*heads, K)
    dq = torch.bmm(d_scores[:, None, :], k_s).view(q.shape)  # (B, T, H, W, heads, d)

    # dk, dv: d sample = d_scores * q (key) or attn * dout (value); each padded token sums, per
    # corner, the weighted queries of the samples whose lower corner it is
    R = k_table.shape[0]
    n = len(st.bits)
    counts = torch.bincount(corners.lower, minlength=R)  # (R,)
    starts = (torch.cumsum(counts, 0) - counts)[None] + torch.arange(n, device=q.device)[:, None] * len(order)
    weights = corner_weights(corners.factors[..., order], st.bits).to(q.dtype)  # (n, M), samples sorted
    query = (order // K).repeat(n)  # (nM,) query of each sorted sample, once per corner
    d_kv = []
    for rows, per_sample in ((q_rows, d_scores), (dout, attn)):
        bag_weights = (weights * per_sample.reshape(-1)[order]).reshape(-1)  # (nM,)
        per_corner = F.embedding_bag(query, rows.view(queries, d), starts.reshape(-1),
                                     per_sample_weights=bag_weights, mode="sum")  # (nR, d)
        d_table = sum_shifted(per_corner.view(n, R, d), corners.shifts(st.bits))  # (R, d)
        d_kv.append(d_table.view(B, T + 1, H + 1, W + 1, heads, d)[:, :T, :H, :W])  # (B, T, H, W, heads, d)

    d_offsets = None
    if offsets_grad:
        # d sample / d position along an axis: the forward differences of K and V along it,
        # read bilinearly on the sample's lower face (one bag per axis keeps its table in cache)
        d_pos = []
        for axis in range(3):
            face_rows = corners.rows(corners.shifts(FACES[axis]))  # (M, 4)
            face_weights = corner_weights(corners.factors, FACES[axis], skip=axis).to(q.dtype).t().contiguous()
            slopes = []
            for table, rows in ((k_table, q_rows), (st.v_table, dout)):
                grid = table.view(B, T + 1, H + 1, W + 1, heads, d)
                last = grid.narrow(1 + axis, grid.shape[1 + axis] - 1, 1)
                diff = torch.diff(grid, dim=1 + axis, append=last).reshape(-1, d)  # (R, d)
                slope = F.embedding_bag(face_rows, diff, per_sample_weights=face_weights, mode="sum")  # (M, d)
                slopes.append(torch.bmm(slope.view(queries, K, d), rows).squeeze(-1))  # (B*N*heads, K)
            d_pos.append(d_scores * slopes[0] + attn * slopes[1])  # (B*N*heads, K)
        d_pos = torch.stack(d_pos, dim=-1).reshape(-1, 3)  # (M, 3)
        d_pos = torch.where(corners.inside, d_pos.to(corners.factors.dtype), 0)  # (M, 3)
        d_offsets = d_pos.view(B, T, H, W, heads, K, 3).to(offsets_dtype)
    return dq, d_kv[0], d_kv[1], d_offsets


class DSAGatherFunction(torch.autograd.Function):
    """3D-DSA forward by weighted gathers; the backward by hand, reusing the forward's corners."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, kernel_size: tuple[int, int, int], scale: float):
        grads = any(ctx.needs_input_grad[:4])  # not while sampling
        out, _, state = gather_forward(q, k, v, offsets, kernel_size, scale, state=grads)
        if grads:
            ctx.save_for_backward(state.q, state.k_table, state.v_table, state.corners.lower, state.corners.factors,
                                  state.corners.inside, state.order, state.k_s, state.v_s, state.attn)
            ctx.strides, ctx.bits = state.corners.strides, state.bits
        ctx.scale = scale
        ctx.offsets_dtype = offsets.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_table, v_table, lower, factors, inside, order, k_s, v_s, attn = ctx.saved_tensors
        state = GatherState(q, k_table, v_table, Corners(lower, ctx.strides, factors, inside), ctx.bits, order,
                            k_s, v_s, attn)
        grads = gather_backward(state, dout, ctx.scale, ctx.needs_input_grad[3], ctx.offsets_dtype)
        return (*grads, None, None)


class GatherSplit:
    """The gather backend as a `SplitOp` (megaslide/attention/kept.py) on q, k, v (B, T, H, W, heads, d) and
    offsets (B, T, H, W, heads, K, 3): the forward and backward of `DSAGatherFunction`, the backward's state
    recomputed from the inputs and the kept lse (no softmax: the attention is exp(scores - lse) as in the forward)."""

    def __init__(self, kernel_size: tuple[int, int, int], scale: float):
        self.kernel_size, self.scale = kernel_size, scale

    def forward(self, q, k, v, offsets):
        out, lse, _ = gather_forward(q, k, v, offsets, self.kernel_size, self.scale, state=False)
        return out, lse

    def backward(self, inputs, out, lse, dout, needs):
        q, k, v, offsets = inputs
        _, _, state = gather_forward(q, k, v, offsets, self.kernel_size, self.scale, lse=lse)
        return gather_backward(state, dout, self.scale, needs[3], offsets.dtype)


def deformable_slide_attention_gather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                      kernel_size: tuple[int, int, int], scale: float) -> torch.Tensor:
    """3D-DSA by weighted gathers; inputs are assumed validated. Shapes as the reference:
    q, k, v (B, T, H, W, heads, d), offsets (B, T, H, W, heads, K, 3) -> (B, T, H, W, heads, d)."""
    return DSAGatherFunction.apply(q, k, v, offsets, kernel_size, scale)
