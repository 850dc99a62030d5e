"""The token-row hooks of VideoDiT that sequence-parallel inference runs the model through."""
from __future__ import annotations

import torch

from megaslide.inference.weights import random_weights_
from megaslide.models.dit import build_dit, patchify, unpatchify


def _model(**kw):
    torch.manual_seed(0)
    return random_weights_(build_dit("tiny", **kw), seed=3).eval()  # no zero gates: every path carries signal


def test_patchify_round_trip_and_order():
    x = torch.randn(2, 3, 4, 6, 8)
    rows = patchify(x, (2, 2, 2))                                   # (B, 2*3*4, 8*3)
    assert rows.shape == (2, 24, 24)
    torch.testing.assert_close(unpatchify(rows, (2, 3, 4), (2, 2, 2)), x, atol=0, rtol=0)
    # token 1 is patch (t=0, y=0, x=1); its values are ordered (pt, ph, pw, C)
    assert torch.equal(rows[0, 1].view(2, 2, 2, 3), x[0, :, 0:2, 0:2, 2:4].permute(1, 2, 3, 0))


@torch.no_grad()
def test_rows_of_a_shard_run_the_same_forward_as_the_whole_clip():
    """embed_shard on any run of rows gives those tokens of `embed`; the blocks (with the attention
    overridden by the block's own) and `head` then reproduce `forward` row by row."""
    model = _model()
    x = torch.randn(2, 3, 4, 6, 8)                       # grid (4, 3, 4): 48 tokens
    t = torch.tensor([100.0, 700.0])
    ids = model.tokenizer(["a red circle", "a blue square moving up"])
    e = model.embed(x, t, ids)
    ctx, ctx_mask = model.embed_context(ids)
    torch.testing.assert_close(ctx, e.ctx)
    rows = patchify(x, model.cfg.patch_size)             # (B, 48, pv*C)
    lo, hi = 10, 29
    cos, sin = e.rope
    shard = model.embed_shard(rows[:, lo:hi], t, ctx, ctx_mask, (cos[lo:hi], sin[lo:hi]), e.grid)
    torch.testing.assert_close(shard.x, e.x[:, lo:hi], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close((shard.t_emb, shard.t_mod), (e.t_emb, e.t_mod))

    whole = model.embed_shard(rows, t, ctx, ctx_mask, e.rope, e.grid)
    h = whole.x
    for i, block in enumerate(model.blocks):
        h = model.run_block(i, h, whole, attn=block.attn)
    got = unpatchify(model.head(h, whole), e.grid, model.cfg.patch_size)
    want = model(x, t, ids)
    assert want.abs().mean() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_attention_override_replaces_only_self_attention():
    model = _model()
    x = torch.randn(1, 3, 2, 4, 4)
    e = model.embed(x, torch.tensor([500.0]), model.tokenizer(["a green triangle"]))
    calls = []

    def silent(h, rope, grid):
        calls.append((tuple(h.shape), grid))
        return torch.zeros_like(h)

    out = model.run_block(0, e.x, e, attn=silent)
    assert calls == [(tuple(e.x.shape), e.grid)]
    assert not torch.allclose(out, model.run_block(0, e.x, e))  # the default attention contributes
    assert not torch.allclose(out, e.x)                         # cross-attention and MLP still run


@torch.no_grad()
def test_bf16_model_embeds_timesteps_and_captions_without_autocast():
    """Inference holds the model in bf16 with no autocast around it: fp32 latents, the fp32
    sinusoidal features and fp32 caption embeddings must meet bf16 weights."""
    model = _model()
    low = _model().to(torch.bfloat16)
    t = torch.tensor([250.0, 900.0])
    t_emb, t_mod = low.embed_timestep(t)
    assert t_emb.dtype == t_mod.dtype == torch.bfloat16
    ref_emb, ref_mod = model.embed_timestep(t)
    torch.testing.assert_close(t_emb.float(), ref_emb, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(t_mod.float(), ref_mod, atol=5e-2, rtol=5e-2)
    emb = torch.randn(2, 5, model.cfg.text_dim)            # precomputed fp32 caption embeddings
    ctx, mask = low.embed_context(emb)
    assert ctx.dtype == torch.bfloat16 and mask.all()
    torch.testing.assert_close(ctx.float(), model.embed_context(emb)[0], atol=5e-2, rtol=5e-2)
    x = torch.randn(1, 3, 2, 4, 4)
    out = low(x, t[:1], model.tokenizer(["a red circle"]))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), model(x, t[:1], model.tokenizer(["a red circle"])), atol=0.1, rtol=0.1)
