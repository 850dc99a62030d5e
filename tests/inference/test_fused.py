"""Fused QK-norm + RoPE (Triton, run by the CPU interpreter) against the unfused path.

Tolerance rule: both paths are compared with an fp64 computation of the same math (RMSNorm
over D, interleaved-pair rotation by the fp32 table angles); the fused error may be at most
2x the unfused error in the same dtype, plus one unit of rounding of the output scale
(eps * max|ref|) so that two near-exact fp32 results do not fail on noise. Same rule for the
gradients of q, k and both norm weights.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton.language is imported (fused.py imports it on first use)

import pytest  # noqa: E402
import torch  # noqa: E402

from megaslide.inference import fused  # noqa: E402
from megaslide.inference.fused import qk_norm_rope, qk_norm_rope_reference, select_backend  # noqa: E402
from megaslide.nn.rope import RopeTable  # noqa: E402
from megaslide.testing import within_tolerance  # noqa: E402

EPS = 1e-6


def rope_rows(n: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    table = RopeTable(head_dim, 40, 12, 12)
    pos = [torch.randint(0, s, (n,), generator=gen) for s in (40, 12, 12)]
    return table.lookup(*pos)  # (n, d/2) x 2, fp32


def exact(q, k, qw, kw, cos, sin, heads):
    """fp64 RMSNorm + rotation, written out."""
    def one(x, w):
        x = x.double()
        if w is not None:
            x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * w.double()
        x = x.unflatten(-1, (heads, -1))                                 # (B, N, h, d)
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)                     # (B, N, h, d/2)
        c, s = cos.double()[:, None], sin.double()[:, None]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)  # (B, N, h, d)
    return one(q, qw), one(k, kw)


def inputs(B, N, heads, d, dtype, norm, seed, layout):
    gen = torch.Generator().manual_seed(seed)
    D = heads * d
    qkv = (torch.randn(B, N, 3 * D, generator=gen) * 3).to(dtype)
    q, k, _ = qkv.chunk(3, dim=-1)                                       # row stride 3D, as in attention
    if layout == "channel-strided":
        wide = (torch.randn(B, N, 2 * D, generator=gen) * 3).to(dtype)
        q, k = wide[..., ::2], wide[..., 1::2]
    qw = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype) if norm else None
    kw = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype) if norm else None
    cos, sin = rope_rows(N, d, seed)
    return q, k, qw, kw, cos, sin


CASES = [  # (B, N, heads, d, norm, layout)
    (2, 7, 3, 10, True, "qkv-slice"),         # D = 30: 15 pairs in a block of 16
    (1, 5, 2, 6, False, "qkv-slice"),
    (3, 4, 4, 16, True, "channel-strided"),   # needs a contiguous copy
    (1, 9, 12, 128, True, "qkv-slice"),       # the wan-1.3b head layout
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, N, heads, d, norm, layout", CASES)
def test_fused_matches_unfused_within_the_error_rule(B, N, heads, d, norm, layout, dtype):
    q, k, qw, kw, cos, sin = inputs(B, N, heads, d, dtype, norm, seed=N, layout=layout)
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (q, k, qw, kw)]
    ref = exact(*leaves, cos, sin, heads)
    gout = [torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
            for i, r in enumerate(ref)]
    want = [r.detach() for r in ref] + list(torch.autograd.grad(ref, [t for t in leaves if t is not None], gout))

    def run(backend):
        xs = [t.detach().requires_grad_() if t is not None else None for t in (q, k, qw, kw)]
        out = qk_norm_rope(*xs, cos, sin, heads=heads, eps=EPS, backend=backend)
        assert all(o.shape == (B, N, heads, d) and o.dtype == dtype for o in out)
        grads = torch.autograd.grad(out, [t for t in xs if t is not None], [g.to(dtype) for g in gout])
        return [o.detach() for o in out] + list(grads)

    fused_out, unfused_out = run("triton"), run("reference")
    for name, w, f, u in zip(["q", "k", "dq", "dk", "dqw", "dkw"], want, fused_out, unfused_out):
        err_f = (f.double() - w).abs().max().item()
        err_u = (u.double() - w).abs().max().item()
        floor = torch.finfo(dtype).eps * w.abs().max().item()
        assert within_tolerance(err_f, err_u, floor), f"{name}: fused error {err_f:.3g} vs unfused {err_u:.3g}"


def test_reference_is_the_models_own_path():
    """The unfused path is exactly `SelfAttention.project_qkv`'s norm + RoPE."""
    from megaslide.attention.dense import DenseAttention
    attn = DenseAttention(48, 4)
    torch.nn.init.normal_(attn.q_norm.weight)
    torch.nn.init.normal_(attn.k_norm.weight)
    h = torch.randn(2, 6, 48)
    cos, sin = rope_rows(6, 12, 0)
    q, k, _ = attn.project_qkv(h, (cos, sin))
    q_raw, k_raw, _ = attn.qkv(h).chunk(3, dim=-1)
    rq, rk = qk_norm_rope_reference(q_raw, k_raw, attn.q_norm.weight, attn.k_norm.weight, cos, sin, 4, EPS)
    assert torch.equal(q, rq) and torch.equal(k, rk)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_projection_replaces_project_qkv(backend):
    """`fused_project_qkv(attn, h, rope)` is `attn.project_qkv(h, rope)`, in the fused kernel's rounding."""
    from megaslide.attention.dense import DenseAttention
    attn = DenseAttention(48, 4)
    torch.nn.init.normal_(attn.q_norm.weight)
    h = torch.randn(2, 6, 48)
    rope = rope_rows(6, 12, 3)
    got = fused.fused_project_qkv(attn, h, rope, backend=backend)
    want = attn.project_qkv(h, rope)
    assert [g.shape for g in got] == [(2, 6, 4, 12)] * 3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_backend_choice_and_errors(monkeypatch):
    q = torch.randn(1, 3, 8)
    cos, sin = rope_rows(3, 4, 0)
    assert select_backend("auto", q).name == "reference"     # auto uses triton only on CUDA
    assert select_backend("triton", q).name == "triton"      # by name, under the interpreter
    with pytest.raises(ValueError, match="choose 'auto'"):
        select_backend("cuda", q)
    with pytest.raises(ValueError, match="float64"):
        select_backend("triton", q.double())
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", q)
    with pytest.raises(ValueError, match=r"cos and sin must be \(N, d/2\)"):
        qk_norm_rope(q, q, None, None, cos[:2], sin[:2], heads=2)
    with pytest.raises(ValueError, match="heads=3"):
        qk_norm_rope(q, q, None, None, cos, sin, heads=3)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rope(q, q, torch.ones(7), None, cos, sin, heads=2)
    assert fused.TRITON_AVAILABLE


def test_kernel_compiles_for_sm90():
    """The interpreter cannot catch GPU lowering errors: build the kernel to sm_90 SASS with Triton's
    bundled ptxas (no GPU needed), at the wan-1.3b row width, in a process without TRITON_INTERPRET."""
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from megaslide.inference import fused

        for dtype in ("bf16", "fp32"):
            for norm in (True, False):
                sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                       "out_ptr": f"*{dtype}", "n_tokens": "i32", "x_row_stride": "i32", "eps": "fp32"}
                const = {"HALF_HEAD": 64, "HALF_ROW": 768, "BLOCK": 1024, "HAS_NORM": norm}
                src = ASTSource(fused._jitted_kernel(), {**sig, **{k: "constexpr" for k in const}}, constexprs=const)
                compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
                assert compiled.asm["cubin"]
                print(dtype, norm, "ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(" ok") == 4
