"""A block's gradients from its saved input: by autograd through a recompute, or for a chunked or slabbed
block slab by slab, each slice's token-wise work run as few times as its memory allows (chunking.py,
"Block gradient", says how many times each part runs and what is kept)."""
from __future__ import annotations

import torch

from megaslide.models.slabs import slab_view


def autograd_block_grad(run, block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out, params):
    """`BlockRunner.block_grad` by autograd: `run(block, x, t_mod, ctx, ctx_mask, rope, grid)` (B, N, D)
    recomputed with grad, then its gradients for grad_out (B, N, D)."""
    x, t_mod, ctx = (t.detach().requires_grad_() for t in (x, t_mod, ctx))
    with torch.enable_grad():
        out = run(block, x, t_mod, ctx, ctx_mask, rope, grid)                      # (B, N, D)
    with torch.autocast(x.device.type, enabled=False):
        grads = torch.autograd.grad(out, [x, t_mod, ctx, *params], grad_out, allow_unused=True)
    return grads[0], grads[1], grads[2], list(grads[3:])


def slab_block_grad(runner, block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out, params, kept=None, slabs=None):
    """`BlockRunner.block_grad` of a chunked or slabbed block, slab by slab. Per slab: q, k, v from the
    pre-attention slices (checkpointed) and the attention with grad; then each slice of the kept rows
    through the post-attention work with grad and straight into its backward, giving the gradient of its
    attention output rows; then the attention's and the pre-attention slices' backward. Parameter, t_mod
    and ctx gradients sum over slices and slabs, x's over the two slabs that read a halo row. The
    parameters' `.grad` is gathered into and restored after. With `kept` (a `KeptAttention`) each slab's
    attention replays its kept output and lse instead of running its forward. `slabs` (a, t0, t1, b) in frames of
    `grid` (default: `runner.slabs`); rows of x outside every slab's kept frames get a gradient only as halo."""
    x = x.detach().contiguous()                                                   # (B, N, D)
    t_mod = t_mod.detach().requires_grad_()
    with torch.enable_grad():
        mod = block.modulation[None] + t_mod                                      # (B, R, D)
    m, c = mod.detach().requires_grad_(), ctx.detach().requires_grad_()  # leaves: every slice's gradient sums in
    grad_x = torch.zeros_like(x)                                                  # (B, N, D)
    fr = grid[1] * grid[2]                                                        # tokens per frame
    slabs = runner.slabs(block, grid) if slabs is None else slabs
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        for slab in slabs:
            xs, rope_s, grid_s, keep = slab_view(x, rope, grid, slab)
            xs = xs.detach().requires_grad_()                                     # (B, n, D), slab + halo
            replay = kept and (kept.whole() if len(slabs) == 1 else kept.slab(slab, fr, x.shape[1]))
            with torch.enable_grad():
                o = runner.attend_slab(block, xs, rope_s, grid_s, keep, m, replay)  # (B, n_keep, h, d)
            grad_o = torch.empty_like(o)
            out_rows = range(slab[0] * fr + keep.start, slab[0] * fr + keep.stop)  # the kept rows in x
            for s in runner.spans(o.shape[1]):
                rows = slice(out_rows[s].start, out_rows[s].stop)
                xi, oi = x[:, rows].detach().requires_grad_(), o[:, s].detach().requires_grad_()
                with torch.enable_grad():
                    out = runner.finish(block, xi, oi, m, c, ctx_mask)            # (B, n_s, D)
                _backward(out, grad_out[:, rows], [xi, oi, m, c, *params])
                grad_x[:, rows] += xi.grad
                grad_o[:, s] = oi.grad                                            # (B, n_s, h, d)
            del out, xi, oi  # the last slice's graph
            _backward(o, grad_o, [xs, m, *params])
            grad_x[:, slab[0] * fr:slab[3] * fr] += xs.grad
        _backward(mod, m.grad, [t_mod, *params])
        return grad_x, t_mod.grad, c.grad, [p.grad for p in params]
    finally:
        for p, g in zip(params, held):
            p.grad = g


def _backward(outputs: torch.Tensor, grads: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Gradients of `outputs` summed into the `.grad` of `inputs`, outside autocast (where a backward runs)."""
    with torch.autocast(outputs.device.type, enabled=False):
        torch.autograd.backward(outputs, grads, inputs=inputs)
