"""Selective recompute of self-attention: an attention op split at its softmax statistics.

A fused attention keeps its output `out` and the log-sum-exp `lse` of every query's scores for its backward,
which needs nothing else from the forward: p = exp(s - lse) is recomputed tile by tile from q and k. So a
backward that is handed the out and lse of an earlier forward on the same q, k, v gives exactly the gradients
of a backward after running that forward again. The offload engine uses that to skip the attention forward of
its recompute (offload.keep_attention): the streamed forward keeps out and lse (`Record`), and the backward's
recompute runs only the token-wise work and the QKV projection, then feeds the kept pair to the op's backward
(`Replay`). In fp32 the gradients equal a full recompute's bit for bit: the op's forward is deterministic, so
the kept pair is the pair a recompute would make, and the graph around the op is the same.

A variant that can keep (`SelfAttention.keep_reason` is "") takes `keep=` in `attend` and runs its op as
`keep(op, *inputs)`, where `op` is a `SplitOp` of the op's own forward (returning out and lse) and backward
(taking them).
"""
from __future__ import annotations

from typing import Protocol

import torch


class SplitOp(Protocol):
    """An attention op as its two halves. `forward(*inputs) -> (out, lse)` with `out` the op's output and `lse`
    its softmax statistics, in whatever layout the op keeps them; `backward(inputs, out, lse, dout, needs)` ->
    one gradient per input (None where `needs[i]` is False), exactly the op's autograd backward."""

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]: ...


class _KeptFunction(torch.autograd.Function):
    """The op's output, given: forward returns the kept `out`; backward is the op's, from the kept out and lse."""

    @staticmethod
    def forward(ctx, op: SplitOp, out: torch.Tensor, lse: torch.Tensor, *inputs: torch.Tensor):
        ctx.op = op
        ctx.save_for_backward(out, lse, *inputs)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        out, lse, *inputs = ctx.saved_tensors
        grads = ctx.op.backward(tuple(inputs), out, lse, dout, ctx.needs_input_grad[3:])
        return None, None, None, *grads


class Record:
    """`keep` of a streamed (no-grad) forward: runs the op's forward and keeps its out and lse here."""

    def __init__(self):
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def __call__(self, op: SplitOp, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.out, self.lse = op.forward(*inputs)
        return self.out


class Replay:
    """`keep` of a recompute with grad: the kept out (no forward), whose backward takes the kept out and lse."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor):
        self.out, self.lse = out, lse

    def __call__(self, op: SplitOp, *inputs: torch.Tensor) -> torch.Tensor:
        return _KeptFunction.apply(op, self.out, self.lse, *inputs)
