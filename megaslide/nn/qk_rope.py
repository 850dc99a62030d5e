"""Fused QK-norm + RoPE: RMSNorm of the query and key projections over the model width, then rotary
embedding per head, in one pass per tensor forward and one backward (the kernels: qk_rope_kernels.py).

The eager path (qk_rope_reference.py, what `SelfAttention.project_qkv` runs off CUDA) is an RMSNorm and a
rotation of separate ops, each reading and writing the whole (B, N, D) activation and saving its own
tensors for the backward. The fused op reads q and k in place (slices of the fused qkv projection: any
row stride), writes each output once, and saves only its inputs: its backward recomputes the norm
statistics from them. It accumulates in fp32 and rounds once per store, so in bf16 it is the more
accurate of the two; cos and sin are constants (no gradient).

Layers (as megaslide/attention/dsa/op.py): the kernels' launchers -> custom ops (opaque to torch.compile,
with fake functions for its shapes) -> an autograd Function -> `qk_norm_rope`. The kernels module is
imported when a kernel first runs, not with this module: triton is optional, and a test sets
TRITON_INTERPRET before the kernels are built. Backends (megaslide.backends, walked in order for "auto"):
`triton` (CUDA; on CPU only under the interpreter and only by name) and `reference`.
"""
from __future__ import annotations

import importlib.util

import torch

from megaslide.backends import Backend, device_guard, triton_device_check, triton_kernels_check
from megaslide.backends import choose_backend as choose_among
from megaslide.nn.qk_rope_reference import qk_norm_rope_reference

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROW = 16384
"""The widest row D = heads * d a kernel program holds in registers."""
KERNELS = "megaslide.nn.qk_rope_kernels"


@torch.library.custom_op("megaslide::qk_norm_rope_forward", mutates_args=())
def _forward(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             eps: float) -> torch.Tensor:
    from megaslide.nn import qk_rope_kernels  # on first use (module docstring)
    with device_guard(x):
        return qk_rope_kernels.norm_rope_forward(x, weight, cos, sin, heads, eps)


@_forward.register_fake
def _(x, weight, cos, sin, heads, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("megaslide::qk_norm_rope_backward", mutates_args=())
def _backward(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              dout: torch.Tensor, heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from megaslide.nn import qk_rope_kernels  # on first use (module docstring)
    with device_guard(x):
        dx, dweight = qk_rope_kernels.norm_rope_backward(x, weight, cos, sin, dout, heads, eps)
    return dx, x.new_empty(0) if dweight is None else dweight  # an op returns tensors only


@_backward.register_fake
def _(x, weight, cos, sin, dout, heads, eps):
    return x.new_empty(x.shape), x.new_empty(0) if weight is None else weight.new_empty(weight.shape)


class _QKNormRopeFunction(torch.autograd.Function):
    """Fused forward and backward of q and k; saves q, k (as passed), the weights and the tables."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, heads: int, eps: float):
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.heads, ctx.eps = heads, eps
        return _forward(q, q_weight, cos, sin, heads, eps), _forward(k, k_weight, cos, sin, heads, eps)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        dq, dq_weight = _backward(q, q_weight, cos, sin, dq_out, ctx.heads, ctx.eps)
        dk, dk_weight = _backward(k, k_weight, cos, sin, dk_out, ctx.heads, ctx.eps)
        return (dq, dk, None if q_weight is None else dq_weight, None if k_weight is None else dk_weight,
                None, None, None, None)


def _fused(q, k, q_weight, k_weight, cos, sin, heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels: (B, N, D) -> (B, N, heads, d); forward only (nothing saved) when no input needs a gradient."""
    B, N, D = q.shape
    cos, sin, eps = cos.float().contiguous(), sin.float().contiguous(), float(eps)   # (N, d/2) each
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, q_weight, k_weight)):
        q, k = _QKNormRopeFunction.apply(q, k, q_weight, k_weight, cos, sin, heads, eps)
    else:
        q, k = _forward(q, q_weight, cos, sin, heads, eps), _forward(k, k_weight, cos, sin, heads, eps)
    return q.view(B, N, heads, D // heads), k.view(B, N, heads, D // heads)


def can_run_reference(q: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    return True, "pure PyTorch, any device and dtype"


def can_run_triton(q: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    """CUDA, fp32 / fp16 / bf16, D <= MAX_ROW; on CPU only under the interpreter and only by name."""
    if not TRITON_AVAILABLE:
        return False, "triton is not installed"
    if q.dtype not in TRITON_DTYPES:
        return False, f"dtype {q.dtype} not supported (use float32, float16 or bfloat16)"
    if q.shape[-1] > MAX_ROW:
        return False, f"row width D={q.shape[-1]} exceeds {MAX_ROW}"
    if q.device.type == "cuda":   # decided without asking triton's runtime: torch.compile traces this choice
        return triton_device_check(q.device, explicit, False, "fused kernels")
    return triton_kernels_check(KERNELS, q.device, explicit, "fused kernels")


BACKENDS: tuple[Backend, ...] = (
    Backend("triton", can_run_triton, _fused),
    Backend("reference", can_run_reference, qk_norm_rope_reference),
)
"""In the order "auto" tries them."""


def choose_backend(name: str, q: torch.Tensor) -> tuple[Backend, dict[str, str]]:
    """The backend `name` runs for q ("auto": the first that can) and why each one tried before it cannot:
    what a benchmark records of the choice."""
    return choose_among(name, BACKENDS, q)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, *, heads: int, eps: float = 1e-6,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the width, then RoPE per head, of the query and key projections.

    q, k: (B, N, D), one dtype (slices of a fused qkv output are fine: any row stride);
    q_weight, k_weight: (D,) RMSNorm weights, or None for no norm; cos, sin: (N, d/2) with d = D / heads
    (rows of `RopeTable.lookup`), pairs interleaved as `apply_rope` rotates them; eps: the RMSNorm's.
    backend: "auto" (the fused kernels on CUDA, else the reference), "triton" or "reference".
    Returns q, k: (B, N, heads, d) in the dtype of q. Gradients reach q, k and both weights."""
    if q.dim() != 3 or k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(f"q and k must both be (B, N, D) of one dtype; got {tuple(q.shape)} {q.dtype} and "
                         f"{tuple(k.shape)} {k.dtype}")
    B, N, D = q.shape
    if heads < 1 or D % heads or (D // heads) % 2:
        raise ValueError(f"heads={heads} must divide D={D} into an even head dim d (RoPE rotates pairs)")
    if cos.shape != (N, D // heads // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be (N, d/2) = ({N}, {D // heads // 2}); got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}: look up the RoPE rows of exactly these N tokens")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and w.shape != (D,):
            raise ValueError(f"{name} must be (D,) = ({D},), got {tuple(w.shape)}")
    return choose_backend(backend, q)[0].run(q, k, q_weight, k_weight, cos, sin, heads, eps)
