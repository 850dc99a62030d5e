"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

With P ranks, rank p holds tokens [p*n, (p+1)*n) of every head before the exchange and all N = P*n
tokens of heads [p*h/P, (p+1)*h/P) after it. Attention then runs locally on whole sequences.

Layouts used by the exchange (G stacks tensors that travel together, e.g. q, k, v):
  sequence-sharded (B, n, G, P, hc, d)  <->  head-sharded (B, P*n, G, hc, d)
where hc heads of each of the P head blocks travel (hc = h/P for a plain exchange, fewer for the
head chunks of Torus). `seq_to_head` / `head_to_seq` are the simple public (B, n, h, d) forms.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaslide.parallel.groups import group_size, world_if_none
from megaslide.parallel.local_attn import contiguous_layout
from megaslide.parallel.ring import RingSpec, ring_attention_bhnd


@dataclass
class PendingExchange:
    """An all-to-all in flight; `wait()` returns the received tensor in its final layout."""

    work: dist.Work | None
    recv: torch.Tensor
    layout: str  # "head" -> (B, P*n, G, hc, d); "seq" -> (B, n, G, P, hc, d)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        p, b, n, g, hc, d = self.recv.shape  # source rank first
        if self.layout == "head":
            return self.recv.permute(1, 0, 2, 3, 4, 5).reshape(b, p * n, g, hc, d)  # (B, P*n, G, hc, d)
        return self.recv.permute(1, 2, 3, 0, 4, 5)  # (B, n, G, P, hc, d)


def start_seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> PendingExchange:
    """Start the exchange of x (B, n, G, P, hc, d): head block p goes to rank p, which receives
    every rank's tokens. `.wait()` gives (B, P*n, G, hc, d)."""
    send = x.permute(3, 0, 1, 2, 4, 5).contiguous()  # (P, B, n, G, hc, d): destination first
    recv = torch.empty_like(send)  # (P, B, n, G, hc, d): source first
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return PendingExchange(work, recv, "head")


def start_head_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> PendingExchange:
    """Start the inverse exchange of y (B, P*n, G, hc, d): token block p goes back to rank p.
    `.wait()` gives (B, n, G, P, hc, d) with the heads of source rank p at index p."""
    p = group_size(group)
    send = y.unflatten(1, (p, y.shape[1] // p)).transpose(0, 1).contiguous()  # (P, B, n, G, hc, d)
    recv = torch.empty_like(send)  # (P, B, n, G, hc, d): source first
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return PendingExchange(work, recv, "seq")


def _split_heads(x: torch.Tensor, p: int) -> torch.Tensor:
    return x.unflatten(3, (p, x.shape[3] // p))  # (B, n, G, P, h/P, d)


class _SeqToHead(torch.autograd.Function):
    """(B, n, G, h, d) -> (B, P*n, G, h/P, d); the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return start_seq_to_head(_split_heads(x, group_size(group)), group).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = start_head_to_seq(grad, ctx.group).wait()  # (B, n, G, P, h/P, d)
        b, n, gg, p, hp, d = g.shape
        return g.reshape(b, n, gg, p * hp, d), None


class _HeadToSeq(torch.autograd.Function):
    """(B, P*n, G, h/P, d) -> (B, n, G, h, d); the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = start_head_to_seq(y, group).wait()  # (B, n, G, P, h/P, d)
        b, n, g, p, hp, d = x.shape
        return x.reshape(b, n, g, p * hp, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return start_seq_to_head(_split_heads(grad, group_size(ctx.group)), ctx.group).wait(), None


def check_heads_divisible(heads: int, degree: int) -> None:
    if heads % degree:
        raise ValueError(f"heads={heads} is not divisible by the Ulysses degree {degree}: pick a "
                         f"ulysses_degree that divides the head count, or use mode='ring' / 'hybrid'")


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sequence shard (B, n, h, d) -> head shard (B, P*n, h/P, d) over `group` (P ranks; None: the world).

    Differentiable. Rank p receives heads [p*h/P, (p+1)*h/P) of all P*n tokens, ordered by rank."""
    group = world_if_none(group)
    check_heads_divisible(x.shape[2], group_size(group))
    return _SeqToHead.apply(x.unsqueeze(2), group).squeeze(2)


def head_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Head shard (B, P*n, h/P, d) -> sequence shard (B, n, h, d); the inverse of `seq_to_head`."""
    group = world_if_none(group)
    p = group_size(group)
    if y.shape[1] % p:
        raise ValueError(f"head_to_seq: sequence length {y.shape[1]} is not divisible by the group size {p}")
    return _HeadToSeq.apply(y.unsqueeze(2), group).squeeze(2)


def seq_to_head_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None):
    """`seq_to_head` of q, k, v (each (B, n, h, d)) in ONE all-to-all; returns three (B, P*n, h/P, d)."""
    group = world_if_none(group)
    check_heads_divisible(q.shape[2], group_size(group))
    qkv = torch.stack((q, k, v), dim=2)  # (B, n, 3, h, d)
    return _SeqToHead.apply(qkv, group).unbind(2)  # 3 x (B, P*n, h/P, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                      *, causal: bool, seq_len: int | None) -> torch.Tensor:
    """Attention over the full sequence with q, k, v sequence-sharded (B, n, h, d) over `group`.

    One all-to-all for q, k, v together, attention on (B, P*n, h/P, d), one all-to-all back.
    Keys at positions >= seq_len (padding) are ignored. Returns (B, n, h, d)."""
    qh, kh, vh = seq_to_head_qkv(q, k, v, group)  # (B, N, h/P, d)
    spec = RingSpec.local(contiguous_layout(0, qh.shape[1]), causal=causal, seq_len=seq_len)
    out = ring_attention_bhnd(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), spec)  # (B, h/P, N, d)
    return head_to_seq(out.transpose(1, 2), group)  # (B, n, h, d)
