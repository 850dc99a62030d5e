"""adaLN modulation: a per-sample shift and scale of normalised tokens."""
from __future__ import annotations

import torch


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x (B, N, D), shift/scale (B, D)."""
    return x * (1 + scale[:, None]) + shift[:, None]
