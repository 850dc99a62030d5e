"""Device timing: medians with their spread, and the ceilings a step is measured against.

- `sync(device)`: wait for the device's queued work (a no-op on CPU).
- `timed(fn, device)`: warm-up calls, then at least `MIN_REPEATS` timed calls, the device synchronised
  around each; a `Timing` with the median and the spread (min, max, std). Across ranks it reports the
  slowest rank. `measure(setup, repeats, device)`: a table row of it in ms, with the peak memory above
  the start (CUDA), an out-of-memory as a status. `kernel_ms(fn, device)`: one call's device time per kernel
  name (torch.profiler; CUDA), to say which kernel a difference between two timings comes from.
- ceilings, measured on the machine at hand: `matmul_tflops` (n^3 matmul), `copy_gbps` (HBM or DRAM
  copy), `pcie_gbps` (copies to and from a page-locked host buffer: H2D, D2H and both at once).

Wall-clock time is read with `time.perf_counter` after a device sync, so a figure covers the queued
work as well as the Python around it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

MIN_REPEATS = 5   # fewer timed calls give no usable spread
GB = 1e9


def sync(device: torch.device | str) -> None:
    """Block until the work queued on `device` has run (CUDA); CPU work is already done."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed call, with the summary statistics tables report."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def std(self) -> float:
        return statistics.pstdev(self.times)

    def ms(self, prefix: str = "ms") -> dict:
        """Median and spread in milliseconds, as result-row fields: `ms`, `ms_min`, `ms_max`, `ms_std`."""
        return {prefix: 1e3 * self.median, f"{prefix}_min": 1e3 * self.min, f"{prefix}_max": 1e3 * self.max,
                f"{prefix}_std": 1e3 * self.std}


def timed(fn, device: torch.device | str, repeats: int = MIN_REPEATS, warmup: int = 1,
          group: dist.ProcessGroup | None = None, across_ranks: bool = False) -> Timing:
    """Time `repeats` calls of fn() after `warmup` untimed ones, synchronising the device around each.

    With `across_ranks` (torch.distributed initialised) every rank enters each call together
    (a barrier on `group`) and each statistic is the slowest rank's, so one straggler is seen."""
    if repeats < MIN_REPEATS:
        raise ValueError(f"repeats={repeats}: time at least {MIN_REPEATS} calls for a median and a spread")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if across_ranks:
            dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    if across_ranks:
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # per call, the slowest rank
        times = t.tolist()
    return Timing(tuple(times))


def measure(setup, repeats: int, device) -> dict:
    """Median and spread (ms) of `repeats` calls of setup()'s step after a warm-up, and the peak memory
    above what was allocated before setup (CUDA)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        timing = timed(setup(), device, repeats)
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    out = {"status": "ok", **timing.ms()}
    if device.type == "cuda":
        out["peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
    return out


def kernel_ms(fn, device: torch.device) -> dict[str, float]:
    """Device time of one fn() call per kernel (or op) name, in ms, from torch.profiler; {} on CPU."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def matmul_tflops(device: torch.device | str, n: int = 8192, dtype: torch.dtype = torch.bfloat16,
                  repeats: int = MIN_REPEATS, calls: int = 10) -> float:
    """Achieved TFLOP/s of an n x n x n matmul (2 n^3 FLOPs): the compute ceiling. Each timed
    repeat runs `calls` matmuls back to back, so launch and sync overheads are amortised."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def matmuls():
        for _ in range(calls):
            a @ b
    return 2 * n ** 3 * calls / timed(matmuls, device, repeats).median / 1e12


def copy_gbps(device: torch.device | str, nbytes: int = 2 ** 30, repeats: int = 10) -> float:
    """A copy within `device`'s memory, read + write bytes per second in GB/s: the memory-bandwidth
    ceiling (HBM on a GPU, DRAM on the CPU with the current torch threads)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, repeats).median / GB


def pcie_gbps(device: torch.device | str, host: torch.Tensor, repeats: int = MIN_REPEATS) -> dict:
    """GB/s of copies between `device` and `host`, a page-locked (nbytes,) uint8 buffer: H2D alone,
    D2H alone, and both at once on two streams. CUDA only. How the buffer is pinned matters: pin it
    the way the offload engine pins its arena to measure the engine's ceiling."""
    device, nbytes = torch.device(device), host.numel()
    if host.dtype != torch.uint8 or host.dim() != 1 or not host.is_pinned():
        raise ValueError(f"host: a page-locked 1-D uint8 buffer is needed, got {host.dtype} {tuple(host.shape)} "
                         f"(pinned: {host.is_pinned()}); e.g. megaslide.offload.host_state.HostArena([nbytes], "
                         f"pin=True).buffer")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty_like(dev)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def copies(pairs):
        def run():
            for stream, dst, src in pairs:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
        return run

    h2d = timed(copies([(up, dev, host)]), device, repeats).median
    d2h = timed(copies([(down, host, dev)]), device, repeats).median
    both = timed(copies([(up, dev, host), (down, host, dev2)]), device, repeats).median
    return {"bytes": nbytes, "h2d_GBps": nbytes / h2d / GB, "d2h_GBps": nbytes / d2h / GB,
            "both_total_GBps": 2 * nbytes / both / GB}
