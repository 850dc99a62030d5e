"""Backend choice, NATTEN / xformers style: the one mechanism of every op with several implementations
(3D-DSA and its offset net's kernels, fused QK-norm + RoPE, the sequence-parallel attention brick).

An op lists its backends in the order "auto" tries them; each has a `can_run(*inputs,
explicit) -> (ok, reason)` check. Asking by name for a backend that cannot run, or "auto"
when none can, raises a ValueError that gives every backend's reason.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Backend:
    name: str
    can_run: Callable[..., tuple[bool, str]]   # (*inputs, explicit: bool) -> (ok, reason)
    run: Callable[..., Any]


def select_backend(name: str, backends: tuple[Backend, ...], *inputs) -> Backend:
    """The backend called `name`, or for "auto" the first in `backends` that can run `inputs`."""
    return choose_backend(name, backends, *inputs)[0]


def choose_backend(name: str, backends: tuple[Backend, ...], *inputs) -> tuple[Backend, dict[str, str]]:
    """`select_backend`'s choice and, for each backend tried before it, why it cannot run: the record a
    benchmark keeps of what ran and why nothing faster did."""
    known = ["auto", *(b.name for b in backends)]
    if name not in known:
        raise ValueError(f"backend={name!r} is unknown; choose 'auto' to take the first that can run, "
                         f"or one of: {', '.join(map(repr, known))}")
    explicit = name != "auto"
    passed: dict[str, str] = {}
    for backend in backends:
        if name in ("auto", backend.name):
            ok, why = backend.can_run(*inputs, explicit)
            if ok:
                return backend, passed
            passed[backend.name] = why
    reasons = []
    for backend in backends:
        ok, why = backend.can_run(*inputs, explicit)
        reasons.append(f"{backend.name}: {'can run' if ok else 'cannot run'} ({why})")
    x = inputs[0]
    raise ValueError(f"backend={name!r} cannot run these inputs ({tuple(x.shape)} {x.dtype} on {x.device}): "
                     + "; ".join(reasons))


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    from triton import knobs
    return bool(knobs.runtime.interpret)


def triton_device_check(device: torch.device, explicit: bool, interpreted: bool, what: str) -> tuple[bool, str]:
    """Triton kernels run on CUDA; on CPU only under the interpreter and only when asked for by name."""
    if device.type == "cuda":
        return True, f"{what} on CUDA"
    if device.type == "cpu" and explicit:
        if interpreted:
            return True, "Triton interpreter on CPU (slow; for tests)"
        return False, "CPU tensors need TRITON_INTERPRET=1 set before the kernels are first used"
    return False, f"needs CUDA tensors (got device {device}; 'auto' uses triton only on CUDA)"


def device_guard(t: torch.Tensor):
    """Launch on t's GPU: Triton launches on the current device, which may not be t's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def triton_kernels_check(module: str, device: torch.device, explicit: bool, what: str) -> tuple[bool, str]:
    """`triton_device_check` for the kernels of `module` (a module path, imported on first use): they
    run in the interpreter if they were built for it or, not yet imported, will be."""
    if device.type != "cuda" and not explicit:  # decided without importing triton (seconds, on CPU runs)
        return triton_device_check(device, explicit, False, what)
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    loaded = sys.modules.get(module)
    interpreted = loaded.INTERPRETED if loaded is not None else triton_interpreted()
    return triton_device_check(device, explicit, interpreted, what)
