"""Ulysses x Ring hybrid (USP-style): all-to-all inside Ulysses groups, ring across them.

With U x R = P ranks placed by `groups.build_mesh`: the Ulysses all-to-all gives each rank
h/U heads of the U*n tokens of its Ulysses group; ring attention over the R groups then covers
the whole sequence for those heads; the inverse all-to-all returns (B, n, h, d). With the
"ring_intra" placement a Ulysses group's tokens are not contiguous; the ring's layouts carry
their true positions, so causal masks and padding stay exact.
"""
from __future__ import annotations

import torch

from megaslide.parallel.groups import SPMesh
from megaslide.parallel.onesided import resolve_transport
from megaslide.parallel.ring import RingSpec, ring_attention_bhnd
from megaslide.parallel.ulysses import check_heads_divisible, head_to_seq, seq_to_head_qkv


def mesh_ring_spec(mesh: SPMesh, shard_len: int, *, causal: bool, seq_len: int | None, transport: str,
                   device: torch.device) -> RingSpec:
    """The ring over `mesh.ring_group` after the Ulysses exchange of shards of `shard_len` tokens."""
    resolved = resolve_transport(transport, mesh.ring_group, device) if mesh.ring_degree > 1 else "p2p"
    return RingSpec(mesh.ring_group, mesh.ring_rank, mesh.ring_degree, mesh.ring_layouts(shard_len),
                    causal, seq_len, resolved)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh, *, causal: bool,
                     seq_len: int | None, transport: str = "p2p") -> torch.Tensor:
    """q, k, v (B, n, h, d): this rank's contiguous shard. Returns its output shard (B, n, h, d)."""
    check_heads_divisible(q.shape[2], mesh.ulysses_degree)
    spec = mesh_ring_spec(mesh, q.shape[1], causal=causal, seq_len=seq_len, transport=transport, device=q.device)
    if mesh.ulysses_degree > 1:
        q, k, v = seq_to_head_qkv(q, k, v, mesh.ulysses_group)  # (B, U*n, h/U, d)
    out = ring_attention_bhnd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec)  # (B, h/U, U*n, d)
    out = out.transpose(1, 2)  # (B, U*n, h/U, d)
    return head_to_seq(out, mesh.ulysses_group) if mesh.ulysses_degree > 1 else out  # (B, n, h, d)
