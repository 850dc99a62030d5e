"""The PyTorch backends of 3D-DSA beside the reference (gather: weighted row gathers; scores:
score matrices, for small grids) against the float64 reference: output and the gradients of
q, k, v and offsets, odd grids, far (clamped), integer and zero offsets, several kernel
sizes, float64 gradcheck, and the low-precision error rule of test_dsa_triton.py; and
neighborhood_attention's scores backend (masked dense attention) and its "auto" choice."""
from __future__ import annotations

import math

import pytest
import torch

from megaslide.attention.dsa import deformable_slide_attention, neighborhood_attention
from megaslide.attention.dsa.op import NA_BACKENDS, NA_SCORES_PER_SAMPLE
from megaslide.backends import select_backend
from tests.attention.test_dsa_op import random_inputs, smooth_offsets

F64 = torch.float64


@pytest.fixture(params=["gather", "scores"])
def backend(request):
    return request.param


def output_and_grads(backend, q, k, v, offsets, kernel_size, grad_out, offsets_grad=True):
    """[out, dq, dk, dv(, doffsets)] of one backend on fresh leaves."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    offsets = offsets.detach().clone().requires_grad_(offsets_grad)
    out = deformable_slide_attention(*leaves, offsets, kernel_size, scale=0.6, backend=backend)
    grads = torch.autograd.grad(out, leaves + ([offsets] if offsets_grad else []), grad_out)
    return [out.detach(), *grads]


def assert_equals_reference(backend, q, k, v, offsets, kernel_size, offsets_grad=True):
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=q.dtype)
    want = output_and_grads("reference", q, k, v, offsets, kernel_size, grad_out, offsets_grad)
    got = output_and_grads(backend, q, k, v, offsets, kernel_size, grad_out, offsets_grad)
    for name, g, w in zip(["out", "dq", "dk", "dv", "doffsets"], got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("shape,kernel_size", [
    ((2, 3, 5, 7, 2, 4), (3, 3, 3)),   # odd grid, two batches and heads
    ((1, 4, 5, 3, 3, 6), (3, 5, 1)),
    ((1, 1, 4, 7, 2, 2), (1, 3, 5)),   # a single frame
    ((2, 5, 5, 5, 1, 3), (5, 5, 5)),   # the window covers the whole grid
    ((1, 3, 4, 5, 1, 5), (1, 1, 1)),
])
def test_matches_reference_float64(backend, shape, kernel_size):
    q, k, v, offsets = random_inputs(shape, kernel_size, offset_std=2.0, seed=11)
    assert_equals_reference(backend, q, k, v, offsets, kernel_size)


def test_far_offsets_are_clamped(backend):
    shape, kernel_size = (2, 3, 4, 5, 2, 4), (3, 3, 3)
    q, k, v, offsets = random_inputs(shape, kernel_size, offset_std=2.0, seed=12)
    far = torch.rand(offsets.shape, generator=torch.Generator().manual_seed(13), dtype=F64) < 0.3
    offsets = torch.where(far, offsets.sign() * (10 + 5 * offsets.abs()), offsets)
    assert_equals_reference(backend, q, k, v, offsets, kernel_size)


@pytest.mark.parametrize("integer", ["zero", "all axes", "t only"])
def test_integer_positions_and_grid_borders(backend, integer):
    """Zero or integer offsets put samples exactly on tokens and on the last index of an axis,
    where the trilinear weights have a kink: the gradient must follow the reference's
    convention there (the upper neighbour, clamped to the last index, is the lower one). Along
    an axis of integer positions only, the backends skip the upper corners."""
    shape, kernel_size = (2, 3, 4, 5, 2, 4), (3, 3, 3)
    q, k, v, offsets = random_inputs(shape, kernel_size, seed=14)
    if integer == "zero":
        offsets = torch.zeros_like(offsets)
    elif integer == "all axes":
        offsets = torch.round(offsets * 2)
    else:
        offsets[..., 0] = torch.round(offsets[..., 0] * 2)
    assert_equals_reference(backend, q, k, v, offsets, kernel_size)


def test_without_offset_gradient(backend):
    shape, kernel_size = (1, 3, 5, 4, 2, 4), (3, 3, 3)
    q, k, v, offsets = random_inputs(shape, kernel_size, seed=15)
    assert_equals_reference(backend, q, k, v, offsets, kernel_size, offsets_grad=False)


@pytest.mark.parametrize("shape,kernel_size,fast", [
    ((1, 1, 3, 3, 1, 2), (1, 3, 3), False),  # full Jacobians
    ((2, 3, 3, 4, 2, 2), (3, 3, 3), True),   # random projections of the Jacobians
])
def test_gradcheck(backend, shape, kernel_size, fast):
    q, k, v, _ = random_inputs(shape, kernel_size, seed=16)
    offsets = smooth_offsets(shape, kernel_size, seed=17)
    inputs = [x.requires_grad_() for x in (q, k, v, offsets)]

    def fn(q, k, v, offsets):
        return deformable_slide_attention(q, k, v, offsets, kernel_size, backend=backend)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, fast_mode=fast)


@pytest.mark.parametrize("dtype,offsets_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),  # as the DSA module calls it: bf16 activations, fp32 offsets
    (torch.float16, torch.float16),
])
def test_low_precision_error_within_twice_the_reference(backend, dtype, offsets_dtype):
    """With the inputs rounded to dtype and the float64 reference as truth, the backend's
    error is at most 2x the same-dtype reference's, plus 2 eps of the value."""
    shape, kernel_size = (2, 3, 5, 6, 2, 16), (3, 3, 3)
    q, k, v, offsets = random_inputs(shape, kernel_size, offset_std=2.0, seed=18)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    offsets = offsets.to(offsets_dtype)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(19), dtype=F64).to(dtype)
    truth = output_and_grads("reference", *(x.to(F64) for x in (q, k, v, offsets)), kernel_size, grad_out.to(F64))
    same_dtype = output_and_grads("reference", q, k, v, offsets, kernel_size, grad_out)
    tested = output_and_grads(backend, q, k, v, offsets, kernel_size, grad_out)
    for name, want, ref, got in zip(["out", "dq", "dk", "dv", "doffsets"], truth, same_dtype, tested):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        err = (got.to(F64) - want).abs().max().item()
        err_ref = (ref.to(F64) - want).abs().max().item()
        floor = 2 * torch.finfo(got.dtype).eps * max(1.0, want.abs().max().item())
        assert err <= 2 * err_ref + floor, f"{name}: {backend} {err:.3e} vs reference {err_ref:.3e}"



