"""Sequence-parallel training of one clip: its token rows split over the P ranks of an SP group.

`SequenceParallel(model, group, parallel, grid)` is applied to a built model from outside and gives the loss of
this rank's share of the clip; while it runs the model, the model's blocks go through a `ShardRunner` (a
`BlockRunner` that keeps the model's own execution config: chunks, slabs, block checkpoints), and at
any other time the model is the one-process model it was (sampling, checkpoints, an EMA copy). Every rank holds
the whole model and the whole batch (the same seeded batch), and runs the model on its own rows only: the patch
embedding, timestep modulation, token-wise block work and final layer act on each row alone (`embed_shard`,
`head`), so only self-attention needs other ranks' tokens. How depends on the variant's `sp_form`:

- "frames" (dsa, dsa_zero, swin): rank r owns whole token frames (`halo.FrameShard`: runs of T // P or
  T // P + 1 frames, not padded). Before each block's attention the rank receives the frames of the other ranks
  that its queries read (`SelfAttention.frame_window`: DSA's kernel reach plus its offset bound; Swin's windows),
  by `halo.exchange_halo`, whose backward returns the halo's gradient to its owners. The block's pre-attention
  work and attention run over [halo before | own frames | halo after] with the clip's RoPE positions, and only
  the own queries go on (the frame slabs of chunking.py, with a halo that comes from other ranks).
- "global" (dense): rank r owns rows [r * n, r * n + valid) with n = ceil(N / P), tail-padded
  (`megaslide.inference.sharded.TokenShard`); the attention is `sequence_parallel_attention` in
  `parallel.sp_mode` (ulysses, ring, hybrid, torus), whose all-to-all and ring exchanges have their own backward.

Loss: each rank's squared error summed over its real rows, divided by the element count of the whole batch, so
the ranks' losses sum to the one-process mean and the gradients of the replicated parameters sum to its
gradient: `reduce_gradients` all-reduces them (sum) over the group, `reduce_loss` the logged value. The offload
engine (megaslide/offload/engine.py) runs the same pieces block by block: `embed` for this rank's rows, the
`ShardRunner`'s `block` in its streamed forward and its `block_grad` (slab by slab over the rank's window, between
the halo exchange and its backward, which returns each halo row's gradient to its owner) in its backward,
`rows_loss` on the head's rows; it sums the block gradients over the ranks in the reduce-scatter of its sharded
host state.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from megaslide.attention import SelfAttention
from megaslide.config import ParallelConfig
from megaslide.diffusion.flow import TIME_SCALE, interpolate
from megaslide.inference.sharded import TokenShard, forward_shard, shard_rope
from megaslide.models.block_grad import slab_block_grad
from megaslide.models.chunking import BlockRunner
from megaslide.models.dit import Embedded, VideoDiT, patchify
from megaslide.models.slabs import frame_slabs
from megaslide.parallel import sequence_parallel_attention
from megaslide.parallel.groups import group_rank, group_size
from megaslide.parallel.halo import FrameShard, exchange_halo

GRAD_BUCKET_ELEMENTS = 1 << 25  # gradients all-reduced in buckets of at most this many elements
_SP_KEPT = ("kept attention (offload.keep_attention) has no sequence-parallel form (parallel.sp > 1): a block's "
            "halo comes from other ranks; set offload.keep_attention=off or parallel.sp=1")


class ShardRunner(BlockRunner):
    """Runs each block of a model on one rank's rows of the clip (see the module docstring), with the model's
    execution config (`base`'s): token chunks, DSA frame slabs within the rank's frames, block checkpoints."""

    def __init__(self, base: BlockRunner, sp: SequenceParallel):
        super().__init__(base.execution, compiled=base.compiled)
        self.sp = sp

    def block(self, block, x, t_mod, ctx, ctx_mask, rope, grid, attn=None, kept=None) -> torch.Tensor:
        """Block `block` on this rank's rows x (B, n, D) of the clip's token grid `grid` -> (B, n, D)."""
        if kept is not None:
            raise ValueError(_SP_KEPT)
        if attn is not None or not isinstance(block.attn, SelfAttention):
            raise ValueError("a sequence-parallel training model runs each block with its own self-attention; "
                             "an attn= override or a parallelize_dit model has no training form here")
        x = x.contiguous()                                                           # (B, n, D)
        mod = block.modulation[None] + t_mod                                         # (B, R, D)
        if block.attn.sp_form == "global":
            return self._run_slab(block, x, rope, grid, slice(None), mod, ctx, ctx_mask)
        sp = self.sp
        windows, local = self.windows(block, grid[0])
        a, b = windows[sp.shard.rank]
        xs = exchange_halo(x, sp.shard, windows, sp.group)                           # (B, (b-a)*H*W, D)
        return self.run_slabs(block, xs, sp.window_rope(a, b, x.device), (b - a, *grid[1:]), local, mod, ctx,
                              ctx_mask)                                              # (B, n, D)

    def windows(self, block, frames: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int]]]:
        """Every rank's attention window [a, b) in clip frames (the frames its slabs read), and this rank's slabs
        in frames of its own window."""
        slabs = [self.rank_slabs(block, frames, r) for r in range(self.sp.shard.world)]
        windows = [(s[0][0], s[-1][3]) for s in slabs]
        a = windows[self.sp.shard.rank][0]
        return windows, [(s0 - a, t0 - a, t1 - a, s1 - a) for s0, t0, t1, s1 in slabs[self.sp.shard.rank]]

    def rank_slabs(self, block, frames: int, rank: int) -> list[tuple[int, int, int, int]]:
        """The slabs (a, t0, t1, b) in clip frames that cover rank `rank`'s frames: one over its attention
        window, or with `slab_frames` DSA's frame slabs within them."""
        t0, t1 = self.sp.shard.bounds(rank)
        if self.execution.slab_frames:
            return frame_slabs(frames, self.execution.slab_frames, block.attn.temporal_reach(block.attn.options),
                               own=(t0, t1))
        a, b = block.attn.frame_window(frames, t0, t1)
        return [(a, t0, t1, b)]

    def attend(self, block, q, k, v, grid, read: dict, keep=None) -> torch.Tensor:
        """Dense attention over every rank's rows (`sequence_parallel_attention`); others as one process."""
        if block.attn.sp_form != "global":
            return super().attend(block, q, k, v, grid, read, keep)
        if keep is not None:
            raise ValueError(_SP_KEPT)
        p = self.sp.parallel
        return sequence_parallel_attention(q, k, v, mode=p.sp_mode, group=self.sp.group, seq_len=math.prod(grid),
                                           ulysses_degree=p.ulysses_degree, ring_degree=p.ring_degree,
                                           placement=p.placement, transport=p.transport, chunks=p.chunks)

    def block_grad(self, block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out, params, kept=None):
        """`BlockRunner.block_grad` on this rank's rows x (B, n, D) (the offload engine's backward). Dense: as one
        process (its SP attention's backward exchanges with the other ranks). A frame shard: the halo exchange
        of `block` with grad, then `slab_block_grad` over the rank's window and its slabs (the output gradient
        grad_out on its own frames), then the exchange's backward, which sends each halo row's gradient to its
        owner and adds the gradients of this rank's rows from the others' halos. Every rank of the group calls
        it for the same block at the same point."""
        if kept is not None:
            raise ValueError(_SP_KEPT)
        if block.attn.sp_form == "global":
            return super().block_grad(block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out, params)
        sp, (T, H, W) = self.sp, grid
        windows, local = self.windows(block, T)
        a, b = windows[sp.shard.rank]
        t0, t1 = sp.shard.bounds(sp.shard.rank)
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            xs = exchange_halo(x.contiguous(), sp.shard, windows, sp.group)            # (B, (b-a)*H*W, D)
        grad_window = grad_out.new_zeros(xs.shape)
        grad_window[:, (t0 - a) * H * W:(t1 - a) * H * W] = grad_out                   # own rows only are outputs
        grad_xs, grad_t_mod, grad_ctx, grads = slab_block_grad(
            self, block, xs.detach(), t_mod, ctx, ctx_mask, sp.window_rope(a, b, x.device), (b - a, H, W),
            grad_window, params, slabs=local)
        with torch.autocast(x.device.type, enabled=False):
            torch.autograd.backward(xs, grad_xs, inputs=[x])
        return x.grad, grad_t_mod, grad_ctx, grads


class SequenceParallel:
    """This rank's share of one clip of token grid `grid` over `group` (P ranks) for training `model`.
    `parallel` gives the dense attention's SP form (sp_mode and its degrees)."""

    def __init__(self, model: VideoDiT, group: dist.ProcessGroup, parallel: ParallelConfig,
                 grid: tuple[int, int, int]):
        world, rank = group_size(group), group_rank(group)
        T, H, W = grid
        form = model.cfg.attention.variant.sp_form
        if form is None:
            raise ValueError(f"attention {model.cfg.attention.name!r} has no sequence-parallel form: set "
                             f"parallel.sp=1, or use dense, dsa, dsa_zero or swin")
        self.group, self.parallel, self.grid, self.model = group, parallel, grid, model
        self.shard = FrameShard(T, H * W, world, rank) if form == "frames" else TokenShard(T * H * W, world, rank)
        self._ropes: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._runners: tuple[BlockRunner, ShardRunner] | None = None  # (the model's runner, its sharded form)

    @contextlib.contextmanager
    def sharded(self):
        """The model's blocks run on this rank's rows (`ShardRunner`, built from the model's runner) inside."""
        model = self.model
        base = model.runner
        if self._runners is None or self._runners[0] is not base:
            self._runners = (base, ShardRunner(base, self))
        model.runner = self._runners[1]
        try:
            yield
        finally:
            model.runner = base

    def window_rope(self, a: int, b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ((b - a) * H * W, d/2) of the clip's token frames [a, b) (built once per window)."""
        key = (a, b, str(device))
        if key not in self._ropes:
            _, H, W = self.grid
            self._ropes[key] = self.model.rope_table(self.grid).grid((b - a, H, W), a, device=device)
        return self._ropes[key]

    def _row_inputs(self, xt: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None):
        """This rank's rows (B, n, pv*C) of the whole clip xt (B, C, T, H, W), the captions' ctx (B, L, D) and
        ctx_mask (B, L), and the rows' RoPE (n, d/2) x 2: what `embed_shard` and `forward_shard` take."""
        model = self.model
        rows = self.shard.take(patchify(xt, model.cfg.patch_size))                   # (B, n, pv*C)
        ctx, ctx_mask = model.embed_context(context, context_mask)                   # (B, L, D), (B, L)
        rope = shard_rope(model.rope_table(self.grid), self.grid, 0, self.shard, xt.device)  # (n, d/2) x 2
        return rows, ctx, ctx_mask, rope

    def embed(self, xt: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor | None = None) -> Embedded:
        """The block inputs of this rank's rows (`embed_shard`: tokens (B, n, D), their RoPE, the clip's grid) for
        the whole clip xt (B, C, T, H, W) at model timesteps t (B,); every rank passes the same clip."""
        rows, ctx, ctx_mask, rope = self._row_inputs(xt, context, context_mask)
        return self.model.embed_shard(rows, t, ctx, ctx_mask, rope, self.grid)

    def velocity_rows(self, xt: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                      context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The velocity of this rank's real rows (B, valid, pv*C) (`patchify`'s layout) for the whole clip
        xt (B, C, T, H, W) at model timesteps t (B,); every rank passes the same clip."""
        rows, ctx, ctx_mask, rope = self._row_inputs(xt, context, context_mask)
        with self.sharded():
            v = forward_shard(self.model, rows, t, ctx, ctx_mask, rope, self.grid)  # (B, n, pv*C)
        return v[:, :self.shard.valid]

    def rows_loss(self, v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """This rank's part of the flow-matching loss from the velocity of its rows v (B, n, pv*C), padding
        included: the squared error over its real rows, divided by the batch's element count. x0, noise
        (B, C, T, H, W)."""
        target = self.shard.take(patchify(noise - x0, self.model.cfg.patch_size))[:, :self.shard.valid]
        return (v[:, :self.shard.valid].float() - target.float()).square().sum() / x0.numel()

    def loss(self, x0: torch.Tensor, context: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
             context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of `flow_matching_loss` (the ranks' parts sum to it). x0, noise (B, C, T, H, W),
        t (B,) in (0, 1)."""
        v = self.velocity_rows(interpolate(x0, noise, t), t * TIME_SCALE, context, context_mask)  # (B, valid, pv*C)
        return self.rows_loss(v, x0, noise)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole clip's loss from every rank's part (a detached copy, summed over the group)."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def reduce_gradients(self, params) -> None:
        """Sum the gradients of the replicated parameters over the group, in place (every rank ends with the
        one-process gradient); parameters without a gradient (the same on every rank) are skipped."""
        grads = [p.grad for p in params if p.grad is not None]
        bucket: list[torch.Tensor] = []
        for g in grads + [None]:
            if bucket and (g is None or sum(b.numel() for b in bucket) + g.numel() > GRAD_BUCKET_ELEMENTS
                           or g.dtype != bucket[0].dtype):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=self.group)
                for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                    b.copy_(part.view_as(b))
                bucket = []
            if g is not None:
                bucket.append(g)
