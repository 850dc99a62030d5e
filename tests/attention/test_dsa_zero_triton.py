"""Zero-offset (dsa_zero) Triton kernels and `neighborhood_attention`, on CPU through the Triton
interpreter (TRITON_INTERPRET=1): output and gradients of q, k, v against the float64 reference
with zero offsets (tolerance rule as tests/attention/test_dsa_triton.py), a deterministic
backward, the forward-only path of both ops, and the dsa_zero module's wiring."""
from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built
pytest.importorskip("triton")

from megaslide.attention.dsa import deformable_slide_attention, neighborhood_attention  # noqa: E402
from megaslide.attention.dsa.module import DSAAttention, DSAZeroAttention  # noqa: E402
from megaslide.attention.dsa.op import NA_BACKENDS  # noqa: E402
from megaslide.attention.dsa.reference import deformable_slide_attention_reference  # noqa: E402
from megaslide.backends import select_backend  # noqa: E402
from megaslide.testing import rounding_floor, within_tolerance  # noqa: E402
from tests.attention.test_dsa_triton import forward, launch, zero_kernels  # noqa: E402  (built for the interpreter)
from tests.helpers import builds_for_sm90  # noqa: E402

F64 = torch.float64
FLOOR_ULPS = 2
NAMES = ["out", "dq", "dk", "dv"]


