"""Diffusers-format Wan checkpoints in and out of the offload engine, never whole in host RAM: the engine that
reads a sharded folder block by block equals the engine built from `load_pretrained`'s model (host state and
training steps bit for bit, fp32); it reads each block's tensors just before that block's host state is filled;
`OffloadEngine.save_pretrained` writes the files `VideoDiT.save_pretrained` writes; `model.pretrained` starts
both of the Trainer's engines from a folder; bad folders are refused before any host state is allocated."""
import dataclasses
import json
import re

import pytest
import torch

from megaslide.config import OffloadConfig
from megaslide.diffusion.batches import Batch
from megaslide.models import load_pretrained
from megaslide.models.dit import DiTBlock, VideoDiT
from megaslide.offload.engine import OffloadEngine
from megaslide.offload.host_state import HostState
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg
from tests.models.test_pretrained import _reference

safetensors = pytest.importorskip("safetensors")

GRID = (3, 3, 5)     # tokens of latents (T, H, W) = (3, 6, 10)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random diffusers Wan (2 blocks), sharded into several files."""
    path = tmp_path_factory.mktemp("wan_sharded")
    _reference().save_pretrained(path, max_shard_size="20KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def _kw(**offload):
    return {"device": CPU, "train_cfg": tiny_train_cfg(batch_size=2, grad_clip=1.0),
            "offload_cfg": OffloadConfig(enabled=True, **offload)}


def _batch(seed: int = 3) -> Batch:
    g = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(2, 4, 3, 6, 10, generator=g), torch.randn(2, 4, 3, 6, 10, generator=g)
    return Batch(x0, torch.randn(2, 7, 20, generator=g), torch.tensor([0.2, 0.9]), noise, [])


def _host_states(engine):
    return [(b.master.clone(), b.weights.clone()) for b in engine.host.blocks]


def test_read_block_by_block_equals_the_engine_of_the_loaded_model(folder, torch_adamw):
    mine = OffloadEngine.from_pretrained(folder, grid=GRID, **_kw())
    theirs = OffloadEngine(load_pretrained(folder), **_kw())
    assert mine.model.cfg == dataclasses.replace(theirs.model.cfg, pretrained=str(folder))
    for (a_master, a_weights), (b_master, b_weights) in zip(_host_states(mine), _host_states(theirs), strict=True):
        assert torch.equal(a_master, b_master) and torch.equal(a_weights, b_weights)
    assert all(torch.equal(a, b) for a, b in zip(mine.resident_params, theirs.resident_params, strict=True))
    for step in range(2):
        a, b = mine.train_step(_batch(step), 1e-3), theirs.train_step(_batch(step), 1e-3)
        assert a["loss"].item() == b["loss"].item() and a["grad_norm"].item() == b["grad_norm"].item()
    a, b = mine.model_state_dict(), theirs.model_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_each_block_is_read_just_before_its_host_state_is_filled(folder, monkeypatch):
    """No whole-model fp32 state: block l's tensors are read after block l - 1 went into the host state, and
    nothing of block l + 1 before block l did; the stem is read before any block."""
    events = []
    open_file = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kw):
            self.inner = open_file(*args, **kw)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            block = re.match(r"blocks\.(\d+)\.", key)
            events.append(("read", int(block[1]) if block else None))
            return self.inner.get_tensor(key)

    load_block = HostState.load_block_
    monkeypatch.setattr(safetensors, "safe_open", Spy)
    monkeypatch.setattr(HostState, "load_block_", lambda self, i, flat: (events.append(("fill", i)),
                                                                         load_block(self, i, flat)))
    OffloadEngine.from_pretrained(folder, grid=GRID, **_kw())
    order = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]   # runs of one kind, collapsed
    assert order == [("read", None), ("read", 0), ("fill", 0), ("read", 1), ("fill", 1)]
    assert events.count(("read", None)) > 5 and events.count(("read", 1)) > 10


def test_dsa_zero_reads_the_dense_projections_with_a_zero_offset_net(folder):
    engine = OffloadEngine.from_pretrained(folder, grid=GRID, attention="dsa_zero", **_kw())
    dense = load_pretrained(folder)
    slots = {s.name: s for s in engine.layout.slots}
    for index, block in enumerate(dense.blocks):
        master = engine.host.blocks[index].master
        qkv = slots["attn.qkv.weight"]
        assert torch.equal(master[qkv.offset:qkv.end].view(qkv.shape), block.attn.qkv.weight)
        for name in ("attn.offset_proj.weight", "attn.offset_proj.bias"):
            assert torch.count_nonzero(master[slots[name].offset:slots[name].end]) == 0
    assert torch.isfinite(engine.train_step(_batch(), 1e-3)["loss"])


def test_export_writes_what_the_model_writes_bit_for_bit(folder, tmp_path):
    engine = OffloadEngine.from_pretrained(folder, grid=GRID, **_kw())
    engine.train_step(_batch(), 1e-2)                      # weights that no file held yet
    engine.save_pretrained(tmp_path / "engine", max_shard_size="20KB")
    model = load_pretrained(folder)
    model.load_state_dict(engine.model_state_dict())
    model.save_pretrained(tmp_path / "model", max_shard_size="20KB")
    written = sorted(p.name for p in (tmp_path / "engine").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "model").iterdir()) and len(written) > 3
    for name in written:
        assert (tmp_path / "engine" / name).read_bytes() == (tmp_path / "model" / name).read_bytes(), name
    again = load_pretrained(tmp_path / "engine")
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine", "model"]   # no partial folder left behind


