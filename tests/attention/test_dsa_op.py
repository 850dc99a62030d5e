"""3D-DSA op: the PyTorch reference against independent writings of its definition,
gradients by finite differences, input validation and backend choice (CPU, float64)."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from megaslide.attention.dsa import deformable_slide_attention  # noqa: E402
from megaslide.attention.dsa.op import BACKENDS  # noqa: E402
from megaslide.attention.dsa.reference import base_positions  # noqa: E402
from megaslide.backends import select_backend  # noqa: E402

F64 = torch.float64


def random_inputs(shape, kernel_size, offset_std=1.5, seed=0, dtype=F64):
    """q, k, v (B, T, H, W, heads, d) and offsets (B, T, H, W, heads, K, 3)."""
    g = torch.Generator().manual_seed(seed)
    B, T, H, W, heads, d = shape
    K = math.prod(kernel_size)
    q, k, v = (torch.randn(shape, generator=g, dtype=dtype) for _ in range(3))
    offsets = torch.randn((B, T, H, W, heads, K, 3), generator=g, dtype=dtype) * offset_std
    return q, k, v, offsets


def window_start(i: int, size: int, kernel: int) -> int:
    return min(max(i - kernel // 2, 0), size - kernel)


def brute_force_dsa(q, k, v, offsets, kernel_size, scale):
    """The written definition, one query, sample and corner at a time (numpy float64)."""
    q, k, v, offsets = (x.detach().numpy().astype(np.float64) for x in (q, k, v, offsets))
    B, T, H, W, heads, d = q.shape
    kt, kh, kw = kernel_size
    sizes = (T, H, W)
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            for y in range(H):
                for x in range(W):
                    starts = [window_start(i, s, kk) for i, s, kk in zip((t, y, x), sizes, kernel_size)]
                    for h in range(heads):
                        keys, values = [], []
                        j = 0
                        for it in range(kt):
                            for iy in range(kh):
                                for ix in range(kw):
                                    base = (starts[0] + it, starts[1] + iy, starts[2] + ix)
                                    lower, upper, frac = [], [], []
                                    for axis in range(3):
                                        p = base[axis] + offsets[b, t, y, x, h, j, axis]
                                        p = min(max(p, 0.0), sizes[axis] - 1.0)
                                        lo = math.floor(p)
                                        lower.append(lo)
                                        upper.append(min(lo + 1, sizes[axis] - 1))
                                        frac.append(p - lo)
                                    key = np.zeros(d)
                                    value = np.zeros(d)
                                    for ct in (0, 1):
                                        for cy in (0, 1):
                                            for cx in (0, 1):
                                                corner, weight = [], 1.0
                                                for axis, bit in enumerate((ct, cy, cx)):
                                                    corner.append(upper[axis] if bit else lower[axis])
                                                    weight *= frac[axis] if bit else 1.0 - frac[axis]
                                                key += weight * k[b, corner[0], corner[1], corner[2], h]
                                                value += weight * v[b, corner[0], corner[1], corner[2], h]
                                    keys.append(key)
                                    values.append(value)
                                    j += 1
                        scores = scale * np.stack(keys) @ q[b, t, y, x, h]  # (K,)
                        attn = np.exp(scores - scores.max())
                        attn /= attn.sum()
                        out[b, t, y, x, h] = attn @ np.stack(values)
    return torch.from_numpy(out)


def neighbourhood_mask(grid, kernel_size):
    """(N, N) bool: key m lies in the clamped window of query n along every axis."""
    coords = torch.stack(torch.meshgrid(*(torch.arange(s) for s in grid), indexing="ij"), -1).reshape(-1, 3)  # (N, 3)
    mask = torch.ones(len(coords), len(coords), dtype=torch.bool)
    for axis, (size, kernel) in enumerate(zip(grid, kernel_size)):
        start = torch.tensor([window_start(int(i), size, kernel) for i in coords[:, axis]])  # (N,)
        key = coords[:, axis][None, :]  # (1, N)
        mask &= (key >= start[:, None]) & (key < start[:, None] + kernel)
    return mask


def masked_dense_attention(q, k, v, mask, scale):
    """Dense softmax attention over the tokens allowed by mask (N, N); q, k, v (B, T, H, W, heads, d)."""
    B, T, H, W, heads, d = q.shape
    qf, kf, vf = (x.reshape(B, T * H * W, heads, d).transpose(1, 2) for x in (q, k, v))  # (B, heads, N, d)
    scores = scale * qf @ kf.transpose(-1, -2)  # (B, heads, N, N)
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, -1) @ vf  # (B, heads, N, d)
    return out.transpose(1, 2).reshape(q.shape)


@pytest.mark.parametrize("shape,kernel_size", [
    ((1, 3, 4, 5, 2, 3), (3, 3, 3)),
    ((2, 2, 3, 5, 1, 4), (1, 3, 5)),
])
def test_reference_matches_brute_force_definition(shape, kernel_size):
    q, k, v, offsets = random_inputs(shape, kernel_size, offset_std=2.0)
    offsets[..., :2, :] *= 10  # some samples far outside the grid: clamped
    scale = 0.7
    out = deformable_slide_attention(q, k, v, offsets, kernel_size, scale=scale, backend="reference")
    expected = brute_force_dsa(q, k, v, offsets, kernel_size, scale)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def smooth_offsets(shape, kernel_size, seed):
    """Offsets whose sample positions sit at least 0.2 away from integers (or 0.5 outside
    the grid), where the op is differentiable, for finite differences."""
    g = torch.Generator().manual_seed(seed)
    B, T, H, W, heads, _ = shape
    K = math.prod(kernel_size)
    base = base_positions((T, H, W), kernel_size).to(F64)  # (T, H, W, K, 3)
    size = torch.tensor([T, H, W], dtype=F64)  # (3,)
    cells = torch.floor(torch.rand((B, T, H, W, heads, K, 3), generator=g, dtype=F64) * (size - 1))
    pos = cells + 0.2 + 0.6 * torch.rand(cells.shape, generator=g, dtype=F64)  # inside, off integers
    outside = torch.rand(cells.shape, generator=g, dtype=F64) < 0.15
    pos = torch.where(outside, -0.5 - 3 * torch.rand(cells.shape, generator=g, dtype=F64), pos)
    return pos - base[None, :, :, :, None]  # (B, T, H, W, heads, K, 3)


@pytest.mark.parametrize("shape,kernel_size,fast", [
    ((1, 1, 3, 3, 1, 2), (1, 3, 3), False),  # full Jacobians: tiny, ~600 evaluations
    ((2, 3, 3, 4, 2, 2), (3, 3, 3), True),  # random projections of the Jacobians
])
def test_reference_gradcheck(shape, kernel_size, fast):
    q, k, v, _ = random_inputs(shape, kernel_size, seed=1)
    offsets = smooth_offsets(shape, kernel_size, seed=2)
    inputs = [x.requires_grad_() for x in (q, k, v, offsets)]

    def fn(q, k, v, offsets):
        return deformable_slide_attention(q, k, v, offsets, kernel_size, backend="reference")

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, fast_mode=fast)


def test_offset_gradient_is_zero_where_clamped():
    shape, kernel_size = (1, 2, 3, 4, 1, 3), (1, 3, 3)
    q, k, v, offsets = random_inputs(shape, kernel_size, seed=3)
    offsets = (offsets.sign() * 50).requires_grad_()  # every coordinate far outside the grid
    out = deformable_slide_attention(q, k, v, offsets, kernel_size, backend="reference")
    out.square().sum().backward()
    assert torch.count_nonzero(offsets.grad) == 0


@pytest.mark.parametrize("shape,kernel_size", [
    ((1, 3, 5, 6, 2, 4), (3, 3, 3)),
    ((2, 4, 5, 3, 1, 3), (3, 5, 1)),
    ((1, 1, 4, 7, 2, 2), (1, 3, 5)),
])
def test_zero_offsets_equal_neighbourhood_attention(shape, kernel_size):
    q, k, v, offsets = random_inputs(shape, kernel_size, seed=4)
    offsets = torch.zeros_like(offsets)
    scale = shape[-1] ** -0.5
    out = deformable_slide_attention(q, k, v, offsets, kernel_size)
    mask = neighbourhood_mask(shape[1:4], kernel_size)
    assert mask.sum(1).eq(math.prod(kernel_size)).all()
    torch.testing.assert_close(out, masked_dense_attention(q, k, v, mask, scale), rtol=1e-12, atol=1e-12)


def test_integer_offsets_equal_shifted_neighbourhood():
    shape, kernel_size = (2, 3, 4, 5, 2, 3), (3, 3, 3)
    B, T, H, W, heads, d = shape
    q, k, v, _ = random_inputs(shape, kernel_size, seed=5)
    g = torch.Generator().manual_seed(6)
    offsets = torch.randint(-3, 4, (B, T, H, W, heads, 27, 3), generator=g).to(F64)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    # Gather the clamped integer positions directly.
    t, y, x = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    starts = [torch.tensor([window_start(i, s, kk) for i in range(s)])[c]
              for c, s, kk in zip((t, y, x), (T, H, W), kernel_size)]  # 3 x (T, H, W)
    jt, jy, jx = torch.meshgrid(torch.arange(3), torch.arange(3), torch.arange(3), indexing="ij")
    base = [s[..., None] + j.reshape(-1) for s, j in zip(starts, (jt, jy, jx))]  # 3 x (T, H, W, K)
    pos = [torch.clamp(bse[None, :, :, :, None] + offsets[..., a].long(), 0, size - 1)
           for a, (bse, size) in enumerate(zip(base, (T, H, W)))]  # 3 x (B, T, H, W, heads, K)
    b_idx = torch.arange(B).view(B, 1, 1, 1, 1, 1)
    h_idx = torch.arange(heads).view(1, 1, 1, 1, heads, 1)
    k_s = k[b_idx, pos[0], pos[1], pos[2], h_idx]  # (B, T, H, W, heads, K, d)
    v_s = v[b_idx, pos[0], pos[1], pos[2], h_idx]  # (B, T, H, W, heads, K, d)
    attn = torch.softmax(torch.einsum("...d,...kd->...k", q, k_s) * d ** -0.5, -1)  # (B, T, H, W, heads, K)
    expected = torch.einsum("...k,...kd->...d", attn, v_s)  # (B, T, H, W, heads, d)

    out = deformable_slide_attention(q, k, v, offsets, kernel_size, backend="reference")
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel_size,match", [
    ((3, 4, 3), r"attention.kernel_size=\(3, 4, 3\) must be three odd positive ints"),
    ((3, 3, 9), r"attention.kernel_size=\(3, 3, 9\) is larger than the token grid \(4, 5, 6\) along w \(9 > 6\)"),
    ((5, 3, 3), r"along t \(5 > 4\); use a smaller odd kernel or more tokens"),
    ((0, 3, 3), r"attention.kernel_size=\(0, 3, 3\) must be three odd positive ints"),
    ((3, 3), r"attention.kernel_size=\(3, 3\) must be three"),
    ((3.0, 3, 3), r"attention.kernel_size=\(3.0, 3, 3\) must be three odd positive ints"),
])
def test_kernel_size_validation(kernel_size, match):
    shape = (1, 4, 5, 6, 1, 2)
    q, k, v, offsets = random_inputs(shape, (1, 1, 1))
    with pytest.raises(ValueError, match=match):
        deformable_slide_attention(q, k, v, offsets, kernel_size)


def test_input_validation():
    shape, ks = (1, 3, 4, 5, 2, 4), (3, 3, 3)
    q, k, v, offsets = random_inputs(shape, ks)
    with pytest.raises(ValueError, match=r"offsets must have shape .*\(1, 3, 4, 5, 2, 27, 3\)"):
        deformable_slide_attention(q, k, v, offsets[..., :9, :], ks)
    with pytest.raises(ValueError, match="k must have q's shape"):
        deformable_slide_attention(q, k[:, :2], v, offsets, ks)
    with pytest.raises(ValueError, match="v must have q's dtype"):
        deformable_slide_attention(q, k, v.float(), offsets, ks)
    with pytest.raises(ValueError, match=r"q must be a non-empty \(B, T, H, W, heads, d\)"):
        deformable_slide_attention(q[0], k[0], v[0], offsets[0], ks)
    with pytest.raises(ValueError, match="offsets must be floating point"):
        deformable_slide_attention(q, k, v, offsets.long(), ks)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        deformable_slide_attention(q, k, v, offsets, ks, scale=float("nan"))


def test_backend_choice_and_errors():
    shape, ks = (1, 3, 3, 3, 1, 4), (3, 3, 3)
    q, k, v, offsets = random_inputs(shape, ks)
    assert select_backend("auto", BACKENDS, q, offsets).name == "scores"  # CPU: never the interpreter
    assert select_backend("reference", BACKENDS, q, offsets).name == "reference"
    with pytest.raises(ValueError, match=r"backend='flash' is unknown.*'auto', 'triton', 'scores', 'gather', "
                                         r"'reference'"):
        deformable_slide_attention(q, k, v, offsets, ks, backend="flash")
    with pytest.raises(ValueError, match=r"triton: cannot run \(dtypes .*float64.*\); scores: can run .*; "
                                         r"gather: can run .*; reference: can run"):
        deformable_slide_attention(q, k, v, offsets, ks, backend="triton")
    out = deformable_slide_attention(q, k, v, offsets, ks, backend="auto")
    torch.testing.assert_close(out, deformable_slide_attention(q, k, v, offsets, ks, backend="reference"))


def test_auto_takes_score_matrices_only_for_small_grids():
    """The score-matrix backend (O(B heads N^2)) beats the gathers only while a query's row of
    N' padded scores is short next to its 8 K corner reads; past MAX_SCORES it cannot run."""
    q, _, _, offsets = random_inputs((1, 2, 3, 3, 1, 2), (1, 1, 1))  # N' = 48 > 2 x 8 reads
    assert select_backend("auto", BACKENDS, q, offsets).name == "gather"
    assert select_backend("scores", BACKENDS, q, offsets).name == "scores"  # asked for by name it runs
    big = torch.zeros(1, 16, 16, 16, 4, 1, dtype=F64)  # 4 heads x 4096 x 4913 scores > 2**24
    with pytest.raises(ValueError, match=r"scores: cannot run \(score matrices of .* exceed"):
        select_backend("scores", BACKENDS, big, torch.zeros(1, 16, 16, 16, 4, 1, 3, dtype=F64))
