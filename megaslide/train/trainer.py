"""The one Trainer: fit loop, warm-up, logging, checkpoint cadence, resume, sampling and the
batches, written once over a pluggable step engine (engine.py).

The offload config chooses the engine: `ResidentEngine` (resident.py: model, fp32 weights and
AdamW on one device) or, with offload.enabled, `OffloadEngine` (megaslide/offload/engine.py:
block state in host RAM, streamed through the device). Both build the model with the same
seed and initialisation and see the same batches (megaslide/diffusion/batches.py), so they agree step by step.
Checkpoints are atomic (megaslide/checkpoint.py) and resume bit-identically. train.deterministic turns on
PyTorch's deterministic algorithms and their companions (determinism.py) from construction until `close()`, so
that a GPU run gives the same bits every time at its seed. A Trainer refuses bad input
before it builds anything or writes a file: the configs (config.validate_training), the device,
and the checkpoint train.resume names (its format, damage, and architecture against this run's).

Data parallel (parallel.dp = P under torchrun, megaslide/parallel/data_parallel.py): every rank draws the
global batch of step s and trains on its share; the engine averages the gradients (the offload engine shards its
host state too), so losses and weights are those of one process on the global batch. Rank 0 writes the files:
metrics (the Trainer's logger is set on rank 0 only), one-file checkpoints and samples; every rank writes its
shards of a sharded checkpoint.

Sequence parallel (parallel.sp = P, megaslide/parallel/sp_train.py): the P ranks of an SP group train each clip of
their replica's batch together, each on its share of the clip's token frames; either engine sums their loss
parts and gradients over the group (the offload engine in the reduce-scatter of its host state's shards, which
span all dp x sp ranks). dp x sp ranks form the run's 2D mesh (`init_training_mesh`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from tqdm import tqdm

from megaslide.checkpoint import (check_fresh_folder, checkpoint_path, prune_checkpoints, resume_point,
                                  save_checkpoint)
from megaslide.config import (
    DataConfig,
    DiTConfig,
    ExecutionConfig,
    OffloadConfig,
    SLAB_AUTO,
    ParallelConfig,
    TrainConfig,
    validate_training,
)
from megaslide.data.build import build_dataset
from megaslide.device import precision_dtype, resolve_device
from megaslide.diffusion.batches import make_batch
from megaslide.diffusion.samplers import euler_sample
from megaslide.models.chunking import apply_execution
from megaslide.models.pretrained import build_model, check_pretrained
from megaslide.offload.engine import OffloadEngine
from megaslide.parallel.data_parallel import DataParallel
from megaslide.parallel.mesh import init_training_mesh, leave_process_groups
from megaslide.parallel.sp_train import SequenceParallel
from megaslide.perf import planner
from megaslide.perf.memory import hbm_available_bytes, host_available_bytes
from megaslide.train.determinism import deterministic_mode, seed_everything
from megaslide.train.engine import StepEngine
from megaslide.train.logger import RunLogger
from megaslide.train.progress import ProgressLines
from megaslide.train.resident import ResidentEngine


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr over warmup_steps, then constant; step is 0-based."""
    return cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))


def build_engine(model_cfg: DiTConfig, train_cfg: TrainConfig, offload_cfg: OffloadConfig, *, device: torch.device,
                 grid: tuple[int, int, int], execution: ExecutionConfig | None = None,
                 mesh: DeviceMesh | None = None, parallel: ParallelConfig | None = None) -> StepEngine:
    """The engine the offload config asks for, run as `execution` says. `grid` is a training clip's token grid
    (the offload planner's check); `mesh` the run's ("dp", "sp") mesh (`init_training_mesh`; None: one process):
    the data-parallel replicas this rank is one of, and the sequence-parallel group that shares each clip, in the
    form `parallel` gives. The offload engine shards the blocks' host state over every rank of the mesh. A random
    model is built on the host under the current seed (the same initial weights either way;
    offload.init_on_host=false builds the offload engine's block by block instead); with model.pretrained the
    weights come from that folder, and are not drawn first: the resident engine's model by `load_pretrained`, the
    offload engine's blocks read one at a time into its host state (`OffloadEngine.from_config`), never the whole
    fp32 model in host RAM."""
    execution = execution or ExecutionConfig()
    sp_group = mesh["sp"].get_group() if mesh is not None and mesh["sp"].size() > 1 else None
    if offload_cfg.enabled:
        return OffloadEngine.from_config(model_cfg, device=device, train_cfg=train_cfg, offload_cfg=offload_cfg,
                                         grid=grid, build_on_host=offload_cfg.builds_on_host(model_cfg),
                                         execution=execution, dp=DataParallel.of_run(mesh), sp_group=sp_group,
                                         parallel=parallel)
    run = planner.grid_run(model_cfg, grid, batch=train_cfg.batch_size, execution=execution,
                           offload=offload_cfg, parallel=parallel)
    autocast = precision_dtype(train_cfg.precision, device) == torch.bfloat16
    if execution.slab_frames == SLAB_AUTO:  # one rank's part of the clip (`planner.rank_grid`)
        hbm = hbm_available_bytes(device)
        execution = planner.resident_slabs(run, host_available_bytes() if hbm is None else hbm,
                                           autocast=autocast).execution
    if device.type == "cpu" and sp_group is None:   # one process holds the whole clip in host RAM
        planner.require_cpu_fit(planner.plan_resident(dataclasses.replace(run, execution=execution),
                                                      autocast=autocast))
    model = apply_execution(build_model(model_cfg), execution).to(device)
    sp = None if sp_group is None else SequenceParallel(model, sp_group, parallel or ParallelConfig(), grid)
    return ResidentEngine(model, device=device, train_cfg=train_cfg, dp=DataParallel.of(mesh), sp=sp)


