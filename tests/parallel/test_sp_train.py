"""Sequence-parallel training of one clip against one process, on gloo with 2 and 3 ranks.

One spawn per group size runs every case (spawning is the slow part). Each rank builds the same randomised
tiny DiT (every weight non-zero, so no gate hides a path) and the same batch, computes the one-process
reference (velocity, loss, every parameter gradient) itself, then the sequence-parallel step on a copy: its
rows of the velocity, its part of the loss and, after `reduce_gradients`, every parameter gradient must equal
the reference (fp32; the SP step sums the same terms in another order). Clips of 7 token frames do not divide
over 2 or 3 ranks; DSA's offsets are driven to near their bound, so samples land in halo frames; with
max_offset 2.5 the halo (6 frames) is longer than a neighbour's shard, so halos come from ranks two away.
Swin runs shifted and unshifted layers over 8 frames with windows of 2 and 4 frames along t. Bad configs are
refused by `RunConfig.validate` (before anything is built), naming the key. Each case also checks the offload
engine's backward of one block on a rank's rows (`ShardRunner.block_grad`) against autograd over the whole clip.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from megaslide.attention.dense import DenseAttention
from megaslide.config import (AttentionConfig, DataConfig, DiTConfig, ExecutionConfig, OffloadConfig, ParallelConfig,
                              RunConfig, TrainConfig)
from megaslide.diffusion.flow import TIME_SCALE, flow_matching_loss, interpolate
from megaslide.inference.sharded import shard_rope
from megaslide.models.block_grad import autograd_block_grad
from megaslide.models.dit import build_dit, patchify
from megaslide.models.chunking import apply_execution
from megaslide.parallel.sp_train import SequenceParallel
from megaslide.testing import spawn

SIZE, BATCH = 8, 2


@dataclass(frozen=True)
class Case:
    attention: str
    options: dict = field(default_factory=dict)
    sp_mode: str = "ulysses"
    execution: dict = field(default_factory=dict)
    frames: int = 7


DSA_FAR = {"max_offset": 2.5}
CASES = {
    "dsa": Case("dsa", DSA_FAR),
    "dsa_chunked_slabs": Case("dsa", DSA_FAR, execution={"chunk_tokens": 24, "slab_frames": 2}),
    "dsa_zero": Case("dsa_zero", {"kernel_size": (5, 3, 3)}),
    "dsa_zero_checkpointed": Case("dsa_zero",
                                  execution={"checkpoint_blocks": True, "chunk_tokens": 40}),
    "dense_ulysses": Case("dense", sp_mode="ulysses"),
    "dense_ring_chunked": Case("dense", sp_mode="ring", execution={"chunk_tokens": 20}),
    "swin": Case("swin", {"window": (2, 2, 2)}, frames=8),
    "swin_t4_chunked": Case("swin", {"window": (4, 2, 2)}, frames=8, execution={"chunk_tokens": 24}),
    "swin_whole_clip": Case("swin", {"window": (7, 2, 2)}),
}


def _model(case: Case):
    torch.manual_seed(0)
    model = build_dit("tiny", attention={"name": case.attention, **case.options}, depth=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for block in model.blocks:
            if case.attention == "dsa":  # offsets near +-max_offset: samples fall in the halo
                block.attn.offset_proj.bias.copy_(3 * torch.randn_like(block.attn.offset_proj.bias))
    return apply_execution(model, ExecutionConfig(**case.execution)).train()


def _batch(model, frames: int):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(BATCH, 3, frames, SIZE, SIZE, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.rand(BATCH, generator=g)
    return x0, model.tokenizer(["a red square", "a blue circle"]), t, noise


def _check_case(case: Case, rank: int) -> None:
    model = _model(case)
    spm = copy.deepcopy(model)
    x0, ids, t, noise = _batch(model, case.frames)
    ref_loss = flow_matching_loss(model, x0, ids, t, noise)
    ref_loss.backward()
    with torch.no_grad():
        ref_v = patchify(model(interpolate(x0, noise, t), t * TIME_SCALE, ids), model.cfg.patch_size)  # (B, N, E)

    parallel = ParallelConfig(sp=dist.get_world_size(), sp_mode=case.sp_mode)
    sp = SequenceParallel(spm, dist.group.WORLD, parallel, model.cfg.token_grid(case.frames, SIZE, SIZE))
    loss = sp.loss(x0, ids, t, noise)
    loss.backward()
    sp.reduce_gradients(spm.parameters())
    torch.testing.assert_close(sp.reduce_loss(loss), ref_loss.detach(), rtol=1e-6, atol=0)
    with torch.no_grad():
        v = sp.velocity_rows(interpolate(x0, noise, t), t * TIME_SCALE, ids)                 # (B, valid, E)
    shard = sp.shard
    torch.testing.assert_close(v, ref_v[:, shard.start:shard.start + shard.valid], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), spm.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        scale = p.grad.abs().max().item()
        assert scale > 0 or "offset" in name, f"{name}: a zero reference gradient tests nothing"
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5 * max(scale, 1e-3), msg=name)
    _check_block_grad(model, spm, sp, ids)


def _check_block_grad(model, spm, sp: SequenceParallel, ids) -> None:
    """`ShardRunner.block_grad` (the offload engine's backward) of block 0 on each rank's rows, for the output
    gradient of those rows: x's rows equal autograd over the whole clip's, and t_mod's, ctx's and every parameter's
    gradients, summed over the ranks, equal its."""
    g = torch.Generator().manual_seed(2)
    grid, block = sp.grid, model.blocks[0]
    x = torch.randn(BATCH, math.prod(grid), model.cfg.dim, generator=g)                  # (B, N, D)
    grad_out = torch.randn(x.shape, generator=g)
    t_mod = torch.randn(BATCH, *block.modulation.shape, generator=g)                     # (B, R, D)
    ctx, ctx_mask = model.embed_context(ids)
    ctx = ctx.detach()
    rope = model.rope_table(grid).grid(grid, 0)
    ref = autograd_block_grad(model.runner.block, block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out,
                              list(block.parameters()))
    shard = sp.shard
    with sp.sharded():
        got = spm.runner.block_grad(spm.blocks[0], shard.take(x), t_mod, ctx, ctx_mask,
                                    shard_rope(spm.rope_table(grid), grid, 0, shard), grid, shard.take(grad_out),
                                    list(spm.blocks[0].parameters()))
    torch.testing.assert_close(got[0][:, :shard.valid], ref[0][:, shard.start:shard.start + shard.valid],
                               rtol=1e-4, atol=1e-5, msg="block_grad: x")
    for name, mine, whole in zip(["t_mod", "ctx", *(n for n, _ in block.named_parameters())], [*got[1:3], *got[3]],
                                 [*ref[1:3], *ref[3]]):
        if whole is None:
            assert mine is None, name
            continue
        summed = mine.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, whole, rtol=1e-4, atol=1e-5 * max(whole.abs().max().item(), 1e-3),
                                   msg=f"block_grad: {name}")


def _run(rank: int, world: int, names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names:
        try:
            _check_case(CASES[name], rank)
        except AssertionError as e:
            raise AssertionError(f"case {name}, rank {rank} of {world}: {e}") from None


@pytest.mark.parametrize("world, names", [
    (2, ["dsa", "dsa_zero", "dense_ulysses", "swin", "swin_whole_clip"]),
    (3, ["dsa", "dsa_chunked_slabs", "dsa_zero_checkpointed", "dense_ring_chunked", "swin", "swin_t4_chunked"]),
])
def test_sp_training_equals_one_process(world, names):
    spawn(_run, world, (names,))


def _run_config(**parallel) -> RunConfig:
    model = DiTConfig(attention=AttentionConfig("dsa"))
    return RunConfig(model=model, data=DataConfig(frames=5, height=8, width=8), parallel=ParallelConfig(**parallel))


@pytest.mark.parametrize("change, key", [
    ({"sp": 6}, "parallel.sp=6 is larger than the clip's 5 token frames"),
    ({"sp": 2, "sp_mode": "rings"}, "parallel.sp_mode='rings'"),
])
def test_bad_sequence_parallel_configs_are_refused_naming_the_key(change, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        _run_config(**change).validate()


def test_sp_needs_an_attention_with_an_sp_form_eager_blocks_no_kept_attention_and_fitting_degrees(monkeypatch):
    run = _run_config(sp=2)
    run.validate()
    run.offload = OffloadConfig(enabled=True)   # the offload engine trains sequence parallel too
    run.validate()
    run.offload = OffloadConfig(enabled=True, keep_attention="auto")
    with pytest.raises(ValueError, match=r"parallel.sp=2 with offload.keep_attention=auto: .* set "
                                         r"offload.keep_attention=off or parallel.sp=1"):
        run.validate()
    run.offload, run.train = OffloadConfig(), TrainConfig(compile=True)
    with pytest.raises(ValueError, match=r"parallel.sp=2 runs its blocks eager: set train.compile=false"):
        run.validate()
    run = _run_config(sp=3)
    run.model.attention = AttentionConfig("dense")
    with pytest.raises(ValueError, match=r"parallel.sp_mode='ulysses' on parallel.sp=3 ranks: heads=4"):
        run.validate()
    monkeypatch.setattr(DenseAttention, "sp_form", None)  # a variant without a sequence-parallel form
    with pytest.raises(ValueError, match=r"parallel.sp=3 with attention.name='dense': this attention has no"):
        run.validate()
