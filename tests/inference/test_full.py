"""Full-sequence sampling on one process against the model's own forward under `euler_sample`.

The sampler runs the DiT on token rows (`embed_shard`'s linear patch embedding, RoPE rows from
the precomputed table, the attention swapped by `parallelize_dit`); the reference is `VideoDiT.forward` (Conv3d,
`VideoDiT.embed`'s RoPE) in `megaslide.diffusion.samplers.euler_sample` with the same
timesteps. fp32; tolerance as in test_causal.py.
"""
from __future__ import annotations

import pytest
import torch

from megaslide.attention.dense import DenseAttention
from megaslide.config import ParallelConfig
from megaslide.diffusion.samplers import euler_sample
from megaslide.inference.full import FullConfig, FullSequenceSampler
from megaslide.parallel.apply import SequenceParallelAttention
from tests.inference.reference import tiny_model

STEPS = (1.0, 0.75, 0.5, 0.25)
TOL = dict(atol=2e-5, rtol=2e-5)



@pytest.mark.parametrize("flags", [{}, dict(precompute_rope=False), dict(fused_qk_rope=False)])
def test_full_sequence_sampler_equals_euler_sample_of_the_model(flags):
    model = tiny_model()
    noise = torch.randn(2, 3, 3, 6, 8, generator=torch.Generator().manual_seed(0))  # odd grid (3, 3, 4)
    ids = model.tokenizer(["a red circle", "a blue square moving up"])
    ref = euler_sample(model, noise, ids, timesteps=list(STEPS))
    sampler = FullSequenceSampler(model, frames=3, height=6, width=8, batch=2,
                                  config=FullConfig(timesteps=STEPS, **flags))
    assert (ref - noise).abs().mean() > 0.1  # the model moved the sample: random weights, not zero-init
    torch.testing.assert_close(sampler.sample(noise, ids), ref, **TOL)


def test_sampler_runs_a_parallelized_copy_and_leaves_the_model_alone():
    model = tiny_model()
    sampler = FullSequenceSampler(model, frames=3, height=6, width=8,
                                  config=FullConfig(parallel=ParallelConfig(sp_mode="ring")))
    assert isinstance(sampler.model.blocks[0].attn, SequenceParallelAttention)
    assert isinstance(model.blocks[0].attn, DenseAttention)
    assert sampler.model.blocks[0].attn.inner.qkv.weight is model.blocks[0].attn.qkv.weight


def test_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="parallel.sp_mode="):
        FullSequenceSampler(model, frames=3, height=6, width=8,
                            config=FullConfig(parallel=ParallelConfig(sp_mode="no")))
    with pytest.raises(ValueError, match="parallel.placement="):
        FullSequenceSampler(model, frames=3, height=6, width=8,
                            config=FullConfig(parallel=ParallelConfig(placement="across")))
    with pytest.raises(ValueError, match="parallel.transport="):
        FullSequenceSampler(model, frames=3, height=6, width=8,
                            config=FullConfig(parallel=ParallelConfig(transport="pigeon")))
    with pytest.raises(ValueError, match="timesteps"):
        FullSequenceSampler(model, frames=3, height=6, width=8, config=FullConfig(timesteps=(1.0, 1.0)))
    with pytest.raises(ValueError, match="patch size"):
        FullSequenceSampler(model, frames=3, height=5, width=8)
    sampler = FullSequenceSampler(model, frames=3, height=6, width=8)
    with pytest.raises(ValueError, match="noise must be"):
        sampler.sample(torch.randn(1, 3, 4, 6, 8), model.tokenizer(["x"]))
