"""Fused AdamW step over flat host buffers: the CPU optimizer of the offload engine.

`adamw_step_` updates fp32 master weights and moments in place in one pass over memory
(C++, SIMD + OpenMP, csrc/cpu_adam.cpp), reading fp32 or bf16 gradients and optionally
writing the updated weights rounded to bf16 into a second buffer in the same pass.
`adamw_step_torch_` is the same step written with torch ops: the readable reference, the
fallback when the C++ library cannot be built, and the GPU-side update of the
`optimizer_device="gpu"` ablation (it runs on any device).

Math: exactly torch.optim.AdamW (decoupled weight decay, bias correction, `step` 1-based), in
the order of its single-tensor path, with the scalars computed in float64 as torch does:

    p   = p * (1 - lr * weight_decay)
    m   = lerp(m, g, 1 - beta1)
    v   = v * beta2 + (1 - beta2) * g * g
    p   = p - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

Exactness against torch.optim.AdamW(foreach=False) on CPU in fp32: `exp_avg` and `exp_avg_sq`
match bit for bit. `param` may differ by 1 ulp in a small fraction of elements, because torch's
CPU `sqrt` is vectorised through MKL/Sleef and is not correctly rounded (1 ulp off for some
inputs), while the C++ kernel uses the IEEE (correctly rounded) square root. The torch backend
uses torch's ops and matches torch.optim.AdamW bit for bit. bf16 output is round-to-nearest-even
of the updated fp32 weight, bit-identical to `param.to(torch.bfloat16)` for every non-NaN value.

Threads: OpenMP, `num_threads` (default torch.get_num_threads()), a static split of the buffer
into one contiguous run of 64 KiB-per-stream blocks per thread, the same run on every call. The
library shares torch's OpenMP runtime and does not pin threads itself (pinning would pin torch's
intra-op threads too); set OMP_PROC_BIND=close OMP_PLACES=cores to pin both. On a multi-socket
host, first-touch the buffers with a matching static split so each thread's pages are local.

Backend: the C++ library is built at first use (see csrc/build.py); if that fails a
RuntimeWarning says why once and the torch backend takes over. `backend()` names the active one.
Set `MEGASLIDE_CPU_ADAM_BACKEND=torch` to force the torch backend (the offload engine's tests do, for
torch.optim.AdamW's exact bits).
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch

from megaslide.offload.csrc import build

__all__ = ["AdamWScalars", "adamw_step_", "adamw_step_torch_", "backend", "native_isa"]

_NAME = "adamw_step_"


@dataclass(frozen=True)
class AdamWScalars:
    """The per-step constants, computed in float64 in the order torch.optim.AdamW uses.

    Each is rounded to fp32 where it meets the tensors, exactly as torch rounds a Python
    scalar passed to an fp32 op."""

    decay: float  # 1 - lr * weight_decay
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    bias_correction2_sqrt: float  # (1 - beta2**step) ** 0.5
    eps: float
    neg_step_size: float  # -lr / (1 - beta1**step)

    @classmethod
    def for_step(cls, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float) -> AdamWScalars:
        bias_correction1 = 1 - beta1 ** float(step)
        bias_correction2 = 1 - beta2 ** float(step)
        return cls(decay=1 - lr * weight_decay, one_minus_beta1=1 - beta1, beta2=beta2,
                   one_minus_beta2=1 - beta2, bias_correction2_sqrt=bias_correction2 ** 0.5,
                   eps=eps, neg_step_size=-(lr / bias_correction1))


def _check_number(name: str, value, low: float, high: float, high_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{_NAME}: {name} must be a finite Python number, got {value!r}")
    if value < low or value > high or (high_open and value == high):
        bound = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
        raise ValueError(f"{_NAME}: {name} must lie in {bound}, got {value}")


def _check_tensor(name: str, t, dtypes: tuple[torch.dtype, ...], device: torch.device | None,
                  numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):  # ValueError like every other bad argument, so callers catch one type
        raise ValueError(f"{_NAME}: {name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.dtype not in dtypes:
        wanted = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{_NAME}: {name} must have dtype {wanted}, got {t.dtype}; "
                         f"allocate it with dtype={dtypes[0]}")
    if device is not None and t.device != device:
        raise ValueError(f"{_NAME}: {name} is on {t.device} but must be on {device}; "
                         f"move it with .to('{device}') (host buffers: pin once, reuse)")
    if not t.is_contiguous():
        raise ValueError(f"{_NAME}: {name} must be contiguous (got shape {tuple(t.shape)}, "
                         f"strides {t.stride()}); pass a flat buffer or .contiguous()")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{_NAME}: {name} has {t.numel()} elements but param has {numel}; "
                         f"all buffers must cover the same parameters")


def _check_disjoint(tensors: dict[str, torch.Tensor]) -> None:
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for name, t in tensors.items() if t.numel() > 0]
    for i, (name_a, lo_a, hi_a) in enumerate(spans):
        for name_b, lo_b, hi_b in spans[i + 1:]:
            if lo_a < hi_b and lo_b < hi_a:
                raise ValueError(f"{_NAME}: {name_a} and {name_b} overlap in memory; "
                                 f"each buffer needs its own storage")


def _validate(param, grad, exp_avg, exp_avg_sq, param_bf16, *, step, lr, beta1, beta2, eps,
              weight_decay, device: torch.device | None) -> None:
    """Raise ValueError naming the bad argument and the fix. `device=None` accepts any device
    as long as every tensor shares param's."""
    _check_tensor("param", param, (torch.float32,), device, None)
    device, numel = param.device, param.numel()
    _check_tensor("grad", grad, (torch.float32, torch.bfloat16), device, numel)
    _check_tensor("exp_avg", exp_avg, (torch.float32,), device, numel)
    _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), device, numel)
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_bf16 is not None:
        _check_tensor("param_bf16", param_bf16, (torch.bfloat16,), device, numel)
        tensors["param_bf16"] = param_bf16
    _check_disjoint(tensors)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{_NAME}: step must be an int >= 1 (1 on the first update), got {step!r}")
    _check_number("lr", lr, 0.0, math.inf, True)
    _check_number("beta1", beta1, 0.0, 1.0, True)
    _check_number("beta2", beta2, 0.0, 1.0, True)
    _check_number("eps", eps, 0.0, math.inf, True)
    _check_number("weight_decay", weight_decay, 0.0, math.inf, True)


