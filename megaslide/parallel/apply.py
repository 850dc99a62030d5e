"""Sequence parallelism applied to a built VideoDiT from outside, as torchtitan applies its parallelisms.

`parallelize_dit(model, mesh_or_group, parallel)` swaps each block's self-attention for its
sequence-parallel form, `SequenceParallelAttention`; nothing else in the model changes, and the
model code stays single-device. Afterwards the model runs on token shards: rank r of the P ranks
of the SP group holds a contiguous run of the video's token rows (`megaslide.inference.sharded.TokenShard`),
embeds it with `VideoDiT.embed_shard`, runs the blocks, and maps its tokens back with
`VideoDiT.head`. Self-attention is the one place tokens meet, and the SP form runs it over all N
tokens with `sequence_parallel_attention` in the form `parallel` (a `ParallelConfig`: sp_mode, the
degrees, placement, transport, chunks) says. One rank (no group, None, or a group of one) keeps the
attention local.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megaslide.attention.dense import DenseAttention
from megaslide.config import ParallelConfig
from megaslide.models.dit import VideoDiT
from megaslide.parallel import resolve_degrees, sequence_parallel_attention
from megaslide.parallel.groups import SPMesh, group_size

Rope = tuple[torch.Tensor, torch.Tensor]
ProjectQKV = Callable[[DenseAttention, torch.Tensor, Rope], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class SequenceParallelAttention(nn.Module):
    """A block's dense self-attention over a token sequence sharded across `group`: h (B, n, D) -> (B, n, D).

    The weights are those of the wrapped attention (`inner`). `project_qkv(inner, h, rope)`, if
    given, computes q, k, v (B, n, heads, d) instead of `inner.project_qkv` (inference passes a
    fused kernel). The sequence is the token grid `grid` of the block call: its N = prod(grid) real
    tokens are sharded contiguously, tail-padded to n rows per rank."""

    def __init__(self, inner: DenseAttention, group: dist.ProcessGroup | None, parallel: ParallelConfig, *,
                 project_qkv: ProjectQKV | None = None):
        super().__init__()
        self.inner = inner
        self.group, self.world, self.parallel = group, group_size(group), parallel
        self._project_qkv = project_qkv

    def project_qkv(self, h: torch.Tensor, rope: Rope):
        """h (B, n, D) -> q, k, v (B, n, heads, d), QK-norm and RoPE applied (rope: cos, sin (n, d/2))."""
        if self._project_qkv is None:
            return self.inner.project_qkv(h, rope)
        return self._project_qkv(self.inner, h, rope)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.inner.project_out(o)  # (B, n, heads, d) -> (B, n, D)

    def forward(self, h: torch.Tensor, rope: Rope, grid: tuple[int, int, int]) -> torch.Tensor:
        q, k, v = self.project_qkv(h, rope)                  # (B, n, heads, d) each
        if self.world == 1:
            o = self.inner.attend(q, k, v, h, grid)          # (B, N, heads, d)
        else:
            p = self.parallel
            o = sequence_parallel_attention(q, k, v, mode=p.sp_mode, group=self.group, seq_len=math.prod(grid),
                                            ulysses_degree=p.ulysses_degree, ring_degree=p.ring_degree,
                                            placement=p.placement, transport=p.transport,
                                            chunks=p.chunks)  # (B, n, heads, d)
        return self.project_out(o)                           # (B, n, D)


def parallelize_dit(model: VideoDiT, mesh_or_group: SPMesh | dist.ProcessGroup | None,
                    parallel: ParallelConfig | None = None, *, project_qkv: ProjectQKV | None = None) -> VideoDiT:
    """Swap every block's self-attention of `model` for its sequence-parallel form, in place; returns `model`.

    mesh_or_group: the SP process group; None (no group) is this process alone, whose attention
      stays local; an `SPMesh` from `build_mesh` fixes the group (the mesh's parent),
      parallel.ulysses_degree, parallel.ring_degree and parallel.placement.
    parallel: the form (default `ParallelConfig()`: Ulysses), checked here (ValueError before any collective).
    project_qkv(attn, h, rope) -> q, k, v: how each block projects its heads (None: its own way).
    Applied again, it replaces the SP form. Only dense attention has one: other variants attend
    locally by design (windows, deformable neighbourhoods) and raise ValueError."""
    parallel = parallel or ParallelConfig()
    group = mesh_or_group
    if isinstance(mesh_or_group, SPMesh):
        mesh = mesh_or_group
        if mesh.parent is None:
            raise ValueError("the mesh has no parent group: build it with megaslide.parallel.build_mesh")
        group = mesh.parent
        parallel = dataclasses.replace(parallel, placement=mesh.placement, ulysses_degree=mesh.ulysses_degree,
                                       ring_degree=mesh.ring_degree)
    parallel.validate()
    if group_size(group) > 1:
        resolve_degrees(parallel.sp_mode, group_size(group), model.cfg.num_heads, parallel.ulysses_degree,
                        parallel.ring_degree)
    for block in model.blocks:
        inner = block.attn.inner if isinstance(block.attn, SequenceParallelAttention) else block.attn
        if not isinstance(inner, DenseAttention):
            raise ValueError(f"attention {model.cfg.attention.name!r} has no sequence-parallel form; "
                             f"sequence parallelism runs dense attention: use attention=dense")
        block.attn = SequenceParallelAttention(inner, group, parallel, project_qkv=project_qkv)
    return model
