"""The offset net's CPU depthwise Conv3d (depthwise.py's `cpu` backend: F.conv3d forward, backward written out)
against F.conv3d and its autograd (+ F.gelu), for the output and the gradients of x, weight and bias.

Truth: F.conv3d in float64; the backend may be at most 2x as wrong as F.conv3d in the tested dtype, plus a
rounding floor (megaslide.testing.within_tolerance)."""
from __future__ import annotations

import pytest
import torch

from megaslide.attention.dsa.depthwise import BACKENDS, depthwise_conv3d
from megaslide.backends import select_backend
from megaslide.testing import check_conv


@pytest.mark.parametrize("shape,kernel,frames,gelu", [
    ((2, 3, 4, 5, 3), (3, 3, 3), (0, 3), False),   # whole clip, odd grid
    ((1, 5, 4, 5, 3), (3, 3, 3), (1, 4), True),    # a frame slab: frames 0 and 4 read as its halo
    ((1, 4, 3, 6, 5), (1, 3, 5), (0, 2), False),   # slab at the clip start, a non-cube kernel
    ((2, 3, 5, 7, 6), (3, 3, 3), (2, 3), True),    # the last frame alone
    ((1, 1, 1, 1, 4), (1, 1, 1), (0, 1), False),   # one token
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_conv3d(shape, kernel, frames, gelu, dtype):
    for seed in (0, 1):
        result = check_conv(shape, frames, dtype, torch.device("cpu"), kernel, seed=seed, gelu=gelu, backend="cpu")
        assert result["passed"], result["errors"]


def test_cpu_backend_float64_equals_autograd_to_rounding():
    """In float64 the written-out backward and F.conv3d's autograd differ only by summation order."""
    g = torch.Generator().manual_seed(3)
    x, weight, bias = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((2, 5, 3, 4, 7), (7, 1, 3, 3, 3), 7))
    dy = torch.randn((2, 3, 3, 4, 7), generator=g, dtype=torch.float64)
    got, want = ([t.detach().clone().requires_grad_() for t in (x, weight, bias)] for _ in range(2))
    for backend, leaves in (("cpu", got), ("torch", want)):
        depthwise_conv3d(*leaves, (1, 4), backend=backend, gelu=True).backward(dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_auto_takes_the_cpu_backend_on_the_cpu_only():
    x = torch.zeros(1, 2, 2, 2, 4)
    assert select_backend("auto", BACKENDS, x).name == "cpu"
    backend = next(b for b in BACKENDS if b.name == "cpu")
    assert not backend.can_run(x.to("meta"), False)[0]
    assert backend.can_run(x.to("meta"), True)[0]


def test_no_gradient_asked_for_none_computed():
    x, weight = torch.randn(1, 3, 2, 2, 4, requires_grad=True), torch.randn(4, 1, 3, 3, 3)
    depthwise_conv3d(x, weight, None, backend="cpu").sum().backward()
    assert x.grad.shape == x.shape and weight.grad is None
