"""Predict a sequence-parallel training step of one clip (megaslide/parallel/sp_train.py) on P ranks.

A step is compute, halo exchanges and one gradient all-reduce, run one after the other (the exchanges are not
overlapped with compute):

- compute: the one-GPU blocks' time of the whole clip, C (fitted to a measured step), times the busiest rank's
  share of the work. A block's pre-attention work (QKV projection, DSA's offset net) and its attention run over
  the rank's attention window (own frames plus halo: `window_share` of the block's work, from its FLOPs), the rest
  (output projection, cross-attention, MLP) over its own frames only:
  work = max over ranks (share * window + (1 - share) * own) / frames.
- halo: `exchanges` exchanges per step (per block: the forward, its recompute under block checkpoints, the
  backward), each moving the busiest rank's halo frames (window - own) over `link_GBps` per direction.
- all-reduce: the fp32 gradients, ring all-reduce: 2 (P - 1) / P x their bytes over `allreduce_GBps` (bus
  bandwidth).

Not modelled: the optimizer step, the embedding and final layer (replicated, small next to the blocks), kernel
efficiency at smaller per-rank sizes, contention between links.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaslide.config import DiTConfig
from megaslide.parallel.halo import FrameShard

GB = 1e9


def window_share(cfg: DiTConfig, ctx_len: int) -> float:
    """The share of a block's multiply-adds per video token that runs over the attention window: the QKV
    projection, the variant's own weights (DSA's offset net) and the self-attention."""
    D, a = cfg.dim, cfg.attention
    window = 3 * D * D + a.variant.extra_macs_per_token(a.options, D, cfg.num_heads)
    window += 2 * D * a.variant.keys_per_query(a.options, (1, 1, 1)) if a.name != "dense" else 0
    own = D * D + 2 * D * D + 2 * D * cfg.ffn_dim + 2 * ctx_len * D  # out proj, cross q + out, MLP, cross attention
    return window / (window + own)


def rank_frames(frames: int, world: int, reach: int) -> list[tuple[int, int]]:
    """(own frames, window frames) of every rank, the window `reach` frames on each side cut at the clip's ends."""
    out = []
    for r in range(world):
        t0, t1 = FrameShard(frames, 1, world, r).bounds(r)
        out.append((t1 - t0, min(frames, t1 + reach) - max(0, t0 - reach)))
    return out


@dataclass(frozen=True)
class SPStep:
    """A predicted SP training step (seconds) and its parts."""

    world: int
    compute_s: float
    halo_s: float
    allreduce_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.halo_s + self.allreduce_s


def work_share(frames: int, world: int, reach: int, share: float) -> float:
    """The busiest rank's share of the one-GPU block work (1.0 on one rank)."""
    return max(share * w + (1 - share) * o for o, w in rank_frames(frames, world, reach)) / frames


def predict_step(world: int, *, compute_s: float, frames: int, reach: int, share: float, frame_bytes: float,
                 exchanges: int, grad_bytes: float, link_GBps: float, allreduce_GBps: float) -> SPStep:
    """The step on `world` ranks of a clip of `frames` token frames whose blocks take `compute_s` on one GPU;
    `frame_bytes`: one token frame of a block input (tokens x dim x element size)."""
    halo = max(w - o for o, w in rank_frames(frames, world, reach))
    halo_s = exchanges * halo * frame_bytes / (link_GBps * GB) if world > 1 else 0.0
    allreduce_s = 2 * (world - 1) / world * grad_bytes / (allreduce_GBps * GB)
    return SPStep(world, compute_s * work_share(frames, world, reach, share), halo_s, allreduce_s)