@pytest.mark.parametrize("shape,kernel_size", [
    ((2, 2, 1, 3, 2, 4), (1, 1, 3)),   # axes of size 2 and 1: the last index is the upper neighbour of the first
    ((1, 1, 2, 2, 3, 3), (1, 1, 1)),
])
def test_axes_of_one_and_two_tokens(backend, shape, kernel_size):
    q, k, v, offsets = random_inputs(shape, kernel_size, offset_std=2.0, seed=20)
    assert_equals_reference(backend, q, k, v, offsets, kernel_size)


@pytest.mark.parametrize("offsets_kind", ["zero", "integer, clamped beyond the edges"])
def test_forward_only_skips_corners_of_zero_weight(backend, offsets_kind):
    """Without an offset gradient the backends read only the corners of nonzero weight; at the
    last index of an axis the scores backend reads the upper neighbour of the one before."""
    shape, kernel_size = (2, 3, 4, 5, 2, 4), (3, 3, 3)
    q, k, v, offsets = random_inputs(shape, kernel_size, offset_std=3.0, seed=21)
    offsets = torch.zeros_like(offsets) if offsets_kind == "zero" else torch.round(offsets)
    with torch.no_grad():
        got = deformable_slide_attention(q, k, v, offsets, kernel_size, scale=0.6, backend=backend)
    want = deformable_slide_attention(q, k, v, offsets, kernel_size, scale=0.6, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape,kernel_size", [
    ((2, 3, 5, 7, 3, 4), (3, 5, 1)),
    ((1, 1, 4, 7, 2, 2), (1, 3, 5)),
    ((2, 5, 5, 5, 1, 3), (5, 5, 5)),
])
def test_neighborhood_attention_as_masked_dense_attention(shape, kernel_size):
    """neighborhood_attention's scores backend (dense attention with the window as a mask) equals
    the reference with zero offsets: output and the gradients of q, k and v."""
    q, k, v, _ = random_inputs(shape, kernel_size, seed=22)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(23), dtype=F64)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    got = neighborhood_attention(*leaves, kernel_size, scale=0.6, backend="scores")
    got = [got.detach(), *torch.autograd.grad(got, leaves, grad_out)]
    zeros = torch.zeros(*shape[:5], math.prod(kernel_size), 3, dtype=F64)
    want = output_and_grads("reference", q, k, v, zeros, kernel_size, grad_out, offsets_grad=False)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_neighborhood_auto_takes_masked_attention_only_for_small_grids():
    """Masked dense attention costs N keys per query against K window reads: "auto" takes it up
    to NA_SCORES_PER_SAMPLE keys per read, the gathers beyond; asked for by name it runs."""
    small = torch.zeros(1, 3, 8, 8, 1, 4, dtype=F64)  # N = 192 <= 32 x 27
    large = torch.zeros(1, 4, 16, 16, 1, 4, dtype=F64)  # N = 1024 > 32 x 27
    for q, name in ((small, "scores"), (large, "gather")):
        offsets = q.new_zeros(()).expand(*q.shape[:5], 27, 3)
        assert select_backend("auto", NA_BACKENDS, q, offsets).name == name
    assert select_backend("scores", NA_BACKENDS, large, offsets).name == "scores"
    assert NA_SCORES_PER_SAMPLE * 27 < 1024
