"""3D-DSA through whole score matrices: the fast backend for small token grids off CUDA.

On a small grid every key is cheap to score: per (batch, head) the matrices Q K^T and
dO V^T, (N, N') with N tokens and N' = (T+1)(H+1)(W+1) padded ones (K and V padded by one
replicated token per axis, as in gather.py), are a few small matmuls. A sample's score is
then its 8 trilinear weights times 8 scalars gathered from its query's row, and its value
read is a scatter of attention x weight into a row of P, out = P V. The backward reuses the
forward's corners and weights: dP = dO V^T gives each sample's attention gradient, dS (the
score gradient scattered like P) gives dq = dS K and dk = dS^T Q, dv = P^T dO, and the
offsets' gradient is the weights' derivatives times the gathered S and dP entries, no
further reads of K or V. Memory is O(B heads N N'), so `can_run_scores` admits only small
grids; the gather backend (O(N K)) takes the rest.
"""
from __future__ import annotations

import torch

from megaslide.attention.dsa.gather import BITS, Corners, corner_weights, pad_replicate, trilinear_corners

MAX_SCORES = 2 ** 24
"""Largest B * heads * N * N' this backend takes (each score-sized matrix is that many floats)."""


def score_elements(q: torch.Tensor) -> int:
    """B * heads * N * N' of q (B, T, H, W, heads, d): the size of one score matrix."""
    B, T, H, W, heads, _ = q.shape
    return B * heads * T * H * W * (T + 1) * (H + 1) * (W + 1)


def per_head(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, W, heads, d) -> (B*heads, T*H*W, d)."""
    B, heads, d = x.shape[0], x.shape[4], x.shape[5]
    return x.reshape(B, -1, heads, d).transpose(1, 2).reshape(B * heads, -1, d)


def per_query(x: torch.Tensor, B: int, heads: int) -> torch.Tensor:
    """(B*heads, N, w) -> (B*N*heads, w): rows in the op's query order (b, token, head)."""
    return x.view(B, heads, -1, x.shape[-1]).transpose(1, 2).reshape(-1, x.shape[-1])


def per_head_rows(x: torch.Tensor, B: int, heads: int) -> torch.Tensor:
    """Inverse of per_query: (B*N*heads, w) -> (B*heads, N, w)."""
    return x.view(B, -1, heads, x.shape[-1]).transpose(1, 2).reshape(B * heads, -1, x.shape[-1])


