"""Fused QK-norm + RoPE (megaslide.nn.qk_rope; Triton, run by the CPU interpreter) against the eager path.

Tolerance rule (megaslide.testing.within_tolerance): on the same rounded inputs, the eager reference in
float64 is the truth; the fused kernels' max error may be at most 2x the error of the eager reference in
the tested dtype, plus a floor of 2 x eps(dtype) x max(1, max|truth|), for the output and every gradient
(dq, dk, dq_weight, dk_weight). The norm weights are fp32, as the module keeps them under autocast.
"""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built (the op imports them on first use)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from megaslide.attention.dense import DenseAttention  # noqa: E402
from megaslide.nn import qk_rope  # noqa: E402
from megaslide.nn.qk_rope import choose_backend, qk_norm_rope  # noqa: E402
from megaslide.nn.rope import RopeTable, apply_rope  # noqa: E402
from megaslide.testing import check_qk_rope  # noqa: E402
from tests.helpers import builds_for_sm90  # noqa: E402

F64 = torch.float64
EPS = 1e-6


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels():
    """The kernels built for the interpreter, also when another test module imported them without it."""
    from megaslide.nn import qk_rope_kernels
    if not qk_rope_kernels.INTERPRETED:
        importlib.reload(qk_rope_kernels)


def rope_rows(n: int, head_dim: int, gen: torch.Generator):
    """cos, sin (n, d/2) of n tokens at random positions of a 3D grid, fp32 as `RopeTable` gives them."""
    table = RopeTable(head_dim, 40, 12, 12)
    return table.lookup(*(torch.randint(0, s, (n,), generator=gen) for s in (40, 12, 12)))


def make_inputs(B, N, heads, d, norm, layout, seed):
    """q, k (B, N, D) as the given layout makes them, fp64 values; weights (D,) fp32 or None; cos, sin;
    output gradients (B, N, heads, d)."""
    gen = torch.Generator().manual_seed(seed)
    D = heads * d
    if layout == "qkv-slice":                       # row stride 3D: the slices attention projects
        q, k, _ = (torch.randn(B, N, 3 * D, generator=gen, dtype=F64) * 3).chunk(3, dim=-1)
    else:                                           # channel stride 2: the op makes a contiguous copy
        wide = torch.randn(B, N, 2 * D, generator=gen, dtype=F64) * 3
        q, k = wide[..., ::2], wide[..., 1::2]
    qw, kw = ((1 + 0.3 * torch.randn(D, generator=gen)) if norm else None for _ in range(2))
    cos, sin = rope_rows(N, d, gen)
    grads = [torch.randn(B, N, heads, d, generator=gen, dtype=F64) for _ in range(2)]
    return q, k, qw, kw, cos, sin, grads


