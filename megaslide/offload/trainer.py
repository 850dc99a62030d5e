"""`OffloadTrainer`: the resident `Trainer`'s API (fit, train_step, sample, save/load/resume)
on the offload engine (megaslide/offload/engine.py), with sharded checkpoints."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from megaslide.config import DataConfig, DiTConfig, OffloadConfig, TrainConfig
from megaslide.data.build import build_dataset
from megaslide.models.dit import VideoDiT
from megaslide.offload import planner
from megaslide.offload.engine import OffloadEngine, param_dtype_for
from megaslide.train.batches import make_batch
from megaslide.train.checkpoint import load_checkpoint, save_checkpoint
from megaslide.train.logger import RunLogger
from megaslide.train.trainer import lr_at, maybe_resume, resolve_device, sample_videos


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
                                    build_on_host=True, resident_blocks=offload_cfg.resident_blocks)
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
        maybe_resume(self.cfg.resume, self.out_dir / "checkpoints", latest_offload_checkpoint, self.load)

    # ---- sampling --------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, captions: list[str], seed: int = 0) -> torch.Tensor:
        """Videos (B, C, T, H, W) in [-1, 1] for the captions."""
        return sample_videos(self.engine.velocity, self.engine.model.tokenizer, captions, seed,
                             model_cfg=self.model_cfg, data_cfg=self.data_cfg, train_cfg=self.cfg, device=self.device)

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
