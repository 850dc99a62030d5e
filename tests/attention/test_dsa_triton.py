"""Fused Triton 3D-DSA kernels against the PyTorch reference, on CPU through the Triton
interpreter (TRITON_INTERPRET=1), for the output and the gradients of q, k, v and offsets.

Tolerance rule: with every input rounded to the tested dtype, the float64 reference is
the truth; the kernel's max error may be at most 2x the error of the same-dtype PyTorch
reference, plus a floor of 2 x eps(dtype) x max(1, max|value|) (at rounding level a 2x ratio
between two summation orders is noise): megaslide.testing.within_tolerance.
"""
from __future__ import annotations

import importlib
import math
import shutil
import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built
pytest.importorskip("triton")

from megaslide.attention.dsa import backward, deformable_slide_attention, forward, launch, rows, sampling  # noqa: E402
from megaslide.attention.dsa import zero_kernels  # noqa: E402
from megaslide.testing import rounding_floor, within_tolerance  # noqa: E402
from tests.helpers import builds_for_sm90  # noqa: E402

if not launch.INTERPRETED:  # built earlier in this process without the interpreter: rebuild, dependencies first
    for module in (launch, rows, sampling, forward, backward, zero_kernels):
        importlib.reload(module)

F64 = torch.float64
FLOOR_ULPS = 2


def make_inputs(shape, kernel_size, dtype, offset_std=1.5, far_fraction=0.0, seed=0):
    """q, k, v (B, T, H, W, heads, d), offsets (B, T, H, W, heads, K, 3) and an output
    gradient, drawn in float64 and rounded to dtype."""
    g = torch.Generator().manual_seed(seed)
    B, T, H, W, heads, d = shape
    K = math.prod(kernel_size)
    q, k, v, grad_out = (torch.randn(shape, generator=g, dtype=F64) for _ in range(4))
    offsets = torch.randn((B, T, H, W, heads, K, 3), generator=g, dtype=F64) * offset_std
    far = torch.rand(offsets.shape, generator=g, dtype=F64) < far_fraction
    offsets = torch.where(far, offsets.sign() * (max(T, H, W) + 5 * offsets.abs()), offsets)
    return [x.to(dtype) for x in (q, k, v, offsets, grad_out)]


def run(backend, inputs, kernel_size, dtype, offsets_grad=True, offsets_dtype=None):
    """Output and gradients (q, k, v[, offsets]) of one backend on inputs cast to dtype
    (offsets to offsets_dtype, default dtype)."""
    q, k, v, grad_out = (x.to(dtype) for x in (inputs[0], inputs[1], inputs[2], inputs[4]))
    offsets = inputs[3].to(offsets_dtype or dtype)
    leaves = [q, k, v] + ([offsets] if offsets_grad else [])
    for x in leaves:
        x.requires_grad_()
    out = deformable_slide_attention(q, k, v, offsets, kernel_size, backend=backend)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out.detach(), *grads]


def assert_matches_reference(shape, kernel_size, dtype=torch.float32, offsets_grad=True,
                             offsets_dtype=None, **input_kw):
    inputs = make_inputs(shape, kernel_size, dtype, **input_kw)
    truth = run("reference", inputs, kernel_size, F64, offsets_grad)
    same_dtype = run("reference", inputs, kernel_size, dtype, offsets_grad, offsets_dtype)
    fused = run("triton", inputs, kernel_size, dtype, offsets_grad, offsets_dtype)
    names = ["out", "dq", "dk", "dv", "doffsets"]
    for name, want, ref, got in zip(names, truth, same_dtype, fused):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        err_fused = (got.to(F64) - want).abs().max().item()
        err_ref = (ref.to(F64) - want).abs().max().item()
        floor = rounding_floor(got.dtype, want, FLOOR_ULPS)
        assert within_tolerance(err_fused, err_ref, floor), (
            f"{name}: triton error {err_fused:.3e} > 2 x reference error {err_ref:.3e} + {floor:.1e}")


def test_cube_window_odd_grid_padded_head_dim():
    assert_matches_reference((1, 3, 5, 7, 1, 24), (3, 3, 3))  # d = 24 runs padded to 32


def test_far_offsets_clamp_two_batches():
    assert_matches_reference((2, 5, 4, 5, 1, 16), (1, 3, 3), far_fraction=0.3, offset_std=3.0)


def test_large_window_touching_every_border():
    assert_matches_reference((1, 3, 5, 6, 1, 16), (3, 5, 5))


def test_zero_offsets_without_offset_gradient():
    assert_matches_reference((1, 3, 4, 5, 1, 32), (3, 3, 3), offsets_grad=False, offset_std=0.0)


