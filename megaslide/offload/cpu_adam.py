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

Compact state (megaslide/offload/compact.py, the formats; offload.master_dtype and offload.moments pick them):
`param` may be bf16, the master weights themselves: widened exactly, updated in fp32 as above, and rounded
back to bf16 stochastically with the random bits of `rounding_key` (compact.rounding_key) at the element
indices `first_index` .. (the element's place in its block's flat buffer); and `exp_avg`, `exp_avg_sq` may
be `QuantizedMoment`s (both): dequantised exactly, updated in fp32 as above (the denominator from the new,
unquantised sqrt(v)), and requantised per block of MOMENT_BLOCK elements, the root's codes rounded
stochastically with the bits of compact.root_key(rounding_key) at the same indices. Both backends compute the same
fp32 values; a rounding or quantisation decision can differ between them only where torch's sqrt is 1 ulp
off and the value lies on a decision boundary.

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

from megaslide.offload.compact import (ROOT_RANDOM_BITS, SIGNED, SQRT, QuantizedMoment, random_bits, root_key,
                                       round_stochastic_bf16)
from megaslide.offload.csrc import build

__all__ = ["AdamWScalars", "adamw_step_", "adamw_step_torch_", "backend", "native_isa"]

Moment = torch.Tensor | QuantizedMoment

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


def _check_moment(name: str, moment, kind: str, device: torch.device, numel: int) -> dict[str, torch.Tensor]:
    """The buffers of a moment (fp32 tensor or QuantizedMoment of `kind`), checked, by name."""
    if not isinstance(moment, QuantizedMoment):
        _check_tensor(name, moment, (torch.float32,), device, numel)
        return {name: moment}
    if moment.kind != kind:
        raise ValueError(f"{_NAME}: {name} is a QuantizedMoment of kind {moment.kind!r} but must be {kind!r}")
    _check_tensor(f"{name}.codes", moment.codes, (torch.uint8,), device, numel)
    _check_tensor(f"{name}.scales", moment.scales, (torch.float32,), device, None)
    if moment.scales.numel() != QuantizedMoment.num_scales(numel):
        raise ValueError(f"{_NAME}: {name}.scales has {moment.scales.numel()} elements but {numel} codes need one "
                         f"per MOMENT_BLOCK; allocate it with QuantizedMoment.zeros")
    return {f"{name}.codes": moment.codes, f"{name}.scales": moment.scales}


def _validate(param, grad, exp_avg, exp_avg_sq, param_bf16, *, step, lr, beta1, beta2, eps,
              weight_decay, device: torch.device | None, rounding_key: int | None = None,
              first_index: int = 0) -> None:
    """Raise ValueError naming the bad argument and the fix. `device=None` accepts any device
    as long as every tensor shares param's."""
    _check_tensor("param", param, (torch.float32, torch.bfloat16), device, None)
    device, numel = param.device, param.numel()
    _check_tensor("grad", grad, (torch.float32, torch.bfloat16), device, numel)
    if isinstance(exp_avg, QuantizedMoment) != isinstance(exp_avg_sq, QuantizedMoment):
        raise ValueError(f"{_NAME}: exp_avg and exp_avg_sq must both be fp32 tensors or both QuantizedMoments")
    tensors = {"param": param, "grad": grad, **_check_moment("exp_avg", exp_avg, SIGNED, device, numel),
               **_check_moment("exp_avg_sq", exp_avg_sq, SQRT, device, numel)}
    if param_bf16 is not None:
        if param.dtype == torch.bfloat16:
            raise ValueError(f"{_NAME}: param is bf16 (the master itself), so there is no param_bf16 copy to "
                             f"write; pass param_bf16=None")
        _check_tensor("param_bf16", param_bf16, (torch.bfloat16,), device, numel)
        tensors["param_bf16"] = param_bf16
    _check_disjoint(tensors)
    stochastic = ("param is bf16" if param.dtype == torch.bfloat16 else
                  "the moments are 8-bit (the second's root codes)" if isinstance(exp_avg, QuantizedMoment) else None)
    if stochastic and (isinstance(rounding_key, bool) or not isinstance(rounding_key, int)
                       or not 0 <= rounding_key < 2 ** 32):
        raise ValueError(f"{_NAME}: {stochastic}, rounded stochastically: pass rounding_key, a 32-bit key "
                         f"(compact.rounding_key(seed, block, step)), got {rounding_key!r}")
    if isinstance(first_index, bool) or not isinstance(first_index, int) or first_index < 0:
        raise ValueError(f"{_NAME}: first_index must be an int >= 0 (param[0]'s index in its flat buffer), "
                         f"got {first_index!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{_NAME}: step must be an int >= 1 (1 on the first update), got {step!r}")
    _check_number("lr", lr, 0.0, math.inf, True)
    _check_number("beta1", beta1, 0.0, 1.0, True)
    _check_number("beta2", beta2, 0.0, 1.0, True)
    _check_number("eps", eps, 0.0, math.inf, True)
    _check_number("weight_decay", weight_decay, 0.0, math.inf, True)


