"""A video's token rows sharded over a sequence-parallel group: the state of SP sampling.

Sampling state lives in *patch-token space*: a latent clip (B, C, T, H, W) is its N patch rows
(B, N, pv*C) (`megaslide.models.dit.patchify`), rows in the DiT's row-major (t, y, x) token order.
The patch embedding and the final layer act on each row alone and the Euler update is
elementwise, so a rank embeds, denoises and un-embeds only its own rows (`forward_shard`, through
the model's `embed_shard` / `run_block` / `head` hooks); self-attention is the one place tokens
meet, and its sequence-parallel form (`megaslide.parallel.apply.parallelize_dit`, or an attention
override per block) does the communication.

Rank r of P holds rows [r * n, r * n + valid) with n = ceil(N / P) (`megaslide.parallel.padding`),
zero-padded at the tail to n rows. RoPE rows are looked up for exactly those tokens from the
global frame index, so no position information is communicated.
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaslide.models.dit import VideoDiT
from megaslide.nn.rope import RopeTable
from megaslide.parallel.groups import group_rank, group_size
from megaslide.parallel.padding import shard_len, shard_sequence, valid_len

Rope = tuple[torch.Tensor, torch.Tensor]
AttnFn = Callable[[torch.Tensor, Rope, tuple[int, int, int]], torch.Tensor]


def unfused_project_qkv(attn, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attn.project_qkv(h, rope)` with QK-norm and RoPE as separate PyTorch ops (the eager reference of
    `megaslide.nn.qk_rope`), where the model's own path fuses them on CUDA: the ablation `fused_qk_rope=False`."""
    return attn.project_qkv(h, rope, qk_rope_backend="reference")


@dataclass(frozen=True)
class TokenShard:
    """Rank `rank`'s contiguous, tail-padded shard of a `seq_len`-token sequence over `world` ranks."""

    seq_len: int
    world: int
    rank: int

    @property
    def n(self) -> int:
        """Rows per rank, padding included."""
        return shard_len(self.seq_len, self.world)

    @property
    def start(self) -> int:
        return min(self.rank * self.n, self.seq_len)

    @property
    def valid(self) -> int:
        """Real (non-padding) rows of this rank."""
        return valid_len(self.seq_len, self.world, self.rank)

    @classmethod
    def of(cls, seq_len: int, group: dist.ProcessGroup | None) -> TokenShard:
        """This process's shard over `group` (None: this process alone holds every row)."""
        return cls(seq_len, group_size(group), group_rank(group))

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard (B, n, E) of full rows (B, N, E)."""
        return shard_sequence(rows, self.world, self.rank)


def shard_positions(grid: tuple[int, int, int], t_start: int, shard: TokenShard):
    """Global (t, y, x) of this shard's real tokens, each (valid,): t = t_start + local frame."""
    _, H, W = grid
    idx = torch.arange(shard.start, shard.start + shard.valid)  # (valid,) row-major token index
    return t_start + idx // (H * W), (idx // W) % H, idx % W


def shard_rope(table: RopeTable, grid: tuple[int, int, int], t_start: int, shard: TokenShard,
               device: torch.device | str | None = None) -> Rope:
    """cos, sin (n, d/2) of this shard's tokens; padding rows get the identity rotation (cos 1, sin 0)."""
    cos, sin = table.lookup(*shard_positions(grid, t_start, shard))  # (valid, d/2) each
    pad = shard.n - shard.valid
    cos = F.pad(cos, (0, 0, 0, pad), value=1.0)                      # (n, d/2)
    sin = F.pad(sin, (0, 0, 0, pad), value=0.0)                      # (n, d/2)
    return cos.to(device), sin.to(device)


def gather_rows(rows: torch.Tensor, shard: TokenShard, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's shard (B, n, E) -> the full real rows (B, N, E) on every rank."""
    if shard.world == 1:
        return rows[:, :shard.seq_len]
    parts = [torch.empty_like(rows) for _ in range(shard.world)]
    dist.all_gather(parts, rows.contiguous(), group=group)
    return torch.cat(parts, dim=1)[:, :shard.seq_len]  # (B, N, E)


def weight_sharing_copy(model: VideoDiT) -> VideoDiT:
    """A copy of `model`'s modules that shares its parameters and buffers.

    A sampler parallelizes its copy (`parallelize_dit` works in place), so the caller's model
    keeps its one-device forward and can serve other samplers, each with its own SP form."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo=shared)


def forward_shard(model: VideoDiT, rows: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor,
                  rope: Rope, grid: tuple[int, int, int], attns: Sequence[AttnFn] | None = None,
                  head: bool = True) -> torch.Tensor | None:
    """The DiT on a shard: rows x (B, n, pv*C) at model timesteps t (B,) -> velocity rows (B, n, pv*C).

    ctx, ctx_mask from `model.embed_context`; rope: cos, sin (n, d/2) of these rows; grid: the token
    grid of the whole sequence; attns[i](h, rope, grid) -> (B, n, D), if given, replaces block i's
    self-attention. head=False stops after the last block and returns None (a forward run only for
    its side effects, e.g. filling a KV cache)."""
    e = model.embed_shard(rows, t, ctx, ctx_mask, rope, grid)
    h = e.x                                                                      # (B, n, D)
    for i in range(len(model.blocks)):
        h = model.run_block(i, h, e, None if attns is None else attns[i])        # (B, n, D)
    return model.head(h, e) if head else None                                    # (B, n, pv*C)
