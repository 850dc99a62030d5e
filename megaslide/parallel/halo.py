"""A clip's token frames split over a sequence-parallel group, and the halo exchange between the ranks.

Rank r of P owns the token frames [T * r // P, T * (r + 1) // P) of a clip of T token frames (`FrameShard`):
consecutive runs whose lengths differ by at most one, every rank at least one frame when P <= T, no padding.
Its tokens are the clip's rows [t0 * H * W, t1 * H * W) in the DiT's row-major (t, y, x) order.

An attention whose queries read only nearby frames (DSA, Swin: `SelfAttention.frame_window`) runs on a rank
over the frames [a, b) its own queries read: its own frames and a halo on each side, the frames it needs of
other ranks. `exchange_halo` assembles them: every rank sends each other rank the part of its own frames that
the other one's window covers (usually a neighbour's boundary frames; a halo longer than a neighbour's shard
reaches further ranks), and in the backward the gradients of those halo frames travel back to their owners,
which add them to the gradients of their own frames. The exchange is point-to-point (isend / irecv) and only
between ranks that share frames.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaslide.parallel.groups import group_rank, group_size

Window = tuple[int, int]  # token frames [a, b)


@dataclass(frozen=True)
class FrameShard:
    """Rank `rank`'s run of whole token frames of a clip of `frames` frames of `frame_tokens` tokens each,
    over `world` ranks: frames [t0, t1), rows [start, start + valid) of the clip's token rows."""

    frames: int
    frame_tokens: int
    world: int
    rank: int

    def __post_init__(self) -> None:
        if not 1 <= self.world <= self.frames:
            raise ValueError(f"{self.world} sequence-parallel ranks cannot share a clip of {self.frames} token "
                             f"frames: parallel.sp must be at most the token frames")

    def bounds(self, rank: int) -> Window:
        """The token frames [t0, t1) rank `rank` owns."""
        return self.frames * rank // self.world, self.frames * (rank + 1) // self.world

    @property
    def t0(self) -> int:
        return self.bounds(self.rank)[0]

    @property
    def t1(self) -> int:
        return self.bounds(self.rank)[1]

    @property
    def start(self) -> int:
        """This rank's first token row."""
        return self.t0 * self.frame_tokens

    @property
    def valid(self) -> int:
        """This rank's token rows (all real: frame shards are not padded)."""
        return (self.t1 - self.t0) * self.frame_tokens

    n = valid

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows (B, valid, E) of the clip's rows (B, N, E)."""
        return rows[:, self.start:self.start + self.valid]


@dataclass(frozen=True)
class HaloPlan:
    """What this rank sends and receives for one exchange: (peer rank in the group, frames [f0, f1)), and the
    window [a, b) it assembles."""

    shard: FrameShard
    window: Window
    sends: tuple[tuple[int, Window], ...]
    recvs: tuple[tuple[int, Window], ...]


def halo_plan(shard: FrameShard, windows: list[Window]) -> HaloPlan:
    """The exchange in which rank r receives the frames of `windows[r]` it does not own (every rank passes the
    same `windows`, one per rank, each covering its rank's own frames)."""
    for r, (a, b) in enumerate(windows):
        t0, t1 = shard.bounds(r)
        if not 0 <= a <= t0 < t1 <= b <= shard.frames:
            raise ValueError(f"rank {r}'s window {(a, b)} must cover its frames {(t0, t1)} inside [0, {shard.frames})")

    def overlap(owner: int, reader: int) -> Window | None:
        (t0, t1), (a, b) = shard.bounds(owner), windows[reader]
        lo, hi = max(t0, a), min(t1, b)
        return (lo, hi) if owner != reader and lo < hi else None

    me, peers = shard.rank, range(shard.world)
    sends = tuple((j, w) for j in peers if (w := overlap(me, j)) is not None)
    recvs = tuple((j, w) for j in peers if (w := overlap(j, me)) is not None)
    return HaloPlan(shard, windows[me], sends, recvs)


def _exchange(outgoing: list[torch.Tensor], incoming: list[torch.Tensor], send_to: list[int], recv_from: list[int],
              group: dist.ProcessGroup) -> None:
    """Send outgoing[i] to group rank send_to[i] and receive incoming[i] from recv_from[i], all at once."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, j), group)
           for t, j in zip(outgoing, send_to)]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, j), group) for t, j in zip(incoming, recv_from)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _rows(frames: Window, origin: int, frame_tokens: int) -> slice:
    """The token rows of `frames` in a run of tokens that starts at frame `origin`."""
    return slice((frames[0] - origin) * frame_tokens, (frames[1] - origin) * frame_tokens)


def _empty_rows(like: torch.Tensor, frames: Window, frame_tokens: int) -> torch.Tensor:
    return like.new_empty(like.shape[0], (frames[1] - frames[0]) * frame_tokens, like.shape[2])  # (B, n, D)


class _HaloExchange(torch.autograd.Function):
    """Own frames' tokens (B, n_own, D) -> the window's tokens (B, (b - a) * H * W, D); the backward sends the
    halo's gradient to its owners and adds what comes back to the own frames' gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: HaloPlan, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.plan, ctx.group = plan, group
        shard, window = plan.shard, plan.window
        fr = shard.frame_tokens
        out = _empty_rows(x, window, fr)                                             # (B, (b-a)*fr, D)
        out[:, _rows((shard.t0, shard.t1), window[0], fr)] = x
        got = [_empty_rows(x, w, fr) for _, w in plan.recvs]
        _exchange([x[:, _rows(w, shard.t0, fr)] for _, w in plan.sends], got,
                  [j for j, _ in plan.sends], [j for j, _ in plan.recvs], group)
        for (_, w), g in zip(plan.recvs, got):
            out[:, _rows(w, window[0], fr)] = g
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        shard, a = plan.shard, plan.window[0]
        fr = shard.frame_tokens
        grad_x = grad[:, _rows((shard.t0, shard.t1), a, fr)].clone()                # (B, n_own, D)
        comes = [_empty_rows(grad, w, fr) for _, w in plan.sends]
        _exchange([grad[:, _rows(w, a, fr)] for _, w in plan.recvs], comes,
                  [j for j, _ in plan.recvs], [j for j, _ in plan.sends], ctx.group)
        for (_, w), g in zip(plan.sends, comes):
            grad_x[:, _rows(w, shard.t0, fr)] += g
        return grad_x, None, None


def exchange_halo(x: torch.Tensor, shard: FrameShard, windows: list[Window],
                  group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's own tokens x (B, n_own, D) -> the tokens of its window windows[rank] (B, (b - a) * H * W, D),
    the other ranks' frames received from them. Collective over `group`: every rank passes the same `windows`.
    Differentiable: the halo's gradient flows back to the rank that owns each frame."""
    if group_size(group) != shard.world or group_rank(group) != shard.rank:
        raise ValueError(f"the shard is rank {shard.rank} of {shard.world}, the group's rank {group_rank(group)} of "
                         f"{group_size(group)}")
    return _HaloExchange.apply(x, halo_plan(shard, windows), group)
