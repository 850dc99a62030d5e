"""Where a piece of work spends its time, from torch.profiler: the operators with the most self time and
how busy the device was.

On CUDA an operator's time is its kernels' device time; copies between host and device (Memcpy, Memset)
run on their own streams beside the compute, so they are counted apart (`copy_ms_per_call`) and the
compute kernels' sum (`kernel_ms_per_call`) is what to hold against the wall time of a call: where the
kernels add up to far less, the device waited on the host. On CPU the times are the operators' self CPU
time. Shared by profile_step.py (the reference Trainer) and oom_thresholds.py (`profile_steps`)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from megaslide.perf.timing import sync

COPY_MARKERS = ("Memcpy", "Memset")


def profile_calls(fn: Callable[[], object], calls: int, device: torch.device) -> profile:
    """`fn` run `calls` times under torch.profiler (CUDA kernels too on a CUDA device), synchronised."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    return prof


def top_operators(prof: profile, calls: int, top: int, device: torch.device) -> dict:
    """The `top` operators by self time per call (name cut to 80 characters, ms, share of the profiled total,
    calls per call), the profiled total per call and, on CUDA, the compute kernels' and the copies' sums."""
    on_gpu = device.type == "cuda"   # there: the kernels alone (a CPU operator's device time repeats its kernels')
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if not on_gpu or e.device_type == DeviceType.CUDA]
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events)
    per_call_ms = 1e3 * calls          # profiler times are in microseconds
    ops = [{"op": e.key[:80], "ms_per_call": getattr(e, key) / per_call_ms, "share": getattr(e, key) / total,
            "calls_per_call": e.count / calls} for e in events[:top] if getattr(e, key) > 0]
    out = {"profiled_ms_per_call": total / per_call_ms, "top": ops}
    if on_gpu:
        copies = sum(getattr(e, key) for e in events if e.key.startswith(COPY_MARKERS))
        out.update(kernel_ms_per_call=(total - copies) / per_call_ms, copy_ms_per_call=copies / per_call_ms)
    return out
