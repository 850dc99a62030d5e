"""Fused QK-norm + RoPE: RMSNorm over the model width, then rotary embedding per head.

The unfused path (`qk_norm_rope_reference`) is what `SelfAttention.project_qkv` does: an
`nn.RMSNorm`-style normalisation of q (and of k) over all D = heads * d channels, a view to
heads, and `apply_rope`. That is about ten kernels per tensor, each reading and writing the
whole (B, N, D) activation. The Triton kernel does it in one pass per tensor: one program
per token row loads the row as interleaved pairs (x[2i], x[2i+1]), computes the RMS in fp32,
scales by the norm weight, rotates each pair by the angle of its head-local pair index and
writes the row once. It reads the q/k slices of the fused qkv projection in place (any row
stride), so no copy is made.

Numerics: the kernel keeps everything in fp32 and rounds once at the store; the unfused path
rounds to the input dtype after the norm and again after the rotation, so in bf16 the fused
path is the more accurate of the two. The backward recomputes through the unfused path
(inference needs no gradient; the backward exists so that the op is a drop-in replacement).

Backends (NATTEN-style, walked in order for "auto"): `triton` (CUDA; on CPU only under the
Triton interpreter, TRITON_INTERPRET=1, and only when asked for by name) and `reference`.
The kernel is jitted on first use, so a test can choose TRITON_INTERPRET before that.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from megaslide.backends import Backend, triton_device_check, triton_interpreted
from megaslide.backends import select_backend as choose_backend
from megaslide.nn.rope import apply_rope

tl = None  # triton.language, imported with the first kernel call (after a test can set TRITON_INTERPRET)

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROW = 16384  # widest row (D) one program holds in registers


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis of x (..., D), as `nn.RMSNorm(D, eps)` computes it; weight (D,) or None."""
    if weight is None:
        return x
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                           heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: q, k (B, N, D) -> RMSNorm over D -> (B, N, heads, d) -> RoPE with cos/sin (N, d/2)."""
    B, N, D = q.shape
    q = apply_rope(rms_norm(q, q_weight, eps).view(B, N, heads, D // heads), cos, sin)  # (B, N, h, d)
    k = apply_rope(rms_norm(k, k_weight, eps).view(B, N, heads, D // heads), cos, sin)  # (B, N, h, d)
    return q, k


def _norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_tokens, x_row_stride, eps,
                    HALF_HEAD: tl.constexpr, HALF_ROW: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_NORM: tl.constexpr):
    """One program per row of x (B*N rows of D = 2*HALF_ROW channels, row stride x_row_stride):
    out[row] = rope(rmsnorm(x[row]) * w), pairs (2i, 2i+1) rotated by angle row % n_tokens, i % HALF_HEAD."""
    row = tl.program_id(0)
    token = row % n_tokens
    i = tl.arange(0, BLOCK)                          # pair index along the row
    live = i < HALF_ROW
    src = x_ptr + row.to(tl.int64) * x_row_stride
    x1 = tl.load(src + 2 * i, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + 2 * i + 1, mask=live, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF_ROW)
        inv_rms = 1.0 / tl.sqrt(mean_sq + eps)
        x1 = x1 * inv_rms * tl.load(w_ptr + 2 * i, mask=live, other=0.0).to(tl.float32)
        x2 = x2 * inv_rms * tl.load(w_ptr + 2 * i + 1, mask=live, other=0.0).to(tl.float32)
    angle = token * HALF_HEAD + i % HALF_HEAD
    c = tl.load(cos_ptr + angle, mask=live, other=0.0)
    s = tl.load(sin_ptr + angle, mask=live, other=0.0)
    dst = out_ptr + row.to(tl.int64) * (2 * HALF_ROW)
    tl.store(dst + 2 * i, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=live)
    tl.store(dst + 2 * i + 1, (x1 * s + x2 * c).to(out_ptr.dtype.element_ty), mask=live)


@functools.cache
def _jitted_kernel():
    """The kernel, jitted on first use (for the interpreter when TRITON_INTERPRET=1 is set by then:
    the interpreter needs triton.language itself imported under that setting)."""
    global tl
    import triton
    import triton.language as tl
    return triton.jit(_norm_rope_rows)


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (B, N, D) as rows with unit channel stride and one row stride (a copy only if needed)."""
    B, N, _ = x.shape
    if x.stride(2) != 1 or (B > 1 and x.stride(0) != N * x.stride(1)):
        x = x.contiguous()
    return x, x.stride(1)


