"""The GPU/CPU-resident reference trainer.

Model, fp32 weights and AdamW state all live on one device. bf16 autocast on CUDA, global
gradient-norm clipping, linear warm-up, optional EMA, atomic checkpoints that resume
bit-identically (see `batches.py`), and W&B logging with sample videos. The offload engine
(megaslide/offload) is tested against this trainer.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from megaslide.config import DataConfig, DiTConfig, TrainConfig
from megaslide.data.build import build_dataset
from megaslide.diffusion.flow import flow_matching_loss
from megaslide.diffusion.samplers import euler_sample
from megaslide.models.dit import VideoDiT
from megaslide.train.batches import make_batch
from megaslide.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megaslide.train.logger import RunLogger


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else ("cpu" if name == "auto" else name))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr over warmup_steps, then constant; step is 0-based."""
    return cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))


def maybe_resume(resume: str, checkpoints: Path, latest: Callable[[Path], Path | None],
                 load: Callable[[str], None]) -> None:
    """Load the checkpoint train.resume names: a path, "auto" (the newest one `latest` finds in
    `checkpoints`, if any) or "" (start fresh). Shared by `Trainer` and `OffloadTrainer`."""
    path = resume
    if path == "auto":
        found = latest(checkpoints)
        path = str(found) if found else ""
    if path:
        load(path)


@torch.no_grad()
def sample_videos(model: Callable, tokenizer: Callable, captions: list[str], seed: int, *, model_cfg: DiTConfig,
                  data_cfg: DataConfig, train_cfg: TrainConfig, device: torch.device,
                  precision: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
    """Videos (B, C, T, H, W) in [-1, 1] for the captions: Euler sampling with classifier-free
    guidance from seeded noise; `model` (x (B, C, T, H, W), t (B,), ids, ...) -> velocity
    (B, C, T, H, W). The sampler runs inside `precision` (e.g. a torch.autocast) when given.
    Shared by `Trainer` and `OffloadTrainer`."""
    d = data_cfg
    g = torch.Generator().manual_seed(seed)
    shape = (len(captions), model_cfg.in_channels, d.frames, d.height, d.width)  # (B, C, T, H, W)
    noise = torch.randn(shape, generator=g)
    ids = tokenizer(captions).to(device)
    null = tokenizer([""] * len(captions)).to(device)
    with precision if precision is not None else contextlib.nullcontext():
        x = euler_sample(model, noise.to(device), ids, null, steps=train_cfg.sample_steps,
                         cfg_scale=train_cfg.cfg_scale)                             # (B, C, T, H, W)
    return x.float().clamp(-1, 1).cpu()


def compile_blocks(model: VideoDiT) -> None:
    """torch.compile every DiT block in place (state-dict names unchanged). The blocks share
    their code, so one compiled graph per input shape and grad mode serves all of them."""
    for block in model.blocks:
        block.compile()


class Trainer:
    def __init__(self, model_cfg: DiTConfig, data_cfg: DataConfig, train_cfg: TrainConfig, out_dir: str | Path,
                 logger: RunLogger | None = None):
        for cfg in (model_cfg, data_cfg, train_cfg):
            cfg.validate()
        grid = model_cfg.token_grid(data_cfg.frames, data_cfg.height, data_cfg.width)
        model_cfg.attention.validate(grid)
        self.model_cfg, self.data_cfg, self.cfg = model_cfg, data_cfg, train_cfg
        self.out_dir = Path(out_dir)
        self.device = resolve_device(train_cfg.device)
        use_bf16 = train_cfg.precision == "bf16" or (train_cfg.precision == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.dataset = build_dataset(data_cfg, in_channels=model_cfg.in_channels)

        torch.manual_seed(train_cfg.seed)
        self.model = VideoDiT(model_cfg).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train_cfg.lr, betas=train_cfg.betas,
                                           weight_decay=train_cfg.weight_decay)
        self.ema = copy.deepcopy(self.model).requires_grad_(False) if train_cfg.ema_decay > 0 else None
        if train_cfg.compile:
            compile_blocks(self.model)
        self.step = 0
        self.logger = logger

    # ---- one step ----------------------------------------------------------------------
    def loss_on(self, batch) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return flow_matching_loss(self.model, batch.x0, batch.ids, batch.t, batch.noise)

    def train_step(self) -> dict:
        batch = make_batch(self.dataset, self.model.tokenizer, self.cfg, self.step).to(self.device)
        lr = lr_at(self.cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.loss_on(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        if self.ema is not None:
            with torch.no_grad():
                for pe, p in zip(self.ema.parameters(), self.model.parameters()):
                    pe.lerp_(p, 1 - self.cfg.ema_decay)
        self.step += 1
        return {"loss": loss.detach(), "grad_norm": grad_norm.detach(), "lr": lr}

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "ema": None if self.ema is None else self.ema.state_dict(),
                "model_cfg": dataclasses.asdict(self.model_cfg), "data_cfg": dataclasses.asdict(self.data_cfg),
                "train_cfg": dataclasses.asdict(self.cfg)}

    def save(self) -> Path:
        return save_checkpoint(self.out_dir / "checkpoints" / f"step_{self.step}.pt", self.state_dict())

    def load(self, path: str | Path) -> None:
        state = load_checkpoint(path, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        self.step = state["step"]

    def maybe_resume(self) -> None:
        maybe_resume(self.cfg.resume, self.out_dir / "checkpoints", latest_checkpoint, self.load)

    # ---- sampling ------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, captions: list[str], seed: int = 0) -> torch.Tensor:
        """Videos (B, C, T, H, W) in [-1, 1] for the captions, from the EMA weights when kept."""
        model = self.ema if self.ema is not None else self.model
        model.eval()
        autocast = torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)
        x = sample_videos(model, model.tokenizer, captions, seed, model_cfg=self.model_cfg, data_cfg=self.data_cfg,
                          train_cfg=self.cfg, device=self.device, precision=autocast)
        model.train()
        return x

    # ---- the loop ------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to cfg.steps; returns the last logged metrics."""
        self.maybe_resume()
        self.model.train()
        last: dict = {}
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train", dynamic_ncols=True)
        t0 = time.perf_counter()
        while self.step < self.cfg.steps:
            out = self.train_step()
            bar.update(1)
            if self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps:
                last = {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]), "lr": out["lr"],
                        "step_time_s": (time.perf_counter() - t0) / self.cfg.log_every}
                t0 = time.perf_counter()
                bar.set_postfix(loss=f"{last['loss']:.4f}")
                if self.logger:
                    self.logger.log(last, self.step)
            if self.step % self.cfg.ckpt_every == 0 or self.step == self.cfg.steps:
                self.save()
        bar.close()
        return last