def test_single_frame():
    assert_matches_reference((1, 1, 4, 6, 2, 16), (1, 3, 3), far_fraction=0.2)


@pytest.mark.parametrize("dtype,offsets_dtype", [
    (torch.float16, None),
    (torch.bfloat16, torch.float32),  # as the DSA module calls it: bf16 activations, fp32 offsets
])
def test_half_precision(dtype, offsets_dtype):
    assert_matches_reference((1, 2, 4, 5, 1, 16), (1, 3, 3), dtype=dtype, offsets_dtype=offsets_dtype)


def test_several_query_blocks_with_partial_last_block():
    """Programs tile the N = 35 queries by 16: masks of the last, partial block."""
    shape, kernel_size = (1, 1, 5, 7, 1, 16), (1, 1, 3)
    q, k, v, offsets, grad_out = make_inputs(shape, kernel_size, torch.float32, offset_std=2.0)
    config = launch.LaunchConfig(block_q=16, block_d=16, num_warps=1)
    out, lse = forward.dsa_forward(q, k, v, offsets, kernel_size, 0.25, config=config)
    grads = backward.dsa_backward(q, k, v, offsets, out, lse, grad_out, kernel_size, 0.25,
                                  offsets_grad=True, config=config)
    leaves = [x.to(F64).requires_grad_() for x in (q, k, v, offsets)]
    want = deformable_slide_attention(*leaves, kernel_size, scale=0.25, backend="reference")
    want_grads = torch.autograd.grad(want, leaves, grad_out.to(F64))
    for got, ref in zip([out, *grads], [want, *want_grads]):
        torch.testing.assert_close(got.to(F64), ref.detach(), rtol=1e-5, atol=1e-5)


def test_kernels_compile_for_sm90():
    """The interpreter cannot catch GPU lowering errors; build the forward kernel to sm_90 SASS
    with Triton's bundled ptxas (no GPU needed) in a process without TRITON_INTERPRET (the
    backward's kernels: tests/attention/test_dsa_binned.py)."""
    assert builds_for_sm90("""
        from megaslide.attention.dsa import forward, launch

        common = {"T": "i32", "H": "i32", "W": "i32", "HEADS": "i32", "D": "i32",
                  "stride_tok": "i32", "stride_off_tok": "i32"}
        fwd = {**{n: "*bf16" for n in ["q_ptr", "k_ptr", "v_ptr", "off_ptr", "out_ptr"]},
               "lse_ptr": "*fp32", **common, "qk_scale": "fp32"}
        cfg = launch.launch_config(262144, 64)
        tiles = {"KT": 3, "KH": 3, "KW": 3, "BLOCK_Q": cfg.block_q, "BLOCK_D": cfg.block_d,
                 "WIDE": False, "EVEN_D": True, "BLOCK_Y": 1}
        build(forward._dsa_fwd_kernel, fwd, {**tiles, "STORE_LSE": True}, cfg.num_warps,
              aligned_ints=("D", "stride_tok"))
        # the patch candidate of the sweep (4 x 4 queries), int64 rows, a padded head dim
        build(forward._dsa_fwd_kernel, fwd, {**tiles, "STORE_LSE": True, "BLOCK_Y": 4, "WIDE": True,
                                             "EVEN_D": False}, cfg.num_warps, aligned_ints=("D", "stride_tok"))
    """) == 2


@pytest.mark.slow
def test_fused_op_inside_torch_compile():
    """Under torch.compile (train.compile) the fused op runs as in eager: the same output and
    gradients. Dynamo must not retrace the Triton launches (on the H200 inductor passed the
    float scale as fp64, which the kernel's fp32 loop state rejects). The backend is `inductor`,
    the one that failed on the H200: it traces the autograd graph (as `aot_eager` does) and lowers
    the graph around the op to generated C++ (on CPU), with the op kept as an opaque call; where no
    C++ compiler is installed, `aot_eager` checks the traced graph alone."""
    backend = "inductor" if shutil.which("g++") else "aot_eager"
    kernel_size = (3, 3, 3)
    inputs = make_inputs((1, 3, 4, 5, 2, 8), kernel_size, torch.float32)

    def attend(q, k, v, offsets):
        return deformable_slide_attention(q.relu(), k, v, offsets, kernel_size, backend="triton") * 2

    results = []
    for fn in (attend, torch.compile(attend, backend=backend)):
        leaves = [x.clone().requires_grad_() for x in inputs[:4]]
        out = fn(*leaves)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, inputs[4])])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)
