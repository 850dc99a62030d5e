"""How the blocks of a built model run: whole, token-chunked, over frame slabs, checkpointed.

The model computes the same function whichever way it runs; `apply_execution(model, execution)` picks
the way from an `ExecutionConfig` after the model is built (as torchtitan applies checkpointing), and the
model's `run_block` and `head` hand every call to the `BlockRunner` it installs. The runner is a plain
object, not a module: it holds no weights, so state-dict names never depend on how a model runs.

Token chunking (`chunk_tokens` = c > 0). Apart from self-attention, everything in a block acts on each
token alone: modulation, norms, the QKV and output projections, QK-norm + RoPE, cross-attention to the
caption and the MLP. The runner runs that work over slices of c tokens, each slice under its own
non-reentrant checkpoint, so autograd keeps only a slice's inputs (its run of x and of the attention
output), never a whole-sequence intermediate such as the MLP's ffn-wide hidden or the cross-attention's
scores. Self-attention (dense, swin, dsa) still sees the whole sequence, and the block keeps whole only
what it needs: q, k, v, the attention input if the variant reads it (`reads_input`: DSA's offset net,
which the runner runs over runs of whole frames of about c tokens, `read_input`), the output and what the
op saves (lse, DSA's offsets). A block's activation memory in forward and backward is then
O(c x (dim + ffn)) plus O(N x dim) for self-attention, instead of O(N x ffn); the price is one more
forward of each slice's token-wise work in backward. Under `checkpoint_blocks` the recomputed forward is
chunked the same way (the checkpoints nest). Outputs and gradients equal the unchunked block's up to
rounding. Every slice launches the block's small kernels again, and a DSA frame run also convolves its
two halo frames, so slices should be large: several frames, enough tokens that their matmuls keep the
device busy.

Frame slabs (`slab_frames` = s > 0, for an attention of bounded temporal reach r: DSA's window plus its
largest offset). A key more than r frames from a query never meets it, so the block's output on frames
[t0, t0 + s) depends only on its input on [t0 - r, t0 + s + r). The block then runs slab by slab, each
under its own checkpoint: the slab with its halo goes through the token-wise projections and the
attention (on that sub-grid: RoPE keeps the global positions, and the attention's clamps at the clip's
ends fall where they fall on the whole grid, because a halo is cut only there), and only the kept frames
go on through the output projection, cross-attention and MLP. Nothing of the attention is ever
whole-clip: a block's memory is O((s + 2r) x per-token state) plus its input, output and their
gradients. The price: the halo's projections and attention are computed for each of its two slabs
((s + 2r) / s), and one more forward of the token-wise work in backward (the slab checkpoint around the
slice checkpoints).

Block gradient (`block_grad`, the offload engine's backward of a streamed block from its saved input). Through
autograd, a streamed block's token-wise work (pre- and post-attention) would run four times and its attention
three with slabs (the streamed forward, the recompute with grad, the slab checkpoint's re-run, the slice
checkpoints' re-run; the slab re-run stops before its last post-attention slice), three and two without. A
chunked or slabbed block's `block_grad` goes slab by slab instead (slabs are independent given x): the
pre-attention slices (checkpointed) and the attention run with grad; each kept slice's post-attention work runs
with grad and straight into its backward, giving the gradient of its attention output rows; then the attention's
backward and the pre-attention slices' (their checkpoints re-run). Per step the post-attention work runs twice
(streamed forward, slab pass), the pre-attention three times and the attention twice. Memory: one slab's q, k, v,
attention output and what the attention saves, the gradient of its kept output rows, and one slice's
post-attention graph: never more than a slab checkpoint's re-run held. Gradients equal autograd's up to the order
in which contributions are summed (over slices, slabs and a halo row's two slabs). Any other block's `block_grad`
is autograd through its recompute.

Kept attention (`kept=`, a `KeptAttention`: offload.keep_attention, megaslide/attention/kept.py). The offload
engine's streamed forward records each kept block's attention output and lse (over slabs: the rows each slab
keeps), and `block_grad` replays them: the recompute runs the token-wise work and the QKV projection (and DSA's
offset net), and the attention's backward starts from the kept output and lse, never its forward. A block run
whole then runs as pre-attention, attention, post-attention like a compiled one (the same ops as the block's
forward). The gradients equal the full recompute's bit for bit in fp32 (kept_attention.py says why for slabs).

Compiled (`compile_blocks`, train.compile on either engine). A block's token-wise halves, `_project_slice`
(pre-attention work, QKV projection, QK-norm + RoPE) and `_finish_slice` (output projection, gated residuals,
cross-attention, MLP), run through torch.compile, which fuses their many small memory-bound kernels
(modulation, LayerNorms, gates, residuals, casts). The attention (`attend`, DSA's offset net `read_input`)
stays eager between them: its kernels are custom ops or SDPA already. A block that is neither chunked nor
slabbed takes the same path with one slice of the whole sequence, without the slice checkpoints. The
compiled functions are module-level and take the block as an argument, and torch.compile inlines modules,
so their parameters are graph inputs: one graph serves every block and slice. Graphs per function: the
first slice length seen is compiled for its size, and the first other one (the shorter last slice, a slab
with less halo) recompiles once with the token count symbolic, which then serves every length; a second
grad mode (the offload engine's no-grad forward, then its recompute with grad) adds one symbolic graph,
and so does a contiguous whole sequence after strided slices (a runner that runs a block whole after
slicing another). A training run compiles two or three graphs per function. torch.compile keeps its graphs
per Python function, shared by every runner of the process, up to its recompile limit (8), past which it
warns and runs the function eager: a process that compiles several attention variants or dtypes should call
`torch._dynamo.reset()` between them. A block run with an `attn=` override or a replaced self-attention
has no compiled form, and a compiled runner refuses it (ValueError). The final layer and the stem run eager.

The final layer (`head`) runs over slices of c rows too, each under a checkpoint: its LayerNorm keeps
fp32 copies of whole rows, too much over millions of tokens. An `attn=` override (KV-cached and
sequence-parallel inference) and a self-attention that is not a `SelfAttention` (the sequence-parallel
form of `parallelize_dit`) run the block whole, eager.

What this costs in memory, per block and item, is modelled in megaslide/perf/activation_memory.py
(`block_memory`) and, for the final layer and the step, in the planner (megaslide/perf/planner.py);
both take the same `ExecutionConfig`.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from megaslide.attention import SelfAttention
from megaslide.config import SLAB_AUTO, ExecutionConfig
from megaslide.models.block_grad import autograd_block_grad, slab_block_grad
from megaslide.models.slabs import frame_slabs, slab_view


def read_over_frame_runs(attn: SelfAttention, h: torch.Tensor, grid, chunk_tokens: int) -> torch.Tensor:
    """What `attn` reads of its input h (B, N, D) (`read_input`), over runs of whole frames of about
    `chunk_tokens` tokens (at least one frame), each under its own checkpoint: backward keeps h and what
    was read, nothing grid-wide in between. Whole in one call when `chunk_tokens` is 0."""
    T, H, W = grid
    if not chunk_tokens:
        return attn.read_input(h, grid, 0, T)
    step = max(1, chunk_tokens // (H * W))  # frames per run
    frames = h.split(H * W, dim=1)           # T x (B, H*W, D): views whose gradients join into h's once
    runs = []
    for t0 in range(0, T, step):
        t1 = min(t0 + step, T)
        a, b = max(t0 - 1, 0), min(t1 + 1, T)   # the run and the one-frame halo each side it reads
        runs.append(checkpoint(_read_window, attn, (b - a, H, W), t0 - a, t1 - a, *frames[a:b],
                               use_reentrant=False))
    return torch.cat(runs, dim=1)            # (B, T, ...)


def _read_window(attn: SelfAttention, grid, t0: int, t1: int, *frames: torch.Tensor) -> torch.Tensor:
    """`attn.read_input` of frames [t0, t1) of the window `frames` (grid (t, H, W)). Its frames are joined
    here, under the run's checkpoint, so that neither the window nor a clip-sized gradient of it outlives
    the run: its backward hands each frame its own frame-sized gradient. The window's ends are the clip's
    ends or real neighbour frames, so the read equals that of the whole clip."""
    return attn.read_input(torch.cat(frames, dim=1), grid, t0, t1)


class BlockRunner:
    """Runs blocks and the final layer as `execution` says; the default runs them whole (see the module
    docstring). With `compiled`, a block's token-wise halves run through torch.compile (see "Compiled")."""

    def __init__(self, execution: ExecutionConfig | None = None, *, compiled: bool = False):
        self.execution = execution or ExecutionConfig()
        if self.execution.slab_frames == SLAB_AUTO:
            raise ValueError(f"execution.slab_frames={SLAB_AUTO} is resolved by the training planner (build_engine, "
                             f"plan_offload), which knows the clip and the device; here give a number of frames "
                             f"(0: no slabs)")
        self.compiled = compiled
        self.project, self.finish = ((torch.compile(_project_slice), torch.compile(_finish_slice)) if compiled
                                     else (_project_slice, _finish_slice))

    def run_block(self, block, x, e, attn=None, *, training: bool = False) -> torch.Tensor:
        """Block `block` on tokens x (B, N, D) with the embedded inputs `e` (`Embedded`); with
        `checkpoint_blocks`, in training with grad, under a checkpoint of the whole block."""
        args = (block, x, e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid, attn)
        if self.execution.checkpoint_blocks and training and torch.is_grad_enabled():
            return checkpoint(self.block, *args, use_reentrant=False)
        return self.block(*args)

    def block(self, block, x, t_mod, ctx, ctx_mask, rope, grid, attn=None, kept=None) -> torch.Tensor:
        """`block(x, t_mod, ctx, ctx_mask, rope, grid, attn)` (B, N, D), chunked and slabbed as configured.
        `kept` (a `KeptAttention`, "Kept attention"): the attention records its output and lse there, or
        replays them; the block then runs as pre-attention, attention, post-attention even when whole."""
        ex = self.execution
        if attn is not None or not isinstance(block.attn, SelfAttention):
            if self.compiled or kept is not None:
                raise ValueError(_EAGER_ONLY if kept is None else _KEPT_OWN)
            return block(x, t_mod, ctx, ctx_mask, rope, grid, attn)
        if not (ex.chunk_tokens or ex.slab_frames or self.compiled or kept is not None):
            return block(x, t_mod, ctx, ctx_mask, rope, grid)
        x = x.contiguous()  # one layout for every block's input (the embedding's output is a transposed view)
        mod = block.modulation[None] + t_mod                                         # (B, R, D)
        return self.run_slabs(block, x, rope, grid, self.slabs(block, grid), mod, ctx, ctx_mask, kept)

    def run_slabs(self, block, x, rope, grid, slabs, mod, ctx, ctx_mask, kept=None) -> torch.Tensor:
        """The block's output on the kept frames of `slabs` ((a, t0, t1, b) each, frames of x's grid), in
        order: (B, sum (t1 - t0) * fr, D); each slab under its own checkpoint when there are several. `kept`
        (a `KeptAttention` of the whole clip x): each slab's attention records or replays its rows there."""
        if len(slabs) == 1:
            return self._run_slab(block, *slab_view(x, rope, grid, slabs[0]), mod, ctx, ctx_mask,
                                  kept and kept.whole())
        fr = grid[1] * grid[2]                                                       # tokens per frame
        out = [checkpoint(self._run_slab, block, *slab_view(x, rope, grid, slab), mod, ctx, ctx_mask,
                          kept and kept.slab(slab, fr, x.shape[1]), use_reentrant=False)
               for slab in slabs]                                                    # (B, (t1-t0)*fr, D) each
        return torch.cat(out, dim=1)                                                 # (B, N, D)

    def block_grad(self, block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out, params, kept=None):
        """The gradients of `self.block(block, x, t_mod, ctx, ctx_mask, rope, grid)` for the output gradient
        grad_out (B, N, D): (grad x (B, N, D), grad t_mod (B, R, D), grad ctx (B, L, D), one per parameter of
        `params`: its gradient, or None where it gets none). A chunked or slabbed block goes slab by slab
        ("Block gradient"); any other block by autograd through its recompute. `kept`: the attention's output
        and lse kept by the forward, replayed instead of re-running the attention ("Kept attention"). Call it
        under the forward's autocast if any: the backward passes run outside autocast."""
        if (self.execution.chunk_tokens or self.execution.slab_frames) and isinstance(block.attn, SelfAttention):
            return slab_block_grad(self, block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out, params, kept)
        run = self.block if kept is None else functools.partial(self.block, kept=kept)
        return autograd_block_grad(run, block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out, params)

    def slabs(self, block, grid) -> list[tuple[int, int, int, int]]:
        """`block`'s frame slabs (`frame_slabs`) on token grid `grid`; one without `slab_frames`."""
        slab = self.execution.slab_frames
        return frame_slabs(grid[0], slab, block.attn.temporal_reach(block.attn.options) if slab else None)

    def head(self, final, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        """`final(x, t_emb)`: tokens (B, n, D) -> rows (B, n, pv*C); with `chunk_tokens`, over slices of
        that many rows, each under a checkpoint."""
        step = self.execution.chunk_tokens
        if not step or x.shape[1] <= step:
            return final(x, t_emb)
        return torch.cat([checkpoint(final, xs, t_emb, use_reentrant=False)
                          for xs in token_slices(x, self.spans(x.shape[1]))], dim=1)  # (B, n, pv*C)

    def _run_slab(self, block, x, rope, grid, keep: slice, mod, ctx, ctx_mask, kept_slab=None):
        """The block over x (B, n, D), a run of whole frames (grid (t, H, W)), returning only the rows
        `keep` (B, n_keep, D): the halo rows outside it are there for the attention of the kept ones.
        Slices run under checkpoints, except in a block run whole (compiled, neither chunked nor slabbed)."""
        o = self.attend_slab(block, x, rope, grid, keep, mod, kept_slab)             # (B, n_keep, h, d)
        x = x[:, keep]                                                               # (B, n_keep, D)
        run = self._slice_run()
        spans = self.spans(x.shape[1])
        out = [run(self.finish, block, xs, oi, mod, ctx, ctx_mask)
               for xs, oi in zip(token_slices(x, spans), token_slices(o, spans))]
        return _join(out)                                                            # (B, n_keep, D)

    def attend_slab(self, block, x, rope, grid, keep: slice, mod, kept_slab=None) -> torch.Tensor:
        """The self-attention output (B, n_keep, heads, d) of the rows `keep` of x (B, n, D), a run of whole
        frames (grid (t, H, W)): the pre-attention work and QKV projection over slices of x (checkpointed as
        `_run_slab` says), then the attention (with `kept_slab`, a `kept.Record` or `kept.Replay`, split at
        its lse); backward keeps q, k, v (and what the attention reads), never a slice's intermediates."""
        cos, sin = rope                                                              # (n, d/2) each
        run = self._slice_run()
        spans = self.spans(x.shape[1], len(range(x.shape[1])[keep]))
        parts = [run(self.project, block, xs, mod, cos[s], sin[s]) for xs, s in zip(token_slices(x, spans), spans)]
        q, k, v, *h = (_join(p) for p in zip(*parts))                                # (B, n, h, d) x 3[, (B, n, D)]
        del parts  # the slices: only their concatenations stay alive through attention
        read = {"read": read_over_frame_runs(block.attn, h[0], grid, self.execution.chunk_tokens)} if h else {}
        return self.attend(block, q, k, v, grid, read, kept_slab)[:, keep]           # (B, n_keep, h, d)

    def attend(self, block, q, k, v, grid, read: dict, keep=None) -> torch.Tensor:
        """`block`'s self-attention of q, k, v (B, n, heads, d) over the token grid `grid` (B, n, heads, d);
        `read`: what the variant read of its input, if it reads it; `keep`: a `kept.Record` or `kept.Replay`
        (split at its lse, "Kept attention"), or None. The sequence-parallel runner replaces it."""
        extra = read if keep is None else {**read, "keep": keep}
        return block.attn.attend(q, k, v, None, grid, **extra)

    def spans(self, n: int, unset: int | None = None) -> list[slice]:
        """The slices of a run of n tokens: `chunk_tokens` each (the last shorter); unset, `unset` (default n)."""
        step = self.execution.chunk_tokens or unset or n
        return [slice(s, s + step) for s in range(0, n, step)]

    def _slice_run(self):
        ex = self.execution
        return _checkpointed if ex.chunk_tokens or ex.slab_frames else _direct


def token_slices(x: torch.Tensor, spans: list[slice]) -> tuple[torch.Tensor, ...]:
    """x (B, n, ...) cut into the consecutive `spans` of its tokens (`BlockRunner.spans`): views, as x[:, s]
    would give, but whose backward joins the slices' gradients into x's with one concatenation. Indexing each
    slice instead gives x a zero-filled gradient of its full size per slice, summed: O(slices x n) memory
    traffic in the backward where O(n) will do."""
    n = x.shape[1]
    return x.split([min(s.stop, n) - s.start for s in spans], dim=1)


def _join(parts) -> torch.Tensor:
    """Slices concatenated along the tokens; one slice as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _checkpointed(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _direct(fn, *args):
    return fn(*args)


def _project_slice(block, x, mod, cos, sin):
    """A slice x (B, n, D) -> q, k, v (B, n, heads, d), and the attention input (B, n, D) if the variant reads it."""
    h = block.pre_attention(x, mod)                                                # (B, n, D)
    q, k, v = block.attn.project_qkv(h, (cos, sin))                                 # (B, n, h, d) each
    return (q, k, v, h) if block.attn.reads_input else (q, k, v)


def _finish_slice(block, x, o, mod, ctx, ctx_mask):
    """A slice x (B, n, D) and its attention output o (B, n, heads, d) -> the block output (B, n, D)."""
    return block.post_attention(x, block.attn.project_out(o), mod, ctx, ctx_mask)


def apply_execution(model, execution: ExecutionConfig):
    """Run `model`'s blocks and final layer as `execution` says, checked against its attention first;
    returns the model. Weights and their names are untouched; a compiled runner stays compiled."""
    execution.validate(model.cfg.attention)
    model.runner = BlockRunner(execution, compiled=model.runner.compiled)
    return model


def compile_blocks(model):
    """Run `model`'s blocks compiled (train.compile; "Compiled" in the module docstring), as its execution
    config says; returns the model. Weights, their names and the model's modules are untouched."""
    model.runner = BlockRunner(model.runner.execution, compiled=True)
    return model


_KEPT_OWN = ("kept attention (offload.keep_attention) needs the block's own self-attention; an attn= override or a "
             "self-attention replaced by parallelize_dit has none: set offload.keep_attention=off")
_EAGER_ONLY = ("a compiled block runner (train.compile=true) runs blocks with their own self-attention only; an "
               "attn= override (KV-cached or sequence-parallel inference) or a self-attention replaced by "
               "parallelize_dit has no compiled form: run such a model without compile_blocks (train.compile=false)")