def test_a_save_over_an_earlier_one_replaces_its_weights_and_keeps_other_files(folder, tmp_path):
    model = load_pretrained(folder)
    model.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    (tmp_path / "out" / "README.md").write_text("mine")
    model.save_pretrained(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "README.md", "config.json", "diffusion_pytorch_model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _refused_before_allocation(monkeypatch):
    def allocate(*args, **kw):
        raise AssertionError("host state allocated before the folder was checked")
    monkeypatch.setattr(HostState, "__init__", allocate)


def test_bad_folders_are_refused_before_the_host_state(folder, tmp_path, monkeypatch):
    _refused_before_allocation(monkeypatch)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        OffloadEngine.from_pretrained(tmp_path / "nowhere", grid=GRID, **_kw())
    bad = tmp_path / "missing"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    index = json.loads((bad / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = index["weight_map"]["blocks.1.attn2.to_k.bias"]
    tensors = safetensors.torch.load_file(bad / shard)
    del tensors["blocks.1.attn2.to_k.bias"]
    del index["weight_map"]["blocks.1.attn2.to_k.bias"]
    safetensors.torch.save_file(tensors, bad / shard)
    (bad / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing keys \['blocks.1.attn2.to_k.bias'\]"):
        OffloadEngine.from_pretrained(bad, grid=GRID, **_kw())
    cfg = dataclasses.replace(load_pretrained(folder).cfg, pretrained=str(folder), depth=3)
    with pytest.raises(ValueError, match=r"holds another architecture: model.depth=3 \(the folder: 2\)"):
        OffloadEngine.from_config(cfg, grid=GRID, **_kw())
    with pytest.raises(ValueError, match=r"model.pretrained='.*nowhere' is not a diffusers-format folder"):
        OffloadEngine.from_config(dataclasses.replace(cfg, pretrained=str(tmp_path / "nowhere")), grid=GRID, **_kw())


@pytest.mark.parametrize("offload", [False, True])
def test_model_pretrained_starts_the_trainer_from_the_folder(tmp_path, torch_adamw, offload):
    """A wan model with the built-in text encoder (its weights saved under MegaSlide names) trains on captions;
    both engines start from the folder's weights, not the seed's, and agree step by step."""
    cfg = dataclasses.replace(tiny_model_cfg(), block="wan", depth=3)
    torch.manual_seed(7)
    saved = VideoDiT(cfg)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p) * 0.05)               # no zero gate hides a block
    saved.save_pretrained(tmp_path / "wan")
    pretrained = dataclasses.replace(cfg, pretrained=str(tmp_path / "wan"))
    trainer = Trainer(pretrained, tiny_data_cfg(), tiny_train_cfg(steps=2), tmp_path / "run",
                      offload_cfg=OffloadConfig(enabled=offload))
    state = (trainer.engine.model_state_dict() if offload
             else {n: p.detach() for n, p in trainer.engine.model.named_parameters()})
    assert all(torch.equal(state[n], p) for n, p in saved.named_parameters())
    random = Trainer(cfg, tiny_data_cfg(), tiny_train_cfg(steps=2), tmp_path / "random",
                     offload_cfg=OffloadConfig(enabled=offload))
    losses = [trainer.train_step()["loss"].item() for _ in range(2)]
    assert losses != [random.train_step()["loss"].item() for _ in range(2)]
    if offload:
        resident = Trainer(pretrained, tiny_data_cfg(), tiny_train_cfg(steps=2), tmp_path / "resident")
        assert losses == [resident.train_step()["loss"].item() for _ in range(2)]


def test_weights_the_files_hold_are_never_drawn_at_random(folder, monkeypatch):
    """load_pretrained initialises the model only where the files lack a parameter (a DSA offset net); the engine
    initialises no block whose parameters the files hold."""
    calls = []
    for cls in (VideoDiT, DiTBlock):
        init = cls.initialize_weights
        monkeypatch.setattr(cls, "initialize_weights", lambda self, *a, _init=init, **kw: (
            calls.append(type(self).__name__), _init(self, *a, **kw)))
    load_pretrained(folder)
    assert calls == []
    load_pretrained(folder, attention="dsa_zero")
    assert calls[0] == "VideoDiT"
    calls.clear()
    OffloadEngine.from_pretrained(folder, grid=GRID, **_kw())
    assert calls == ["VideoDiT", "DiTBlock"]   # the one-block stem model (its block 0): block 1 is read only
    calls.clear()
    OffloadEngine.from_pretrained(folder, grid=GRID, attention="dsa_zero", **_kw())
    assert calls == ["VideoDiT", "DiTBlock", "DiTBlock"]


def test_compact_state_loads_rounded_and_exports_its_master(folder, tmp_path):
    engine = OffloadEngine.from_pretrained(folder, grid=GRID, **_kw(master_dtype="bf16", moments="int8"))
    model = load_pretrained(folder)
    state = engine.model_state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach().bfloat16().float() if name.startswith("blocks.") else p), name
    engine.save_pretrained(tmp_path / "engine")
    model.load_state_dict(state)
    model.save_pretrained(tmp_path / "model")
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        assert (tmp_path / "engine" / name).read_bytes() == (tmp_path / "model" / name).read_bytes()
