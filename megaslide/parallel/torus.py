"""Torus attention: the Ulysses all-to-all split into head chunks and pipelined with attention.

The h/U heads a rank owns after the exchange are split into C chunks. Chunk c+1's input
all-to-all (q, k, v together) is in flight while chunk c's attention runs, and chunk c's output
all-to-all overlaps chunk c+1's attention. Each chunk's attention is a ring over the mesh's ring
group (a plain local attention when ring_degree == 1), so Torus covers pure Ulysses (U = P) and
the Ulysses x Ring hybrid alike. The backward mirrors the pipeline: dO chunks go seq -> head,
the ring backward runs, and dQ/dK/dV chunks go head -> seq.

The collectives use async_op=True handles. On CUDA, NCCL runs them on its own stream, so they
overlap attention kernels on the current stream without a user-managed side stream; on gloo
they run on gloo's worker thread. Results equal `hybrid_attention` exactly (same math, chunked).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megaslide.parallel.groups import SPMesh, group_size
from megaslide.parallel.hybrid import hybrid_attention, mesh_ring_spec
from megaslide.parallel.ring import RingSpec, ring_backward, ring_forward
from megaslide.parallel.ulysses import PendingExchange, check_heads_divisible, start_head_to_seq, start_seq_to_head


def head_chunks(heads: int, chunks: int) -> list[tuple[int, int]]:
    """Split heads [0, heads) into `chunks` contiguous ranges of near-equal size."""
    if not 1 <= chunks <= heads:
        raise ValueError(f"chunks={chunks} must be between 1 and the heads per rank ({heads})")
    bounds = [heads * c // chunks for c in range(chunks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def pipeline(n_chunks: int, start_in: Callable[[int], PendingExchange],
             compute: Callable[[int, torch.Tensor], torch.Tensor],
             start_out: Callable[[torch.Tensor], PendingExchange],
             finish_out: Callable[[int, torch.Tensor], None]) -> None:
    """Run exchange-in -> compute -> exchange-out for every chunk, overlapping neighbours.

    Issue order (the same on every rank, as collectives require): in(0), in(1), out(0), in(2), out(1), ..."""
    incoming = start_in(0)
    outgoing = []
    for c in range(n_chunks):
        upcoming = start_in(c + 1) if c + 1 < n_chunks else None
        outgoing.append(start_out(compute(c, incoming.wait())))
        incoming = upcoming
    for c, pending in enumerate(outgoing):
        finish_out(c, pending.wait())


class _TorusAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, spec: RingSpec, chunks: list[tuple[int, int]]):
        b, n, h, d = q.shape
        p = group_size(group)
        scale = d ** -0.5
        qkv = torch.stack((q, k, v), dim=2).unflatten(3, (p, h // p))  # (B, n, 3, P, h/P, d)
        out = torch.empty(b, n, 1, p, h // p, d, dtype=q.dtype, device=q.device)  # (B, n, 1, P, h/P, d)
        saved: list[torch.Tensor] = []

        def compute(c: int, x: torch.Tensor) -> torch.Tensor:  # x (B, N, 3, hc, d)
            qc, kc, vc = (t.transpose(1, 2) for t in x.unbind(2))  # (B, hc, N, d)
            o, lse = ring_forward(qc, kc, vc, spec, scale)  # (B, hc, N, d), (B, hc, N)
            o = o.to(q.dtype)
            saved.extend((qc, kc, vc, o, lse))
            return o.transpose(1, 2).unsqueeze(2)  # (B, N, 1, hc, d)

        def finish_out(c: int, y: torch.Tensor) -> None:  # y (B, n, 1, P, hc, d)
            lo, hi = chunks[c]
            out[..., lo:hi, :] = y

        pipeline(len(chunks), lambda c: start_seq_to_head(qkv[..., chunks[c][0]:chunks[c][1], :], group),
                 compute, lambda y: start_head_to_seq(y, group), finish_out)
        ctx.save_for_backward(*saved)
        ctx.group, ctx.spec, ctx.chunks, ctx.scale = group, spec, chunks, scale
        return out.view(b, n, h, d)

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        group, chunks = ctx.group, ctx.chunks
        b, n, h, d = dout.shape
        p = group_size(group)
        dout = dout.unflatten(2, (p, h // p)).unsqueeze(2)  # (B, n, 1, P, h/P, d)
        grads = torch.empty(b, n, 3, p, h // p, d, dtype=dout.dtype, device=dout.device)  # (B, n, 3, P, h/P, d)

        def compute(c: int, x: torch.Tensor) -> torch.Tensor:  # x (B, N, 1, hc, d)
            qc, kc, vc, o, lse = saved[5 * c:5 * c + 5]
            dq, dk, dv = ring_backward(x[:, :, 0].transpose(1, 2), qc, kc, vc, o, lse, ctx.spec, ctx.scale)
            return torch.stack((dq, dk, dv)).permute(1, 3, 0, 2, 4).to(dout.dtype)  # (B, N, 3, hc, d)

        def finish_out(c: int, y: torch.Tensor) -> None:  # y (B, n, 3, P, hc, d)
            lo, hi = chunks[c]
            grads[..., lo:hi, :] = y

        pipeline(len(chunks), lambda c: start_seq_to_head(dout[..., chunks[c][0]:chunks[c][1], :], group),
                 compute, lambda y: start_head_to_seq(y, group), finish_out)
        dq, dk, dv = grads.flatten(3, 4).unbind(2)  # 3 x (B, n, h, d)
        return dq, dk, dv, None, None, None


def torus_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh, *, causal: bool,
                    seq_len: int | None, chunks: int | None = None, transport: str = "p2p") -> torch.Tensor:
    """q, k, v (B, n, h, d): this rank's contiguous shard. Returns its output shard (B, n, h, d).

    `chunks`: head chunks per rank (default min(h/U, 4)). With ulysses_degree == 1 there is no
    all-to-all to overlap and this is `hybrid_attention` (a ring)."""
    check_heads_divisible(q.shape[2], mesh.ulysses_degree)
    if mesh.ulysses_degree == 1:
        return hybrid_attention(q, k, v, mesh, causal=causal, seq_len=seq_len, transport=transport)
    heads_per_rank = q.shape[2] // mesh.ulysses_degree
    ranges = head_chunks(heads_per_rank, chunks if chunks is not None else min(heads_per_rank, 4))
    spec = mesh_ring_spec(mesh, q.shape[1], causal=causal, seq_len=seq_len, transport=transport, device=q.device)
    return _TorusAttention.apply(q, k, v, mesh.ulysses_group, spec, ranges)