@torch.no_grad()
def adamw_step_torch_(param: torch.Tensor, grad: torch.Tensor, exp_avg: Moment, exp_avg_sq: Moment, *,
                      step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                      weight_decay: float = 0.0, param_bf16: torch.Tensor | None = None,
                      rounding_key: int | None = None, first_index: int = 0) -> None:
    """One AdamW step with torch ops, in place; any device (all tensors on param's device).

    Args:
        param: (N,) fp32 master weights, or bf16 ones (rounded stochastically), updated in place.
        grad: (N,) fp32 or bf16 gradient (bf16 is widened to fp32 first, exactly).
        exp_avg, exp_avg_sq: (N,) fp32 first and second moments, or both QuantizedMoments, updated in place.
        step: 1-based step count of this update.
        param_bf16: optional (N,) bf16 buffer that receives the updated fp32 weights (round to nearest).
        rounding_key, first_index: the random bits of the stochastic roundings (module docstring).
    Tensors may have any shape with N elements; they must be contiguous.
    """
    _validate(param, grad, exp_avg, exp_avg_sq, param_bf16, step=step, lr=lr, beta1=beta1,
              beta2=beta2, eps=eps, weight_decay=weight_decay, device=None, rounding_key=rounding_key,
              first_index=first_index)
    s = AdamWScalars.for_step(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay)
    quantized = isinstance(exp_avg, QuantizedMoment)
    g = grad.float()  # (N,) fp32; no copy when grad is already fp32
    p = param.float()  # (N,) fp32: the master itself, or an exact widening of a bf16 one
    m = exp_avg.values() if quantized else exp_avg  # (N,) fp32
    if quantized:
        root = exp_avg_sq.values()
        v = root.mul_(root)  # (N,) fp32: the square of the stored root
    else:
        v = exp_avg_sq
    if weight_decay != 0:
        p.mul_(s.decay)
    m.lerp_(g, s.one_minus_beta1)
    v.mul_(s.beta2).addcmul_(g, g, value=s.one_minus_beta2)
    root = v.sqrt()  # (N,) fp32
    denom = (root / s.bias_correction2_sqrt).add_(s.eps)  # (N,) fp32
    p.addcdiv_(m, denom, value=s.neg_step_size)
    if param.dtype == torch.bfloat16:
        param.copy_(round_stochastic_bf16(p, random_bits(rounding_key, first_index, p.numel(), p.device)))
    if param_bf16 is not None:
        param_bf16.copy_(p)
    if quantized:
        exp_avg.store_(m)
        exp_avg_sq.store_(root, random_bits(root_key(rounding_key), first_index, root.numel(), root.device,
                                            ROOT_RANDOM_BITS))


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
    lib.megaslide_adamw_step_compact.restype = None
    lib.megaslide_adamw_step_compact.argtypes = [p, ctypes.c_int, p, ctypes.c_int, p, p, p, p, p, ctypes.c_int64,
                                                 f, f, f, f, f, f, f, ctypes.c_uint32, ctypes.c_uint32,
                                                 ctypes.c_int]
    return lib


