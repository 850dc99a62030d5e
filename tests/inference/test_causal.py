"""Causal chunked generation on one process against dense, explicitly masked references.

Grid: 6 latent frames of 4 x 10 (2 x 5 tokens per frame), chunks of 2 frames (20 tokens), fp32.
Tolerance: both sides compute the same fp32 math in different orders (row blocks, SDPA vs
einsum, Conv3d vs a linear patch embedding), so they agree to fp32 rounding amplified by two
random-weight blocks: ~1e-6 relative; ATOL/RTOL leave a margin of ~10x, far below any real bug
(a wrong mask, RoPE index or cache slot changes outputs at the 1e-1 level).
"""
from __future__ import annotations

import pytest
import torch

from megaslide.inference.causal import CausalConfig, CausalGenerator
from megaslide.inference.kv_cache import KVCache
from tests.inference.reference import chunked_forward, masked_forward, reference_generate, tiny_model

FRAMES, HEIGHT, WIDTH, CHUNK = 6, 4, 10, 2
STEPS = (1.0, 0.75, 0.5, 0.25)
TOL = dict(atol=2e-5, rtol=2e-5)



@pytest.fixture(scope="module")
def setup():
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 3, FRAMES, HEIGHT, WIDTH, generator=gen)
    return model, noise, model.tokenizer(["a red circle moving left"])


def make(model, **kw) -> CausalGenerator:
    cfg = CausalConfig(**{"chunk_frames": CHUNK, "timesteps": STEPS, **kw})
    return CausalGenerator(model, frames=FRAMES, height=HEIGHT, width=WIDTH, config=cfg)


@pytest.mark.parametrize("chunk, window", [(2, None), (2, 1), (1, 2)])  # (1, 2): 6 chunks cycle a 3-slot ring
@pytest.mark.parametrize("t", [0.0, 0.6])
def test_chunks_through_the_cache_equal_one_block_causal_forward(setup, t, chunk, window):
    """The key test of the global time index: chunk c's RoPE starts at frame c * F, its queries see
    the cached keys of chunks c-W..c, and the result is one dense forward of the whole video."""
    model, noise, ids = setup
    x = torch.randn(noise.shape, generator=torch.Generator().manual_seed(2))
    ref = masked_forward(model, x, t, ids, chunk, window)
    got = chunked_forward(make(model, chunk_frames=chunk, window=window), x, t, ids)
    assert ref.abs().mean() > 0.1  # random weights: a real signal, not adaLN-Zero's zeros
    torch.testing.assert_close(got, ref, **TOL)


def test_wrong_time_index_is_detected(setup):
    """The check above has teeth: RoPE from frame 0 for every chunk (a local index) fails it."""
    model, noise, ids = setup
    ref = masked_forward(model, noise, 0.6, ids, CHUNK)
    gen = make(model)
    gen._ropes = [gen._lookup_rope(0)] * gen.num_chunks
    assert (chunked_forward(gen, noise, 0.6, ids) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 1])
def test_generation_equals_reference_without_cache(setup, window):
    model, noise, ids = setup
    ref = reference_generate(model, noise, ids, CHUNK, STEPS, window)
    got = make(model, window=window).sample(noise, ids)
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("flags", [dict(precompute_rope=False), dict(host_sync_free=False, cuda_graphs=False),
                                   dict(fused_qk_rope=False)])
def test_each_optimisation_switch_gives_the_same_video(setup, flags):
    model, noise, ids = setup
    torch.testing.assert_close(make(model, **flags).sample(noise, ids), make(model).sample(noise, ids), **TOL)