def make_inputs(shape, dtype, seed=0):
    """q, k, v and an output gradient (B, T, H, W, heads, d), drawn in float64 and rounded to dtype."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=F64).to(dtype) for _ in range(4)]


def reference(inputs, kernel_size, dtype):
    """Output and gradients of the PyTorch reference with zero offsets, inputs cast to dtype."""
    q, k, v, grad_out = (x.to(dtype).requires_grad_(i < 3) for i, x in enumerate(inputs))
    offsets = torch.zeros(*q.shape[:5], math.prod(kernel_size), 3, dtype=dtype)
    out = deformable_slide_attention_reference(q, k, v, offsets, kernel_size, q.shape[-1] ** -0.5)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)]


def fused(inputs, kernel_size, config=None):
    """Output and gradients of the zero-offset kernels (config: tiles, default as the op's)."""
    q, k, v, grad_out = inputs
    scale = q.shape[-1] ** -0.5
    out, lse = zero_kernels.na_forward(q, k, v, kernel_size, scale, config=config)
    return [out, *zero_kernels.na_backward(q, k, v, out, lse, grad_out, kernel_size, scale, config=config)]


def assert_matches_reference(shape, kernel_size, dtype=torch.float32, config=None):
    inputs = make_inputs(shape, dtype)
    truth, same_dtype = reference(inputs, kernel_size, F64), reference(inputs, kernel_size, dtype)
    for name, want, ref, got in zip(NAMES, truth, same_dtype, fused(inputs, kernel_size, config)):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        err_fused = (got.to(F64) - want).abs().max().item()
        err_ref = (ref.to(F64) - want).abs().max().item()
        floor = rounding_floor(got.dtype, want, FLOOR_ULPS)
        assert within_tolerance(err_fused, err_ref, floor), (
            f"{name}: triton error {err_fused:.3e} > 2 x reference error {err_ref:.3e} + {floor:.1e}")


@pytest.mark.parametrize("shape,kernel_size", [
    ((1, 3, 5, 7, 1, 12), (3, 3, 3)),  # odd grid, d = 12 padded to 16
    ((2, 1, 4, 6, 1, 40), (1, 3, 5)),  # one frame (kernel 1), d = 40 padded to 64, two batches
    ((1, 5, 3, 4, 2, 16), (3, 1, 1)),  # two heads, windows along t only
    ((1, 3, 3, 5, 1, 16), (3, 3, 5)),  # windows as large as the grid: every key reached by every query
])
def test_matches_reference_fp32(shape, kernel_size):
    assert_matches_reference(shape, kernel_size)


def test_matches_reference_bf16():
    assert_matches_reference((1, 3, 5, 7, 1, 16), (3, 3, 3), dtype=torch.bfloat16)


def test_blocks_with_different_inverse_ranges():
    """Blocks of 16 keys (the last one partial): blocks away from the edges loop over fewer
    queries per axis than edge blocks (up to 2k - 1), each to its own longest range."""
    config = launch.LaunchConfig(block_q=16, block_d=16, num_warps=1)
    assert_matches_reference((1, 3, 6, 9, 1, 16), (3, 3, 3), config=config)


def test_backward_is_deterministic():
    inputs = make_inputs((1, 3, 5, 6, 2, 16), torch.bfloat16, seed=1)
    first, second = fused(inputs, (3, 3, 3)), fused(inputs, (3, 3, 3))
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def _lse_spy(monkeypatch, module, name: str) -> list:
    """Replace module.name, a forward returning (out, lse), with a wrapper that records each lse."""
    calls, forward = [], getattr(module, name)

    def spy(*args, **kw):
        out, lse = forward(*args, **kw)
        calls.append(lse)
        return out, lse

    monkeypatch.setattr(module, name, spy)
    return calls


def test_forward_only_stores_no_lse(monkeypatch):
    """Without a gradient to compute (no_grad, inference_mode, or no input requiring grad) the op
    asks the kernels for no lse and saves nothing: the output has no autograd graph and equals
    the training forward's output."""
    calls = _lse_spy(monkeypatch, zero_kernels, "na_forward")
    q, k, v, _ = make_inputs((1, 3, 4, 5, 2, 16), torch.float32, seed=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    trained = neighborhood_attention(*leaves, (3, 3, 3), backend="triton")
    assert trained.grad_fn is not None and calls.pop().shape == (1, 2, 60)
    with torch.no_grad():
        no_grad = neighborhood_attention(*leaves, (3, 3, 3), backend="triton")
    with torch.inference_mode():
        inference = neighborhood_attention(q, k, v, (3, 3, 3), backend="triton")
    plain = neighborhood_attention(q, k, v, (3, 3, 3), backend="triton")
    assert calls == [None, None, None]
    for out in (no_grad, inference, plain):
        assert out.grad_fn is None
        assert torch.equal(out, trained.detach())


def test_general_op_forward_only_stores_no_lse_and_equals_training_forward(monkeypatch):
    calls = _lse_spy(monkeypatch, forward, "dsa_forward")
    q, k, v, _ = make_inputs((1, 3, 4, 5, 1, 16), torch.float32, seed=3)
    offsets = torch.randn(1, 3, 4, 5, 1, 27, 3, generator=torch.Generator().manual_seed(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, offsets)]
    trained = deformable_slide_attention(*leaves, (3, 3, 3), backend="triton")
    assert calls.pop().shape == (1, 1, 60)
    with torch.no_grad():
        sampled = deformable_slide_attention(*leaves, (3, 3, 3), backend="triton")
    assert calls == [None]
    assert trained.grad_fn is not None and sampled.grad_fn is None
    assert torch.equal(sampled, trained.detach())


@pytest.mark.parametrize("backend", ["scores", "gather", "reference"])
def test_pytorch_backends_without_offsets(backend):
    """Off CUDA the op runs the general PyTorch backends with zero offsets that need no gradient."""
    q, k, v, grad_out = make_inputs((1, 3, 4, 5, 2, 4), F64, seed=5)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = neighborhood_attention(*leaves, (3, 3, 3), backend=backend)
    want = reference([q, k, v, grad_out], (3, 3, 3), F64)
    for got, ref in zip([out.detach(), *torch.autograd.grad(out, leaves, grad_out)], want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_backend_choice_and_errors():
    q = torch.zeros(1, 3, 3, 3, 1, 4, dtype=F64)
    offsets = q.new_zeros(()).expand(1, 3, 3, 3, 1, 27, 3)
    assert select_backend("auto", NA_BACKENDS, q, offsets).name == "scores"  # CPU: never the interpreter
    with pytest.raises(ValueError, match=r"triton: cannot run \(dtypes .*float64.*\); scores: can run"):
        neighborhood_attention(q, q, q, (3, 3, 3), backend="triton")
    with pytest.raises(ValueError, match=r"attention.kernel_size=\(3, 5, 3\) is larger than the token grid "
                                         r"\(3, 3, 3\) along h \(5 > 3\)"):
        neighborhood_attention(q, q, q, (3, 5, 3))


def test_dsa_zero_module_is_a_fresh_dsa_module_without_offset_gradient():
    """dsa_zero attends as a fresh dsa layer (zero-initialised offsets) and never touches its offset net."""
    torch.manual_seed(0)
    dsa, zero = DSAAttention(32, 2), DSAZeroAttention(32, 2)
    dsa.initialize_weights()
    grid = (3, 4, 5)
    q, k, v = (torch.randn(1, 60, 2, 16, requires_grad=True) for _ in range(3))
    x = torch.randn(1, 60, 32)
    torch.testing.assert_close(zero.attend(q, k, v, x, grid), dsa.attend(q, k, v, x, grid))
    zero.attend(q, k, v, x, grid).sum().backward()
    assert all(p.grad is None for p in zero.parameters())


@pytest.mark.slow
def test_op_inside_torch_compile():
    """Under torch.compile (aot_eager: the traced autograd graph) the zero-offset op runs as in
    eager, with and without gradients (its kernels are opaque custom ops)."""
    q, k, v, grad_out = make_inputs((1, 3, 4, 5, 2, 8), torch.float32, seed=6)

    def attend(q, k, v):
        return neighborhood_attention(q.relu(), k, v, (3, 3, 3), backend="triton") * 2

    results = []
    for fn in (attend, torch.compile(attend, backend="aot_eager")):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        with torch.no_grad():
            sampled = fn(q, k, v)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, grad_out), sampled])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)


