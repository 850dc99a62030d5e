"""Sequence-parallel causal and full-sequence sampling on 2 and 3 gloo ranks (tiny model, fp32).

One spawn per group size runs every check (spawning is the slow part on a 2-core runner):
- causal generation sharded over P ranks equals one-process generation, over several chunks,
  with and without a sliding window, on two grids: 20 tokens per chunk (P=3 pads: 7, 7, 6 real
  rows) and 9 tokens per chunk (P=2 pads: 5, 4);
- teacher-forced chunks through the sharded cache equal one dense block-causal forward (the
  global time index, under SP);
- full-sequence sampling through `sequence_parallel_attention` (ulysses, ring) equals the
  model's own `forward` under `euler_sample`, on 50 tokens (P=3 pads);
- heads not divisible by P raise ValueError before any collective;
- `init_distributed` joined the group from torchrun's environment with NVLink multicast off.
Tolerances as in test_causal.py: same fp32 math in a different order.
"""
from __future__ import annotations

import os

import pytest
import torch

from megaslide.config import ParallelConfig
from megaslide.diffusion.samplers import euler_sample
from megaslide.inference.causal import CausalConfig, CausalGenerator
from megaslide.inference.full import FullConfig, FullSequenceSampler
from megaslide.parallel import shard_len
from tests.inference.dist_harness import run_ranks
from tests.inference.reference import chunked_forward, masked_forward, tiny_model

STEPS = (1.0, 0.75, 0.5, 0.25)
TOL = dict(atol=2e-5, rtol=2e-5)
GRIDS = ((6, 4, 10, 2), (3, 6, 6, 1))  # (latent frames, height, width, chunk frames)


def _noise(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _check_causal(ctx, model, ids) -> int:
    """Returns how many of the grids were padded on this group size."""
    padded = 0
    for frames, h, w, chunk in GRIDS:
        noise = _noise((1, 3, frames, h, w), frames)
        for window in (None, 1):
            cfg = CausalConfig(chunk_frames=chunk, timesteps=STEPS, window=window)
            single = CausalGenerator(model, frames=frames, height=h, width=w, config=cfg).sample(noise, ids)
            sharded = CausalGenerator(model, frames=frames, height=h, width=w, config=cfg, group=ctx.group)
            torch.testing.assert_close(sharded.sample(noise, ids), single, **TOL)
        x = _noise(noise.shape, 7)
        torch.testing.assert_close(chunked_forward(sharded, x, 0.6, ids), masked_forward(model, x, 0.6, ids, chunk, 1),
                                   **TOL)
        tokens = chunk * (h // 2) * (w // 2)
        padded += shard_len(tokens, ctx.world) * ctx.world != tokens
    return padded


def _check_full(ctx, model, ids) -> None:
    noise = _noise((1, 3, 5, 4, 10), 11)  # 5 x 2 x 5 = 50 tokens
    ref = euler_sample(model, noise, ids, timesteps=list(STEPS))
    for sp in ({"sp_mode": "ulysses"}, {"sp_mode": "ring"}, {"sp_mode": "torus", "chunks": 2}):  # 6 heads: 3 or 2
        sampler = FullSequenceSampler(model, frames=5, height=4, width=10, group=ctx.group,
                                      config=FullConfig(timesteps=STEPS, parallel=ParallelConfig(**sp)))
        torch.testing.assert_close(sampler.sample(noise, ids), ref, **TOL)


def _body(ctx, world: int) -> None:
    assert (ctx.world, ctx.backend) == (world, "gloo")
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    model = tiny_model()
    ids = model.tokenizer(["a red circle moving left"])
    assert _check_causal(ctx, model, ids) >= 1, "no grid exercised padded shards"
    _check_full(ctx, model, ids)
    if world == 3:
        four_heads = tiny_model(dim=64, heads=4)
        with pytest.raises(ValueError, match="heads=4 are not divisible by the 3"):
            CausalGenerator(four_heads, frames=6, height=4, width=10, group=ctx.group)
        with pytest.raises(ValueError, match="heads=4 is not divisible"):
            FullSequenceSampler(four_heads, frames=6, height=4, width=10, group=ctx.group)


@pytest.mark.parametrize("world", [2, 3])
def test_sequence_parallel_sampling_matches_one_process(world):
    run_ranks(_body, world, world)