class Trainer:
    def __init__(self, model_cfg: DiTConfig, data_cfg: DataConfig, train_cfg: TrainConfig, out_dir: str | Path,
                 logger: RunLogger | None = None, *, offload_cfg: OffloadConfig | None = None,
                 execution: ExecutionConfig | None = None, parallel: ParallelConfig | None = None):
        offload_cfg, execution = offload_cfg or OffloadConfig(), execution or ExecutionConfig()
        validate_training(model_cfg, data_cfg, train_cfg, offload_cfg, execution, parallel)
        if model_cfg.pretrained:
            check_pretrained(model_cfg)
        self.model_cfg, self.data_cfg, self.cfg = model_cfg, data_cfg, train_cfg
        self.out_dir = Path(out_dir)
        self.device = resolve_device(train_cfg.device, key="train.device",
                                     local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        # train.deterministic: process-wide switches, on before CUDA starts and until close() (back off if this fails)
        with contextlib.ExitStack() as modes:
            if train_cfg.deterministic:
                modes.enter_context(deterministic_mode(self.device))
            # under torchrun: the process group and this rank's place among the data-parallel replicas
            self.mesh = init_training_mesh(parallel or ParallelConfig(), self.device)
            self.dp = DataParallel.of(self.mesh)
            # (checkpoint, step) to continue from, checked (format, damage, architecture) before anything is built;
            # rank 0 first, as it removes what a killed save left
            sharded = (OffloadEngine if offload_cfg.enabled else ResidentEngine).sharded_checkpoints
            check_fresh_folder(train_cfg.resume, self.checkpoints)   # every rank at once: all refuse together
            for turn in (True, False):
                if self.dp.is_main == turn:
                    self.resume_from = resume_point(train_cfg.resume, self.checkpoints, model_cfg, sharded=sharded)
                self.dp.barrier()
            # the dataset before the engine: a video folder decodes its first clip (decord present, file readable)
            # before any weights are allocated; the offload planner then refuses a model too big before it is built
            self.dataset = build_dataset(data_cfg, in_channels=model_cfg.in_channels)
            seed_everything(train_cfg.seed)
            grid = model_cfg.token_grid(data_cfg.frames, data_cfg.height, data_cfg.width)
            self.engine = build_engine(model_cfg, train_cfg, offload_cfg, device=self.device, grid=grid,
                                       execution=execution, mesh=self.mesh, parallel=parallel)
            self.execution = self.engine.model.runner.execution   # as run: slab_frames=auto resolved
            self._modes = modes.pop_all()
        self.logger = logger

    @property
    def step(self) -> int:
        return self.engine.step

    def train_step(self) -> dict:
        rows = self.dp.rows(self.cfg.batch_size)  # this replica's share of the global batch
        batch = make_batch(self.dataset, self.engine.model.tokenizer, self.cfg, self.step, rows).to(self.device)
        return self.engine.train_step(batch, lr_at(self.cfg, self.step))

    # ---- checkpoints ---------------------------------------------------------------------------
    def _configs(self) -> dict:
        return {"model_cfg": dataclasses.asdict(self.model_cfg), "data_cfg": dataclasses.asdict(self.data_cfg),
                "train_cfg": dataclasses.asdict(self.cfg)}

    @property
    def checkpoints(self) -> Path:
        return self.out_dir / "checkpoints"

    def save(self) -> Path:
        """A checkpoint at this step; then, with train.keep_checkpoints = k > 0, all but the newest k go. With
        data parallelism a sharded checkpoint is written by every rank (each its shards), one file by rank 0."""
        sharded = self.engine.sharded_checkpoints
        path = checkpoint_path(self.checkpoints, self.step, sharded=sharded)
        if sharded or self.dp.is_main:
            self.engine.save(path, self._configs())
        if self.cfg.keep_checkpoints and self.dp.is_main:
            prune_checkpoints(self.checkpoints, self.cfg.keep_checkpoints, sharded=sharded)
        return path

    def load(self, path: str | Path) -> None:
        self.engine.load(Path(path))

    def maybe_resume(self) -> None:
        """Load the checkpoint train.resume named (`resume_from`: a path, or with "auto" the newest in
        the output folder) unless training is past it already, and say which; nothing for a fresh run."""
        if self.resume_from is not None and self.step < self.resume_from[1]:
            self.load(self.resume_from[0])
            if self.dp.is_main:
                print(f"resumed from {self.resume_from[0]} at step {self.step}")

    def export_model(self, path: str | Path) -> Path:
        """The sampling weights in the single-file format (fp32 `model` state dict, no optimizer
        state), which experiments/sample.py reads whichever engine trained them. Data parallel: every rank calls
        it (the sharded engine gathers the weights), rank 0 writes."""
        model = self.engine.model_state_dict()
        if not self.dp.is_main:
            return Path(path)
        return save_checkpoint(path, {"step": self.step, "model": model, "ema": None, **self._configs()})

    # ---- sampling ----------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, captions: list[str], seed: int = 0) -> torch.Tensor:
        """Videos (B, C, T, H, W) in [-1, 1] for the captions: Euler sampling with classifier-free
        guidance from seeded noise, with the engine's sampling weights (the EMA when kept)."""
        d, tokenizer = self.data_cfg, self.engine.model.tokenizer
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn((len(captions), self.model_cfg.in_channels, d.frames, d.height, d.width), generator=g)
        ids = tokenizer(captions).to(self.device)
        null = tokenizer([""] * len(captions)).to(self.device)
        x = euler_sample(self.engine.velocity, noise.to(self.device), ids, null, steps=self.cfg.sample_steps,
                         cfg_scale=self.cfg.cfg_scale)                                # (B, C, T, H, W)
        return x.float().clamp(-1, 1).cpu()

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self, label: str = "train", progress: str = "bar") -> dict:
        """Train to cfg.steps; returns the last logged metrics (with the engine's time breakdown; a run resumed at
        its last step, with nothing left to train, returns the row its log kept for that step). `label` names
        the progress: `progress="bar"` draws a tqdm bar; "lines" prints a line starting with the label at each
        tenth of the run instead (megaslide/train/progress.py), for runs in processes that share one terminal or
        log file, as the study scripts' workers do. A step the engine refuses as non-finite (`NonFiniteStep`, a
        FloatingPointError naming the step) ends the run: it propagates before that step is logged or
        checkpointed, so the checkpoints written are those of the finite steps before it."""
        if progress not in ("bar", "lines"):
            raise ValueError(f"progress={progress!r} must be 'bar' (a tqdm bar) or 'lines' (labelled plain lines)")
        self.maybe_resume()
        last: dict = {}
        first = self.step
        shown = (ProgressLines(label, self.cfg.steps, self.step, disable=not self.dp.is_main) if progress == "lines"
                 else tqdm(total=self.cfg.steps, initial=self.step, desc=label, dynamic_ncols=True,
                           disable=not self.dp.is_main))
        with shown as bar:
            while self.step < self.cfg.steps:
                out = self.train_step()
                if self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps:
                    last = {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]), "lr": out["lr"],
                            **self.engine.timings(range(first, self.step))}
                    first = self.step
                    bar.set_postfix(loss=f"{last['loss']:.4f}")
                    if self.logger:
                        self.logger.log(last, self.step)
                bar.update(1)  # after the postfix: a line shows this step's loss
                if self.step % self.cfg.ckpt_every == 0 or self.step == self.cfg.steps:
                    self.save()
        return last or (dict(self.logger.last_train) if self.logger else {})

    def close(self) -> None:
        """Release the engine, leave the process group (if any) and restore what train.deterministic switched."""
        self.engine.close()
        if self.mesh is not None:
            leave_process_groups()
        self._modes.close()
