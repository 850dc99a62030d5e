"""The two optimizer paths of the offload engine for the block parameters.

`CpuUpdater`: the fused CPU AdamW on a worker thread over each block's flat host master and
moments, writing the bf16 weights into the pinned weight buffer. `GpuUpdater` (the
optimizer_device="gpu" ablation): master and moments stream to the device, AdamW runs there,
and they stream back. Both take `UpdateJob`s from `OffloadEngine` (megaslide/offload/engine.py)
and gate each block's next H2D with `before_load`.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from megaslide.offload.cpu_adam import adamw_step_torch_
from megaslide.offload.host_state import HostState
from megaslide.offload.streamer import Lanes, elapsed
from megaslide.train.engine import NonFiniteStep, check_finite


@dataclass(frozen=True)
class AdamHyper:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@dataclass
class ClipCoefficient:
    device: torch.Tensor   # () fp32 on the compute device
    host: torch.Tensor     # () fp32 on the CPU (pinned with CUDA), valid once `ready` completes
    ready: object          # event


@dataclass
class StepHealth:
    """A training step's loss and, once known, its global gradient norm, copied to the host: the
    updater refuses the step's block updates when either is not finite (`check`)."""

    step: int              # 1-based, as the metrics log numbers steps
    lr: float              # train.lr, named in the refusal
    host: torch.Tensor     # (1,) loss or (2,) loss and grad norm, fp32 on the CPU (pinned with CUDA)
    ready: object          # event: `host` holds the values

    def check(self) -> None:
        """Wait for the values (the updater's thread, or the device already done) and refuse a non-finite one."""
        self.ready.synchronize()
        check_finite(self.step, self.lr, **dict(zip(("loss", "grad_norm"), self.host.tolist())))


@dataclass
class UpdateJob:
    """One AdamW update of one block's flat host state."""

    block: int
    step: int                        # 1-based AdamW step
    lr: float
    spans: list[tuple[int, int]]     # element ranges of parameters that got gradients
    tag: int                         # training step index, for the time breakdown
    landed: object = None            # event: the gradient is in host staging (None: it stays on the device)
    device_grads: torch.Tensor | None = None  # (numel,) gradient on the device (GpuUpdater without clipping)
    clip: ClipCoefficient | None = None
    health: StepHealth | None = None  # checked before the update; None: unchecked (engine's own test paths)
    rounding_key: int = 0            # the random bits of the stochastic roundings (compact.rounding_key)


class CpuUpdater:
    """Runs AdamW on the host, on one worker thread, each block as soon as its job may run.

    The worker waits for the gradient's D2H (and the clip coefficient), refuses the update when the
    step's loss or gradient norm (`job.health`) or, without clipping, the block's own gradient is not
    finite, scales the gradient, and runs `adam` over the block's flat buffers, writing bf16 weights
    straight into the pinned weight buffer. After a refusal it applies no update at all: the
    `NonFiniteStep` reaches the training thread at its next `before_load` or `flush`.
    `before_load(l)` blocks the caller until block l's update is done."""

    def __init__(self, host: HostState, hyper: AdamHyper, adam, serial: bool):
        self.host, self.hyper, self.adam, self.serial = host, hyper, adam, serial
        self._done = [threading.Event() for _ in range(host.depth)]
        for event in self._done:
            event.set()
        self._seconds: list[tuple[int, float]] = []
        self._error: BaseException | None = None
        self._refused = False          # a step was refused: no later update is applied
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="megaslide-cpu-adam", daemon=True)
        self._thread.start()

    def submit(self, job: UpdateJob) -> None:
        self._done[job.block].clear()
        if self.serial:
            self._run(job)
            self._raise()
        else:
            self._queue.put(job)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            self._run(job)

    def _run(self, job: UpdateJob) -> None:
        try:
            job.landed.synchronize()
            if job.clip is not None:
                job.clip.ready.synchronize()
            b, h = self.host.blocks[job.block], self.hyper
            if self._refused:
                return
            self._check(job, b.grads)
            start = time.perf_counter()
            if job.clip is not None:
                b.grads.mul_(job.clip.host)
            # the bf16 weights of an fp32 master come out of the same pass; a bf16 master's fp32 weights (the CPU
            # exact mode) are copied from it after
            fused_copy = b.weights is not b.master and b.master.dtype == torch.float32
            for lo, hi in job.spans:
                self.adam(b.master[lo:hi], b.grads[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi], step=job.step,
                          lr=job.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                          param_bf16=b.weights[lo:hi] if fused_copy else None, rounding_key=job.rounding_key,
                          first_index=self.host.shard.start + lo)   # the element's index in the whole block
                if b.weights is not b.master and not fused_copy:
                    b.weights[lo:hi].copy_(b.master[lo:hi])
            self._seconds.append((job.tag, time.perf_counter() - start))
        except BaseException as err:  # re-raised on the training thread
            self._error = err
        finally:
            self._done[job.block].set()

    def _check(self, job: UpdateJob, grads: torch.Tensor) -> None:
        """Refuse the job's step when its loss or gradient norm, or (unclipped: the norm is not known yet)
        its block's gradient, is not finite."""
        try:
            if job.health is not None:
                job.health.check()
                if job.clip is None and not all(bool(torch.isfinite(grads[lo:hi]).all()) for lo, hi in job.spans):
                    raise NonFiniteStep(job.health.step, f"block {job.block}'s gradient", "not finite", job.health.lr)
        except NonFiniteStep:
            self._refused = True
            raise

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, NonFiniteStep):
                raise err
            raise RuntimeError("the CPU AdamW worker failed") from err

    def before_load(self, index: int) -> None:
        self._done[index].wait()
        self._raise()

    def flush(self) -> None:
        for event in self._done:
            event.wait()
        self._raise()

    def take_seconds(self, steps: range) -> float:
        taken = sum(s for tag, s in self._seconds if tag in steps)
        self._seconds = [(tag, s) for tag, s in self._seconds if tag >= steps.stop]
        return taken

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()


