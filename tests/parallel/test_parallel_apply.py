"""parallelize_dit: a built VideoDiT's block attention swapped for its sequence-parallel form.

One process: the one-rank form is the model's own forward; what has no SP form is refused.
Two gloo ranks: the model parallelized over a mesh from `build_mesh` (the ring-only hybrid),
run on padded token shards through the model's row hooks, equals one-process `forward` (fp32,
the same math in another order: tolerance as in tests/inference).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megaslide.attention.dense import DenseAttention
from megaslide.config import ParallelConfig
from megaslide.inference.sharded import TokenShard, forward_shard, gather_rows, shard_rope, weight_sharing_copy
from megaslide.inference.weights import random_weights_
from megaslide.models.dit import build_dit, patchify, unpatchify
from megaslide.nn.rope import RopeTable
from megaslide.parallel import build_mesh
from megaslide.parallel.apply import SequenceParallelAttention, parallelize_dit
from megaslide.parallel.groups import SPMesh
from megaslide.testing import spawn

TOL = dict(atol=2e-5, rtol=2e-5)


def _model(**kw):
    return random_weights_(build_dit("tiny", **kw), seed=1).eval()


def _inputs(model, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    return x, torch.tensor([600.0]), model.tokenizer(["a yellow square moving down"])


@torch.no_grad()
def test_one_rank_form_is_the_models_forward_and_reapplying_replaces_it():
    model = _model()
    x, t, ids = _inputs(model, (1, 3, 2, 6, 8))
    want = model(x, t, ids)
    sp = parallelize_dit(weight_sharing_copy(model), None, ParallelConfig(sp_mode="ring"))
    sp = parallelize_dit(sp, None, ParallelConfig(sp_mode="torus", chunks=2))
    attn = sp.blocks[0].attn
    assert isinstance(attn, SequenceParallelAttention) and isinstance(attn.inner, DenseAttention)
    assert (attn.parallel.sp_mode, attn.world) == ("torus", 1)
    assert attn.inner.qkv.weight is model.blocks[0].attn.qkv.weight  # weights shared, not copied
    assert isinstance(model.blocks[0].attn, DenseAttention)          # the original is untouched
    torch.testing.assert_close(sp(x, t, ids), want, **TOL)


def test_refuses_what_has_no_sequence_parallel_form():
    with pytest.raises(ValueError, match="'dsa' has no sequence-parallel form"):
        parallelize_dit(_model(attention="dsa"), None)
    with pytest.raises(ValueError, match="mode='zigzag'"):
        parallelize_dit(_model(), None, ParallelConfig(sp_mode="zigzag"))
    with pytest.raises(ValueError, match="transport="):
        parallelize_dit(_model(), None, ParallelConfig(transport="pigeon"))
    hand_made = SPMesh(1, 1, "ulysses_intra", ((0,),), None, None, 0, 0)
    with pytest.raises(ValueError, match="build_mesh"):
        parallelize_dit(_model(), hand_made)


def _sharded_forward_over_a_mesh(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _model()
    x, t, ids = _inputs(model, (1, 3, 3, 6, 10))                     # grid (3, 3, 5): 45 tokens, 23 + 22 rows
    want = model(x, t, ids)
    mesh = build_mesh(1, world)                                       # hybrid with ulysses_degree 1: a ring
    with pytest.raises(ValueError, match=f"ulysses_degree={world}, ring_degree=1"):
        # the mesh fixes the degrees
        parallelize_dit(weight_sharing_copy(model), mesh, ParallelConfig(sp_mode="ulysses"))
    sp = parallelize_dit(weight_sharing_copy(model), mesh, ParallelConfig(sp_mode="hybrid"))
    grid = model.cfg.token_grid(*x.shape[2:])
    shard = TokenShard.of(45, dist.group.WORLD)
    assert shard.valid < shard.n or rank == 0                         # the last rank holds padding
    rope = shard_rope(RopeTable(model.cfg.head_dim, *grid), grid, 0, shard)
    ctx, ctx_mask = sp.embed_context(ids)
    with torch.no_grad():
        v = forward_shard(sp, shard.take(patchify(x, model.cfg.patch_size)), t, ctx, ctx_mask, rope, grid)
    got = unpatchify(gather_rows(v, shard, dist.group.WORLD), grid, model.cfg.patch_size)
    assert want.abs().mean() > 0.1
    torch.testing.assert_close(got, want, **TOL)


def test_mesh_parallelized_model_on_two_ranks_equals_one_process():
    spawn(_sharded_forward_over_a_mesh, 2)
