"""Ring attention: K/V blocks travel around the ring while each rank attends with its queries.

At step t, ring rank r holds the K/V block of ring rank (r - t) mod R. The block for step t+1
is already in flight (double buffering: isend/irecv, or a one-sided get, see onesided.py)
while step t computes. Partial results merge exactly through their log-sum-exp in fp32.

Backward (`ring_backward`) re-runs the ring with the saved output and lse: each rank adds its
queries' share of dK/dV to accumulators that travel with the K/V blocks, and after R passes
every accumulator is back at the rank that owns the block. dQ stays local.

Tensors here are in kernel layout (B, h, n, d); `ring_attention` is the (B, n, h, d) wrapper.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaslide.parallel.groups import group_rank, group_size, world_if_none
from megaslide.parallel.local_attn import (Layout, block_backward_, block_forward_, compute_dtype,
                                           contiguous_layout, plan_block_pairs)
from megaslide.parallel.onesided import SymmMemKVStream, resolve_transport


@dataclass(frozen=True)
class RingSpec:
    """A ring of `size` ranks over `group` (None when size == 1); this rank is ring rank `rank`.

    layouts[j]: the global token positions of ring rank j's block rows. Keys at positions >=
    `seq_len` are padding. `transport` moves K/V in the forward: "p2p" or "symm_mem"."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    layouts: tuple[Layout, ...]
    causal: bool
    seq_len: int | None
    transport: str = "p2p"

    @staticmethod
    def local(layout: Layout, *, causal: bool, seq_len: int | None) -> RingSpec:
        """A ring of one rank: plain local attention over `layout`."""
        return RingSpec(None, 0, 1, (layout,), causal, seq_len)

    def pairs(self, src: int):
        return plan_block_pairs(self.layouts[self.rank], self.layouts[src], causal=self.causal,
                                seq_len=self.seq_len)


@dataclass
class PendingPass:
    works: list
    recv: torch.Tensor
    sent: torch.Tensor  # kept alive until the send completes

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.recv


def ring_pass(x: torch.Tensor, spec: RingSpec, tag: int) -> PendingPass:
    """Send x to the next ring rank and receive the previous rank's x, asynchronously."""
    nxt = dist.get_global_rank(spec.group, (spec.rank + 1) % spec.size)
    prv = dist.get_global_rank(spec.group, (spec.rank - 1) % spec.size)
    recv = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, nxt, spec.group, tag), dist.P2POp(dist.irecv, recv, prv, spec.group, tag)]
    return PendingPass(dist.batch_isend_irecv(ops), recv, x)


class P2PKVStream:
    """Two-sided transport: the block of step t+1 is the one the previous rank held at step t."""

    def __init__(self, kv: torch.Tensor, spec: RingSpec):
        self.spec = spec
        self.current = kv
        self.pending: PendingPass | None = None

    def prefetch(self, step: int) -> None:
        self.pending = ring_pass(self.current, self.spec, tag=0)

    def get(self, step: int) -> torch.Tensor:
        if step > 0:
            self.current = self.pending.wait()
        return self.current

    def close(self) -> None:
        self.pending = None


def ring_blocks(k: torch.Tensor, v: torch.Tensor, spec: RingSpec) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (source ring rank, k block, v block) for steps 0..R-1; k, v (B, h, n, d).

    The transfer of step t+1's block starts before step t's block is handed out."""
    if spec.size == 1:
        yield spec.rank, k, v
        return
    kv = torch.stack((k, v))  # (2, B, h, n, d)
    stream = SymmMemKVStream(kv, spec.group, spec.rank, spec.size) if spec.transport == "symm_mem" \
        else P2PKVStream(kv, spec)
    for t in range(spec.size):
        block = stream.get(t)  # (2, B, h, n, d)
        if t + 1 < spec.size:
            stream.prefetch(t + 1)
        yield (spec.rank - t) % spec.size, block[0], block[1]
    stream.close()


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, h, n, d), k/v (B, h, nk, d) -> out (B, h, n, d) and lse (B, h, n), in fp32 (fp64)."""
    cdt = compute_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=cdt, device=q.device)  # (B, h, n, d)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=cdt, device=q.device)  # (B, h, n)
    for src, k_blk, v_blk in ring_blocks(k, v, spec):
        block_forward_(out, lse, q, k_blk, v_blk, spec.pairs(src), scale)
    return out, lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, spec: RingSpec, scale: float):
    """Gradients for this rank's q (B, h, n, d) and k/v (B, h, nk, d), given the forward's out
    (B, h, n, d) and lse (B, h, n). Returns dq, dk, dv in the accumulation dtype."""
    cdt = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)  # (B, h, n, d)
    if spec.size == 1:
        dk = torch.zeros(k.shape, dtype=cdt, device=k.device)  # (B, h, nk, d)
        dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
        block_backward_(dq, dk, dv, dout, q, k, v, out, lse, spec.pairs(spec.rank), scale)
        return dq, dk, dv
    kv = torch.stack((k, v))  # (2, B, h, nk, d): travels like the forward's blocks
    pending_dkv = None
    for t in range(spec.size):
        pending_kv = ring_pass(kv, spec, tag=0) if t + 1 < spec.size else None
        dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)  # (2, B, h, nk, d)
        block_backward_(dq, dkv[0], dkv[1], dout, q, kv[0], kv[1], out, lse,
                        spec.pairs((spec.rank - t) % spec.size), scale)
        if pending_dkv is not None:
            dkv += pending_dkv.wait()  # the accumulator of the same block, from the previous rank
        pending_dkv = ring_pass(dkv, spec, tag=1)
        if pending_kv is not None:
            kv = pending_kv.wait()
    dkv = pending_dkv.wait()  # one last pass brings every accumulator home
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: RingSpec):
        scale = q.shape[-1] ** -0.5
        out, lse = ring_forward(q, k, v, spec, scale)
        out = out.to(q.dtype)  # (B, h, n, d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.scale = spec, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.spec, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention_bhnd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec) -> torch.Tensor:
    """Differentiable ring attention in kernel layout: q (B, h, n, d), k/v (B, h, nk, d) -> (B, h, n, d)."""
    return _RingAttention.apply(q, k, v, spec)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                   *, causal: bool = False, seq_len: int | None = None, transport: str = "p2p") -> torch.Tensor:
    """Attention over the full sequence; q, k, v (B, n, h, d) are this rank's contiguous shard
    (SP rank r holds tokens [r*n, (r+1)*n)). Returns this rank's shard of the output (B, n, h, d)."""
    group = world_if_none(group)
    size, n = group_size(group), q.shape[1]
    layouts = tuple(contiguous_layout(j * n, n) for j in range(size))
    spec = RingSpec(group, group_rank(group), size, layouts, causal, seq_len,
                    resolve_transport(transport, group, q.device))
    out = ring_attention_bhnd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec)  # (B, h, n, d)
    return out.transpose(1, 2)  # (B, n, h, d)