def test_chunks_are_yielded_in_order_and_do_not_depend_on_later_noise(setup):
    model, noise, ids = setup
    gen = make(model)
    first = [c.latents.clone() for c in gen.generate(noise, ids)]
    assert [c.index for c in gen.generate(noise, ids)] == [0, 1, 2]
    for changed in (1, 2):
        other = noise.clone()
        other[:, :, changed * CHUNK:] = torch.randn_like(other[:, :, changed * CHUNK:])
        second = [c.latents for c in gen.generate(other, ids)]
        for c in range(changed):
            assert torch.equal(first[c], second[c]), f"chunk {c} changed when chunk {changed} did"
        assert not torch.allclose(first[changed], second[changed])


def test_yield_comes_before_the_clean_pass(setup):
    """A chunk is handed out before its cache-writing forward: the first chunk is ready after its
    denoising steps alone (what time-to-first-frame measures)."""
    model, noise, ids = setup
    gen = make(model)
    calls = []
    forward = gen.forward_chunk
    gen.forward_chunk = lambda c, x, t, *a, **k: calls.append((c, t)) or forward(c, x, t, *a, **k)
    stream = gen.generate(noise, ids)
    next(stream)
    assert calls == [(0, t) for t in STEPS]
    next(stream)
    assert calls[len(STEPS)] == (0, 0.0)


def test_shorter_video_than_built_for(setup):
    model, noise, ids = setup
    short = make(model).sample(noise[:, :, :2 * CHUNK], ids)
    torch.testing.assert_close(short, make(model).sample(noise, ids)[:, :, :2 * CHUNK], **TOL)


def test_errors(setup):
    model, noise, ids = setup
    with pytest.raises(ValueError, match="chunk_frames=4"):
        CausalGenerator(model, frames=FRAMES, height=HEIGHT, width=WIDTH, config=CausalConfig(chunk_frames=4))
    with pytest.raises(ValueError, match="timesteps"):
        make(model, timesteps=(0.5, 0.75))
    with pytest.raises(ValueError, match="window"):
        make(model, window=0)
    with pytest.raises(ValueError, match="cuda_graphs"):
        make(model, host_sync_free=False, cuda_graphs=True)
    with pytest.raises(ValueError, match="patch size"):
        CausalGenerator(model, frames=FRAMES, height=5, width=WIDTH, config=CausalConfig(chunk_frames=CHUNK))
    gen = make(model)
    longer = torch.cat([noise, noise[:, :, :CHUNK]], dim=2)
    with pytest.raises(ValueError, match="at most frames=6"):
        next(gen.generate(longer, ids))
    with pytest.raises(ValueError, match="multiple of chunk_frames"):
        next(gen.generate(noise[:, :, :3], ids))
    ctx, mask = gen.encode_context(ids)
    rows = gen.shard_rows(noise[:, :, :CHUNK])
    with pytest.raises(ValueError, match="KV cache overflow"):
        gen.forward_chunk(gen.num_chunks, rows, 0.5, ctx, mask)
    with pytest.raises(ValueError, match="shard_rows"):
        gen.forward_chunk(0, rows[:, 1:], 0.5, ctx, mask)


def test_kv_cache_ring_holds_the_last_window():
    cache = KVCache(depth=1, batch=1, heads=1, head_dim=2, chunk_tokens=3, num_chunks=10, window=2)
    assert cache.slots == 3 and len(cache.k) == 1 and cache.k[0].shape == (1, 1, 9, 2)
    for c in range(6):
        cache.begin_chunk(c)
        k = torch.full((1, 3, 1, 2), float(c))
        keys, values = cache.write_and_view(0, k, -k)
        assert sorted(set(keys.flatten().tolist())) == list(range(max(0, c - 2), c + 1))
        assert torch.equal(values, -keys)
    with pytest.raises(ValueError, match="window"):
        KVCache(depth=1, batch=1, heads=1, head_dim=2, chunk_tokens=3, num_chunks=2, window=0)
    with pytest.raises(ValueError, match="begin_chunk"):
        KVCache(depth=1, batch=1, heads=1, head_dim=2, chunk_tokens=3, num_chunks=2).write_and_view(0, k, k)
