"""Swin-DiT self-attention: Video-Swin 3D windows with alternating shifted windows.

Even blocks attend inside non-overlapping (wt, wh, ww) windows; odd blocks first roll the
grid by half a window, so windows straddle the previous boundaries, and mask pairs of
tokens that were not neighbours before the roll. Along an axis where the window covers the
whole grid nothing is shifted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megaslide.attention.base import AttendMemory, Grid, SelfAttention, check_fits_grid, option_triple


def _partition(x: torch.Tensor, grid, window) -> torch.Tensor:
    """(B, N, h, d) -> (B, nW, h, wlen, d) windows, row-major over window positions."""
    B, _, h, d = x.shape
    (T, H, W), (wt, wh, ww) = grid, window
    x = x.view(B, T // wt, wt, H // wh, wh, W // ww, ww, h, d)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6, 8)                        # (B, nT, nH, nW, h, wt, wh, ww, d)
    return x.reshape(B, -1, h, wt * wh * ww, d)


def _unpartition(x: torch.Tensor, grid, window) -> torch.Tensor:
    """Inverse of `_partition`: (B, nW, h, wlen, d) -> (B, N, h, d)."""
    B, _, h, _, d = x.shape
    (T, H, W), (wt, wh, ww) = grid, window
    x = x.view(B, T // wt, H // wh, W // ww, h, wt, wh, ww, d)
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4, 8)                        # (B, nT, wt, nH, wh, nW, ww, h, d)
    return x.reshape(B, T * H * W, h, d)


def shift_mask(grid, window, shift, device) -> torch.Tensor:
    """(nW, wlen, wlen) bool, True where two tokens of a rolled window may attend to each other."""
    labels = torch.zeros(grid, dtype=torch.long)
    for axis, (size, w, s) in enumerate(zip(grid, window, shift)):
        if s == 0:
            continue
        idx = torch.arange(size)
        region = (idx >= size - w).long() + (idx >= size - s).long()   # 0, 1, 2 along this axis
        labels = labels * 3 + region.view([-1 if a == axis else 1 for a in range(3)])
    win = _partition(labels.view(1, -1, 1, 1), grid, window)[0, :, 0, :, 0]  # (nW, wlen)
    return (win[:, :, None] == win[:, None, :]).to(device)


@dataclass(frozen=True)
class SwinOptions:
    window: tuple[int, int, int] = (2, 4, 4)  # (wt, wh, ww) in tokens; must divide the token grid

    def __post_init__(self):
        object.__setattr__(self, "window", option_triple("window", self.window))


class SwinAttention(SelfAttention):
    """Registered as `swin` by the `megaslide.attention` entry point in pyproject.toml."""

    name = "swin"
    Options = SwinOptions
    sp_form = "frames"

    @classmethod
    def check_grid(cls, options: SwinOptions, grid: Grid) -> None:
        check_fits_grid("window", options.window, grid, "use a window of at most the grid size")
        for axis, w, s in zip("thw", options.window, grid):
            if s % w:
                raise ValueError(f"token grid {tuple(grid)} is not divisible by attention.window={options.window} "
                                 f"along {axis} ({s} % {w} != 0); pick a window that divides the grid")

    @classmethod
    def keys_per_query(cls, options: SwinOptions, grid: Grid) -> int:
        return math.prod(options.window)

    @classmethod
    def attend_memory(cls, options: SwinOptions, dim: int, num_heads: int, act: int, chunked: bool) -> AttendMemory:
        """SDPA on 5-D windows runs PyTorch's math path (the fused kernels take 4-D inputs), which computes
        in fp32: it upcasts bf16 q, k, v (`allow_fp16_bf16_reduction_math_sdp` is off by default) and keeps
        the scaled q and k, v and each window's softmax in fp32; the block keeps the output put back in token
        order. The planner once counted these in the activation dtype and left out the copies the windows
        cost (the rolled and partitioned q, k, v, the fp32 upcasts, `_safe_softmax`'s extra scores); under
        bf16 it under-predicted Swin blocks by 7% (offload) to 32% (chunked, where attention sets the peak).

        forward, as the fp32 output is cast back (on a shifted layer): the rolled q, k, v, the partitioned q
        and k, the fp32 output, the boolean window mask and its additive copy; in bf16 also the partitioned v
        (in fp32 it is the v kept), the upcast q and k, the output's cast and the cast of the attention weights
        SDPA also returns (the token-order output, counted in saved, is not made yet); backward: two score
        gradients (the softmax's backward) or one and fp32 dq and dk (the scores' matmul backward), whichever
        is larger. Measured on CPU with `LiveTensorBytes`
        (the math path is the same composite on CUDA)."""
        fp32, wlen = 4, math.prod(options.window)
        scores = num_heads * wlen  # elements per token
        casts = (act * dim + 2 * fp32 * dim + act * dim + act * scores) if act < fp32 else 0
        saved = 3 * fp32 * dim + fp32 * scores + act * dim
        forward = 3 * act * dim + 2 * act * dim + fp32 * dim + (1 + act) * wlen + casts - act * dim
        backward = fp32 * scores + max(fp32 * scores, 2 * fp32 * dim)
        return AttendMemory("none", saved, forward, backward)

    def frame_window(self, frames: int, t0: int, t1: int) -> tuple[int, int]:
        """The windows along t of the queries of frames [t0, t1), widened so that this layer run over them
        windows them as over the whole clip. Unshifted layers: from the window boundary at or before t0 to the
        one at or after t1 (multiples of wt). Shifted layers (shift s along t): the run [a, b), a and b
        multiples of wt, rolls by s itself, so its windows start at a + s + k * wt as the clip's do, except its
        two cut end windows [a, a + s) and [b - wt + s, b); a and b are moved out until the queries lie between
        those, or to the clip's ends, where those windows are the clip's own, and so that the run, longer than
        one window, shifts too."""
        wt = self.options.window[0]
        s = wt // 2 if self.layer_idx % 2 == 1 and wt < frames else 0
        a = max(0, (t0 - s) // wt * wt)
        b = min(frames, -(-(t1 + (wt - s if s else 0)) // wt) * wt)
        if s and b - a == wt:  # a run of one window would not shift: widen it by one (the clip has two or more)
            a, b = (a, b + wt) if b < frames else (a - wt, b)
        return a, b

    def attend(self, q, k, v, x, grid):
        self.check_grid(self.options, grid)
        window = self.options.window
        shifted = self.layer_idx % 2 == 1
        shift = tuple(w // 2 if shifted and w < s else 0 for w, s in zip(window, grid))
        if any(shift):
            q, k, v = (self._roll(t, grid, [-s for s in shift]) for t in (q, k, v))
        qw, kw_, vw = (_partition(t, grid, window) for t in (q, k, v))  # (B, nW, h, wlen, d)
        mask = shift_mask(grid, window, shift, q.device)[None, :, None] if any(shift) else None
        o = F.scaled_dot_product_attention(qw, kw_, vw, attn_mask=mask)   # (B, nW, h, wlen, d)
        o = _unpartition(o, grid, window)                                 # (B, N, h, d)
        return self._roll(o, grid, list(shift)) if any(shift) else o

    @staticmethod
    def _roll(x: torch.Tensor, grid, shifts) -> torch.Tensor:
        B, N, h, d = x.shape
        x = x.view(B, *grid, h, d).roll(shifts=shifts, dims=(1, 2, 3))  # (B, T, H, W, h, d)
        return x.reshape(B, N, h, d)
