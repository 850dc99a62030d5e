"""RMSNorm for mixed precision: the weight follows the input's dtype."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` whose weight follows the input's dtype. Under bf16 autocast the input is bf16
    and the weight fp32, a mix for which torch skips its fused kernel (which accumulates in
    fp32 anyway) and runs the unfused ops; casting the weight keeps the fused kernel. The
    weight and its gradient stay fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)
