"""What `Trainer` asks of a step engine: the one interface of the resident and the offload engine.

`Trainer` (trainer.py) writes the fit loop, warm-up, logging, checkpoint cadence, resume,
sampling and the batches once; the engine owns the weights and the optimizer state and
does one optimizer step at a time. `ResidentEngine` (resident.py) keeps everything on one
device; `OffloadEngine` (megaslide/offload/engine.py) keeps the blocks' state in host RAM.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import torch

from megaslide.diffusion.batches import Batch
from megaslide.models.dit import VideoDiT


class NonFiniteStep(FloatingPointError):
    """A step whose loss or global gradient norm is not finite, refused before its update is applied."""

    def __init__(self, step: int, what: str, value: float | str, lr: float):
        super().__init__(f"step {step}: {what} is {value}; lower train.lr (now {lr:.0e}) or check the data")
        self.step = step


def check_finite(step: int, lr: float, **values: float) -> None:
    """Raise `NonFiniteStep` for the first of `values` (loss=..., grad_norm=..., host floats) that is
    not finite; `step` is the 1-based step number the metrics log uses."""
    for what, value in values.items():
        if not math.isfinite(value):
            raise NonFiniteStep(step, what.replace("_", " "), value, lr)


class StepEngine(Protocol):
    model: VideoDiT              # the model it trains; its tokenizer makes the batches' caption ids
    step: int                    # optimizer steps taken (restored by `load`)
    sharded_checkpoints: bool    # checkpoint format: a step_N/ folder of shards, else one step_N.pt file

    def train_step(self, batch: Batch, lr: float) -> dict:
        """One optimizer step on `batch` (on the engine's device) at learning rate `lr`;
        returns loss and grad_norm (device tensors, not waited for) and lr. A step whose loss or
        gradient norm is not finite raises `NonFiniteStep` before its non-finite update is applied
        (the offload engine on CUDA may raise it at a later call: see its docstring)."""

    def velocity(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                 context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The sampling model, no grad: x (B, C, T, H, W), t (B,) in [0, 1000] -> velocity (B, C, T, H, W)."""

    def timings(self, steps: range) -> dict[str, float]:
        """Seconds per step averaged over `steps` (which have all started), at least
        `step_time_s`; may synchronise."""

    def save(self, path: Path, extra: dict) -> Path:
        """Write a checkpoint at `path` (see checkpoint.checkpoint_path) holding `extra` too."""

    def load(self, path: Path) -> None:
        """Restore the state `save` wrote, step counter included."""

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights `velocity` uses, by parameter name, fp32 on the CPU."""

    def close(self) -> None:
        """Release threads and pinned memory."""
