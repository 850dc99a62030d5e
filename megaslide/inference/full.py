"""Full-sequence sampling over P ranks: the bidirectional baseline of causal generation.

All latent frames are denoised at once, as xDiT and Wan's own multi-GPU inference do: the
video's row-major tokens are sharded contiguously over the SP group (tail-padded when N % P
!= 0, `sharded.TokenShard`), and every block's self-attention is swapped for its
sequence-parallel form in the chosen mode (ulysses, ring, hybrid, torus) by
`megaslide.parallel.apply.parallelize_dit`. The sampler is `megaslide.diffusion.samplers`'
Euler loop with the same timesteps as causal generation (default four steps: t = 1.0, 0.75,
0.5, 0.25 -> 0). RoPE rows of each rank's tokens are looked up once (`precompute_rope`) and
QK-norm + RoPE can be fused, as in the causal generator; there are no CUDA graphs (at tens of
thousands of tokens per forward, launch overhead is negligible).

Entry point: experiments/generate_full.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megaslide.config import ParallelConfig
from megaslide.diffusion.samplers import FEW_STEP_TIMESTEPS, check_timesteps, euler_integrate, model_timesteps
from megaslide.inference.sharded import (Rope, TokenShard, forward_shard, gather_rows, shard_rope,
                                         unfused_project_qkv, weight_sharing_copy)
from megaslide.models.dit import VideoDiT, patchify, unpatchify
from megaslide.nn.rope import RopeTable
from megaslide.parallel.apply import parallelize_dit
from megaslide.parallel.groups import group_size


@dataclass
class FullConfig:
    timesteps: tuple[float, ...] = FEW_STEP_TIMESTEPS  # descending, in (0, 1]; the last step goes to 0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the SP form: sp_mode, degrees, placement, ...
    precompute_rope: bool = True
    fused_qk_rope: bool = True

    def __post_init__(self):
        self.timesteps = tuple(float(t) for t in self.timesteps)

    def validate(self) -> None:
        check_timesteps(self.timesteps)
        self.parallel.validate()


class FullSequenceSampler:
    """Bidirectional sampling of a whole video of `frames` x `height` x `width` latents over `group`
    (None: this process alone). Every rank must pass the same noise and caption.

    The sampler runs its own parallelized copy of `model` (`self.model`, sharing the weights);
    the model passed in is left as it was."""

    def __init__(self, model: VideoDiT, *, frames: int, height: int, width: int,
                 config: FullConfig | None = None, group: dist.ProcessGroup | None = None, batch: int = 1):
        cfg = config or FullConfig()
        cfg.validate()
        mc = model.cfg
        self.grid = mc.token_grid(frames, height, width, keys=("frames", "height", "width"))  # or raises
        self.config, self.batch = cfg, batch
        self.group = group if group_size(group) > 1 else None
        self.model = parallelize_dit(weight_sharing_copy(model), self.group, cfg.parallel,
                                     project_qkv=None if cfg.fused_qk_rope else unfused_project_qkv)
        self.shape = (batch, mc.in_channels, frames, height, width)
        self.shard = TokenShard.of(math.prod(self.grid), self.group)
        self.device = next(model.parameters()).device
        self.rope_table = RopeTable(mc.head_dim, *self.grid)
        self._rope = self._lookup_rope() if cfg.precompute_rope else None

    def _lookup_rope(self) -> Rope:
        return shard_rope(self.rope_table, self.grid, 0, self.shard, self.device)  # (n, d/2) x 2

    def velocity(self, x: torch.Tensor, t: float, ctx: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        """This rank's rows x (B, n, pv*C) at time t in [0, 1] -> their velocity (B, n, pv*C) float32."""
        rope = self._rope if self._rope is not None else self._lookup_rope()
        tt = model_timesteps(t, self.batch, self.device)                                   # (B,)
        return forward_shard(self.model, x, tt, ctx, ctx_mask, rope, self.grid).float()  # (B, n, pv*C)

    @torch.no_grad()
    def sample(self, noise: torch.Tensor, context: torch.Tensor,
               context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """noise (B, C, T, H, W) -> the video's latents (B, C, T, H, W) float32, on every rank."""
        if tuple(noise.shape) != self.shape:
            raise ValueError(f"noise must be {self.shape} (B, C, T, H, W), as the sampler was built; "
                             f"got {tuple(noise.shape)}")
        patch = self.model.cfg.patch_size
        ctx, ctx_mask = self.model.embed_context(context, context_mask)         # (B, L, D), (B, L)
        x = self.shard.take(patchify(noise.to(self.device).float(), patch))     # (B, n, pv*C)
        x = euler_integrate(lambda x, t: self.velocity(x, t, ctx, ctx_mask), x, self.config.timesteps)
        return unpatchify(gather_rows(x, self.shard, self.group), self.grid, patch)  # (B, C, T, H, W)
