"""MegaSlide-DiT offload engine: the GPU as a stateless worker, every block's state in host RAM.

One training step (`OffloadEngine.train_step`):
1. the resident stem (patch embed, timestep MLPs, text encoder, caption projection) runs
   on the device with autograd; its outputs t_mod, ctx, t_emb enter the rest as leaves;
2. streamed forward (no grad) over the blocks, keeping each block's input;
3. unembed + loss with autograd: gradients of the last hidden state and of t_emb, and the
   final layer's parameter gradients;
4. streamed backward: block l is recomputed from its input and backpropagated; its flat
   gradient goes D2H and to the optimizer (below);
5. one backward through the stem graph with the accumulated gradients of x, t_mod, ctx,
   t_emb: each stem tensor gets exactly the gradient it gets in a resident backward;
6. global-norm clipping and the updates.

Non-block parameters stay resident on the device in fp32 with torch.optim.AdamW (0.25 B of
the 7B preset's 6.96 B parameters). Block parameters: bf16 weights on the device (fp32 in the exact mode),
fp32 master and moments on the host, updated by the fused CPU AdamW on a worker thread
(`CpuUpdater`), or, in the optimizer_device="gpu" ablation, on the device after streaming
master and moments there and back (`GpuUpdater`).

Clipping scheme (global norm, exact): per-parameter gradient norms are computed on the
device as each block's gradient is produced (no sync) and combined once, after the
backward, in the model's parameter order, exactly as `clip_grad_norm_` combines them. The
coefficient min(1, max_norm / (norm + 1e-6)) is copied to the host; then the updates of
blocks 0..L-1 are queued in forward order and overlap the NEXT step's forward: block l's
H2D waits only for block l's update. The gradient is scaled in its staging buffer before
the AdamW pass (in bf16 mode that rounds the scaled gradient to bf16 once). Without
clipping (grad_clip=0) each block's update is queued as soon as its gradient has landed,
and overlaps the rest of the backward.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megaslide.config import DataConfig, DiTConfig, OffloadConfig, TrainConfig
from megaslide.data.build import build_dataset
from megaslide.diffusion.flow import TIME_SCALE, interpolate
from megaslide.diffusion.samplers import euler_sample
from megaslide.metrics.flops import StepBreakdown
from megaslide.metrics.memory import host_available_bytes
from megaslide.models.dit import VideoDiT
from megaslide.offload import planner
from megaslide.offload.cpu_adam import adamw_step_, adamw_step_torch_
from megaslide.offload.host_state import BlockLayout, HostState
from megaslide.offload.streamer import BlockInputs, BlockStreamer, Lanes, elapsed
from megaslide.train.batches import Batch, make_batch
from megaslide.train.checkpoint import load_checkpoint, save_checkpoint
from megaslide.train.logger import RunLogger
from megaslide.train.trainer import lr_at, resolve_device

ADAM_BACKENDS = ("fused", "torch")  # cpu_adam.adamw_step_ (C++ SIMD) | cpu_adam.adamw_step_torch_ (torch ops)


def param_dtype_for(precision: str, device: torch.device) -> torch.dtype:
    """bf16 block weights where the reference trainer would autocast to bf16, else fp32."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.bfloat16 if bf16 else torch.float32


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


class CpuUpdater:
    """Runs AdamW on the host, on one worker thread, each block as soon as its job may run.

    The worker waits for the gradient's D2H (and the clip coefficient), scales the gradient,
    and runs `adam` over the block's flat buffers, writing bf16 weights straight into the
    pinned weight buffer. `before_load(l)` blocks the caller until block l's update is done."""

    def __init__(self, host: HostState, hyper: AdamHyper, adam, serial: bool):
        self.host, self.hyper, self.adam, self.serial = host, hyper, adam, serial
        self._done = [threading.Event() for _ in range(host.depth)]
        for event in self._done:
            event.set()
        self._seconds: list[tuple[int, float]] = []
        self._error: BaseException | None = None
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
            start = time.perf_counter()
            b, h = self.host.blocks[job.block], self.hyper
            if job.clip is not None:
                b.grads.mul_(job.clip.host)
            for lo, hi in job.spans:
                self.adam(b.master[lo:hi], b.grads[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi], step=job.step,
                          lr=job.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                          param_bf16=None if b.weights is b.master else b.weights[lo:hi])
            self._seconds.append((job.tag, time.perf_counter() - start))
        except BaseException as err:  # re-raised on the training thread
            self._error = err
        finally:
            self._done[job.block].set()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
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


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