CASES = [  # (B, N, heads, d, norm, layout)
    (2, 7, 3, 10, True, "qkv-slice"),           # D = 30: 15 pairs in a block of 16; 14 rows over 3 programs
    (1, 1, 1, 6, True, "qkv-slice"),            # one token, one head
    (1, 5, 2, 6, False, "qkv-slice"),           # no QK-norm (qk_norm=False)
    (3, 3, 4, 16, True, "channel-strided"),     # the tiny preset's head dim; a strided input
    (1, 5, 1, 64, True, "qkv-slice"),           # S / B / L head dim
    (1, 3, 3, 72, True, "qkv-slice"),           # XL head dim: 108 pairs in a block of 128
    (1, 3, 3, 128, True, "qkv-slice"),          # 1B .. 105B and wan-1.3b head dim
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, N, heads, d, norm, layout", CASES)
def test_fused_matches_the_float64_reference_within_the_error_rule(B, N, heads, d, norm, layout, dtype):
    q, k, qw, kw, cos, sin, grads = make_inputs(B, N, heads, d, norm, layout, seed=B * 100 + N * 10 + d)
    check = check_qk_rope(q, k, qw, kw, cos, sin, grads, heads, dtype, eps=EPS)
    assert list(check["errors"]) == ["q", "k", "dq", "dk"] + (["dq_weight", "dk_weight"] if norm else [])
    assert check["passed"], {name: e for name, e in check["errors"].items() if not e["ok"]}


def test_reference_is_the_eager_rmsnorm_and_rope():
    """The eager backend is the model's RMSNorm modules and `apply_rope`, bit for bit."""
    attn = DenseAttention(48, 4)
    torch.nn.init.normal_(attn.q_norm.weight)
    torch.nn.init.normal_(attn.k_norm.weight)
    h = torch.randn(2, 6, 48)
    cos, sin = rope_rows(6, 12, torch.Generator().manual_seed(0))
    q, k, v = attn.project_qkv(h, (cos, sin), qk_rope_backend="reference")
    q_raw, k_raw, v_raw = attn.qkv(h).chunk(3, dim=-1)
    assert torch.equal(q, apply_rope(attn.q_norm(q_raw).view(2, 6, 4, 12), cos, sin))
    assert torch.equal(k, apply_rope(attn.k_norm(k_raw).view(2, 6, 4, 12), cos, sin))
    assert torch.equal(v, v_raw.view(2, 6, 4, 12))


@pytest.mark.parametrize("qk_norm", [True, False])
def test_project_qkv_runs_the_fused_op_when_chosen_and_matches_eager(qk_norm, monkeypatch):
    """Training's `project_qkv` runs the fused kernels, forward and backward, when its backend picks them
    (forced here on CPU, where "auto" picks the eager path), with the eager path's output and gradients."""
    from megaslide.nn import qk_rope_kernels
    calls = []
    for name in ("norm_rope_forward", "norm_rope_backward"):
        launch = getattr(qk_rope_kernels, name)
        monkeypatch.setattr(qk_rope_kernels, name, lambda *a, _f=launch, _n=name: calls.append(_n) or _f(*a))
    torch.manual_seed(1)
    attn = DenseAttention(30, 3, qk_norm=qk_norm)
    if qk_norm:
        torch.nn.init.normal_(attn.q_norm.weight, 1, 0.3)
        torch.nn.init.normal_(attn.k_norm.weight, 1, 0.3)
    h = torch.randn(2, 5, 30)
    rope = rope_rows(5, 10, torch.Generator().manual_seed(2))
    dout = [torch.randn(2, 5, 3, 10) for _ in range(3)]
    params = [p for name, p in attn.named_parameters() if not name.startswith("out.")]  # what project_qkv uses
    assert choose_backend("auto", h)[0].name == "reference"   # CPU: the eager path, by default

    results = []
    for backend in ("reference", "triton"):
        attn.qk_rope_backend = backend
        x = h.clone().requires_grad_()
        out = attn.project_qkv(x, rope)
        results.append([o.detach() for o in out] + list(torch.autograd.grad(out, [x, *params], dout)))
    assert calls == ["norm_rope_forward"] * 2 + ["norm_rope_backward"] * 2
    for eager, fused in zip(*results):
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


def test_auto_picks_the_fused_op_on_cuda_and_says_why_not_elsewhere():
    """The choice (`choose_backend`, what `project_qkv` runs by default) on shapes and devices alone: fake
    CUDA tensors need no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        bf16 = torch.empty(2, 9, 1536, device="cuda", dtype=torch.bfloat16)
        wide = torch.empty(1, 2, 2 * qk_rope.MAX_ROW, device="cuda", dtype=torch.bfloat16)
        double = torch.empty(1, 2, 64, device="cuda", dtype=F64)
        assert choose_backend("auto", bf16) == (qk_rope.BACKENDS[0], {})
        for x, why in ((wide, "exceeds"), (double, "float64 not supported")):
            backend, reasons = choose_backend("auto", x)
            assert backend.name == "reference" and why in reasons["triton"]
    backend, reasons = choose_backend("auto", torch.empty(1, 2, 8))
    assert backend.name == "reference" and "needs CUDA tensors" in reasons["triton"]


def test_bad_input_and_backend_errors(monkeypatch):
    q = torch.randn(1, 3, 8)
    cos, sin = rope_rows(3, 4, torch.Generator().manual_seed(0))
    assert choose_backend("triton", q)[0].name == "triton"      # by name, under the interpreter
    with pytest.raises(ValueError, match="choose 'auto'"):
        qk_norm_rope(q, q, None, None, cos, sin, heads=2, backend="cuda")
    with pytest.raises(ValueError, match="float64"):
        qk_norm_rope(q.double(), q.double(), None, None, cos, sin, heads=2, backend="triton")
    with pytest.raises(ValueError, match=r"cos and sin must be \(N, d/2\)"):
        qk_norm_rope(q, q, None, None, cos[:2], sin[:2], heads=2)
    with pytest.raises(ValueError, match="heads=3"):
        qk_norm_rope(q, q, None, None, cos, sin, heads=3)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rope(q, q, torch.ones(7), None, cos, sin, heads=2)
    with pytest.raises(ValueError, match="one dtype"):
        qk_norm_rope(q, q.bfloat16(), None, None, cos, sin, heads=2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_project_qkv_inside_torch_compile(backend):
    """Under torch.compile (regional compile of project_qkv, train.compile) the backend choice traces and the
    custom ops stay opaque calls: one graph (fullgraph), the same output and gradients as eager (aot_eager)."""
    attn = DenseAttention(30, 3)
    attn.qk_rope_backend = backend
    torch.nn.init.normal_(attn.q_norm.weight, 1, 0.3)
    rope = rope_rows(5, 10, torch.Generator().manual_seed(4))
    h = torch.randn(2, 5, 30)
    params = [attn.qkv.weight, attn.q_norm.weight, attn.k_norm.weight]
    results = []
    for fn in (attn.project_qkv, torch.compile(attn.project_qkv, backend="aot_eager", fullgraph=True)):
        x = h.clone().requires_grad_()
        out = fn(x, rope)
        results.append([o.detach() for o in out] + list(torch.autograd.grad(sum(o.sum() for o in out), [x, *params])))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)


def test_kernels_compile_for_sm90():
    """The interpreter cannot catch GPU lowering errors: build both kernels to sm_90 SASS (no GPU needed) at
    the wan-1.3b and 105B row widths, bf16 and fp32, with and without the norm."""
    assert builds_for_sm90("""
        from megaslide.nn import qk_rope_kernels as kernels

        for D in (1536, 12288):
            block, warps = kernels._block_and_warps(D)
            for dtype in ("bf16", "fp32"):
                for norm in (True, False):
                    const = {"HALF_HEAD": 64, "HALF_ROW": D // 2, "BLOCK": block, "HAS_NORM": norm}
                    common = {"x_ptr": f"*{dtype}", "w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
                    build(kernels._norm_rope_fwd, {**common, "out_ptr": f"*{dtype}", "n_tokens": "i32",
                                                   "x_row_stride": "i32", "eps": "fp32"}, const, warps)
                    build(kernels._norm_rope_bwd, {**common, "dout_ptr": f"*{dtype}", "dx_ptr": f"*{dtype}",
                                                   "dw_ptr": "*fp32", "n_rows": "i32", "n_tokens": "i32",
                                                   "x_row_stride": "i32", "rows_per_program": "i32",
                                                   "eps": "fp32"}, const, warps)
    """) == 16