class GpuUpdater:
    """The optimizer_device="gpu" ablation: per block, master and moments (and the gradient,
    when it was staged on the host) go H2D, `adamw_step_torch_` runs on the device, and
    master, moments and bf16 weights come back D2H: 14 B/param more each way than the CPU
    path (bf16). Two slots, so block l+1's state streams in while block l updates. All
    ordering is by events; no host waits. The state transfers share the H2D lane with the
    weights: with clipping, the next forward's first weight copy queues behind them."""

    def __init__(self, host: HostState, hyper: AdamHyper, lanes: Lanes, device: torch.device):
        self.host, self.hyper, self.lanes = host, hyper, lanes
        n, dtype = host.layout.numel, host.param_dtype
        self.slots = [{"master": torch.empty(n, device=device), "exp_avg": torch.empty(n, device=device),
                       "exp_avg_sq": torch.empty(n, device=device),
                       "grads": torch.empty(n, device=device, dtype=dtype),
                       "weights": torch.empty(n, device=device, dtype=dtype), "free": None} for _ in range(2)]
        self._next = 0
        self.updated: list = [None] * host.depth
        self._spans: list[tuple[int, object, object]] = []

    def submit(self, job: UpdateJob) -> None:
        h2d, compute, d2h = self.lanes.h2d, self.lanes.compute, self.lanes.d2h
        slot, b, h = self.slots[self._next], self.host.blocks[job.block], self.hyper
        self._next ^= 1
        aliased = b.weights is b.master
        state = ("master", "exp_avg", "exp_avg_sq")
        h2d.wait(slot["free"])
        h2d.wait(job.landed)
        grads_in = job.device_grads is None
        with h2d.timed(sum(getattr(b, k).nbytes for k in state) + (b.grads.nbytes if grads_in else 0)):
            for key in state:
                slot[key].copy_(getattr(b, key), non_blocking=True)
            if grads_in:
                slot["grads"].copy_(b.grads, non_blocking=True)
        compute.wait(h2d.record())
        grads = slot["grads"] if grads_in else job.device_grads
        with compute:
            start = compute.marker()
            if job.clip is not None:
                grads.mul_(job.clip.device)
            for lo, hi in job.spans:
                adamw_step_torch_(slot["master"][lo:hi], grads[lo:hi], slot["exp_avg"][lo:hi],
                                  slot["exp_avg_sq"][lo:hi], step=job.step, lr=job.lr, beta1=h.beta1,
                                  beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                                  param_bf16=None if aliased else slot["weights"][lo:hi])
            self._spans.append((job.tag, start, compute.marker()))
        if self.lanes.serial:
            compute.synchronize()
        d2h.wait(compute.record())
        with d2h.timed(sum(getattr(b, k).nbytes for k in state) + (0 if aliased else b.weights.nbytes)):
            for key in state:
                getattr(b, key).copy_(slot[key], non_blocking=True)
            if not aliased:
                b.weights.copy_(slot["weights"], non_blocking=True)
        slot["free"] = self.updated[job.block] = d2h.record()

    def before_load(self, index: int) -> None:
        self.lanes.h2d.wait(self.updated[index])

    def flush(self) -> None:
        self.lanes.synchronize()

    def take_seconds(self, steps: range) -> float:
        taken = sum(elapsed(a, b) for tag, a, b in self._spans if tag in steps)
        self._spans = [s for s in self._spans if s[0] >= steps.stop]
        return taken

    def close(self) -> None:
        self.flush()