def _triton_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      heads: int, eps: float) -> torch.Tensor:
    """One launch: x (B, N, D) -> normalised and rotated (B, N, heads, d), dtype of x."""
    kernel = _jitted_kernel()
    B, N, D = x.shape
    x, row_stride = _rows_view(x)
    out = torch.empty(B, N, D, dtype=x.dtype, device=x.device)  # (B, N, D)
    w = weight.contiguous() if weight is not None else x  # a placeholder pointer when there is no norm
    block = 1 << (D // 2 - 1).bit_length()  # next power of two >= D / 2
    kernel[(B * N,)](x, w, cos.float().contiguous(), sin.float().contiguous(), out, N, row_stride,
                               float(eps), HALF_HEAD=D // heads // 2, HALF_ROW=D // 2, BLOCK=block,
                               HAS_NORM=weight is not None, num_warps=4 if block >= 256 else 1)
    return out.view(B, N, heads, D // heads)


class _FusedQKNormRope(torch.autograd.Function):
    """Triton forward; the backward recomputes through the unfused reference."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, heads: int, eps: float):
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.heads, ctx.eps = heads, eps
        return (_triton_norm_rope(q, q_weight, cos, sin, heads, eps),
                _triton_norm_rope(k, k_weight, cos, sin, heads, eps))

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in saved]
            outs = qk_norm_rope_reference(*inputs, heads=ctx.heads, eps=ctx.eps)
            wanted = [t for t in inputs if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(outs, wanted, (grad_q, grad_k), allow_unused=True) if wanted else ())
        result = [next(grads) if t is not None and t.requires_grad else None for t in inputs]
        return (*result, None, None)


def can_run_reference(q: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    return True, "pure PyTorch, any device and dtype"


def can_run_triton(q: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    """CUDA, fp32/fp16/bf16, D <= MAX_ROW; on CPU only under the interpreter and only by name."""
    if not TRITON_AVAILABLE:
        return False, "triton is not installed"
    if q.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {q.dtype} not supported (use float32, float16 or bfloat16)"
    if q.shape[-1] > MAX_ROW:
        return False, f"row width D={q.shape[-1]} exceeds {MAX_ROW}"
    return triton_device_check(q.device, explicit, triton_interpreted(), "fused kernel")


BACKENDS: tuple[Backend, ...] = (
    Backend("triton", can_run_triton, _FusedQKNormRope.apply),
    Backend("reference", can_run_reference, qk_norm_rope_reference),
)
"""In the order "auto" tries them."""


def select_backend(name: str, q: torch.Tensor) -> Backend:
    """The backend `name` ("auto": the first that can run q)."""
    return choose_backend(name, BACKENDS, q)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, *, heads: int, eps: float = 1e-6,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the width, then RoPE per head, of the query and key projections.

    q, k: (B, N, D) (slices of a fused qkv output are fine: any row stride, unit channel stride);
    q_weight, k_weight: (D,) RMSNorm weights, or None for no norm; cos, sin: (N, d/2) with
    d = D / heads (rows of `RopeTable.lookup`), pairs interleaved as `apply_rope` expects.
    Returns q, k: (B, N, heads, d) in the dtype of q."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (B, N, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    B, N, D = q.shape
    if heads < 1 or D % heads or (D // heads) % 2:
        raise ValueError(f"heads={heads} must divide D={D} into an even head dim d (RoPE rotates pairs)")
    if cos.shape != (N, D // heads // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be (N, d/2) = ({N}, {D // heads // 2}); got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}: look up the RoPE rows of exactly these N tokens")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and w.shape != (D,):
            raise ValueError(f"{name} must be (D,) = ({D},), got {tuple(w.shape)}")
    return select_backend(backend, q).run(q, k, q_weight, k_weight, cos, sin, heads, eps)


def fused_project_qkv(attn, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attn.project_qkv(h, rope)` of a `SelfAttention` with QK-norm + RoPE fused (`qk_norm_rope`):
    h (B, n, D), cos / sin (n, d/2) -> q, k, v (B, n, heads, d)."""
    B, n, _ = h.shape
    q, k, v = attn.qkv(h).chunk(3, dim=-1)                     # (B, n, D) each
    weights = [getattr(norm, "weight", None) for norm in (attn.q_norm, attn.k_norm)]
    eps = getattr(attn.q_norm, "eps", None)
    eps = torch.finfo(h.dtype).eps if eps is None else eps  # nn.RMSNorm's default
    q, k = qk_norm_rope(q, k, *weights, *rope, heads=attn.num_heads, eps=eps, backend=backend)  # (B, n, h, d)
    return q, k, v.view(B, n, attn.num_heads, attn.head_dim)
