"""Latent caches with a tiny random Wan VAE and umT5: the latents are the VAE's normalised means and the
embeddings umT5's, zero past the caption; an interrupted cache resumes (whole files kept, a damaged one redone);
a clip of the wrong size or frame count is refused by name before anything is encoded; training batches carry
the cached embeddings; without the wan extra the error says what to install."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from megaslide.config import DataConfig
from megaslide.data import latent_cache as lc
from megaslide.data.encode_cache import encode_prompts, encode_video_folder
from megaslide.data.latent_cache import LatentCache
from megaslide.diffusion.batches import make_batch
from megaslide.extras import require
from megaslide.models.dit import HashTokenizer
from tests.helpers import tiny_train_cfg
from tests.wan_assets import FRAMES, SIZE, TEXT_LEN, write_checkpoint, write_clips

diffusers = pytest.importorskip("diffusers", reason='needs the wan extra: pip install -e ".[wan]"')
pytest.importorskip("transformers", reason='needs the wan extra: pip install -e ".[wan]"')
CAPTIONS = ["a red circle moving left", "a blue square moving up", "a circle moving down"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megaslide.models.encoders import UMT5Text, WanVAE
    root = tmp_path_factory.mktemp("wan")
    write_checkpoint(root)
    write_clips(root / "clips", CAPTIONS)
    cpu = torch.device("cpu")
    return {"root": root, "vae": WanVAE(root / "vae", cpu),
            "text": UMT5Text(root / "text_encoder", root / "tokenizer", TEXT_LEN, cpu)}


def _encode(assets, out, vae=None, clips=None, **kw):
    size = {"frames": FRAMES, "height": SIZE, "width": SIZE, **kw}
    return encode_video_folder(clips or assets["root"] / "clips", out, vae=vae or assets["vae"], text=assets["text"],
                               sources={"test": 1}, progress=False, **size)


class Interrupted(RuntimeError):
    pass


class FailAfter:
    """The VAE, interrupted (an exception) once `n` clips are encoded; counts the clips it encodes."""

    def __init__(self, vae, n: int | None = None):
        self.vae, self.n, self.calls = vae, n, 0
        self.channels, self.size_error, self.latent_shape = vae.channels, vae.size_error, vae.latent_shape

    def encode(self, video):
        if self.n is not None and self.calls == self.n:
            raise Interrupted("killed")
        self.calls += 1
        return self.vae.encode(video)


def test_cache_holds_normalised_latents_and_padded_embeddings(assets, tmp_path):
    manifest, encoded = _encode(assets, tmp_path / "cache")
    assert encoded == 3 and manifest["complete"] and manifest["latent_shape"] == [4, 3, 8, 8]
    cache = LatentCache(tmp_path / "cache")
    item = cache[1]
    from megaslide.data.video_folder import read_clip
    vae = assets["vae"].vae
    mu = vae.encode(read_clip(assets["root"] / "clips" / "clip1.mp4", FRAMES)[None]).latent_dist.mean[0]
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    torch.testing.assert_close(item["video"], (mu - mean) / std)
    tokens = assets["text"].tokenizer([CAPTIONS[1]], padding="max_length", max_length=TEXT_LEN, return_tensors="pt")
    n = int(tokens.attention_mask.sum())                       # 5 words and the end token
    assert n == 6 and item["context_mask"].tolist() == [True] * n + [False] * (TEXT_LEN - n)
    hidden = assets["text"].model(tokens.input_ids, tokens.attention_mask).last_hidden_state[0]
    torch.testing.assert_close(item["context"][:n], hidden[:n])
    assert item["context"][n:].abs().max() == 0 and item["caption"] == CAPTIONS[1]
    null, null_mask = cache.null_context
    assert null_mask.tolist() == [True] + [False] * (TEXT_LEN - 1) and null[1:].abs().max() == 0


def test_interrupted_cache_resumes_where_it_stopped(assets, tmp_path):
    out = tmp_path / "cache"
    with pytest.raises(Interrupted):
        _encode(assets, out, vae=FailAfter(assets["vae"], n=1))
    assert not json.loads((out / lc.MANIFEST).read_text())["complete"]
    assert sorted(p.name for p in (out / lc.CLIPS).iterdir()) == ["00000.safetensors"]   # no partial file
    with pytest.raises(ValueError, match="incomplete.*run experiments/precompute.py again"):
        LatentCache(out)
    first = lc.clip_file(out, 0).read_bytes()
    vae = FailAfter(assets["vae"])
    _, encoded = _encode(assets, out, vae=vae)
    assert encoded == vae.calls == 2 and lc.clip_file(out, 0).read_bytes() == first
    lc.clip_file(out, 2).write_bytes(lc.clip_file(out, 2).read_bytes()[:100])   # a damaged file is redone
    _, encoded = _encode(assets, out)
    assert encoded == 1 and len(LatentCache(out)) == 3
    with pytest.raises(ValueError, match=r"\['sources', 'latent_shape'\] differ"):
        encode_video_folder(assets["root"] / "clips", out, frames=3, height=SIZE, width=SIZE, vae=assets["vae"],
                            text=assets["text"], sources={"test": 2}, progress=False)


@pytest.mark.parametrize("clip, size, match", [
    ((FRAMES, SIZE, 24), {}, r"clip .*clip1.mp4 is 16x24, not height x width = 16x16"),
    ((FRAMES - 2, SIZE, SIZE), {}, r"clip .*clip1.mp4 has 3 frames, fewer than frames=5"),
    ((FRAMES, SIZE, SIZE), {"frames": 4}, r"frames=4, height=16, width=16: 4 frames is not 1 \+ 2k"),
    ((FRAMES, SIZE, SIZE), {"height": 15, "width": 14}, r"15x14 is not a multiple of 2"),
])
def test_a_clip_that_does_not_fit_is_refused_by_name_before_encoding(assets, tmp_path, clip, size, match):
    clips = write_clips(tmp_path / "clips", CAPTIONS[:1])
    write_clips(tmp_path / "other", CAPTIONS[:2], frames=clip[0], size=clip[1:])
    (tmp_path / "other" / "clip1.mp4").replace(clips / "clip1.mp4")
    (clips / "captions.jsonl").write_text((tmp_path / "other" / "captions.jsonl").read_text())
    vae = FailAfter(assets["vae"])
    with pytest.raises(ValueError, match=match):
        _encode(assets, tmp_path / "cache", vae=vae, clips=clips, **size)
    assert vae.calls == 0 and not (tmp_path / "cache").exists()


def test_batches_carry_cached_embeddings_and_the_null_caption_when_dropped(assets, tmp_path):
    _encode(assets, tmp_path / "cache")
    data = DataConfig(name="latent_cache", root=str(tmp_path / "cache"), frames=0, height=0, width=0)
    data.validate()
    assert (data.frames, data.height, data.width) == (3, 8, 8)
    with pytest.raises(ValueError, match="model.in_channels=3, but the latent cache .* set model.in_channels=4"):
        data.check_channels(3)
    with pytest.raises(ValueError, match="model.text_dim=64, .* set model.text_dim=16"):
        data.check_captions(False, 64)
    with pytest.raises(ValueError, match="data.frames=5, but the latent cache .* frames 3"):
        DataConfig(name="latent_cache", root=data.root, frames=5, height=0, width=0).validate()
    cache = LatentCache(data.root)
    cfg = tiny_train_cfg(batch_size=6, caption_dropout=0.5, seed=3)
    batch = make_batch(cache, HashTokenizer(16, 4), cfg, 0)
    assert batch.x0.shape == (6, 4, 3, 8, 8) and batch.context.shape == (6, TEXT_LEN, 16)
    dropped = [i for i, c in enumerate(batch.captions) if c == ""]
    assert 0 < len(dropped) < 6
    for i, caption in enumerate(batch.captions):
        want = cache.null_context if caption == "" else (lambda it: (it["context"], it["context_mask"]))(
            cache[CAPTIONS.index(caption)])
        assert torch.equal(batch.context[i], want[0]) and torch.equal(batch.mask[i], want[1])


def test_prompt_files_hold_the_prompt_and_the_null_caption(assets, tmp_path):
    (path,) = encode_prompts(tmp_path, assets["text"], ["a red square"])
    found = lc.load_tensors(path)
    context, mask = assets["text"].encode(["a red square", ""])
    assert torch.equal(found["context"], context[0]) and torch.equal(found["null_mask"], mask[1])


def test_without_the_wan_extra_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)      # import diffusers raises ModuleNotFoundError
    with pytest.raises(ImportError, match=r'the Wan VAE needs diffusers: pip install -e "\.\[wan\]"'):
        from megaslide.models.encoders import WanVAE
        WanVAE("/nowhere", torch.device("cpu"))
    with pytest.raises(ImportError, match=r'x needs diffusers: pip install -e "\.\[wan\]"'):
        require("diffusers", "x")
