"""Wan checkpoints in the diffusers format: a tiny random diffusers `WanTransformer3DModel` loads into MegaSlide
with the same output and gradients, exports round-trip bit for bit and load back into diffusers, sharded folders
load, DSA swaps in with the checkpoint's projections, and bad folders give errors naming the file and the keys."""
import json
import sys

import pytest
import torch

from megaslide.models import load_pretrained
from megaslide.models.dit import DIT_PRESETS, build_dit, count_params
from megaslide.models.wan import to_diffusers

diffusers = pytest.importorskip("diffusers", reason='needs the wan extra: pip install -e ".[wan]"')
safetensors = pytest.importorskip("safetensors.torch", reason="needs safetensors (the wan extra)")

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=20, freq_dim=16, ffn_dim=40, num_layers=2, rope_max_seq_len=32)
"""Head dim 12: RoPE pairs t, h, w = 2, 2, 2 (d - 4 (d // 6), 2 (d // 6), 2 (d // 6))."""


def _reference(seed: int = 0):
    """A tiny diffusers Wan with every weight random (no zero-init output or gate hides a path)."""
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(**TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _inputs(seed: int = 1):
    """Latents on an odd grid (T, H, W) = (3, 6, 10): tokens (3, 3, 5); two timesteps; 7 caption tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 3, 6, 10, generator=g), torch.tensor([31.0, 977.0]), torch.randn(2, 7, 20, generator=g)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan")
    _reference().save_pretrained(path)
    return path


def test_output_and_every_gradient_match_diffusers(folder):
    ref, model = _reference(), load_pretrained(folder)
    x, t, ctx = _inputs()
    want = ref(hidden_states=x, timestep=t, encoder_hidden_states=ctx).sample
    got = model(x, t, ctx)
    assert _relative(got, want) <= 1e-5
    weight = torch.randn_like(want)
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    theirs = dict(ref.named_parameters())
    compared = 0
    for name, p in model.named_parameters():
        for key, grad in to_diffusers(name, p.grad).items():
            assert theirs[key].grad.abs().max() > 0, key
            assert _relative(grad.reshape(theirs[key].shape), theirs[key].grad) <= 1e-5, key
            compared += 1
    assert compared == len(theirs)                     # every diffusers parameter's gradient


def test_export_round_trips_bit_for_bit_and_diffusers_loads_it(folder, tmp_path):
    model = load_pretrained(folder)
    model.save_pretrained(tmp_path)
    again = load_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    original = safetensors.load_file(folder / "diffusion_pytorch_model.safetensors")
    exported = safetensors.load_file(tmp_path / "diffusion_pytorch_model.safetensors")
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    theirs = diffusers.WanTransformer3DModel.from_pretrained(tmp_path)
    x, t, ctx = _inputs(seed=2)
    assert torch.equal(theirs(hidden_states=x, timestep=t, encoder_hidden_states=ctx).sample, model(x, t, ctx))


def test_sharded_folders_load_both_ways(folder, tmp_path):
    _reference().save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    assert len(list((tmp_path / "theirs").glob("*.safetensors"))) > 1
    whole, sharded = load_pretrained(folder), load_pretrained(tmp_path / "theirs")
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), sharded.parameters(), strict=True))
    whole.save_pretrained(tmp_path / "ours", max_shard_size="20KB")
    assert (tmp_path / "ours" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    x, t, ctx = _inputs()
    back = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "ours")
    assert torch.equal(back(hidden_states=x, timestep=t, encoder_hidden_states=ctx).sample, whole(x, t, ctx))
    assert torch.equal(load_pretrained(tmp_path / "ours")(x, t, ctx), whole(x, t, ctx))


def test_dsa_swaps_in_with_the_checkpoint_projections(folder, tmp_path):
    dense = load_pretrained(folder)
    dsa = load_pretrained(folder, attention="dsa")
    block = dsa.blocks[1].attn
    assert torch.equal(block.qkv.weight, dense.blocks[1].attn.qkv.weight)
    assert torch.count_nonzero(block.offset_proj.weight) == 0 and torch.count_nonzero(block.offset_proj.bias) == 0
    x, t, ctx = _inputs()
    # zero offsets: exactly neighbourhood attention (dsa_zero) ...
    torch.testing.assert_close(dsa(x, t, ctx), load_pretrained(folder, attention="dsa_zero")(x, t, ctx),
                               rtol=1e-6, atol=1e-6)
    # ... which, with a window as large as the token grid (3, 3, 5), is the dense model
    whole = load_pretrained(folder, attention={"name": "dsa", "kernel_size": [3, 3, 5]})
    assert _relative(whole(x, t, ctx), dense(x, t, ctx)) <= 1e-5
    # a trained offset net is MegaSlide-only: saved under its own names, restored by load_pretrained
    with torch.no_grad():
        block.offset_proj.bias.normal_(std=0.3)
    dsa.save_pretrained(tmp_path)
    back = load_pretrained(tmp_path)
    assert back.cfg.attention.name == "dsa" and torch.equal(back.blocks[1].attn.offset_proj.bias,
                                                            block.offset_proj.bias)
    assert torch.equal(back(x, t, ctx), dsa(x, t, ctx))


def test_presets_count_what_diffusers_builds():
    for name, shape in [("wan-1.3b", (12, 8960, 30)), ("wan-14b", (40, 13824, 40))]:
        heads, ffn, layers = shape
        with torch.device("meta"):
            ref = diffusers.WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=128, ffn_dim=ffn,
                                                  num_layers=layers)
        assert count_params(DIT_PRESETS[name]) == sum(p.numel() for p in ref.parameters()), name


def _copy(folder, to):
    to.mkdir()
    for f in folder.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def test_bad_folders_name_the_file_and_the_keys(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_pretrained(tmp_path / "nowhere")
    other = _copy(folder, tmp_path / "unet")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "_class_name": "UNet2DConditionModel"}))
    with pytest.raises(ValueError, match=r"unet/config\.json: _class_name is 'UNet2DConditionModel'"):
        load_pretrained(other)
    i2v = _copy(folder, tmp_path / "i2v")
    (i2v / "config.json").write_text(json.dumps({**config, "image_dim": 1280}))
    with pytest.raises(ValueError, match="image_dim=1280 is not supported"):
        load_pretrained(i2v)
    weights = safetensors.load_file(folder / "diffusion_pytorch_model.safetensors")
    for name, edit, message in [
        ("missing", lambda w: w.pop("blocks.1.attn2.to_k.bias"), r"missing keys \['blocks.1.attn2.to_k.bias'\]"),
        ("unexpected", lambda w: w.update(extra_head=torch.zeros(3)), r"unexpected keys \['extra_head'\]"),
        ("shape", lambda w: w.update({"proj_out.bias": torch.zeros(5)}),
         r"keys \['proj_out.bias'\] have shapes \[\(5,\)\]"),
    ]:
        bad = _copy(folder, tmp_path / name)
        edited = dict(weights)
        edit(edited)
        safetensors.save_file(edited, bad / "diffusion_pytorch_model.safetensors")
        with pytest.raises(ValueError, match=message) as err:
            load_pretrained(bad)
        assert str(bad / "diffusion_pytorch_model.safetensors") in str(err.value)


def test_a_shard_without_the_keys_its_index_lists(tmp_path):
    _reference().save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    key, shard = next(iter(sorted(index["weight_map"].items())))
    tensors = safetensors.load_file(tmp_path / shard)
    del tensors[key]
    safetensors.save_file(tensors, tmp_path / shard)
    with pytest.raises(ValueError, match=rf"{shard}: lacks keys .*{key}"):
        load_pretrained(tmp_path)


def test_without_safetensors_it_says_what_to_install(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[wan\]"'):
        load_pretrained(folder)


def test_save_refuses_what_has_no_diffusers_form(folder, tmp_path):
    with pytest.raises(ValueError, match="max_shard_size='ten'"):
        load_pretrained(folder).save_pretrained(tmp_path, max_shard_size="ten")
    with pytest.raises(ValueError, match="model.block='dit'"):
        build_dit("tiny").save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())                 # refused before anything is written