class OffloadEngine:
    """Trains a `VideoDiT` whose blocks live in host RAM (see the module docstring).

    `model`'s blocks may hold real weights (copied into the host state here) or be on the
    meta device; then fill `engine.host` with `load_block_` before training. The stem and
    final layer must hold real weights; they move to `device`."""

    def __init__(self, model: VideoDiT, *, device: torch.device, train_cfg: TrainConfig,
                 offload_cfg: OffloadConfig, adam_backend: str = "fused", pin_optimizer_state: bool | None = None):
        offload_cfg.validate()
        if adam_backend not in ADAM_BACKENDS:
            raise ValueError(f"adam_backend={adam_backend!r}: choose one of {ADAM_BACKENDS}")
        self.device, self.train_cfg, self.offload_cfg = device, train_cfg, offload_cfg
        self.param_dtype = param_dtype_for(train_cfg.precision, device)
        cuda = device.type == "cuda"
        if cuda and offload_cfg.gpu_memory_fraction > 0:
            torch.cuda.set_per_process_memory_fraction(offload_cfg.gpu_memory_fraction, torch.cuda.current_device())
        self.layout = BlockLayout.from_module(model.blocks[0])
        depth = len(model.blocks)
        pin_state = offload_cfg.optimizer_device == "gpu" if pin_optimizer_state is None else pin_optimizer_state
        planner.require_host_fit(planner.host_bytes(self.layout, depth, self.param_dtype, pin_state),
                                 host_available_bytes(), what=f"the host state of {depth} blocks")
        self.host = HostState(self.layout, depth, self.param_dtype, pin=cuda, pin_optimizer_state=pin_state)
        for index, block in enumerate(model.blocks):
            if not any(p.is_meta for p in block.parameters()):
                self.host.load_block_(index, self.layout.flatten(block))

        named = list(model.named_parameters())
        self.resident_names = [n for n, _ in named if not n.startswith("blocks.")]
        self.resident_params = [p for n, p in named if not n.startswith("blocks.")]
        slot_of = {s.name: i for i, s in enumerate(self.layout.slots)}
        self._norm_order = [("block", int(n.split(".")[1]), slot_of[n.split(".", 2)[2]])
                            if n.startswith("blocks.") else ("resident", self.resident_names.index(n))
                            for n, _ in named]
        for name, child in model.named_children():
            if name != "blocks":
                child.to(device)
        self.model = model

        self.autocast_dtype = torch.bfloat16 if self.param_dtype == torch.bfloat16 else None
        self.lanes = Lanes(device, serial=not offload_cfg.overlap)
        self.versions = [0] * depth
        self.streamer = BlockStreamer(model.blocks, self.host, self.lanes, device, self.compute_ctx,
                                      before_load=lambda i: self.updater.before_load(i),
                                      version=lambda i: self.versions[i])
        self.optimizer = torch.optim.AdamW(self.resident_params, lr=train_cfg.lr, betas=train_cfg.betas,
                                           weight_decay=train_cfg.weight_decay)
        self.hyper = AdamHyper(train_cfg.betas[0], train_cfg.betas[1], 1e-8, train_cfg.weight_decay)
        threads = offload_cfg.cpu_threads or None
        self._cpu_adam = (functools.partial(adamw_step_, num_threads=threads) if adam_backend == "fused"
                          else adamw_step_torch_)
        self.updater = self._make_updater(offload_cfg.optimizer_device)
        self._coef_host = torch.zeros((), pin_memory=cuda)
        self._landed: list = [None] * depth                       # per block: event of its gradient's D2H
        self._spans = [[(0, self.layout.numel)] for _ in range(depth)]  # per block: ranges AdamW updates
        self._marks: dict[int, object] = {}
        self.step = 0

    # ---- configuration -----------------------------------------------------------------------
    @property
    def clip(self) -> float:
        return self.train_cfg.grad_clip

    def compute_ctx(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _make_updater(self, optimizer_device: str):
        if optimizer_device == "gpu":
            return GpuUpdater(self.host, self.hyper, self.lanes, self.device)
        return CpuUpdater(self.host, self.hyper, self._cpu_adam, self.lanes.serial)

    def set_mode(self, *, overlap: bool, optimizer_device: str, grad_clip: float | None = None) -> None:
        """Switch the ablations (and optionally the clip norm, 0 = off) between steps, on the
        same host state and weights."""
        dataclasses.replace(self.offload_cfg, optimizer_device=optimizer_device).validate()
        self.updater.close()
        self.lanes.synchronize()
        self.lanes.serial = not overlap
        self.offload_cfg = dataclasses.replace(self.offload_cfg, overlap=overlap, optimizer_device=optimizer_device)
        if grad_clip is not None:
            self.train_cfg = dataclasses.replace(self.train_cfg, grad_clip=grad_clip)
        self.updater = self._make_updater(optimizer_device)

    # ---- one step ------------------------------------------------------------------------------
    def train_step(self, batch: Batch, lr: float) -> dict:
        """One optimizer step on `batch` (tensors on the device) at learning rate `lr`.
        Returns device tensors (loss, grad_norm) and lr; nothing here waits for the GPU."""
        if not all(self.host.loaded):
            missing = [i for i, ok in enumerate(self.host.loaded) if not ok]
            raise ValueError(f"blocks {missing} have no weights yet; fill them with engine.host.load_block_")
        compute, tag = self.lanes.compute, self.step
        self._marks[tag] = compute.marker()
        self.lanes.tag = tag
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        with compute.timed(), self.compute_ctx():
            xt = interpolate(batch.x0, batch.noise, batch.t)                  # (B, C, T, H, W)
            e = self.model.embed(xt, batch.t * TIME_SCALE, batch.ids)
        inp = BlockInputs(_leaf(e.t_mod), _leaf(e.ctx), e.ctx_mask, e.rope, e.grid)
        h, saved = self.streamer.forward(e.x.detach(), inp, keep_inputs=True)  # (B, N, D)
        h, t_emb = h.requires_grad_(), _leaf(e.t_emb)
        with compute.timed():
            with self.compute_ctx():
                v = self.model.unembed(h, dataclasses.replace(e, t_emb=t_emb))  # (B, C, T, H, W)
                loss = F.mse_loss(v.float(), (batch.noise - batch.x0).float())
            # autograd.grad, not .backward: a leaf's .grad is copied into the leaf's layout, and the
            # blocks' reductions must see the gradient exactly as a resident backward passes it on
            grad_h, grad_t_emb, *grads = torch.autograd.grad(loss, [h, t_emb, *self.resident_params],
                                                             allow_unused=True)
            for p, g in zip(self.resident_params, grads):
                p.grad = g
        on_grads = functools.partial(self._on_block_grads, step=self.step + 1, lr=lr)
        grads_to_host = self.clip > 0 or self.offload_cfg.optimizer_device == "cpu"
        bw = self.streamer.backward(grad_h, saved, inp, grads_to_host=grads_to_host, on_block_grads=on_grads)
        with compute.timed():
            torch.autograd.backward([e.x, e.t_mod, e.ctx, e.t_emb], [bw.grad_x, bw.grad_t_mod, bw.grad_ctx, grad_t_emb])
            grad_norm = self._global_norm(bw.norms)
            clip = self._clip_resident_and_share(grad_norm) if self.clip > 0 else None
            self.optimizer.step()
        if clip is not None:
            for index in range(self.host.depth):
                self._submit(UpdateJob(index, self.step + 1, lr, self._spans[index], tag, self._landed[index],
                                       None, clip))
        self.step += 1
        return {"loss": loss.detach(), "grad_norm": grad_norm.detach(), "lr": lr}

    def _on_block_grads(self, index: int, shell, landed, used: list[bool], *, step: int, lr: float) -> None:
        self._landed[index] = landed
        self._spans[index] = self.layout.spans(used)
        if self.clip <= 0:
            device_grads = None if landed is not None else shell.grads
            self._submit(UpdateJob(index, step, lr, self._spans[index], self.step, landed, device_grads))

    def _submit(self, job: UpdateJob) -> None:
        self.versions[job.block] += 1
        self.updater.submit(job)

    def _global_norm(self, block_norms: list[dict[int, torch.Tensor]]) -> torch.Tensor:
        """L2 norm of all gradients: per-parameter norms stacked in the model's parameter
        order, then their norm (what clip_grad_norm_ computes)."""
        present = [(i, p.grad) for i, p in enumerate(self.resident_params) if p.grad is not None]
        resident = dict(zip((i for i, _ in present), torch._foreach_norm([g for _, g in present], 2)))
        norms = []
        for entry in self._norm_order:
            n = resident.get(entry[1]) if entry[0] == "resident" else block_norms[entry[1]].get(entry[2])
            if n is not None:
                norms.append(n)
        return torch.linalg.vector_norm(torch.stack(norms), 2)

    def _clip_resident_and_share(self, total_norm: torch.Tensor) -> ClipCoefficient:
        """clip_grad_norm_'s coefficient; scales the resident gradients and sends it to the host."""
        coef = torch.clamp(self.clip / (total_norm + 1e-6), max=1.0)  # ()
        grads = [p.grad for p in self.resident_params if p.grad is not None]
        torch._foreach_mul_(grads, coef)
        self._coef_host.copy_(coef, non_blocking=True)
        return ClipCoefficient(coef, self._coef_host, self.lanes.compute.record())

    # ---- inference -----------------------------------------------------------------------------
    @torch.no_grad()
    def velocity(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                 context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The model's forward with streamed blocks: x (B, C, T, H, W), t (B,) in [0, 1000]
        -> velocity (B, C, T, H, W). A drop-in `model` for the samplers."""
        self.lanes.tag = None
        with self.compute_ctx():
            e = self.model.embed(x, t, context, context_mask)
        h, _ = self.streamer.forward(e.x, BlockInputs(e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid), keep_inputs=False)
        with self.compute_ctx():
            return self.model.unembed(h, e)                                     # (B, C, T, H, W)

    # ---- accounting ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every pending update and transfer."""
        self.updater.flush()
        self.lanes.synchronize()

    def breakdown(self, steps: range) -> StepBreakdown:
        """Per-step averages over `steps` (synchronises). The step time is the period between
        the starts of step `steps.start` and `steps.stop`; if step `steps.stop` has not begun,
        the end is now, after all pending work (the last step then counts its tail)."""
        end_mark = self._marks.get(steps.stop)
        self.flush()
        if end_mark is None:
            end_mark = self.lanes.compute.marker()
            self.lanes.synchronize()
        n = len(steps)
        step_s = elapsed(self._marks[steps.start], end_mark) / n
        parts = {}
        for name in ("compute", "h2d", "d2h"):
            parts[name] = getattr(self.lanes, name).take_busy(steps)
        optimizer_s = self.updater.take_seconds(steps)
        self._marks = {k: v for k, v in self._marks.items() if k >= steps.stop}
        return StepBreakdown(step_s, parts["compute"][0] / n, parts["h2d"][0] / n, parts["d2h"][0] / n,
                             optimizer_s / n, parts["h2d"][1] / n, parts["d2h"][1] / n)

    # ---- state -----------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model by name, fp32 on the CPU (blocks from the host master)."""
        self.flush()
        out = {}
        for name, entry in zip(self._param_names(), self._norm_order):
            if entry[0] == "resident":
                out[name] = self.resident_params[entry[1]].detach().float().cpu().clone()
            else:
                slot = self.layout.slots[entry[2]]
                out[name] = self.host.blocks[entry[1]].master[slot.offset:slot.end].view(slot.shape).clone()
        return out

    def _param_names(self) -> list[str]:
        return [self.resident_names[e[1]] if e[0] == "resident" else f"blocks.{e[1]}.{self.layout.slots[e[2]].name}"
                for e in self._norm_order]

    def resident_state(self) -> dict:
        self.flush()
        return {"step": self.step, "versions": list(self.versions),
                "params": {n: p.detach().cpu().clone() for n, p in zip(self.resident_names, self.resident_params)},
                "optimizer": self.optimizer.state_dict()}

    def load_resident_state(self, state: dict) -> None:
        self.flush()
        with torch.no_grad():
            for name, p in zip(self.resident_names, self.resident_params):
                p.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.versions = list(state["versions"])
        self.streamer.invalidate()

    def close(self) -> None:
        self.updater.close()
        self.host.close()


class OffloadTrainer:
    """The `Trainer` API (fit, train_step, sample, save/load, step) on the offload engine.

    Same batches (`make_batch`), loss, warm-up and clipping as the resident reference, so the
    two agree step by step (exactly in fp32). EMA is not supported (it would add 4 B/param of
    host state); checkpoints are sharded: one file per block plus the resident state."""

    def __init__(self, model_cfg: DiTConfig, data_cfg: DataConfig, train_cfg: TrainConfig,
                 offload_cfg: OffloadConfig, out_dir: str | Path, logger: RunLogger | None = None, *,
                 adam_backend: str = "fused"):
        for cfg in (model_cfg, data_cfg, train_cfg, offload_cfg):
            cfg.validate()
        grid = model_cfg.token_grid(data_cfg.frames, data_cfg.height, data_cfg.width)
        model_cfg.attention.validate(grid)
        if train_cfg.ema_decay > 0:
            raise ValueError(f"train.ema_decay={train_cfg.ema_decay}: the offload engine keeps no EMA copy; "
                             f"set train.ema_decay=0 (or train with offload=none)")
        self.model_cfg, self.data_cfg, self.cfg, self.offload_cfg = model_cfg, data_cfg, train_cfg, offload_cfg
        self.out_dir = Path(out_dir)
        self.device = resolve_device(train_cfg.device)
        dtype = param_dtype_for(train_cfg.precision, self.device)
        plan = planner.plan_offload(model_cfg, batch=train_cfg.batch_size, grid=grid, param_dtype=dtype,
                                    optimizer_device=offload_cfg.optimizer_device, grad_clip=train_cfg.grad_clip > 0,
                                    build_on_host=True)
        planner.require_fit(plan, self.device, offload_cfg.gpu_memory_fraction)
        self.dataset = build_dataset(data_cfg, in_channels=model_cfg.in_channels)
        torch.manual_seed(train_cfg.seed)
        model = VideoDiT(model_cfg)  # built on the host with the reference trainer's initialisation
        self.engine = OffloadEngine(model, device=self.device, train_cfg=train_cfg, offload_cfg=offload_cfg,
                                    adam_backend=adam_backend)
        self.logger = logger

    @property
    def step(self) -> int:
        return self.engine.step

    def train_step(self) -> dict:
        batch = make_batch(self.dataset, self.engine.model.tokenizer, self.cfg, self.step).to(self.device)
        return self.engine.train_step(batch, lr_at(self.cfg, self.step))

    # ---- checkpoints: <out>/checkpoints/step_N/{state.pt, block_0000.pt, ...} ---------------
    def save(self) -> Path:
        folder = self.out_dir / "checkpoints" / f"step_{self.step}"
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.engine.flush()
        for index in range(self.engine.host.depth):
            save_checkpoint(tmp / f"block_{index:04d}.pt", self.engine.host.block_state(index))
        state = {**self.engine.resident_state(), "model_cfg": dataclasses.asdict(self.model_cfg),
                 "data_cfg": dataclasses.asdict(self.data_cfg), "train_cfg": dataclasses.asdict(self.cfg)}
        save_checkpoint(tmp / "state.pt", state)  # written last: its presence marks a complete folder
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return folder

    def load(self, path: str | Path) -> None:
        folder = Path(path)
        state = load_checkpoint(folder / "state.pt")
        for index in range(self.engine.host.depth):
            self.engine.host.load_block_state(index, load_checkpoint(folder / f"block_{index:04d}.pt"))
        self.engine.load_resident_state(state)

    def export_model(self, path: str | Path) -> Path:
        """Write the weights in the resident trainer's checkpoint format (fp32 `model` state
        dict, no optimizer state), which experiments/sample.py and `Trainer.load` read."""
        state = {"step": self.step, "model": self.engine.model_state_dict(), "ema": None,
                 "model_cfg": dataclasses.asdict(self.model_cfg), "data_cfg": dataclasses.asdict(self.data_cfg),
                 "train_cfg": dataclasses.asdict(self.cfg)}
        return save_checkpoint(path, state)

    def maybe_resume(self) -> None:
        path = self.cfg.resume
        if path == "auto":
            found = latest_offload_checkpoint(self.out_dir / "checkpoints")
            path = str(found) if found else ""
        if path:
            self.load(path)

    # ---- sampling --------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, captions: list[str], seed: int = 0) -> torch.Tensor:
        """Videos (B, C, T, H, W) in [-1, 1] for the captions."""
        d, tokenizer = self.data_cfg, self.engine.model.tokenizer
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(len(captions), self.model_cfg.in_channels, d.frames, d.height, d.width, generator=g)
        ids = tokenizer(captions).to(self.device)
        null = tokenizer([""] * len(captions)).to(self.device)
        x = euler_sample(self.engine.velocity, noise.to(self.device), ids, null, steps=self.cfg.sample_steps,
                         cfg_scale=self.cfg.cfg_scale)
        return x.float().clamp(-1, 1).cpu()

    # ---- the loop ----------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to cfg.steps; returns the last logged metrics (with the offload time breakdown)."""
        self.maybe_resume()
        last: dict = {}
        first = self.step
        while self.step < self.cfg.steps:
            out = self.train_step()
            if self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps:
                parts = self.engine.breakdown(range(first, self.step))
                first = self.step
                last = {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]), "lr": out["lr"],
                        "step_time_s": parts.step_s, "compute_s": parts.compute_s, "h2d_s": parts.h2d_s,
                        "d2h_s": parts.d2h_s, "optimizer_s": parts.optimizer_s,
                        "overlap_efficiency": parts.overlap_efficiency}
                if self.logger:
                    self.logger.log(last, self.step)
            if self.step % self.cfg.ckpt_every == 0 or self.step == self.cfg.steps:
                self.save()
        self.engine.flush()
        return last


def latest_offload_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete `step_N` checkpoint folder (one with its state.pt), or None."""
    found = [p for p in Path(folder).glob("step_*") if (p / "state.pt").is_file()]
    return max(found, key=lambda p: int(p.name.split("_")[1]), default=None)
