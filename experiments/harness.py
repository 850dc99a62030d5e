"""The plumbing every experiment script shares; the timing itself is megaslide/perf/timing.py.

- `progress(message)`: a time-stamped line from rank 0.
- `kernel_check_device(smoke, script)`: the device of a Triton kernel check (CUDA, or the CPU interpreter).
- `pcie_ceiling(device, nbytes)`: `megaslide.perf.timing.pcie_gbps` on a host buffer page-locked the way
  the offload engine pins its arena.
- `ExperimentRun`: a table script's W&B run (config, result tables, headline scalars, plots)
  beside its result JSON, which records where the W&B run lies.

The accuracy rule of kernel checks and the multi-process launcher (`spawn`) live in `megaslide.testing`,
which the tests share.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.report import find_tables
from experiments.results_io import (check_result_name, check_writable_folder, result_path, results_root,
                                   write_result)
from megaslide.offload.host_state import HostArena
from megaslide.perf.timing import pcie_gbps
from megaslide.train.logger import RunLogger

_START = time.perf_counter()


# ----------------------------------------------------------------------------- plumbing
def progress(message: str) -> None:
    """Print `message` stamped with the seconds since the script started, flushed at once (so a
    hung stage is named in the log), from rank 0 only when torch.distributed is initialised."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", flush=True)


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


def pcie_ceiling(device: torch.device | str, nbytes: int) -> dict:
    """`pcie_gbps` (H2D, D2H, both at once) on an `nbytes` host buffer page-locked the way the offload engine
    pins its arena (`HostArena`, not the caching host allocator). CUDA only."""
    arena = HostArena([nbytes], pin=True)
    try:
        return pcie_gbps(device, arena.buffer)
    finally:
        arena.close()


# ----------------------------------------------------------------------------- W&B + result JSON
class ExperimentRun:
    """One run of a table script: its W&B run and its result file `<results>/<experiment>/<name>.json`.

    The W&B run (offline unless WANDB_MODE says otherwise, nothing at all when it is `disabled`)
    lies in `<out_dir>/<experiment>/<name>/wandb` and holds the config; `finish` adds every
    table of the result (as report.py finds them), the headline scalars and the plots. Every
    saved result records the run's folder as `wandb_dir` (None when W&B is disabled).
    `<results>` is `results_root`: the repo's results/, or for a `trial` run (smoke, tiny, plan_only)
    `<out_dir>/<experiment>/<name>/results`; `MEGASLIDE_RESULTS_DIR` overrides both."""

    def __init__(self, experiment: str, name: str, config: dict, out_dir: str | Path = "runs",
                 project: str = "megaslide", rank: int = 0, trial: bool = False):
        self.experiment, self.name = experiment, check_result_name(name)   # before the run folder exists
        run_dir = Path(out_dir) / experiment / name
        self.results_dir = results_root(run_dir / "results" if trial else None)
        if os.environ.get("MEGASLIDE_RESULTS_DIR"):
            check_writable_folder(self.results_dir, "MEGASLIDE_RESULTS_DIR")
        self.logger = RunLogger(run_dir, project=project, name=f"{experiment}-{name}", config=config, rank=rank)

    @property
    def result_path(self) -> Path:
        return result_path(self.experiment, self.name, self.results_dir)

    def save(self, payload: dict) -> Path:
        """Write the result file now (scripts call this after each row, so a crash keeps the rows)."""
        return write_result(self.experiment, self.name, {**payload, "wandb_dir": self.logger.wandb_dir},
                            self.results_dir)

    def timed_cells(self, payload: dict, passed: bool, keys, cells_of) -> list[dict]:
        """A kernel benchmark's timed rows: `cells_of(*key)` for each key in order, only once its check `passed`;
        the result is saved as partial before and after each key, so a run cut short keeps what it measured.
        Sets payload["tables"]["cells"] and returns the rows."""
        self.save({**payload, "partial": True})
        rows = []
        for key in keys if passed else ():
            rows += cells_of(*key)
            self.save({**payload, "partial": True, "tables": {**payload["tables"], "cells": rows}})
        payload["tables"]["cells"] = rows
        return rows

    def finish(self, payload: dict, scalars: dict, images: dict[str, Path] | None = None) -> Path:
        """Write the result, then log its tables, `scalars` and `images` (key -> png) to W&B and close: the
        result is on disk before W&B sees it, so a W&B failure cannot lose a finished measurement."""
        path = self.save(payload)
        for key, rows in find_tables(payload).items():
            self.logger.log_table(key, rows)
        self.logger.summary(scalars)
        for key, image in (images or {}).items():
            self.logger.log_image(key, image)
        self.logger.finish()
        return path


def check_line(check: dict, where: str) -> str:
    """One kernel check of a benchmark's check table as a line: dtype, `where` (its shape and case), verdict, and
    each output's error beside the reference's (`errors`: name -> {err, ref_err})."""
    errors = " ".join(f"{k} {e['err']:.2e}/{e['ref_err']:.2e}" for k, e in check["errors"].items())
    return f"check {check['dtype']:8s} {where}: {'ok' if check['passed'] else 'FAIL'} {errors}"

