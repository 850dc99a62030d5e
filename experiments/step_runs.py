"""What the scripts that time training steps of a synthetic clip share (mfu_overlap.py,
oom_thresholds.py, scaling.py): the step's run (a RunConfig, made by experiments.hydra_config.compose_run
from the script's config and the train.py overrides it records) and its batch, the clip fields the results
pages read, the result of a cell whose loss
went non-finite, and running it in a fresh process under a time limit. Each of them records the loss
of every step it runs (warm-up and timed) in the cell's `losses`."""
from __future__ import annotations

import dataclasses
import multiprocessing
import time
from dataclasses import dataclass

import torch

from megaslide.config import DiTConfig, RunConfig, TrainConfig
from megaslide.diffusion.batches import Batch


@dataclass(frozen=True)
class Step:
    """A training step of `run`: its model, train.batch_size clips of data.frames x data.height x data.width
    (what synthetic_batch makes), train.precision, how its blocks run (execution) and offload; with the
    train.py overrides that make `run` (`python -m experiments.plan <run_overrides>` plans it)."""

    run: RunConfig
    run_overrides: tuple[str, ...]

    @property
    def cfg(self) -> DiTConfig:
        return self.run.model

    @property
    def batch(self) -> int:
        return self.run.train.batch_size

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.run.grid

    def train_config(self, device: torch.device) -> TrainConfig:
        """train, on the device the step runs on (train.device may say auto)."""
        return dataclasses.replace(self.run.train, device=device.type)


def clip_fields(run: RunConfig) -> dict:
    """The run's clip, batch and precision under the flat names that results written before the run groups
    hold and the results pages read (experiments/claims)."""
    return {"frames": run.data.frames, "height": run.data.height, "width": run.data.width,
            "batch": run.train.batch_size, "precision": run.train.precision}


def synthetic_batch(run: RunConfig, device: torch.device, tokenizer) -> Batch:
    """A fixed batch of train.batch_size random clips (data.frames x data.height x data.width latents of
    model.in_channels) and one caption, seed 0: the same data in every run, so runs differ only in what they
    measure."""
    g = torch.Generator().manual_seed(0)
    batch = run.train.batch_size
    shape = (batch, run.model.in_channels, run.data.frames, run.data.height, run.data.width)
    captions = ["a red ball bouncing on a wooden floor"] * batch
    return Batch(torch.randn(shape, generator=g), tokenizer(captions), torch.rand(batch, generator=g),
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
