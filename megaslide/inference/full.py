"""Full-sequence sampling over P ranks: the bidirectional baseline of causal generation.

All latent frames are denoised at once, as xDiT and Wan's own multi-GPU inference do: the
video's row-major tokens are sharded contiguously over the SP group (tail-padded when N % P
!= 0, `sharded.TokenShard`), and every block's self-attention is
`megaslide.parallel.sequence_parallel_attention` in the chosen mode (ulysses, ring, hybrid,
torus) over all N tokens, plugged in through the `attn=` override of `DiTBlock`. The sampler is
the same rectified-flow Euler as causal generation, with the same timesteps (default four
steps: t = 1.0, 0.75, 0.5, 0.25 -> 0). RoPE rows of each rank's tokens are looked up once
(`precompute_rope`) and QK-norm + RoPE can be fused, as in the causal generator; there are no
CUDA graphs (at tens of thousands of tokens per forward, launch overhead is negligible).

    torchrun --standalone --nproc_per_node 2 -m megaslide.inference.full --preset wan-1.3b \
        --frames 21 --height 60 --width 104 --out full.pt
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaslide.diffusion.flow import TIME_SCALE
from megaslide.inference.causal import DEFAULT_TIMESTEPS
from megaslide.inference.launch import add_model_args, build_model, group_size, init_distributed, shutdown
from megaslide.inference.sharded import Rope, ShardedDiT, TokenShard, gather_rows, patchify, shard_rope, unpatchify
from megaslide.models.dit import VideoDiT
from megaslide.nn.rope import RopeTable
from megaslide.parallel import MODES, PLACEMENTS, TRANSPORTS, resolve_degrees, sequence_parallel_attention


@dataclass
class FullConfig:
    timesteps: tuple[float, ...] = DEFAULT_TIMESTEPS  # descending, in (0, 1]; the last step goes to 0
    mode: str = "ulysses"                            # a sequence_parallel_attention mode
    ulysses_degree: int | None = None                # for mode hybrid / torus
    ring_degree: int | None = None
    placement: str = "ulysses_intra"                 # sequence_parallel_attention's placement, transport, chunks
    transport: str = "p2p"
    chunks: int | None = None
    precompute_rope: bool = True
    fused_qk_rope: bool = True

    def __post_init__(self):
        self.timesteps = tuple(float(t) for t in self.timesteps)

    def validate(self) -> None:
        ts = self.timesteps
        if not ts or any(not 0 < t <= 1 for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
            raise ValueError(f"timesteps={ts} must be strictly descending values in (0, 1]")
        for name, value, known in (("mode", self.mode, MODES), ("placement", self.placement, PLACEMENTS),
                                   ("transport", self.transport, TRANSPORTS)):
            if value not in known:
                raise ValueError(f"{name}={value!r}: choose one of {known}")


class SPAttention:
    """Block `layer`'s self-attention over the whole sharded sequence: h (B, n, D) -> (B, n, D)."""

    def __init__(self, runner: ShardedDiT, layer: int, group: dist.ProcessGroup | None, seq_len: int,
                 config: FullConfig):
        self.runner, self.group, self.seq_len, self.config = runner, group, seq_len, config
        self.attn = runner.model.blocks[layer].attn

    def __call__(self, h: torch.Tensor, rope: Rope, grid: tuple[int, int, int]) -> torch.Tensor:
        q, k, v = self.runner.project_qkv(self.attn, h, rope)  # (B, n, h, d) each
        if self.group is None:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            o = o.transpose(1, 2)                               # (B, N, h, d)
        else:
            c = self.config
            o = sequence_parallel_attention(q, k, v, mode=c.mode, group=self.group, ulysses_degree=c.ulysses_degree,
                                            ring_degree=c.ring_degree, seq_len=self.seq_len, placement=c.placement,
                                            transport=c.transport, chunks=c.chunks)  # (B, n, h, d)
        return self.attn.project_out(o)                         # (B, n, D)


class FullSequenceSampler:
    """Bidirectional sampling of a whole video of `frames` x `height` x `width` latents over `group`
    (None: one rank). Every rank must pass the same noise and caption."""

    def __init__(self, model: VideoDiT, *, frames: int, height: int, width: int,
                 config: FullConfig | None = None, group: dist.ProcessGroup | None = None, batch: int = 1):
        cfg = config or FullConfig()
        cfg.validate()
        mc = model.cfg
        self.grid = mc.token_grid(frames, height, width)  # raises if the video does not patchify
        P = group_size(group)
        if P > 1:
            resolve_degrees(cfg.mode, P, mc.num_heads, cfg.ulysses_degree, cfg.ring_degree)  # ValueError early
        self.model, self.config, self.batch = model, cfg, batch
        self.group = group if P > 1 else None
        self.shape = (batch, mc.in_channels, frames, height, width)
        self.shard = TokenShard.of(math.prod(self.grid), self.group)
        self.device = next(model.parameters()).device
        self.runner = ShardedDiT(model, fused_qk=cfg.fused_qk_rope)
        self.rope_table = RopeTable(mc.head_dim, *self.grid)
        self.attns = [SPAttention(self.runner, i, self.group, self.shard.seq_len, cfg) for i in range(mc.depth)]
        self._rope = self._lookup_rope() if cfg.precompute_rope else None

    def _lookup_rope(self) -> Rope:
        return shard_rope(self.rope_table, self.grid, 0, self.shard, self.device)  # (n, d/2) x 2

    @torch.no_grad()
    def sample(self, noise: torch.Tensor, context: torch.Tensor,
               context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """noise (B, C, T, H, W) -> the video's latents (B, C, T, H, W) float32, on every rank."""
        if tuple(noise.shape) != self.shape:
            raise ValueError(f"noise must be {self.shape} (B, C, T, H, W), as the sampler was built; "
                             f"got {tuple(noise.shape)}")
        ctx, ctx_mask = self.runner.encode_context(context, context_mask)      # (B, L, D), (B, L)
        x = self.shard.take(patchify(noise.to(self.device).float(), self.model.cfg.patch_size))  # (B, n, pv*C)
        ts = self.config.timesteps
        for t, t_next in zip(ts, ts[1:] + (0.0,)):
            tt = torch.full((self.batch,), t * TIME_SCALE, device=self.device)  # (B,) model timestep
            rope = self._rope if self._rope is not None else self._lookup_rope()
            v = self.runner.forward(x, tt, ctx, ctx_mask, rope, self.grid, self.attns)  # (B, n, pv*C)
            x = x + (t_next - t) * v.float()
        rows = gather_rows(x, self.shard, self.group)                           # (B, N, pv*C)
        return unpatchify(rows, self.grid, self.model.cfg.patch_size)          # (B, C, T, H, W)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Full-sequence sequence-parallel sampling (run under torchrun)")
    add_model_args(parser)
    parser.add_argument("--mode", default="ulysses", choices=MODES)
    parser.add_argument("--placement", default="ulysses_intra", choices=PLACEMENTS)
    parser.add_argument("--transport", default="p2p", choices=TRANSPORTS)
    args = parser.parse_args(argv)
    ctx = init_distributed(args.device)
    model, noise, ids = build_model(args, ctx)
    sampler = FullSequenceSampler(model, frames=args.frames, height=args.height, width=args.width,
                                  config=FullConfig(mode=args.mode, placement=args.placement, transport=args.transport),
                                  group=ctx.group)
    video = sampler.sample(noise, ids)
    if ctx.is_main:
        torch.save(video.cpu(), args.out)
        print(f"wrote latents {tuple(video.shape)} to {args.out}", flush=True)
    shutdown(ctx)


if __name__ == "__main__":
    main()
