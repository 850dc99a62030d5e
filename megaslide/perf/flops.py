"""FLOPs, MFU and the per-step time breakdown of a training step.

What is counted (a multiply-add is 2 FLOPs):
- weight FLOPs: 2 x (elements of every Linear / Conv weight) x (tokens it acts on). Block
  weights act on the B*N video tokens, except the cross-attention K/V projection, which acts
  on the B*L caption tokens; so do the attention variant's own weights (its
  `extra_macs_per_token`: DSA's offset net); patch embedding and the final layer act on video
  tokens; the text encoder and caption projection on caption tokens; the timestep MLPs once
  per sample. Biases, norms and modulation vectors are not matmuls and are not counted.
- attention FLOPs: QK^T and PV, 4 x keys x head_dim x heads = 4 x keys x D per query:
  self-attention has the variant's `keys_per_query` keys (dense N, Swin one window
  wt*wh*ww, DSA its K = kt*kh*kw samples; the trilinear gathers are not counted);
  cross-attention L keys; the text encoder's self-attention L keys over caption tokens.
Training FLOPs = 3 x forward (backward = 2 x forward). This is "6 x params x tokens plus
attention". The recomputation of the offload engine (one more forward) is NOT counted as
model FLOPs; `executed` adds it, for the planner's compute estimate and lower bound.
MFU = training FLOPs / step time / peak, against a peak measured in the same run (bf16
matmul: megaslide/perf/timing.py matmul_tflops) and against the datasheet.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megaslide.config import AttentionConfig, DiTConfig
from megaslide.models.dit import MOD_ROWS

H200_DATASHEET_BF16_TFLOPS = 989.0  # dense bf16, NVIDIA H200 SXM datasheet


def keys_per_query(attention: AttentionConfig, grid: tuple[int, int, int]) -> int:
    """Keys each video token attends to in self-attention (the variant's own count)."""
    return attention.variant.keys_per_query(attention.options, grid)


@dataclass(frozen=True)
class DiTFlops:
    """Forward FLOPs of one VideoDiT pass over a batch."""

    weights: float    # Linear / Conv weights
    attention: float  # QK^T and PV

    @property
    def forward(self) -> float:
        return self.weights + self.attention

    @property
    def train(self) -> float:
        """Model FLOPs of a training step: forward + backward (2 x forward)."""
        return 3 * self.forward

    @property
    def executed(self) -> float:
        """FLOPs the offload engine runs: the training FLOPs plus the recomputed forward."""
        return 4 * self.forward


def token_path_flops(cfg: DiTConfig, queries: int, keys: int, ctx_len: int, final_layer: bool = True) -> DiTFlops:
    """Forward FLOPs of one clip's video tokens through `VideoDiT(cfg)`: `queries` tokens through
    the patch embedding, every block (self-attention to `keys` tokens each, cross-attention to
    `ctx_len` caption tokens, MLP) and, if `final_layer`, the final layer. Keys may differ from
    queries: a chunk of causal generation attends to its KV cache too. The caption encoder and
    the timestep embedding, which run once per sample, are left to `dit_flops`."""
    D, a = cfg.dim, cfg.attention
    out_patch = cfg.in_channels * math.prod(cfg.patch_size)
    per_video_token = 4 * D * D + 2 * D * D + 2 * D * cfg.ffn_dim  # self qkv+out, cross q+out, MLP
    per_video_token += a.variant.extra_macs_per_token(a.options, D, cfg.num_heads)
    edges = out_patch * D * (2 if final_layer else 1)               # patch embed (+ final Linear)
    weights = 2 * (queries * (cfg.depth * per_video_token + edges) + ctx_len * cfg.depth * 2 * D * D)  # + cross K/V
    attention = cfg.depth * (4 * queries * keys * D + 4 * queries * ctx_len * D)
    return DiTFlops(weights, attention)


def dit_flops(cfg: DiTConfig, batch: int, grid: tuple[int, int, int]) -> DiTFlops:
    """Forward FLOPs of `VideoDiT(cfg)` on `batch` clips of token grid (T', H', W')."""
    D, Dt, L = cfg.dim, cfg.text_dim, cfg.text_len
    tokens = token_path_flops(cfg, math.prod(grid), keys_per_query(cfg.attention, grid), L)
    text_layer = 4 * Dt * Dt + 2 * Dt * 4 * Dt                      # in/out projections, FFN (4x)
    text_layers = cfg.text_layers if cfg.text_encoder else 0        # none without the built-in encoder
    stem_caption = text_layers * text_layer + Dt * D + D * D        # text encoder, text_proj
    per_sample = cfg.freq_dim * D + D * D + MOD_ROWS[cfg.block] * D * D  # t_embed MLP, t_proj
    weights = batch * (tokens.weights + 2 * (L * stem_caption + per_sample))
    attention = batch * (tokens.attention + text_layers * 4 * L * L * Dt)
    return DiTFlops(float(weights), float(attention))


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    return flops / seconds / (peak_tflops * 1e12)


@dataclass
class StepBreakdown:
    """Where one training step's time went (seconds per step, averaged over steps).

    compute/h2d/d2h are the busy times of the three CUDA streams (events around each
    piece of work); optimizer is the wall time of the CPU AdamW updates (or the GPU
    updates' kernel time with optimizer_device=gpu). With perfect overlap the step takes
    as long as the busiest part: overlap efficiency = max(parts) / step."""

    step_s: float
    compute_s: float
    h2d_s: float
    d2h_s: float
    optimizer_s: float
    h2d_bytes: float
    d2h_bytes: float

    @property
    def overlap_efficiency(self) -> float:
        return max(self.compute_s, self.h2d_s, self.d2h_s, self.optimizer_s) / self.step_s

    @property
    def h2d_GBps(self) -> float:
        return self.h2d_bytes / self.h2d_s / 1e9 if self.h2d_s > 0 else 0.0

    @property
    def d2h_GBps(self) -> float:
        return self.d2h_bytes / self.d2h_s / 1e9 if self.d2h_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "overlap_efficiency": self.overlap_efficiency,
                "h2d_GBps": self.h2d_GBps, "d2h_GBps": self.d2h_GBps}