def test_kernels_compile_for_sm90():
    """The interpreter cannot catch GPU lowering errors (the while loops, say): build the three kernels."""
    assert builds_for_sm90("""
        from megaslide.attention.dsa import launch, zero_kernels as zk

        sizes = {"T": "i32", "H": "i32", "W": "i32", "HEADS": "i32", "D": "i32", "stride_tok": "i32"}
        bf16 = lambda *names: {n: "*bf16" for n in names}
        fp32 = lambda *names: {n: "*fp32" for n in names}
        scales = {"scale": "fp32", "qk_scale": "fp32"}
        cfg = launch.launch_config(262144, 64)
        tiles = {"KT": 3, "KH": 3, "KW": 3, "BLOCK_Q": cfg.block_q, "BLOCK_D": cfg.block_d,
                 "WIDE": False, "EVEN_D": True, "BLOCK_Y": 1}
        for fn, sig, const in [
            (zk._na_fwd_kernel, {**bf16("q_ptr", "k_ptr", "v_ptr", "out_ptr"), **fp32("lse_ptr"), **sizes,
                                 "qk_scale": "fp32"}, {**tiles, "STORE_LSE": False}),
            (zk._na_bwd_dq_kernel, {**bf16("q_ptr", "k_ptr", "v_ptr", "out_ptr", "dout_ptr"),
                                    **fp32("lse_ptr", "delta_ptr"), **bf16("dq_ptr"), **sizes, **scales}, tiles),
            (zk._na_bwd_dkdv_kernel, {**bf16("q_ptr", "k_ptr", "v_ptr", "dout_ptr"), **fp32("lse_ptr", "delta_ptr"),
                                      **bf16("dk_ptr", "dv_ptr"), **sizes, **scales}, tiles),
        ]:
            build(fn, sig, const, cfg.num_warps, aligned_ints=("D", "stride_tok"))
    """) == 3
