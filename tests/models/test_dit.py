import dataclasses

import pytest
import torch

from megaslide.config import ExecutionConfig
from megaslide.models.chunking import apply_execution
from megaslide.models.dit import DIT_PRESETS, build_dit, count_params

NAMED_SIZES = {"1B": 1e9, "7B": 7e9, "14B": 14e9, "33B": 33e9, "105B": 105e9}


def test_forward_shapes_and_zero_init():
    model = build_dit("tiny")
    x = torch.randn(2, 3, 4, 8, 6)                        # odd width in tokens: grid (4, 4, 3)
    ids = model.tokenizer(["a red circle moving left", ""])
    out = model(x, torch.tensor([10.0, 900.0]), ids)
    assert out.shape == x.shape
    assert torch.count_nonzero(out) == 0                  # adaLN-Zero: the final layer starts at zero


@pytest.mark.parametrize("name", sorted(NAMED_SIZES))
def test_count_params_within_two_percent_of_name(name):
    assert abs(count_params(DIT_PRESETS[name]) / NAMED_SIZES[name] - 1) < 0.02


def test_count_params_allocates_nothing_and_counts_the_built_model():
    for attention in ["dense", "dsa"]:
        model = build_dit("tiny", attention=attention)
        assert sum(p.numel() for p in model.parameters()) == count_params(model.cfg), attention
    assert count_params(DIT_PRESETS["105B"]) > 1e11         # on the meta device: no 400 GB allocated


@pytest.mark.parametrize("name,shape", [("wan-1.3b", (30, 1536, 12, 8960)), ("wan-14b", (40, 5120, 40, 13824))])
def test_wan_preset_shapes(name, shape):
    """The shapes of Wan 2.1's models (tests/models/test_pretrained.py checks them against diffusers' build)."""
    cfg = DIT_PRESETS[name]
    assert (cfg.depth, cfg.dim, cfg.num_heads, cfg.ffn_dim, cfg.in_channels, cfg.patch_size) == (*shape, 16, (1, 2, 2))
    assert (cfg.block, cfg.text_encoder, cfg.text_dim, cfg.text_len) == ("wan", False, 4096, 512)


def test_wan_block_family_without_text_encoder():
    """A wan model has 6 modulation rows and no built-in text encoder: it takes caption embeddings, not ids."""
    model = build_dit(dataclasses.replace(DIT_PRESETS["tiny"], block="wan", text_encoder=False))
    assert model.text_encoder is None and model.blocks[0].modulation.shape == (6, 64)
    assert sum(p.numel() for p in model.parameters()) == count_params(model.cfg)
    x = torch.randn(1, 3, 2, 4, 4)
    assert model(x, torch.tensor([300.0]), torch.randn(1, 5, 64)).shape == x.shape
    with pytest.raises(ValueError, match="no built-in text encoder"):
        model(x, torch.tensor([300.0]), model.tokenizer(["a red circle"]))
    with pytest.raises(ValueError, match="model.block='nope'"):
        build_dit("tiny", block="nope")


def test_precomputed_text_embeddings_and_checkpointing_match():
    torch.manual_seed(0)
    model = build_dit("tiny", checkpoint_blocks=True)
    for p in model.parameters():                           # leave zero-init so outputs are non-trivial
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(1, 3, 2, 4, 4, requires_grad=True)
    emb = torch.randn(1, 5, model.cfg.text_dim)
    out = model(x, torch.tensor([300.0]), emb)
    out.square().sum().backward()
    g_ckpt = x.grad.clone()
    x.grad = None
    apply_execution(model, ExecutionConfig())            # the same weights, run without checkpoints
    out2 = model(x, torch.tensor([300.0]), emb)
    out2.square().sum().backward()
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(g_ckpt, x.grad)
    with pytest.raises(ValueError, match="text_dim"):
        model(x, torch.tensor([300.0]), torch.randn(1, 5, model.cfg.text_dim + 1))


def test_unknown_preset_and_attention():
    with pytest.raises(ValueError, match="unknown DiT preset"):
        build_dit("nope")
    with pytest.raises(ValueError, match="attention.name"):
        build_dit("tiny", attention="nope")


def test_rmsnorm_matches_torch_and_keeps_fp32_weight_under_bf16():
    from megaslide.nn import RMSNorm
    ours, ref = RMSNorm(24, eps=1e-6), torch.nn.RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 24)
    assert torch.equal(ours(x), ref(x))                                   # fp32: the same op
    y = ours(x.bfloat16())                                                # bf16 input, fp32 weight
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref(x), rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert ours.weight.grad is not None and ours.weight.grad.dtype == torch.float32
