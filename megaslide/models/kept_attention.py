"""One block's kept self-attention (offload.keep_attention, megaslide/attention/kept.py): its output and
log-sum-exp over the whole clip, recorded by the streamed forward and replayed by the backward's recompute.

A block run whole keeps the op's out and lse as the op made them. A block run over frame slabs (a variant of
bounded reach: DSA, whose op returns out in q's shape (B, t, H, W, heads, d) and lse (B, heads, n)) keeps the
rows each slab keeps, in clip buffers out (B, N, heads, d) and lse (B, heads, N). Replaying a slab, its halo
rows get out 0 and lse +inf: their output gradient is 0, so their softmax probabilities exp(s - lse) only ever
multiply zeros, and with lse +inf they are 0 themselves; the kept rows' out and lse are the slab's own.
"""
from __future__ import annotations

import math

import torch

from megaslide.attention.kept import Record, Replay


class KeptAttention:
    """A block's kept attention: empty (the streamed forward records into it) or holding `out` and `lse`
    (the backward replays them)."""

    def __init__(self, out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        self.out, self.lse = out, lse
        self.recording = out is None

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What is kept (out, lse): what the engine stores, on the device or in host RAM."""
        return [self.out, self.lse]

    def whole(self) -> Record | Replay:
        """`keep` for the attention over the whole clip."""
        return _WholeRecord(self) if self.recording else Replay(self.out, self.lse)

    def slab(self, slab: tuple[int, int, int, int], frame_tokens: int, tokens: int) -> Record | Replay:
        """`keep` for the attention over slab (a, t0, t1, b) (`frame_slabs`) of a clip of `tokens` tokens,
        `frame_tokens` per frame."""
        a, t0, t1, b = slab
        rows = slice(t0 * frame_tokens, t1 * frame_tokens)                    # kept rows in the clip
        keep = slice((t0 - a) * frame_tokens, (t1 - a) * frame_tokens)       # the same rows in the slab
        if self.recording:
            return _SlabRecord(self, rows, keep, tokens)
        return _SlabReplay(self, rows, keep, (b - a) * frame_tokens)


class _WholeRecord(Record):
    def __init__(self, kept: KeptAttention):
        super().__init__()
        self.kept = kept

    def __call__(self, op, *inputs):
        out = super().__call__(op, *inputs)
        self.kept.out, self.kept.lse = self.out, self.lse
        return out


class _SlabRecord(Record):
    def __init__(self, kept: KeptAttention, rows: slice, keep: slice, tokens: int):
        super().__init__()
        self.kept, self.rows, self.keep, self.tokens = kept, rows, keep, tokens

    def __call__(self, op, *inputs):
        out = super().__call__(op, *inputs)                                   # (B, t, H, W, h, d)
        B, h, d = out.shape[0], out.shape[-2], out.shape[-1]
        if self.kept.out is None:
            self.kept.out = out.new_empty((B, self.tokens, h, d))             # (B, N, h, d)
            self.kept.lse = self.lse.new_empty((B, h, self.tokens))           # (B, h, N)
        self.kept.out[:, self.rows] = out.view(B, -1, h, d)[:, self.keep]
        self.kept.lse[:, :, self.rows] = self.lse[:, :, self.keep]
        return out


class _SlabReplay(Replay):
    def __init__(self, kept: KeptAttention, rows: slice, keep: slice, n: int):
        B, _, h, d = kept.out.shape
        out = kept.out.new_zeros((B, n, h, d))                                # (B, n, h, d)
        lse = kept.lse.new_full((B, h, n), math.inf)                          # (B, h, n)
        out[:, keep] = kept.out[:, rows]
        lse[:, :, keep] = kept.lse[:, :, rows]
        super().__init__(out, lse)

    def __call__(self, op, *inputs):
        self.out = self.out.view(inputs[0].shape)                             # q's shape (B, t, H, W, h, d)
        return super().__call__(op, *inputs)
