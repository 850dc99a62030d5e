"""What the scripts that time training steps of a synthetic clip share (mfu_overlap.py,
oom_thresholds.py, scaling.py): the step's model and clip, its batch, the result of a cell whose loss
went non-finite, and running it in a fresh process under a time limit. Each of them records the loss
of every step it runs (warm-up and timed) in the cell's `losses`."""
from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass

import torch

from megaslide.config import DiTConfig, ExecutionConfig
from megaslide.diffusion.batches import Batch


@dataclass(frozen=True)
class Step:
    """A training step's model, clip (batch x frames x height x width latents: what
    synthetic_batch reads), precision and how its blocks run."""

    cfg: DiTConfig
    frames: int
    height: int
    width: int
    batch: int
    precision: str
    execution: ExecutionConfig

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.cfg.token_grid(self.frames, self.height, self.width)


def synthetic_batch(cfg: DiTConfig, bench, device: torch.device, tokenizer) -> Batch:
    """A fixed batch of `bench.batch` random clips (frames x height x width latents) and one caption, seed 0:
    the same data in every run, so runs differ only in what they measure."""
    g = torch.Generator().manual_seed(0)
    shape = (bench.batch, cfg.in_channels, bench.frames, bench.height, bench.width)
    captions = ["a red ball bouncing on a wooden floor"] * bench.batch
    return Batch(torch.randn(shape, generator=g), tokenizer(captions), torch.rand(bench.batch, generator=g),
                 torch.randn(shape, generator=g), captions).to(device)


NON_FINITE = "non-finite loss"   # a cell's status when a step's loss or gradient norm was not finite


def non_finite(err: FloatingPointError, losses: list[float]) -> dict:
    """The result fields of a cell whose engine refused a step (megaslide.train.engine.NonFiniteStep):
    a failure, never "fits", with the losses of the steps before it."""
    return {"status": NON_FINITE, "phase": f"step {getattr(err, 'step', '?')}", "error": str(err)[:300],
            "losses": losses}


def run_isolated(target, args: tuple, time_limit_s: float) -> dict:
    """target(*args, queue) in a fresh process forked from a torch-preloaded server; its result, or
    {"status": "time limit"} past `time_limit_s` (the process is killed), or {"status": "crashed"}."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "megaslide.offload.engine", "experiments.step_runs"])
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    deadline = time.monotonic() + time_limit_s
    while proc.is_alive() and queue.empty() and time.monotonic() < deadline:
        proc.join(timeout=0.2)
    if not queue.empty():
        result = queue.get()
        proc.join()
        return result
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"status": "time limit", "phase": f"over {time_limit_s:.0f} s"}
    return {"status": "crashed", "phase": f"exit code {proc.exitcode}"}
