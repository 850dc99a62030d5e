"""The resident step engine: model, fp32 weights and AdamW state all on one device.

bf16 autocast where train.precision asks for it, global gradient-norm clipping, a refusal of a
non-finite loss or gradient norm before the update (one host sync per step reads both), an optional
EMA copy (sampled from when kept) and, with train.compile, the blocks' token-wise work compiled
(`compile_blocks`, megaslide/models/chunking.py, as the offload engine does). It is the
reference the offload engine (megaslide/offload) is tested against. With data parallelism
(`DataParallel`) each replica holds the whole model and the gradients are averaged before clipping; with
sequence parallelism (`SequenceParallel`, megaslide/parallel/sp_train.py) each rank of an SP group computes its
part of the clip's loss and the parts' gradients are summed over the group first.
"""
from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path

import torch

from megaslide.checkpoint import load_checkpoint, save_checkpoint
from megaslide.config import TrainConfig
from megaslide.device import precision_dtype
from megaslide.diffusion.batches import Batch
from megaslide.diffusion.flow import flow_matching_loss
from megaslide.models.chunking import compile_blocks
from megaslide.models.dit import VideoDiT
from megaslide.parallel.data_parallel import DataParallel
from megaslide.parallel.sp_train import SequenceParallel
from megaslide.train.engine import check_finite


class ResidentEngine:
    """Trains `model` (already on `device`) with torch.optim.AdamW; see the module docstring."""

    sharded_checkpoints = False

    def __init__(self, model: VideoDiT, *, device: torch.device, train_cfg: TrainConfig,
                 dp: DataParallel = DataParallel.single(), sp: SequenceParallel | None = None):
        self.model, self.device, self.cfg, self.dp, self.sp = model, device, train_cfg, dp, sp
        self.autocast_dtype = torch.bfloat16 if precision_dtype(train_cfg.precision, device) == torch.bfloat16 else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, betas=train_cfg.betas,
                                           weight_decay=train_cfg.weight_decay)
        self.ema = copy.deepcopy(model).requires_grad_(False) if train_cfg.ema_decay > 0 else None
        if train_cfg.compile:
            compile_blocks(model)
        self.step = 0
        self.phase = ""  # the part of the step running now (forward, backward, optimizer step), for OOM reports
        self._marks: dict[int, float] = {}  # step -> perf_counter at its start

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def loss(self, batch: Batch) -> torch.Tensor:
        """The batch's loss; under sequence parallelism this rank's part of it."""
        with self.autocast():
            if self.sp is not None:
                return self.sp.loss(batch.x0, batch.context, batch.t, batch.noise, batch.mask)
            return flow_matching_loss(self.model, batch.x0, batch.context, batch.t, batch.noise, batch.mask)

    def train_step(self, batch: Batch, lr: float) -> dict:
        self._marks[self.step] = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.phase = "forward"
        loss = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.phase = "backward"
        loss.backward()
        self.phase = "optimizer step"
        if self.sp is not None:  # the parts' sums over the SP group: the clip's gradient and loss
            self.sp.reduce_gradients(self.model.parameters())
            loss = self.sp.reduce_loss(loss)
        # data parallel: the replicas' mean gradient and loss, those of the global batch (one collective)
        loss = self.dp.mean_grads_(list(self.model.parameters()), loss.detach().float().reshape(1))[0]
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        loss_value, norm_value = torch.stack([loss.detach().float(), grad_norm.float()]).tolist()  # one host sync
        check_finite(self.step + 1, self.cfg.lr, loss=loss_value, grad_norm=norm_value)
        self.optimizer.step()
        if self.ema is not None:
            with torch.no_grad():   # one fused update over all parameters, not one launch per tensor
                torch._foreach_lerp_(list(self.ema.parameters()), list(self.model.parameters()),
                                     1 - self.cfg.ema_decay)
        self.step += 1
        return {"loss": loss.detach(), "grad_norm": grad_norm.detach(), "lr": lr}

    @torch.no_grad()
    def velocity(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                 context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The EMA model's velocity when an EMA is kept, else the trained model's, under autocast."""
        with self.autocast():
            return self._sampled_model()(x, t, context, context_mask)  # (B, C, T, H, W)

    def _sampled_model(self) -> VideoDiT:
        return self.ema if self.ema is not None else self.model

    def timings(self, steps: range) -> dict[str, float]:
        """Wall time per step from the start of step `steps.start` to now, after the device is idle."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._marks[steps.start]
        self._marks = {k: v for k, v in self._marks.items() if k >= steps.stop}
        return {"step_time_s": seconds / len(steps)}

    # ---- checkpoints: one file, checkpoints/step_N.pt ------------------------------------------
    def save(self, path: Path, extra: dict) -> Path:
        return save_checkpoint(path, {"step": self.step, "model": self.model.state_dict(),
                                      "optimizer": self.optimizer.state_dict(),
                                      "ema": None if self.ema is None else self.ema.state_dict(), **extra})

    def load(self, path: Path) -> None:
        state = load_checkpoint(path, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        self.step = state["step"]

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().cpu().clone() for k, v in self._sampled_model().state_dict().items()}

    def close(self) -> None:
        """Nothing to release: the model and optimizer are ordinary tensors."""
