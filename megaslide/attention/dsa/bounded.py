"""The offset bound of the DSA module: offsets = max_offset * tanh(o) in fp32, o the offset Linear's output.

Why an op of its own: in PyTorch it is three passes over the offsets (the cast to fp32, tanh, the scale)
and autograd keeps tanh's fp32 output beside the scaled offsets that the attention op keeps too. The
Triton path (bounded_kernels.py) is one pass each way and keeps only its output, the tensor the
attention op saves anyway: the backward's derivative max_offset - y^2 / max_offset needs nothing else.

Backends as depthwise.py's: "triton" (CUDA, or the CPU interpreter when asked for by name), "torch"
(the reference and the CPU path); "auto" takes triton on CUDA.
"""
from __future__ import annotations


import torch

from megaslide.backends import Backend, device_guard, select_backend, triton_kernels_check

BLOCK = 2048
"""Elements per program (the interpreter takes them all in one)."""


def _kernels():
    from megaslide.attention.dsa import bounded_kernels
    return bounded_kernels


def _grid(n: int) -> tuple[int, int]:
    """(programs, BLOCK) for n elements."""
    import triton
    block = triton.next_power_of_2(max(n, 1)) if _kernels().INTERPRETED else BLOCK
    return triton.cdiv(n, block), block


# custom ops, as depthwise.py's: torch.compile treats them as opaque calls
@torch.library.custom_op("megaslide::bound_forward", mutates_args=())
def _forward(o: torch.Tensor, max_offset: float) -> torch.Tensor:
    y = torch.empty(o.shape, dtype=torch.float32, device=o.device)
    programs, block = _grid(o.numel())
    with device_guard(o):
        _kernels()._bound_fwd_kernel[(programs,)](o, y, o.numel(), max_offset, BLOCK=block)
    return y


@_forward.register_fake
def _(o, max_offset):
    return o.new_empty(o.shape, dtype=torch.float32)


@torch.library.custom_op("megaslide::bound_backward", mutates_args=())
def _backward(dy: torch.Tensor, y: torch.Tensor, max_offset: float, dtype: torch.dtype) -> torch.Tensor:
    do = torch.empty(y.shape, dtype=dtype, device=y.device)
    programs, block = _grid(y.numel())
    with device_guard(y):
        _kernels()._bound_bwd_kernel[(programs,)](dy, y, do, y.numel(), max_offset, BLOCK=block)
    return do


@_backward.register_fake
def _(dy, y, max_offset, dtype):
    return y.new_empty(y.shape, dtype=dtype)


class _BoundTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, max_offset: float):
        y = _forward(o.contiguous(), max_offset)
        ctx.save_for_backward(y)
        ctx.meta = (max_offset, o.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        max_offset, dtype = ctx.meta
        if max_offset == 0:  # y is 0 everywhere and so is its gradient
            return torch.zeros(y.shape, dtype=dtype, device=y.device), None
        return _backward(dy.contiguous(), y, max_offset, dtype), None


def _bound_torch(o: torch.Tensor, max_offset: float) -> torch.Tensor:
    return max_offset * torch.tanh(o.float())


def _bound_triton(o: torch.Tensor, max_offset: float) -> torch.Tensor:
    if torch.is_grad_enabled() and o.requires_grad:
        return _BoundTriton.apply(o, max_offset)
    return _forward(o.contiguous(), max_offset)


def _can_run_torch(o: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    return True, "torch.tanh"


def _can_run_triton(o: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    return triton_kernels_check("megaslide.attention.dsa.bounded_kernels", o.device, explicit, "Triton offset bound")


BACKENDS: tuple[Backend, ...] = (Backend("triton", _can_run_triton, _bound_triton),
                                 Backend("torch", _can_run_torch, _bound_torch))


def bounded_offsets(o: torch.Tensor, max_offset: float, backend: str = "auto") -> torch.Tensor:
    """max_offset * tanh(o) in fp32, o of any float dtype and shape; max_offset >= 0."""
    if max_offset < 0:
        raise ValueError(f"bounded_offsets: max_offset={max_offset} must be >= 0")
    return select_backend(backend, BACKENDS, o).run(o, float(max_offset))
