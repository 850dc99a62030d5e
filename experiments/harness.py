"""The benchmarking harness every experiment script shares.

- `sync(device)`: wait for the device's queued work (a no-op on CPU); `progress(message)`: a
  time-stamped line from rank 0.
- `timed(fn, device)`: warm-up calls, then at least `MIN_REPEATS` timed calls; a `Timing` with the
  median and the spread (min, max, std). Across ranks it reports the slowest rank. `measure(setup,
  repeats, device)`: a table row of it in ms, with the peak memory above the start (CUDA), OOM as a status.
- ceilings measured in the run itself: `matmul_tflops` (n^3 matmul), `copy_gbps` (HBM or DRAM copy),
  `pcie_gbps` (pinned H2D, D2H and both at once).
- `ExperimentRun`: a table script's W&B run (config, result tables, headline scalars, plots)
  beside its result JSON, which records where the W&B run lies.

The accuracy rule of kernel checks and the multi-process launcher (`spawn`) live in `megaslide.testing`,
which the tests share.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.report import find_tables
from experiments.results_io import check_result_name, result_path, write_result
from megaslide.train.logger import RunLogger

MIN_REPEATS = 5   # fewer timed calls give no usable spread
GB = 1e9
_START = time.perf_counter()


# ----------------------------------------------------------------------------- timing
def sync(device: torch.device | str) -> None:
    """Block until the work queued on `device` has run (CUDA); CPU work is already done."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(message: str) -> None:
    """Print `message` stamped with the seconds since the script started, flushed at once (so a
    hung stage is named in the log), from rank 0 only when torch.distributed is initialised."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", flush=True)


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


def kernel_check_device(smoke: bool, script: str) -> torch.device | None:
    """The device of a Triton kernel check: CUDA where there is a GPU (with TF32 off, so that fp32
    references are true fp32); with `smoke` and no GPU, the CPU through the Triton interpreter
    (TRITON_INTERPRET=1, set before any kernels module is first imported); else None, said on stderr."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda")
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        return torch.device("cpu")
    print(f"{script} needs a CUDA GPU (use smoke=true for the CPU interpreter run)", file=sys.stderr)
    return None


# ----------------------------------------------------------------------------- ceilings
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


def pcie_gbps(device: torch.device | str, nbytes: int, repeats: int = MIN_REPEATS) -> dict:
    """GB/s of pinned copies (page-locked the way the offload engine pins its arena): H2D alone,
    D2H alone, and both at once on two streams. CUDA only."""
    from megaslide.offload.host_state import HostArena

    device = torch.device(device)
    arena = HostArena([nbytes], pin=True)
    host, dev = arena.buffer, torch.empty(nbytes, dtype=torch.uint8, device=device)
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
    arena.close()
    return {"bytes": nbytes, "h2d_GBps": nbytes / h2d / GB, "d2h_GBps": nbytes / d2h / GB,
            "both_total_GBps": 2 * nbytes / both / GB}


# ----------------------------------------------------------------------------- W&B + result JSON
class ExperimentRun:
    """One run of a table script: its W&B run and its result file `results/<experiment>/<name>.json`.

    The W&B run (offline unless WANDB_MODE says otherwise, nothing at all when it is `disabled`)
    lies in `<out_dir>/<experiment>/<name>/wandb` and holds the config; `finish` adds every
    table of the result (as report.py finds them), the headline scalars and the plots. Every
    saved result records the run's folder as `wandb_dir` (None when W&B is disabled)."""

    def __init__(self, experiment: str, name: str, config: dict, out_dir: str | Path = "runs",
                 project: str = "megaslide", rank: int = 0):
        self.experiment, self.name = experiment, check_result_name(name)   # before the run folder exists
        self.logger = RunLogger(Path(out_dir) / experiment / name, project=project, name=f"{experiment}-{name}",
                                config=config, rank=rank)

    @property
    def result_path(self) -> Path:
        return result_path(self.experiment, self.name)

    def save(self, payload: dict) -> Path:
        """Write the result file now (scripts call this after each row, so a crash keeps the rows)."""
        return write_result(self.experiment, self.name, {**payload, "wandb_dir": self.logger.wandb_dir})

    def finish(self, payload: dict, scalars: dict, images: dict[str, Path] | None = None) -> Path:
        """Log the result's tables, `scalars` and `images` (key -> png) to W&B, write the result, close."""
        for key, rows in find_tables(payload).items():
            self.logger.log_table(key, rows)
        self.logger.summary(scalars)
        for key, path in (images or {}).items():
            self.logger.log_image(key, path)
        path = self.save(payload)
        self.logger.finish()
        return path
