"""The DiT run on one rank's shard of the token sequence: the core of sequence-parallel sampling.

Sampling state lives in *patch-token space*: a latent clip (B, C, T, H, W) is cut into its N
patches, one row of pv * C values per token (pv = pt * ph * pw, order (pt, ph, pw, C), the
order of the final layer's output), rows in the DiT's row-major (t, y, x) token order. The
patch embedding and the final layer act on each row alone, and the Euler update is
elementwise, so a rank embeds, denoises and un-embeds only its own rows; self-attention is
the one place tokens meet, and the caller supplies it per block (through the `attn=`
override of `DiTBlock`) with whatever communication it needs.

Rank r of P holds rows [r * n, r * n + valid) with n = ceil(N / P) (`megaslide.parallel.padding`),
zero-padded at the tail to n rows. RoPE rows are looked up for exactly those tokens from the
global frame index, so no position information is communicated.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megaslide.inference.fused import qk_norm_rope
from megaslide.inference.launch import group_rank, group_size
from megaslide.models.dit import N_MOD, VideoDiT
from megaslide.nn.rope import RopeTable
from megaslide.parallel.padding import shard_len, shard_sequence, valid_len

Rope = tuple[torch.Tensor, torch.Tensor]
AttnFn = Callable[[torch.Tensor, Rope, tuple[int, int, int]], torch.Tensor]


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
        return cls(seq_len, group_size(group), group_rank(group))

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard (B, n, E) of full rows (B, N, E)."""
        return shard_sequence(rows, self.world, self.rank)


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Latents (B, C, T, H, W) -> rows (B, N, pv*C), row-major tokens, values in (pt, ph, pw, C) order."""
    B, C, T, H, W = x.shape
    pt, ph, pw = patch
    x = x.reshape(B, C, T // pt, pt, H // ph, ph, W // pw, pw)      # (B, C, T', pt, H', ph, W', pw)
    x = x.permute(0, 2, 4, 6, 3, 5, 7, 1)                            # (B, T', H', W', pt, ph, pw, C)
    return x.reshape(B, (T // pt) * (H // ph) * (W // pw), pt * ph * pw * C)  # (B, N, pv*C)


def unpatchify(rows: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """Rows (B, N, pv*C) -> latents (B, C, T, H, W); the inverse of `patchify`."""
    B = rows.shape[0]
    T, H, W = grid
    pt, ph, pw = patch
    x = rows.reshape(B, T, H, W, pt, ph, pw, -1)               # (B, T', H', W', pt, ph, pw, C)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)                      # (B, C, T', pt, H', ph, W', pw)
    return x.reshape(B, x.shape[1], T * pt, H * ph, W * pw)    # (B, C, T, H, W)


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
    if group is None:
        return rows[:, :shard.seq_len]
    parts = [torch.empty_like(rows) for _ in range(shard.world)]
    dist.all_gather(parts, rows.contiguous(), group=group)
    return torch.cat(parts, dim=1)[:, :shard.seq_len]  # (B, N, E)


class ShardedDiT:
    """A VideoDiT evaluated on a token shard with a caller-given self-attention per block.

    Holds the patch embedding as a (D, pv*C) matrix over rows (a Conv3d whose kernel equals its
    stride is a linear map of each patch). Build it after the model is on its device and dtype.
    `fused_qk=True` computes QK-norm + RoPE with `megaslide.inference.fused.qk_norm_rope`."""

    def __init__(self, model: VideoDiT, fused_qk: bool = False, qk_backend: str = "auto"):
        self.model = model
        self.cfg = model.cfg
        self.fused_qk, self.qk_backend = fused_qk, qk_backend
        w = model.patch_embed.proj.weight.detach()                        # (D, C, pt, ph, pw)
        self.embed_weight = w.permute(0, 2, 3, 4, 1).reshape(w.shape[0], -1)  # (D, pv*C), (pt, ph, pw, C) order
        self.embed_bias = model.patch_embed.proj.bias.detach()             # (D,)
        self.dtype = w.dtype

    def encode_context(self, context: torch.Tensor, context_mask: torch.Tensor | None = None):
        """Caption ids (B, L) or embeddings (B, L, Dt) -> ctx (B, L, D), ctx_mask (B, L); once per video."""
        ctx, mask = self.model.encode_text(context, context_mask)  # (B, L, Dt), (B, L)
        return self.model.text_proj(ctx.to(self.dtype)), mask        # (B, L, D), (B, L)

    def project_qkv(self, attn: nn.Module, h: torch.Tensor, rope: Rope):
        """Block input h (B, n, D) -> q, k, v (B, n, heads, d) with QK-norm and RoPE applied."""
        if not self.fused_qk:
            return attn.project_qkv(h, rope)
        B, n, _ = h.shape
        q, k, v = attn.qkv(h).chunk(3, dim=-1)                     # (B, n, D) each
        weights = [getattr(norm, "weight", None) for norm in (attn.q_norm, attn.k_norm)]
        eps = getattr(attn.q_norm, "eps", None)
        eps = torch.finfo(h.dtype).eps if eps is None else eps  # nn.RMSNorm's default
        q, k = qk_norm_rope(q, k, *weights, *rope, heads=attn.num_heads, eps=eps,
                            backend=self.qk_backend)                 # (B, n, h, d) each
        return q, k, v.view(B, n, attn.num_heads, attn.head_dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor,
                rope: Rope, grid: tuple[int, int, int], attns: Sequence[AttnFn],
                head: bool = True) -> torch.Tensor | None:
        """Rows x (B, n, pv*C) at model timesteps t (B,) in [0, 1000] -> velocity rows (B, n, pv*C).

        rope: cos, sin (n, d/2) of these rows; attns[i](h, rope, grid) -> (B, n, D) is block i's
        self-attention. head=False stops after the last block and returns None (a forward run
        only for its side effects, e.g. filling a KV cache)."""
        m = self.model
        h = F.linear(x.to(self.dtype), self.embed_weight, self.embed_bias)  # (B, n, D)
        low = self.dtype in (torch.bfloat16, torch.float16)
        with torch.autocast(x.device.type, dtype=self.dtype, enabled=low, cache_enabled=False):
            t_emb = m.t_embed(t).to(self.dtype)                             # (B, D); fp32 features in
        t_mod = m.t_proj(t_emb).unflatten(1, (N_MOD, -1))                   # (B, 9, D)
        for block, attn in zip(m.blocks, attns):
            h = block(h, t_mod, ctx, ctx_mask, rope, grid, attn=attn)       # (B, n, D)
        if not head:
            return None
        return m.final(h, t_emb)                                            # (B, n, pv*C)


@torch.no_grad()
def random_weights_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter with seeded random values (identical on every rank of one device type).

    Matrices get N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2), other vectors N(0, 0.1^2). Unlike
    the adaLN-Zero init, no gate or output layer is zero, so every path of the network carries
    signal: what speed and equivalence checks of an untrained model need."""
    norms = {id(mod.weight) for mod in model.modules()
             if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) and mod.weight is not None}
    for i, p in enumerate(model.parameters()):
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if p.dim() >= 2:
            p.copy_(noise / p[0].numel() ** 0.5)
        elif id(p) in norms:
            p.copy_(1 + 0.1 * noise)
        else:
            p.copy_(0.1 * noise)
    return model