@torch.no_grad()
def adamw_step_torch_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
                      beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                      param_bf16: torch.Tensor | None = None) -> None:
    """One AdamW step with torch ops, in place; any device (all tensors on param's device).

    Args:
        param: (N,) fp32 master weights, updated in place.
        grad: (N,) fp32 or bf16 gradient (bf16 is widened to fp32 first, exactly).
        exp_avg, exp_avg_sq: (N,) fp32 first and second moments, updated in place.
        step: 1-based step count of this update.
        param_bf16: optional (N,) bf16 buffer that receives the updated weights.
    Tensors may have any shape with N elements; they must be contiguous.
    """
    _validate(param, grad, exp_avg, exp_avg_sq, param_bf16, step=step, lr=lr, beta1=beta1,
              beta2=beta2, eps=eps, weight_decay=weight_decay, device=None)
    s = AdamWScalars.for_step(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay)
    g = grad.float()  # (N,) fp32; no copy when grad is already fp32
    if weight_decay != 0:
        param.mul_(s.decay)
    exp_avg.lerp_(g, s.one_minus_beta1)
    exp_avg_sq.mul_(s.beta2).addcmul_(g, g, value=s.one_minus_beta2)
    denom = (exp_avg_sq.sqrt() / s.bias_correction2_sqrt).add_(s.eps)  # (N,) fp32
    param.addcdiv_(exp_avg, denom, value=s.neg_step_size)
    if param_bf16 is not None:
        param_bf16.copy_(param)


def _native() -> ctypes.CDLL | None:
    """The C++ library, or None (torch backend) when forced by env or when the build fails. The
    environment is read on every call, so setting it (a test's monkeypatch.setenv) takes effect at once."""
    if os.environ.get("MEGASLIDE_CPU_ADAM_BACKEND", "").lower() == "torch":
        return None
    return _library()


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The C++ library, built and loaded once per process; None when the build fails."""
    try:
        lib = build.load("cpu_adam.cpp")
    except build.BuildError as err:
        warnings.warn(f"megaslide.offload.cpu_adam: C++ AdamW unavailable, using the slower "
                      f"torch backend. Reason: {err}", RuntimeWarning, stacklevel=4)
        return None
    lib.megaslide_cpu_adam_isa.restype = ctypes.c_char_p
    lib.megaslide_cpu_adam_isa.argtypes = []
    f, p = ctypes.c_float, ctypes.c_void_p
    lib.megaslide_adamw_step.restype = None
    lib.megaslide_adamw_step.argtypes = [p, p, ctypes.c_int, p, p, p, ctypes.c_int64,
                                         f, f, f, f, f, f, f, ctypes.c_int]
    return lib


def backend() -> str:
    """The backend `adamw_step_` runs on this machine: "cpp" or "torch"."""
    return "torch" if _native() is None else "cpp"


def native_isa() -> str | None:
    """The vector ISA the C++ library was compiled for ("avx512", "avx2-fma", ...), or None."""
    lib = _native()
    return None if lib is None else lib.megaslide_cpu_adam_isa().decode()


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                param_bf16: torch.Tensor | None = None, num_threads: int | None = None) -> None:
    """One fused AdamW step on CPU tensors, in place, in one pass over memory.

    Args:
        param: (N,) fp32 master weights, updated in place.
        grad: (N,) fp32 or bf16 gradient, read directly (bf16 is widened exactly).
        exp_avg, exp_avg_sq: (N,) fp32 first and second moments, updated in place.
        step: 1-based step count of this update (bias correction uses it).
        param_bf16: optional (N,) bf16 buffer, e.g. a slice of a pinned weight buffer; receives
            the updated weights rounded to nearest even.
        num_threads: OpenMP threads; default torch.get_num_threads().
    All tensors live on the CPU, are contiguous (any shape with N elements) and do not overlap.
    Releases the GIL while it runs (ctypes), so a Python thread can drive it during backward.
    """
    _validate(param, grad, exp_avg, exp_avg_sq, param_bf16, step=step, lr=lr, beta1=beta1,
              beta2=beta2, eps=eps, weight_decay=weight_decay, device=torch.device("cpu"))
    if num_threads is None:
        num_threads = torch.get_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"{_NAME}: num_threads must be an int >= 1 or None, got {num_threads!r}")
    lib = _native()
    if lib is None:
        adamw_step_torch_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                          beta2=beta2, eps=eps, weight_decay=weight_decay, param_bf16=param_bf16)
        return
    if param.numel() == 0:
        return
    s = AdamWScalars.for_step(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay)
    lib.megaslide_adamw_step(
        param.data_ptr(), grad.data_ptr(), int(grad.dtype == torch.bfloat16), exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(), None if param_bf16 is None else param_bf16.data_ptr(),
        param.numel(), s.decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
        s.bias_correction2_sqrt, s.eps, s.neg_step_size, num_threads)
