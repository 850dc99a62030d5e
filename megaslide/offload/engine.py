"""MegaSlide-DiT offload engine: the GPU as a stateless worker, every block's state in host RAM.

One training step (`OffloadEngine.train_step`):
1. the resident stem (patch embed, timestep MLPs, text encoder, caption projection) runs
   on the device with autograd; its outputs t_mod, ctx, t_emb enter the rest as leaves;
2. streamed forward (no grad) over the blocks, keeping each block's input (with
   offload.boundary_stride = k only those of blocks 0, k, 2k, ...: the backward re-runs the
   others' forward segment by segment; with offload.activation_offload parked in pinned host
   RAM and brought back one block ahead of the backward: HBM holds about max(2, k) block inputs
   whatever the depth);
3. unembed + loss with autograd: gradients of the last hidden state and of t_emb, and the
   final layer's parameter gradients;
4. streamed backward: block l is recomputed from its input and backpropagated; its flat
   gradient goes D2H and to the optimizer (below). With offload.resident_blocks = k the
   last k blocks kept their weights and graphs on the device from step 2 and skip the
   recompute and the re-stream. With offload.keep_attention the blocks the planner names kept
   their attention output and lse from step 2 (on the device or in pinned host RAM,
   `KeptAttentionPlan`) and their recompute skips the attention forward (selective recompute,
   bit-identical in fp32);
5. one backward through the stem graph with the accumulated gradients of x, t_mod, ctx,
   t_emb: each stem tensor gets exactly the gradient it gets in a resident backward;
6. global-norm clipping and the updates.

Non-block parameters stay resident on the device in fp32 with torch.optim.AdamW (0.25 B of
the 7B preset's 6.96 B parameters). Block parameters: bf16 weights on the device (fp32 in the exact mode),
fp32 master and moments on the host (or the compact state offload.master_dtype and offload.moments ask for:
a bf16 master rounded stochastically with bits keyed by train.seed, the block and the step, which a
checkpoint records; 8-bit moments), updated by the fused CPU AdamW on a worker thread
(`CpuUpdater`), or, in the optimizer_device="gpu" ablation, on the device after streaming
master and moments there and back (`GpuUpdater`); both live in megaslide/offload/updaters.py.
It is a step engine of `Trainer` (megaslide/train/engine.py), chosen by offload.enabled;
`OffloadEngine.from_config` builds the model for it (`from_pretrained` from a diffusers-format folder, block
by block; `save_pretrained` writes one back). Checkpoints are sharded: one file per
block (master weights and moments) plus the resident state.

Data parallel, ZeRO-3 style (`dp`, parallel.dp = P ranks, each training on its share of the global batch): each
rank's host holds 1/P of every block's weights, gradient staging, master and moments (`Shard`, the flat block
padded to P equal parts), in the run's state format (compact too: a shard holds whole quantisation blocks of an
8-bit moment, and a bf16 master's stochastic rounding draws each element's bits by its index in the whole block,
so P ranks update exactly as one process does), and its CPU AdamW updates that shard only. The streamer copies
the shard H2D and all-gathers the block on the device, one block ahead as before, and reduce-scatters each
block's gradient (the replicas' mean) before the shard goes D2H. The resident (non-block) parameters are
replicated, their gradients averaged in one all-reduce. The loss is the replicas' mean, and the clip norm is
exact: the shards' squared norms are summed over the replicas. A checkpoint holds each rank's shard of each block
(`block_shard`), and resumes on any number of ranks.

Clipping scheme (global norm, exact): per-parameter gradient norms are computed on the
device as each block's gradient is produced (no sync) and combined once, after the
backward, in the model's parameter order, exactly as `clip_grad_norm_` combines them. The
coefficient min(1, max_norm / (norm + 1e-6)) is copied to the host; then the updates of
blocks 0..L-1 are queued in forward order and overlap the NEXT step's forward: block l's
H2D waits only for block l's update. The gradient is scaled in its staging buffer before
the AdamW pass (in bf16 mode that rounds the scaled gradient to bf16 once). Without
clipping (grad_clip=0) each block's update is queued as soon as its gradient has landed,
and overlaps the rest of the backward.

Non-finite steps (`NonFiniteStep`, megaslide/train/engine.py), checked without a host sync on the
training thread. The loss is copied to the host right after it is computed, and the loss and global
grad norm again once the norm is combined (`_share_health`). Block updates: with clipping every
block's update waits for the clip coefficient anyway, and the CPU updater's worker refuses it when the
loss or grad norm is not finite; without clipping a block's update is queued before the global norm
exists, so the worker checks the loss and that block's own gradient. The resident parameters: on
CUDA their AdamW is fused and its found_inf flag, set on the device from the loss and norm, skips the
step (and every later one). After a refusal nothing more is updated, and the training thread raises
the error at its next wait: the next step's first block load, or `flush` (which `save`,
`breakdown` and `model_state_dict` call first), so no checkpoint of the refused step is written. On
the CPU device the values are checked on the training thread as soon as each is computed: the loss
before the backward, the norm before any clipped or resident update. The optimizer_device="gpu"
ablation (`GpuUpdater`) applies block updates unchecked; the error still comes at the next `flush`. Sharded over
data-parallel ranks, the loss and norm are the replicas' (the same on every rank), and each step starts by waiting
for the last one's, so every rank raises at the same call rather than one while its peers wait in a collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaslide.checkpoint import (
    BLOCK_LAYOUT,
    SHARD_RANKS,
    SHARDED_STATE,
    block_shard,
    load_checkpoint,
    read_block,
    save_sharded_checkpoint,
)
from megaslide.config import DiTConfig, ExecutionConfig, OffloadConfig, ParallelConfig, TrainConfig
from megaslide.device import precision_dtype
from megaslide.diffusion.batches import Batch
from megaslide.diffusion.flow import TIME_SCALE, interpolate
from megaslide.models.chunking import apply_execution, compile_blocks
from megaslide.models.dit import DiTBlock, VideoDiT
from megaslide.models.pretrained import (
    WeightFiles,
    build_model,
    check_pretrained,
    meta_model,
    write_pretrained,
)
from megaslide.offload.compact import rounding_key
from megaslide.offload.cpu_adam import adamw_step_
from megaslide.offload.host_state import BlockLayout, HostState, Shard
from megaslide.offload.kept_store import KeptStore
from megaslide.offload.streamer import BackwardResult, BlockInputs, BlockStreamer, Lanes, elapsed
from megaslide.offload.updaters import AdamHyper, ClipCoefficient, CpuUpdater, GpuUpdater, StepHealth, UpdateJob
from megaslide.parallel.data_parallel import DataParallel
from megaslide.parallel.sp_train import SequenceParallel
from megaslide.perf import planner
from megaslide.perf.flops import StepBreakdown
from megaslide.perf.host_memory import MOMENT_BLOCK, StateFormat, host_bytes, require_host_fit
from megaslide.perf.kept_attention import KeptAttentionPlan
from megaslide.perf.memory import hbm_available_bytes, host_available_bytes
from megaslide.perf.stream_schedule import parked_inputs


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


class OffloadEngine:
    """Trains a `VideoDiT` whose blocks live in host RAM (see the module docstring).

    `model`'s blocks may hold real weights (copied into the host state here) or be on the
    meta device; then fill `engine.host` with `load_block_` before training. The stem and
    final layer must hold real weights; they move to `device`. `from_config` does all this."""

    sharded_checkpoints = True

    def __init__(self, model: VideoDiT, *, device: torch.device, train_cfg: TrainConfig,
                 offload_cfg: OffloadConfig, pin_optimizer_state: bool | None = None,
                 kept_attention: KeptAttentionPlan | None = None, dp: DataParallel = DataParallel.single(),
                 sp: SequenceParallel | None = None):
        offload_cfg.validate()
        check_sharding(offload_cfg, dp)
        if kept_attention is None and offload_cfg.keep_attention != "off":
            raise ValueError(f"offload.keep_attention={offload_cfg.keep_attention}: the planner places the kept "
                             f"attention; build the engine with OffloadEngine.from_config, or pass kept_attention=")
        if (sp is None) != (dp.sp == 1) or (sp is not None and sp.model is not model):
            raise ValueError("a sequence-parallel offload engine takes the SequenceParallel of its own model and a "
                             "DataParallel over every rank of the run (DataParallel.of_run); build it with "
                             "OffloadEngine.from_config(..., sp_group=, parallel=)")
        self.device, self.train_cfg, self.offload_cfg, self.dp, self.sp = device, train_cfg, offload_cfg, dp, sp
        self.param_dtype = precision_dtype(train_cfg.precision, device)
        self.cuda = cuda = device.type == "cuda"
        if cuda and offload_cfg.gpu_memory_fraction > 0:
            torch.cuda.set_per_process_memory_fraction(offload_cfg.gpu_memory_fraction, torch.cuda.current_device())
        self.layout = BlockLayout.from_module(model.blocks[0])
        depth = len(model.blocks)
        if offload_cfg.resident_blocks > depth:
            raise ValueError(f"offload.resident_blocks={offload_cfg.resident_blocks} exceeds the model's "
                             f"{depth} blocks; use at most {depth}")
        pin_state = offload_cfg.optimizer_device == "gpu" if pin_optimizer_state is None else pin_optimizer_state
        fmt = StateFormat.of(self.param_dtype, offload_cfg)
        shard = Shard.of(self.layout.numel, dp.rank, dp.size)   # this rank's part of every block (all of it: P=1)
        require_host_fit(host_bytes(shard.numel, depth, fmt, pin_state), host_available_bytes(),
                         what=f"the host state of {depth} blocks" + (f" (1/{dp.size} of it per rank)" if dp.size > 1
                                                                     else ""),
                         ranks=dp.size, ranks_per_node=dp.ranks_per_node)
        stride = offload_cfg.boundary_stride
        parked = parked_inputs(depth, offload_cfg.resident_blocks, stride) if offload_cfg.activation_offload else 0
        self.host = HostState(self.layout, depth, fmt, pin=cuda, pin_optimizer_state=pin_state,
                              input_buffers=parked, shard=shard)
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
        self.model = compile_blocks(model) if train_cfg.compile else model

        self.autocast_dtype = torch.bfloat16 if self.param_dtype == torch.bfloat16 else None
        self.lanes = Lanes(device, serial=not offload_cfg.overlap)
        self.kept_attention = kept_attention or KeptAttentionPlan("off")
        kept = KeptStore(self.lanes, self.kept_attention.gpu, self.kept_attention.host, pin=cuda)
        self.versions = [0] * depth
        self.streamer = BlockStreamer(model.blocks, self.host, self.lanes, device, self.compute_ctx,
                                      before_load=lambda i: self.updater.before_load(i),
                                      version=lambda i: self.versions[i], resident=offload_cfg.resident_blocks,
                                      offload_inputs=offload_cfg.activation_offload,
                                      run=lambda *inputs, **kw: self.model.runner.block(*inputs, **kw),
                                      stride=stride, kept=kept,
                                      grad=lambda *inputs, **kw: self.model.runner.block_grad(*inputs, **kw),
                                      group=dp.group, replicas=dp.replicas)
        # fused on CUDA: its found_inf flag skips a non-finite step on the device, with no host sync
        self.optimizer = torch.optim.AdamW(self.resident_params, lr=train_cfg.lr, betas=train_cfg.betas,
                                           weight_decay=train_cfg.weight_decay, fused=True if cuda else None)
        self._refused = torch.zeros((), device=device)   # 1 once a step was non-finite: resident updates stop
        self._health: list[StepHealth] = []              # CUDA: steps whose values have not been checked here
        self.hyper = AdamHyper(train_cfg.betas[0], train_cfg.betas[1], 1e-8, train_cfg.weight_decay)
        self._cpu_adam = functools.partial(adamw_step_, num_threads=offload_cfg.cpu_threads or None)
        self.updater = self._make_updater(offload_cfg.optimizer_device)
        self._coef_host = torch.zeros((), pin_memory=cuda)
        self._landed: list = [None] * depth                       # per block: event of its gradient's D2H
        self._spans = [[(0, shard.numel)] for _ in range(depth)]  # per block: ranges of its shard AdamW updates
        self._marks: dict[int, object] = {}
        self.step = 0
        self.rounding_seed = train_cfg.seed  # keys the random bits of a bf16 master's stochastic rounding
        self.phase = ""  # the part of the step running now (forward, loss, backward, optimizer step), for OOM reports

    @classmethod
    def from_config(cls, model_cfg: DiTConfig, *, device: torch.device, train_cfg: TrainConfig,
                    offload_cfg: OffloadConfig, grid: tuple[int, int, int],
                    pin_optimizer_state: bool | None = None, build_on_host: bool = False,
                    execution: ExecutionConfig | None = None, dp: DataParallel = DataParallel.single(),
                    sp_group: dist.ProcessGroup | None = None, parallel: ParallelConfig | None = None
                    ) -> OffloadEngine:
        """An engine training a new `VideoDiT(model_cfg)`, once the planner has found that host
        RAM and HBM hold it for train_cfg.batch_size clips of token grid `grid` (T', H', W').

        With `build_on_host` the whole fp32 model is made on the host once: `VideoDiT(model_cfg)` under the
        caller's seed (the resident engine's initial weights bit for bit) or, with model_cfg.pretrained,
        `load_pretrained`. Without it no fp32 copy of the whole model is ever made: the model is built on the
        meta device, its stem (and block 0) come from a one-block model built on the host, and every further
        block is built on the meta device one at a time and copied into the host state. A random block is
        defined on the host by `DiTBlock.initialize_weights`: the model's own init rules, so the same
        statistics and the same exact zeros (adaLN-Zero gates, final layer), though not its random stream.
        With model_cfg.pretrained (a diffusers-format folder of model_cfg's architecture) the stem and each
        block take the folder's weights, read from its safetensors files one parameter at a time; a block is
        initialised first only where the folder lacks some of its parameters (a DSA offset net: zero, so the
        model starts as neighbourhood attention). The host then holds its state plus about one block.
        `execution` says how the blocks run (`apply_execution`; its checkpoint_blocks is moot: the engine
        recomputes every streamed block anyway; slab_frames=auto takes the plan's choice within this machine's
        free HBM). With offload.keep_attention the plan also places the blocks' kept attention output and lse,
        within this machine's free HBM and host RAM (`OffloadPlan.kept`). With `dp` the
        blocks' host state is sharded over the data-parallel replicas (each keeps its shard of every block it
        builds or reads), and train_cfg.batch_size is their global batch; the kept attention is each rank's own,
        of its batch share. With `sp_group` (sequence parallel, `dp` over every rank of the run:
        `DataParallel.of_run`) the ranks of that group train each clip of their replica's share together, each
        its rows (`SequenceParallel`, in the form `parallel` gives), and the host state is sharded over all the
        run's ranks."""
        execution = execution or ExecutionConfig()
        for cfg in (model_cfg, train_cfg, offload_cfg):
            cfg.validate()
        execution.validate(model_cfg.attention)
        if model_cfg.pretrained:
            check_pretrained(model_cfg)
        if train_cfg.ema_decay > 0:
            raise ValueError(f"train.ema_decay={train_cfg.ema_decay}: the offload engine keeps no EMA copy; "
                             f"set train.ema_decay=0 (or train with offload.enabled=false)")
        check_sharding(offload_cfg, dp)
        run = planner.grid_run(model_cfg, grid, batch=train_cfg.batch_size, grad_clip=train_cfg.grad_clip,
                               execution=execution, offload=offload_cfg,
                               parallel=dataclasses.replace(parallel or ParallelConfig(), dp=dp.replicas, sp=dp.sp))
        hbm = hbm_available_bytes(device, offload_cfg.gpu_memory_fraction)
        plan = planner.plan_offload(run, param_dtype=precision_dtype(train_cfg.precision, device),
                                    pin_optimizer_state=pin_optimizer_state, build_on_host=build_on_host,
                                    budgets=planner.Budgets(host_available_bytes() if hbm is None else hbm,
                                                            host_available_bytes(), device.type),
                                    ranks_per_node=dp.ranks_per_node)
        planner.require_fit(plan, device, offload_cfg.gpu_memory_fraction)
        execution = plan.execution  # execution.slab_frames=auto: the size the plan chose
        kw = {"device": device, "train_cfg": train_cfg, "offload_cfg": offload_cfg,
              "pin_optimizer_state": pin_optimizer_state, "kept_attention": plan.kept, "dp": dp}

        def make(model: VideoDiT) -> OffloadEngine:
            sp = None if sp_group is None else SequenceParallel(model, sp_group, parallel or ParallelConfig(), grid)
            return cls(model, sp=sp, **kw)

        if build_on_host:
            return make(apply_execution(build_model(model_cfg), execution))
        with torch.device("meta"):
            model = apply_execution(VideoDiT(model_cfg), execution)
        weights = WeightFiles(Path(model_cfg.pretrained), model) if model_cfg.pretrained else None  # keys checked
        first = VideoDiT(dataclasses.replace(model_cfg, depth=1))  # the stem and block 0, initialised by the model
        for name, child in first.named_children():
            if name != "blocks":
                setattr(model, name, child)
        if weights is None:
            engine = make(model)
            for index, block in enumerate(_initialised_blocks(model_cfg, first.blocks[0])):
                engine.host.load_block_(index, engine.layout.flatten(block))
            return engine
        with weights, torch.no_grad():
            for name, param in model.named_parameters():
                if not name.startswith("blocks."):
                    weights.copy_(name, param)
            engine = make(model)
            for index, block in enumerate(_initialised_blocks(model_cfg, first.blocks[0], weights)):
                for name, param in block.named_parameters():
                    weights.copy_(f"blocks.{index}.{name}", param)
                engine.host.load_block_(index, engine.layout.flatten(block))
        return engine

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: torch.device, train_cfg: TrainConfig,
                        offload_cfg: OffloadConfig, grid: tuple[int, int, int],
                        execution: ExecutionConfig | None = None, **overrides) -> OffloadEngine:
        """An engine training the diffusers-format Wan model in folder `path` (`load_pretrained`'s contract and
        `overrides`, e.g. attention="dsa"), its blocks read straight into the host state: `from_config` with
        model.pretrained = `path`."""
        folder, model = meta_model(path, **overrides)
        return cls.from_config(dataclasses.replace(model.cfg, pretrained=str(folder)), device=device,
                               train_cfg=train_cfg,
                               offload_cfg=offload_cfg, grid=grid, execution=execution)

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
        switched = dataclasses.replace(self.offload_cfg, optimizer_device=optimizer_device)
        switched.validate()
        check_sharding(switched, self.dp)
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
        # sharded: every rank waits for the last step's values, so all refuse a non-finite step at the same call
        self._check_health(wait=self.dp.size > 1)
        compute, tag = self.lanes.compute, self.step
        self._marks[tag] = compute.marker()
        self.lanes.tag = tag
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.phase = "forward"
        with self._rows():
            return self._train_step(batch, lr, compute, tag)

    def _rows(self):
        """Where the blocks run on this rank's rows of each clip (sequence parallel: `SequenceParallel.sharded`)."""
        return contextlib.nullcontext() if self.sp is None else self.sp.sharded()

    def _embed(self, xt: torch.Tensor, t: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None):
        """The block inputs of the clip xt (B, C, T, H, W) at model timesteps t (B,): all its tokens, or under
        sequence parallelism this rank's rows (B, n, D)."""
        if self.sp is None:
            return self.model.embed(xt, t, context, mask)
        return self.sp.embed(xt, t, context, mask)

    def _loss(self, h: torch.Tensor, e, batch: Batch) -> torch.Tensor:
        """The flow-matching loss of this rank's clips from the last block's output h: their mean squared velocity
        error, or under sequence parallelism this rank's part of it (the parts sum to it)."""
        if self.sp is None:
            v = self.model.unembed(h, e)                                        # (B, C, T, H, W)
            return F.mse_loss(v.float(), (batch.noise - batch.x0).float())
        return self.sp.rows_loss(self.model.head(h, e), batch.x0, batch.noise)  # from rows (B, n, pv*C)

    def _train_step(self, batch: Batch, lr: float, compute, tag: int) -> dict:
        with compute.timed(), self.compute_ctx():
            xt = interpolate(batch.x0, batch.noise, batch.t)                  # (B, C, T, H, W)
            e = self._embed(xt, batch.t * TIME_SCALE, batch.context, batch.mask)
        inp = BlockInputs(_leaf(e.t_mod), _leaf(e.ctx), e.ctx_mask, e.rope, e.grid)
        h, kept = self.streamer.forward(e.x.detach(), inp, keep_inputs=True)   # (B, N, D); SP: (B, n, D)
        h, t_emb = h.requires_grad_(), _leaf(e.t_emb)
        self.phase = "loss"
        with compute.timed():
            with self.compute_ctx():
                loss = self._loss(h, dataclasses.replace(e, t_emb=t_emb), batch)
            # the global batch's loss: the replicas' mean of their SP parts' sum (one process: this loss)
            global_loss = self.dp.mean_(loss.detach().float().reshape(1).clone())    # (1,)
            loss_health = self._share_health(global_loss)
            # autograd.grad, not .backward: a leaf's .grad is copied into the leaf's layout, and the
            # blocks' reductions must see the gradient exactly as a resident backward passes it on
            grad_h, grad_t_emb, *grads = torch.autograd.grad(loss, [h, t_emb, *self.resident_params],
                                                             allow_unused=True)
            for p, g in zip(self.resident_params, grads):
                p.grad = g
        on_grads = functools.partial(self._on_block_grads, step=self.step + 1, lr=lr, health=loss_health)
        grads_to_host = self.clip > 0 or self.offload_cfg.optimizer_device == "cpu"
        self.phase = "backward"
        bw = self.streamer.backward(grad_h, kept, inp, grads_to_host=grads_to_host, on_block_grads=on_grads)
        with compute.timed():
            torch.autograd.backward([e.x, e.t_mod, e.ctx, e.t_emb], [bw.grad_x, bw.grad_t_mod, bw.grad_ctx, grad_t_emb])
            self.phase = "optimizer step"
            self.dp.mean_grads_(self.resident_params, global_loss[:0])   # replicated: the global batch's gradient
            grad_norm = self._global_norm(bw)
            values = torch.cat([global_loss, grad_norm.float().reshape(1)])   # (2,)
            health = self._share_health(values)
            clip = self._clip_resident_and_share(grad_norm) if self.clip > 0 else None
            self._resident_update(values, health)
        if clip is not None:
            for index in range(self.host.depth):
                self._submit(UpdateJob(index, self.step + 1, lr, self._spans[index], tag, self._landed[index],
                                       None, clip, health))
        self.step += 1
        return {"loss": global_loss[0], "grad_norm": grad_norm.detach(), "lr": lr}

    def _on_block_grads(self, index: int, shell, landed, used: list[bool], *, step: int, lr: float,
                        health: StepHealth) -> None:
        self._landed[index] = landed
        self._spans[index] = self.host.shard.spans(self.layout.spans(used))
        if self.clip <= 0:
            device_grads = None if landed is not None else shell.grads
            self._submit(UpdateJob(index, step, lr, self._spans[index], self.step, landed, device_grads,
                                   health=health))

    # ---- the finiteness check (see "Non-finite steps" in the module docstring) ------------------------
    def _share_health(self, values: torch.Tensor) -> StepHealth:
        """`values` (the loss, then the grad norm) of step self.step + 1 on their way to the host. On the
        CPU they are checked here and now; on CUDA no one waits for them here."""
        health = StepHealth(self.step + 1, self.train_cfg.lr, torch.empty(values.shape, pin_memory=self.cuda),
                            None)
        health.host.copy_(values, non_blocking=True)
        health.ready = self.lanes.compute.record()
        if not self.cuda:
            health.check()
        return health

    def _resident_update(self, values: torch.Tensor, health: StepHealth) -> None:
        """The resident parameters' AdamW step, skipped on the device (fused AdamW's found_inf) from the
        first step whose loss or grad norm is not finite on; the training thread checks the values later."""
        if self.cuda:
            self._refused = torch.maximum(self._refused, (~torch.isfinite(values)).any().float())
            self.optimizer.found_inf = self._refused
            self._health.append(health)
        self.optimizer.step()

    def _check_health(self, wait: bool) -> None:
        """Raise `NonFiniteStep` for the first step whose values reached the host non-finite (CUDA; on the
        CPU `_share_health` checked them); with `wait`, wait for all of them."""
        while self._health and (wait or self._health[0].ready.query()):
            self._health.pop(0).check()

    def _submit(self, job: UpdateJob) -> None:
        job.rounding_key = rounding_key(self.rounding_seed, job.block, job.step)
        self.versions[job.block] += 1
        self.updater.submit(job)

    def _global_norm(self, bw: BackwardResult) -> torch.Tensor:
        """L2 norm of all gradients: per-parameter norms stacked in the model's parameter
        order, then their norm (what clip_grad_norm_ computes). Sharded, the blocks' part is the sum over the
        replicas of their shards' squared norms (one all-reduce), beside the replicated resident gradients'."""
        present = [(i, p.grad) for i, p in enumerate(self.resident_params) if p.grad is not None]
        resident = dict(zip((i for i, _ in present), torch._foreach_norm([g for _, g in present], 2)))
        if self.dp.group is not None:
            blocks = self.dp.sum_(torch.stack(bw.shard_squares).sum().reshape(1))[0]
            return (blocks + torch.stack(list(resident.values())).float().square().sum()).sqrt()
        block_norms = bw.norms
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
        self.phase = "forward"
        with self.compute_ctx():
            e = self.model.embed(x, t, context, context_mask)
        h, _ = self.streamer.forward(e.x, BlockInputs(e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid), keep_inputs=False)
        with self.compute_ctx():
            return self.model.unembed(h, e)                                     # (B, C, T, H, W)

    # ---- accounting ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every pending update and transfer; raise `NonFiniteStep` for a refused step."""
        self.updater.flush()
        self.lanes.synchronize()
        self._check_health(wait=True)

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

    def timings(self, steps: range) -> dict[str, float]:
        """`breakdown` in the names `Trainer` logs."""
        parts = self.breakdown(steps)
        return {"step_time_s": parts.step_s, "compute_s": parts.compute_s, "h2d_s": parts.h2d_s,
                "d2h_s": parts.d2h_s, "optimizer_s": parts.optimizer_s,
                "overlap_efficiency": parts.overlap_efficiency}

    # ---- state -----------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model by name, fp32 on the CPU (blocks from the host master; sharded, gathered
        from the replicas: every rank calls it)."""
        self.flush()
        masters = [self._master(index) for index in range(self.host.depth)]
        return {name: self._parameter(entry, masters).clone()
                for name, entry in zip(self._param_names(), self._norm_order)}

    def _parameter(self, entry: tuple, masters: list[torch.Tensor]) -> torch.Tensor:
        """One parameter (an entry of `_norm_order`), fp32 on the CPU: a block's is a slice of its whole master
        `masters[block]` (layout.numel,) on the CPU, widened where it is bf16 (a view of an fp32 one)."""
        if entry[0] == "resident":
            return self.resident_params[entry[1]].detach().float().cpu()
        slot = self.layout.slots[entry[2]]
        return masters[entry[1]][slot.offset:slot.end].view(slot.shape).float()

    def save_pretrained(self, path: str | Path, max_shard_size: int | str = "10GB") -> None:
        """Write the model (a `wan` one) as a diffusers-format folder from the resident parameters and the
        blocks' master weights (a bf16 master widened to fp32): the files of `VideoDiT.save_pretrained` of the
        same weights. Parameters are read from the host state as their shard is written (`write_pretrained`), so
        the host holds at most one shard (`max_shard_size`) beyond the engine's state. One process's engine only:
        a rank of a sharded one holds 1/(parallel.dp x parallel.sp) of each block."""
        if self.dp.group is not None:
            raise ValueError(f"save_pretrained of an offload engine sharded over {self.dp.size} ranks "
                             f"({self.dp.key}): each holds only its shard of every block; save a training checkpoint "
                             f"(it resumes on any number of ranks, experiments/export.py writes a folder from it) or "
                             f"save from a one-process engine")
        self.flush()
        masters = [block.master for block in self.host.blocks]
        where = dict(zip(self._param_names(), self._norm_order))
        params = [(n, torch.Size(self.resident_params[e[1]].shape if e[0] == "resident"
                                 else self.layout.slots[e[2]].shape), torch.float32) for n, e in where.items()]
        write_pretrained(self.model.cfg, params, lambda name: self._parameter(where[name], masters), path,
                         max_shard_size)

    def _master(self, index: int) -> torch.Tensor:
        """Block `index`'s master weights (layout.numel,) in the master dtype on the CPU, all-gathered on the
        device from the replicas' shards when sharded."""
        master, shard = self.host.blocks[index].master, self.host.shard
        if self.dp.group is None:
            return master
        whole = torch.empty(shard.padded, dtype=master.dtype, device=self.device)
        dist.all_gather_single(whole, master.to(self.device), group=self.dp.group)
        return whole[:self.layout.numel].cpu()

    def _param_names(self) -> list[str]:
        return [self.resident_names[e[1]] if e[0] == "resident" else f"blocks.{e[1]}.{self.layout.slots[e[2]].name}"
                for e in self._norm_order]

    # ---- checkpoints: a folder checkpoints/step_N/ of block_0000.pt ... and state.pt -----------------
    def save(self, path: Path, extra: dict) -> Path:
        """Each block's master weights and moments in a file of its own (sharded: every rank writes its shard of
        each, `block_shard`), then (rank 0) the resident parameters, their AdamW state, the step and block
        versions, the seed of the stochastic rounding, the blocks' flat layout (so that a reader needs no
        engine), the ranks and `extra` in state.pt. Collective when sharded; the folder appears complete or not
        at all."""
        self.flush()
        shard = self.host.shard
        blocks = ((block_shard(path, index, shard.rank, shard.ranks).stem, self.host.block_state(index))
                  for index in range(self.host.depth))
        state = {"step": self.step, "versions": list(self.versions), "rounding_seed": self.rounding_seed,
                 "params": {n: p.detach().cpu().clone() for n, p in zip(self.resident_names, self.resident_params)},
                 "optimizer": self.optimizer.state_dict(), BLOCK_LAYOUT: self.layout.record(),
                 SHARD_RANKS: shard.ranks, **extra}
        return save_sharded_checkpoint(path, blocks, state, main=self.dp.is_main, barrier=self.dp.barrier)

    def load(self, path: Path) -> None:
        state = load_checkpoint(path / SHARDED_STATE)
        saved = state.get(BLOCK_LAYOUT)  # None: a checkpoint older than the record
        if saved is not None and saved != self.layout.record():
            raise ValueError(f"checkpoint {str(path)!r} lays its blocks out otherwise than this model does; resume it "
                             f"with the model config it was saved with (its state.pt holds model_cfg)")
        self.flush()
        saved_ranks, shard = state.get(SHARD_RANKS, 1), self.host.shard
        for index in range(self.host.depth):
            if saved_ranks == shard.ranks:   # this rank's own file
                part = load_checkpoint(block_shard(path, index, shard.rank, shard.ranks))
            else:                            # saved over another number of ranks: the whole block, then its shard
                whole = read_block(path, index, saved_ranks, self.layout.numel, moment_block=MOMENT_BLOCK)
                part = {key: shard.take_state(value) for key, value in whole.items()}
            self.host.load_block_state(index, part)
        with torch.no_grad():
            for name, p in zip(self.resident_names, self.resident_params):
                p.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.versions = list(state["versions"])
        self.rounding_seed = state.get("rounding_seed", self.rounding_seed)  # absent: a checkpoint older than it
        self.streamer.invalidate()

    def close(self) -> None:
        self.updater.close()
        self.host.close()
        self.streamer.kept.close()


def check_sharding(offload_cfg: OffloadConfig, dp: DataParallel) -> None:
    """The sharded engine (parallel.dp x parallel.sp > 1) runs AdamW on the CPU, each rank over its shard."""
    if dp.size > 1 and offload_cfg.optimizer_device != "cpu":
        raise ValueError(f"offload.optimizer_device={offload_cfg.optimizer_device!r} with {dp.key}: the "
                         f"sharded offload engine updates each rank's shard on the CPU; set "
                         f"offload.optimizer_device=cpu (or run one process)")


def _initialised_blocks(cfg: DiTConfig, first: DiTBlock, weights: WeightFiles | None = None) -> Iterator[DiTBlock]:
    """`first` (block 0), then blocks 1.. of `cfg`, each built on the meta device when asked for and defined on
    the host by `DiTBlock.initialize_weights`, unless `weights` hold all of its parameters (the caller copies
    them in)."""
    yield first
    for index in range(1, cfg.depth):
        with torch.device("meta"):
            block = DiTBlock(cfg, index)
        block.to_empty(device="cpu")
        if weights is None or not all(weights.saved(f"blocks.{index}.{n}") for n, _ in block.named_parameters()):
            block.initialize_weights()
        yield block
