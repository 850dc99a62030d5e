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
import math

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


def sample_positions(offsets: torch.Tensor, kernel_size: tuple[int, int, int]) -> torch.Tensor:
    """Every sample's clamped position: base window position + offset, clamped to [0, S - 1] per axis.
    offsets (B, T, H, W, heads, K, 3) -> (B, T, H, W, heads, K, 3) in at least float32."""
    grid = tuple(offsets.shape[1:4])
    coord_dtype = torch.promote_types(offsets.dtype, torch.float32)
    base = base_positions(grid, kernel_size, offsets.device).to(coord_dtype)  # (T, H, W, K, 3)
    pos = base[None, :, :, :, None] + offsets.to(coord_dtype)  # (B, T, H, W, heads, K, 3)
    hi = torch.tensor([s - 1 for s in grid], dtype=coord_dtype, device=offsets.device)  # (3,)
    return torch.clamp(pos, min=torch.zeros_like(hi), max=hi)  # (B, T, H, W, heads, K, 3)


def halo_extent(tile: tuple[int, int, int], kernel_size: tuple[int, int, int], reach: int) -> tuple[int, int, int]:
    """Tokens of a query tile's halo along (t, y, x) (the halo forward, halo.py): the tile grown by the window's
    reach kernel // 2 and by `reach` tokens of offset on each side. A clamped sample of the tile inside
    [first - kernel // 2 - reach, last + kernel // 2 + reach] has both trilinear corners there (the upper one
    at weight 0 at the last index)."""
    return tuple(s + 2 * (k // 2) + 2 * reach for s, k in zip(tile, kernel_size))


def halo_paths_reference(offsets: torch.Tensor, kernel_size: tuple[int, int, int], reach: int,
                         tile: tuple[int, int, int]) -> torch.Tensor:
    """The halo forward's choice of path written out plainly: (B * heads, tiles) int8, 1 where every sample of
    the tile (tiles row-major over (t, y, x) tile indices) lies inside its halo, else 0 (the gathers). Along
    an axis of size S a tile starting at a has the halo [o, o + E - 1], o = max(0, min(a - k // 2 - reach,
    S - E)), E from `halo_extent`."""
    B, T, H, W, heads = offsets.shape[:5]
    extent = halo_extent(tile, kernel_size, reach)
    pos = sample_positions(offsets, kernel_size)  # (B, T, H, W, heads, K, 3)
    inside = torch.ones(pos.shape[:-1], dtype=torch.bool, device=pos.device)  # (B, T, H, W, heads, K)
    for axis, (size, step, kernel, length) in enumerate(zip((T, H, W), tile, kernel_size, extent)):
        first = torch.arange(size, device=pos.device) // step * step  # (S,) first query of each query's tile
        origin = torch.clamp(torch.minimum(first - kernel // 2 - reach, torch.tensor(size - length)), min=0)  # (S,)
        shape = [1] * 6
        shape[1 + axis] = size
        origin = origin.view(shape).to(pos.dtype)  # broadcast along this axis
        inside &= (pos[..., axis] >= origin) & (pos[..., axis] <= origin + length - 1)
    tiles = [-(-size // step) for size, step in zip((T, H, W), tile)]
    per_query = inside.all(dim=-1).permute(0, 4, 1, 2, 3)  # (B, heads, T, H, W)
    padded = torch.ones(B, heads, *(n * step for n, step in zip(tiles, tile)), dtype=torch.bool,
                        device=pos.device)  # (B, heads, tT * t, tY * y, tX * x): queries past the grid pass
    padded[:, :, :T, :H, :W] = per_query
    blocks = padded.view(B, heads, tiles[0], tile[0], tiles[1], tile[1], tiles[2], tile[2])
    return blocks.all(dim=7).all(dim=5).all(dim=3).reshape(B * heads, -1).to(torch.int8)  # (B * heads, tiles)


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
    k_samples, v_samples = sampled_keys_values(q, k, v, offsets, kernel_size)  # (B, T, H, W, heads, K, d) each
    scores = torch.einsum("bthwnd,bthwnkd->bthwnk", q, k_samples) * scale  # (B, T, H, W, heads, K)
    attn = torch.softmax(scores, dim=-1)  # (B, T, H, W, heads, K)
    return torch.einsum("bthwnk,bthwnkd->bthwnd", attn, v_samples)  # (B, T, H, W, heads, d)


def log_sum_exp_reference(q: torch.Tensor, k: torch.Tensor, offsets: torch.Tensor,
                          kernel_size: tuple[int, int, int], scale: float) -> torch.Tensor:
    """The log-sum-exp of every query's scaled sample scores in log2 units, (B, heads, N) with N = T * H * W:
    what the fused forwards save for the backward; inputs as `deformable_slide_attention_reference`."""
    B, T, H, W, heads, d = q.shape
    k_samples, _ = sampled_keys_values(q, k, k, offsets, kernel_size)  # (B, T, H, W, heads, K, d)
    scores = torch.einsum("bthwnd,bthwnkd->bthwnk", q, k_samples) * scale  # (B, T, H, W, heads, K)
    lse = torch.logsumexp(scores, dim=-1) / math.log(2)  # (B, T, H, W, heads)
    return lse.reshape(B, T * H * W, heads).transpose(1, 2)  # (B, heads, N)


def sampled_keys_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                        kernel_size: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query's sampled keys and values, (B, T, H, W, heads, K, d) each in k's dtype: the trilinear
    samples at the clamped positions base + offset; inputs as `deformable_slide_attention_reference`."""
    B, T, H, W, heads, d = q.shape
    grid = (T, H, W)
    N = T * H * W
    device = q.device
    pos = sample_positions(offsets, kernel_size)  # (B, T, H, W, heads, K, 3)

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
    return k_samples, v_samples