def backend() -> str:
    """The backend `adamw_step_` runs on this machine: "cpp" or "torch"."""
    return "torch" if _native() is None else "cpp"


def native_isa() -> str | None:
    """The vector ISA the C++ library was compiled for ("avx512", "avx2-fma", ...), or None."""
    lib = _native()
    return None if lib is None else lib.megaslide_cpu_adam_isa().decode()


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: Moment, exp_avg_sq: Moment, *, step: int,
                lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                param_bf16: torch.Tensor | None = None, num_threads: int | None = None,
                rounding_key: int | None = None, first_index: int = 0) -> None:
    """One fused AdamW step on CPU tensors, in place, in one pass over memory.

    Args:
        param: (N,) fp32 master weights, or bf16 ones (rounded stochastically), updated in place.
        grad: (N,) fp32 or bf16 gradient, read directly (bf16 is widened exactly).
        exp_avg, exp_avg_sq: (N,) fp32 first and second moments, or both QuantizedMoments, updated in place.
        step: 1-based step count of this update (bias correction uses it).
        param_bf16: optional (N,) bf16 buffer (fp32 param only), e.g. a slice of a pinned weight buffer;
            receives the updated weights rounded to nearest even.
        num_threads: OpenMP threads; default torch.get_num_threads().
        rounding_key, first_index: the random bits of the stochastic roundings (module docstring).
    All tensors live on the CPU, are contiguous (any shape with N elements) and do not overlap.
    Releases the GIL while it runs (ctypes), so a Python thread can drive it during backward.
    """
    _validate(param, grad, exp_avg, exp_avg_sq, param_bf16, step=step, lr=lr, beta1=beta1,
              beta2=beta2, eps=eps, weight_decay=weight_decay, device=torch.device("cpu"),
              rounding_key=rounding_key, first_index=first_index)
    if num_threads is None:
        num_threads = torch.get_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"{_NAME}: num_threads must be an int >= 1 or None, got {num_threads!r}")
    lib = _native()
    if lib is None:
        adamw_step_torch_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                          beta2=beta2, eps=eps, weight_decay=weight_decay, param_bf16=param_bf16,
                          rounding_key=rounding_key, first_index=first_index)
        return
    if param.numel() == 0:
        return
    s = AdamWScalars.for_step(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay)
    scalars = (s.decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.bias_correction2_sqrt, s.eps,
               s.neg_step_size)
    out = None if param_bf16 is None else param_bf16.data_ptr()
    grad_bf16 = int(grad.dtype == torch.bfloat16)
    quantized = isinstance(exp_avg, QuantizedMoment)
    if param.dtype == torch.float32 and not quantized:
        lib.megaslide_adamw_step(param.data_ptr(), grad.data_ptr(), grad_bf16, exp_avg.data_ptr(),
                                 exp_avg_sq.data_ptr(), out, param.numel(), *scalars, num_threads)
        return
    m, v = (exp_avg.codes, exp_avg_sq.codes) if quantized else (exp_avg, exp_avg_sq)
    m_scales, v_scales = (exp_avg.scales.data_ptr(), exp_avg_sq.scales.data_ptr()) if quantized else (None, None)
    lib.megaslide_adamw_step_compact(param.data_ptr(), int(param.dtype == torch.bfloat16), grad.data_ptr(),
                                     grad_bf16, m.data_ptr(), m_scales, v.data_ptr(), v_scales, out, param.numel(),
                                     *scalars, rounding_key or 0, first_index & 0xFFFFFFFF, num_threads)
