"""Readable PyTorch reference of 3D Deformable Slide Attention (3D-DSA).

Every query token (t, y, x) and head attends to K = kt * kh * kw sampling points. Sample
j starts at position j of the query's clamped base window (NATTEN's neighbourhood: along
an axis of size S with kernel k the window of query i starts at clamp(i - k // 2, 0, S - k))
and is moved by a learned offset (dt, dy, dx) in token units. The moved position is clamped
to the grid, K and V are read there by trilinear interpolation of the 8 surrounding
tokens, and the query takes a softmax over its K samples.

This path materialises the sampled keys and values, (B, T, H, W, heads, K, d) each, and
lets autograd differentiate it. It runs on any device and dtype (float64 included); the
fused Triton kernels (forward.py, backward.py, zero_kernels.py) are tested against it.
"""
from __future__ import annotations

import itertools

import torch


def window_starts(size: int, kernel: int, device: torch.device | None = None) -> torch.Tensor:
    """First index of the clamped window of every query along one axis.

    Returns a long tensor (size,): start[i] = clamp(i - kernel // 2, 0, size - kernel).
    """
    i = torch.arange(size, device=device)  # (S,)
    return torch.clamp(i - kernel // 2, 0, size - kernel)  # (S,)


def base_positions(grid: tuple[int, int, int], kernel_size: tuple[int, int, int],
                   device: torch.device | None = None) -> torch.Tensor:
    """Integer positions of every query's base window samples.

    grid = (T, H, W), kernel_size = (kt, kh, kw). Returns a long tensor (T, H, W, K, 3)
    with K = kt * kh * kw in row-major order over (it, iy, ix) and the last axis (t, y, x).
    """
    axes = []
    for size, kernel in zip(grid, kernel_size):
        start = window_starts(size, kernel, device)  # (S,)
        axes.append(start[:, None] + torch.arange(kernel, device=device))  # (S, k)
    (T, H, W), (kt, kh, kw) = grid, kernel_size
    pos_t = axes[0][:, None, None, :, None, None].expand(T, H, W, kt, kh, kw)  # (T, H, W, kt, kh, kw)
    pos_y = axes[1][None, :, None, None, :, None].expand(T, H, W, kt, kh, kw)  # (T, H, W, kt, kh, kw)
    pos_x = axes[2][None, None, :, None, None, :].expand(T, H, W, kt, kh, kw)  # (T, H, W, kt, kh, kw)
    pos = torch.stack([pos_t, pos_y, pos_x], dim=-1)  # (T, H, W, kt, kh, kw, 3)
    return pos.reshape(T, H, W, kt * kh * kw, 3)  # (T, H, W, K, 3)


def trilinear_corners(pos: torch.Tensor, grid: tuple[int, int, int]):
    """The 8 grid tokens around each (already clamped) position and their weights.

    pos: (..., 3) floating positions (t, y, x) inside [0, S - 1] per axis. Yields 8 pairs
    (token, weight): token is the long flat index t * H * W + y * W + x, shape (...);
    weight has pos's dtype, shape (...), and is differentiable with respect to pos. At
    the last index of an axis the upper neighbour is the same token with weight 0.
    """
    hi = torch.tensor([s - 1 for s in grid], device=pos.device)  # (3,)
    lower = torch.floor(pos)  # (..., 3), no gradient flows through floor
    frac = pos - lower  # (..., 3)
    lower = lower.long()  # (..., 3)
    upper = torch.minimum(lower + 1, hi)  # (..., 3)
    H, W = grid[1], grid[2]
    for bits in itertools.product((0, 1), repeat=3):
        upper_mask = torch.tensor(bits, dtype=torch.bool, device=pos.device)  # (3,)
        corner = torch.where(upper_mask, upper, lower)  # (..., 3)
        weight = torch.where(upper_mask, frac, 1 - frac).prod(dim=-1)  # (...)
        token = (corner[..., 0] * H + corner[..., 1]) * W + corner[..., 2]  # (...)
        yield token, weight


def deformable_slide_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                         offsets: torch.Tensor,
                                         kernel_size: tuple[int, int, int],
                                         scale: float) -> torch.Tensor:
    """3D-DSA by materialised trilinear sampling; inputs are assumed validated.

    q, k, v: (B, T, H, W, heads, d); offsets: (B, T, H, W, heads, K, 3) with
    K = prod(kernel_size), last axis (dt, dy, dx). Returns (B, T, H, W, heads, d) in
    q's dtype. Positions and interpolation weights are computed in at least float32;
    the sampling, scores, softmax and weighted sum run in q's dtype.
    """
    B, T, H, W, heads, d = q.shape
    grid = (T, H, W)
    N = T * H * W
    device = q.device
    coord_dtype = torch.promote_types(offsets.dtype, torch.float32)

    base = base_positions(grid, kernel_size, device).to(coord_dtype)  # (T, H, W, K, 3)
    pos = base[None, :, :, :, None] + offsets.to(coord_dtype)  # (B, T, H, W, heads, K, 3)
    hi = torch.tensor([s - 1 for s in grid], dtype=coord_dtype, device=device)  # (3,)
    pos = torch.clamp(pos, min=torch.zeros_like(hi), max=hi)  # (B, T, H, W, heads, K, 3)

    batch = torch.arange(B, device=device).view(B, 1, 1, 1, 1, 1)  # (B, 1, 1, 1, 1, 1)
    head = torch.arange(heads, device=device).view(1, 1, 1, 1, heads, 1)  # (1, 1, 1, 1, heads, 1)
    k_rows = k.reshape(B * N * heads, d)  # (B*N*heads, d)
    v_rows = v.reshape(B * N * heads, d)  # (B*N*heads, d)
    k_samples = torch.zeros(*pos.shape[:-1], d, dtype=k.dtype, device=device)  # (B, T, H, W, heads, K, d)
    v_samples = torch.zeros_like(k_samples)  # (B, T, H, W, heads, K, d)
    for token, weight in trilinear_corners(pos, grid):
        row = (batch * N + token) * heads + head  # (B, T, H, W, heads, K)
        weight = weight.to(k.dtype)[..., None]  # (B, T, H, W, heads, K, 1)
        k_samples = k_samples + weight * k_rows[row]  # (B, T, H, W, heads, K, d)
        v_samples = v_samples + weight * v_rows[row]  # (B, T, H, W, heads, K, d)

    scores = torch.einsum("bthwnd,bthwnkd->bthwnk", q, k_samples) * scale  # (B, T, H, W, heads, K)
    attn = torch.softmax(scores, dim=-1)  # (B, T, H, W, heads, K)
    return torch.einsum("bthwnk,bthwnkd->bthwnd", attn, v_samples)  # (B, T, H, W, heads, d)
