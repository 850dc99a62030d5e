"""The self-attention op's time, in a training step and alone (experiments/oom_thresholds.py).

The op is a variant's `attend` (megaslide/attention/base.py): its token mixing, DSA's offset net
included; everything around it (projections, QK-norm, RoPE) is the block's.
- `AttendTimer`: while active, every call of the given modules' `attend` is timed (CUDA events on
  a GPU, on the stream it runs on; the wall clock on the CPU, where every op has finished when it
  returns): its forward, whether the streamed one, a recompute or a slab's re-run, and its backward,
  from the moment the gradient of its output is ready to the moment those of its inputs are. Their
  sum over a step, over the step's time, is the step's attention share.
- `attend_rate`: one `attend` of a model's width, heads and attention, timed alone on a probe clip,
  forward and backward: the planner's `AttentionRate`, the step-time estimate's attention term,
  measured in the same run as the steps it bounds.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from megaslide.perf.timing import MIN_REPEATS, sync
from megaslide.attention import build_attention
from megaslide.attention.base import SelfAttention
from megaslide.config import DiTConfig
from megaslide.models.chunking import read_over_frame_runs
from megaslide.offload.streamer import elapsed
from megaslide.perf.flops import keys_per_query
from megaslide.perf.planner import AttentionRate


class _Stamp(torch.autograd.Function):
    """Identity on `tensors`; its backward first calls `stamp()`. Put on `attend`'s output, it marks
    where attend's backward begins; on its inputs, where it ends (all their gradients are made)."""

    @staticmethod
    def forward(ctx, stamp, *tensors):
        ctx.stamp = stamp
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.stamp()
        return (None, *grads)


def _stamped(stamp, tensors: list) -> list:
    """`tensors` (None entries kept as they are) through one `_Stamp`."""
    present = [t for t in tensors if t is not None]
    out = iter(_Stamp.apply(stamp, *present))
    return [None if t is None else next(out) for t in tensors]


class AttendTimer:
    """Times every `attend` of `modules` while entered (see the module docstring); `seconds()` after the
    device is idle gives the total of the finished forward and backward spans, then starts over."""

    def __init__(self, modules: list[SelfAttention], device: torch.device):
        self.modules, self.cuda = modules, device.type == "cuda"
        self._spans: list[list] = []   # [start, end] markers; a backward whose end never came stays open

    def _marker(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _timed(self, attend):
        def run(q, k, v, x, grid, **read):  # read=: what the chunk runner read of the input (DSA's offsets)
            forward = [self._marker(), None]
            backward = [None, None]
            track = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, x))
            if track:
                q, k, v, x = _stamped(lambda: backward.__setitem__(1, self._marker()), [q, k, v, x])
            o = attend(q, k, v, x, grid, **read)                           # (B, N, h, d)
            forward[1] = self._marker()
            self._spans.append(forward)
            if track:
                o, = _stamped(lambda: backward.__setitem__(0, self._marker()), [o])
                self._spans.append(backward)
            return o
        return run

    def __enter__(self) -> AttendTimer:
        for module in self.modules:
            module.attend = self._timed(module.attend)   # an instance attribute over the class's method
        return self

    def __exit__(self, *exc) -> None:
        for module in self.modules:
            del module.attend

    def seconds(self) -> float:
        total = sum(elapsed(a, b) for a, b in self._spans if a is not None and b is not None)
        self._spans = []
        return total


def _timed_attend(module, q, k, v, x, grid, chunk_tokens: int, grad, device: torch.device,
                  dtype: torch.dtype) -> tuple[float, float]:
    """Seconds of one forward (with grad; the input read over frame runs of `chunk_tokens`, as the chunk runner
    reads it) and of its backward of `module.attend`, each between device syncs."""
    for t in (q, k, v, x, *module.parameters()):
        if t is not None:
            t.grad = None
    sync(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=dtype, enabled=dtype == torch.bfloat16):
        read = {"read": read_over_frame_runs(module, x, grid, chunk_tokens)} if module.reads_input else {}
        o = module.attend(q, k, v, x, grid, **read)               # (1, N, h, d)
    sync(device)
    middle = time.perf_counter()
    o.backward(grad)
    sync(device)
    return middle - start, time.perf_counter() - middle


def attend_rate(cfg: DiTConfig, grid: tuple[int, int, int], device: torch.device, dtype: torch.dtype,
                repeats: int = MIN_REPEATS, chunk_tokens: int = 0) -> dict:
    """One `attend` of `cfg`'s attention (width, heads, options; its input read over frame runs of about
    `chunk_tokens` tokens, execution.chunk_tokens, as the chunk runner does) on one clip of token grid
    `grid`, in `dtype` (bf16: under autocast, as the engines run it), with its weights as the model
    initialises them: its forward (with grad, as in a recompute) and its backward, each timed between
    device syncs, medians of `repeats` after one untimed call, averaged over an unshifted and a shifted
    layer (Swin shifts odd ones). Returns the times and the rate in counted TFLOP/s
    (planner.AttentionRate's fields)."""
    a, D, heads = cfg.attention, cfg.dim, cfg.num_heads
    tokens = math.prod(grid)
    counted = 4.0 * tokens * keys_per_query(a, grid) * D    # QK^T and PV, as megaslide/perf/flops.py counts them
    forward_s = backward_s = 0.0
    for layer in (0, 1):
        module = build_attention(a.name, D, heads, qk_norm=cfg.qk_norm, layer_idx=layer,
                                 **dataclasses.asdict(a.options))
        if hasattr(module, "initialize_weights"):
            module.initialize_weights()
        module = module.to(device=device, dtype=dtype)
        q, k, v = (torch.randn(1, tokens, heads, D // heads, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        x = torch.randn(1, tokens, D, device=device, dtype=dtype, requires_grad=True) if module.reads_input else None
        args = (module, q, k, v, x, grid, chunk_tokens, torch.randn_like(q), device, dtype)
        _timed_attend(*args)
        runs = [_timed_attend(*args) for _ in range(repeats)]
        forward_s += statistics.median(f for f, _ in runs) / 2
        backward_s += statistics.median(b for _, b in runs) / 2
    rate = AttentionRate(counted / forward_s / 1e12, 2 * counted / backward_s / 1e12)
    return {"tokens": tokens, "grid": list(grid), "forward_ms": 1e3 * forward_s, "backward_ms": 1e3 * backward_s,
            **dataclasses.asdict(rate)}