def corner_tokens(corners: Corners, bits, heads: int, padded_tokens: int, K: int) -> torch.Tensor:
    """(B*N*heads, K * len(bits)): each sample's corner tokens within its (batch, head) padded grid."""
    lower = (corners.lower // heads) % padded_tokens  # (M,) the lower corner's token
    shifts = torch.tensor([s // heads for s in corners.shifts(bits)], device=lower.device)  # (n,)
    return (lower[:, None] + shifts).view(-1, K * len(bits))  # (B*N*heads, K*n)


class DSAScoresFunction(torch.autograd.Function):
    """3D-DSA through per-(batch, head) score matrices; the backward by hand from the forward's corners."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, kernel_size: tuple[int, int, int], scale: float):
        B, T, H, W, heads, d = q.shape
        K = offsets.shape[-2]
        padded = (T + 1) * (H + 1) * (W + 1)
        corners = trilinear_corners(offsets, kernel_size)
        bits = BITS if ctx.needs_input_grad[3] else corners.live_bits()  # the offsets' gradient reads all 8
        tokens = corner_tokens(corners, bits, heads, padded, K)  # (B*N*heads, K*n)
        weights = corner_weights(corners.factors, bits).t().to(q.dtype).reshape(tokens.shape)  # (B*N*heads, K*n)
        k_pad, v_pad = (per_head(pad_replicate(x)) for x in (k, v))  # (B*heads, N', d) each
        qh = per_head(q)  # (B*heads, N, d)
        s = per_query(torch.bmm(qh, k_pad.transpose(1, 2)), B, heads)  # (B*N*heads, N') all scores
        s_at = s.gather(1, tokens)  # (B*N*heads, K*n) the scores of the corners
        scores = (s_at * weights).view(-1, K, len(bits)).sum(-1) * scale  # (B*N*heads, K)
        attn = torch.softmax(scores, dim=-1)  # (B*N*heads, K)
        spread = (attn[..., None] * weights.view(-1, K, len(bits))).view(tokens.shape)  # (B*N*heads, K*n)
        p = torch.zeros_like(s).scatter_add_(1, tokens, spread)  # (B*N*heads, N')
        out = torch.bmm(per_head_rows(p, B, heads), v_pad)  # (B*heads, N, d)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(qh, k_pad, v_pad, corners.factors, corners.inside, tokens, weights, s_at, attn, p)
        ctx.bits = bits
        ctx.scale = scale
        ctx.offsets_dtype = offsets.dtype
        return per_query(out, B, heads).view(q.shape)  # (B, T, H, W, heads, d)

    @staticmethod
    def backward(ctx, dout):
        qh, k_pad, v_pad, factors, inside, tokens, weights, s_at, attn, p = ctx.saved_tensors
        B, T, H, W, heads, d = dout.shape
        K, n = attn.shape[1], len(ctx.bits)
        do = per_head(dout)  # (B*heads, N, d)
        dp = per_query(torch.bmm(do, v_pad.transpose(1, 2)), B, heads)  # (B*N*heads, N')
        dp_at = dp.gather(1, tokens).view(-1, K, n)  # (B*N*heads, K, n)
        d_attn = (dp_at * weights.view(-1, K, n)).sum(-1)  # (B*N*heads, K)
        d_scores = attn * (d_attn - (attn * d_attn).sum(-1, keepdim=True)) * ctx.scale  # (B*N*heads, K)
        ds = torch.zeros_like(p).scatter_add_(1, tokens, (d_scores[..., None] * weights.view(-1, K, n)).view(
            tokens.shape))  # (B*N*heads, N')
        ds = per_head_rows(ds, B, heads)  # (B*heads, N, N')
        dq = torch.bmm(ds, k_pad)  # (B*heads, N, d)
        dk = torch.bmm(ds.transpose(1, 2), qh)  # (B*heads, N', d)
        dv = torch.bmm(per_head_rows(p, B, heads).transpose(1, 2), do)  # (B*heads, N', d)
        # padded tokens are read with weight 0 only (an upper neighbour past the end): crop them
        dk, dv = (x.view(B, heads, T + 1, H + 1, W + 1, d)[:, :, :T, :H, :W].permute(0, 2, 3, 4, 1, 5)
                  for x in (dk, dv))  # (B, T, H, W, heads, d)

        d_offsets = None
        if ctx.needs_input_grad[3]:
            # d loss / d weight of each corner = d_scores * S + attn * dP there; along an axis, the
            # position moves weight from the lower to the upper corner, in proportion to the other
            # axes' weights: d pos = sum over the lower face of (upper - lower) x those weights
            d_weight = d_scores[..., None] * s_at.view(-1, K, n) + attn[..., None] * dp_at
            d_weight = d_weight.to(factors.dtype).reshape(-1, 8).t().contiguous().view(2, 2, 2, -1)  # (2, 2, 2, M)
            t, y, x = factors  # (2, M) each
            d_pos = torch.stack([((d_weight[1] - d_weight[0]) * (y[:, None] * x[None])).sum((0, 1)),
                                 ((d_weight[:, 1] - d_weight[:, 0]) * (t[:, None] * x[None])).sum((0, 1)),
                                 ((d_weight[:, :, 1] - d_weight[:, :, 0]) * (t[:, None] * y[None])).sum((0, 1))],
                                dim=-1)  # (M, 3)
            d_pos = torch.where(inside, d_pos, 0)  # (M, 3)
            d_offsets = d_pos.view(B, T, H, W, heads, K, 3).to(ctx.offsets_dtype)
        return (per_query(dq, B, heads).view(dout.shape), dk, dv, d_offsets, None, None)


def deformable_slide_attention_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                      kernel_size: tuple[int, int, int], scale: float) -> torch.Tensor:
    """3D-DSA through score matrices; inputs are assumed validated and small enough
    (`score_elements(q) <= MAX_SCORES`). Shapes as the reference: q, k, v (B, T, H, W, heads, d),
    offsets (B, T, H, W, heads, K, 3) -> (B, T, H, W, heads, d)."""
    return DSAScoresFunction.apply(q, k, v, offsets, kernel_size, scale)
