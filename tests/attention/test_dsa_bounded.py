"""The DSA offset bound max_offset * tanh(o) on Triton (bounded.py) against torch.tanh, on CPU through the
Triton interpreter: output and gradient, saturation, max_offset 0, and what it keeps for backward."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built
pytest.importorskip("triton")

from megaslide.attention.dsa import bounded_kernels  # noqa: E402
from megaslide.attention.dsa.bounded import bounded_offsets  # noqa: E402
from megaslide.testing import rounding_floor, within_tolerance  # noqa: E402
from tests.helpers import builds_for_sm90  # noqa: E402

if not bounded_kernels.INTERPRETED:  # built earlier in this process without the interpreter
    importlib.reload(bounded_kernels)


def value_and_grad(backend, o, grad, max_offset):
    o = o.clone().requires_grad_()
    y = bounded_offsets(o, max_offset, backend=backend)
    return y.detach(), torch.autograd.grad(y, o, grad)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_tanh_with_saturated_and_zero_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    o = torch.cat([torch.randn(3001, generator=g, dtype=torch.float64) * 2,
                   torch.tensor([0.0, 1e-6, -1e-6, 30.0, -30.0, 200.0, -200.0], dtype=torch.float64)])
    o = o.to(dtype).reshape(1, -1, 1)  # an odd count: a partial last block on the GPU
    grad = torch.randn(o.shape, generator=g, dtype=torch.float64).float()
    truth = value_and_grad("torch", o.double(), grad.double(), 4.0)
    ref = value_and_grad("torch", o, grad, 4.0)
    got = value_and_grad("triton", o, grad, 4.0)
    for name, want, r, x in zip(("y", "do"), truth, ref, got):
        assert x.dtype == r.dtype and x.shape == r.shape, name
        err, ref_err = (x.double() - want).abs().max().item(), (r.double() - want).abs().max().item()
        floor = rounding_floor(torch.float32 if name == "y" else dtype, want)
        assert within_tolerance(err, ref_err, floor), f"{name}: {err:.3e} > 2 x {ref_err:.3e} + {floor:.1e}"
    assert got[0].abs().max().item() <= 4.0 and got[0].dtype == torch.float32


def test_zero_bound_gives_zero_offsets_and_gradient():
    o = torch.randn(2, 7)
    y, do = value_and_grad("triton", o, torch.ones(2, 7), 0.0)
    assert torch.equal(y, torch.zeros(2, 7)) and torch.equal(do, torch.zeros(2, 7))


def test_keeps_only_its_output_for_backward():
    """The Triton bound saves one tensor, its own output (which the attention op keeps anyway); torch's
    chain saves tanh's fp32 output beside it."""
    saved = []
    o = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = bounded_offsets(o, 2.0, backend="triton")
    assert len(saved) == 1 and saved[0].data_ptr() == y.data_ptr()


def test_negative_bound_is_refused():
    with pytest.raises(ValueError, match=r"max_offset=-1.0 must be >= 0"):
        bounded_offsets(torch.zeros(3), -1.0)


def test_kernels_compile_for_sm90():
    assert builds_for_sm90("""
        from megaslide.attention.dsa import bounded as bd, bounded_kernels as bk

        build(bk._bound_fwd_kernel, {"o_ptr": "*bf16", "y_ptr": "*fp32", "n": "i32", "max_offset": "fp32"},
              {"BLOCK": bd.BLOCK}, 4)
        build(bk._bound_bwd_kernel, {"dy_ptr": "*fp32", "y_ptr": "*fp32", "do_ptr": "*bf16", "n": "i32",
                                     "max_offset": "fp32"}, {"BLOCK": bd.BLOCK}, 4)
    """) == 2
