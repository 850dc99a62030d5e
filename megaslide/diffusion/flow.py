"""Rectified flow (flow matching) with velocity prediction.

x_t = (1 - t) x_0 + t * noise for t in [0, 1]; the model predicts v = noise - x_0 and is
given the timestep as 1000 * t. Training samples t from a logit-normal distribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TIME_SCALE = 1000.0


def sample_timesteps(batch: int, generator: torch.Generator, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Logit-normal t in (0, 1): sigmoid of N(mean, std^2), shape (batch,)."""
    return torch.sigmoid(mean + std * torch.randn(batch, generator=generator))


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t for clean x0 (B, ...) and noise (B, ...) at t (B,)."""
    t = t.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * noise


def flow_matching_loss(model, x0: torch.Tensor, context, t: torch.Tensor, noise: torch.Tensor,
                       context_mask=None) -> torch.Tensor:
    """Mean squared error between predicted and true velocity (noise - x0)."""
    xt = interpolate(x0, noise, t)                       # (B, C, T, H, W)
    v = model(xt, t * TIME_SCALE, context, context_mask)  # (B, C, T, H, W)
    return F.mse_loss(v.float(), (noise - x0).float())
