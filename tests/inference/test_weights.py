"""Inference reads a sharded checkpoint of the offload engine through the layout that the checkpoint
records (megaslide.checkpoint.BLOCK_LAYOUT), never through the offload engine."""
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megaslide.inference
from megaslide.checkpoint import (
    BLOCK_LAYOUT,
    SHARDED_STATE,
    block_shard,
    flat_layout,
    load_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from megaslide.config import OffloadConfig
from megaslide.inference.weights import caption_input, load_model, sampling_weights
from megaslide.models.dit import DIT_PRESETS, VideoDiT, build_dit
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

DEPTH = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny offload run of 2 steps on CPU, checkpointed at its end (checkpoints/step_2/)."""
    cfg = dataclasses.replace(tiny_model_cfg("dsa"), depth=DEPTH)
    trainer = Trainer(cfg, tiny_data_cfg(), tiny_train_cfg(steps=2), tmp_path_factory.mktemp("run"),
                      offload_cfg=OffloadConfig(enabled=True))
    trainer.fit()
    yield trainer, trainer.checkpoints / "step_2"
    trainer.close()


def _assert_trained_weights(weights: dict[str, torch.Tensor], trainer) -> None:
    model = VideoDiT(trainer.model_cfg)
    model.load_state_dict(weights)                    # strict: every parameter, no extra key
    trained = trainer.engine.model_state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p, trained[name]), name


def test_the_checkpoint_records_the_engine_layout(run):
    trainer, folder = run
    record = load_checkpoint(folder / SHARDED_STATE)[BLOCK_LAYOUT]
    assert record == trainer.engine.layout.record()
    assert record["names"] == [name for name, _ in trainer.engine.model.blocks[0].named_parameters()]


def test_an_offload_checkpoint_loads_for_inference_with_equal_weights(run):
    trainer, folder = run
    model = load_model(trainer.model_cfg, checkpoint=str(folder), device=torch.device("cpu"), dtype=torch.float32)
    trained = trainer.engine.model_state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p, trained[name]), name


def test_the_reader_cuts_the_shards_as_the_record_says(run, tmp_path):
    """Shards packed without padding (another layout than the engine's): the record alone places them."""
    trainer, folder = run
    state = load_checkpoint(folder / SHARDED_STATE)
    trained = trainer.engine.model_state_dict()
    block = trainer.engine.model.blocks[0]
    record = flat_layout(((name, p.shape) for name, p in block.named_parameters()), align=1)
    shards = []
    for index in range(DEPTH):
        master = torch.cat([trained[f"blocks.{index}.{name}"].flatten() for name in record["names"]])
        assert master.numel() == record["numel"]
        shards.append((block_shard(tmp_path, index).stem, {"master": master}))
    packed = save_sharded_checkpoint(tmp_path / "step_2", shards, {**state, BLOCK_LAYOUT: record})
    weights, _ = sampling_weights(packed)
    _assert_trained_weights(weights, trainer)
    shard = block_shard(packed, 1)
    save_checkpoint(shard, {"master": load_checkpoint(shard)["master"][:-1]})
    with pytest.raises(ValueError, match=f"{shard.name}.*{BLOCK_LAYOUT}"):
        sampling_weights(packed)


def test_a_checkpoint_without_the_record_still_loads(run, tmp_path):
    """Checkpoints written before state.pt held the layout: rebuilt from the saved config on meta."""
    trainer, folder = run
    old = tmp_path / "step_2"
    old.mkdir()
    for index in range(DEPTH):
        shard = block_shard(folder, index)
        (old / shard.name).write_bytes(shard.read_bytes())
    state = load_checkpoint(folder / SHARDED_STATE)
    del state[BLOCK_LAYOUT]
    save_checkpoint(old / SHARDED_STATE, state)
    weights, _ = sampling_weights(old)
    _assert_trained_weights(weights, trainer)


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_inference_never_imports_the_offload_engine():
    files = sorted(Path(megaslide.inference.__file__).parent.glob("*.py"))
    assert files
    for path in files:
        offload = sorted(m for m in _imported_modules(path) if m == "megaslide.offload"
                         or m.startswith("megaslide.offload."))
        assert not offload, f"{path.name} imports {offload}"
    code = ("import sys, megaslide.inference.weights; "
            "print(sorted(m for m in sys.modules if m.startswith('megaslide.offload')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(megaslide.inference.__file__).parents[2])
    assert out.stdout.strip() == "[]"  # not even through another package


def test_flat_layout_aligns_each_parameter():
    record = flat_layout([("a", (3, 5)), ("b", (7,)), ("c", ())], align=8)
    assert record == {"names": ["a", "b", "c"], "shapes": [[3, 5], [7], []], "offsets": [0, 16, 24], "numel": 32}


def test_caption_input_is_ids_or_seeded_embeddings():
    """Token ids for a model with the built-in encoder; for one that reads embeddings (the Wan presets),
    seeded stand-ins of the encoder's output shape, the same on every call."""
    tiny = build_dit("tiny")
    assert torch.equal(caption_input(tiny, ["a red circle"], torch.device("cpu")), tiny.tokenizer(["a red circle"]))
    cfg = dataclasses.replace(DIT_PRESETS["tiny"], block="wan", text_encoder=False, text_len=7)
    wan = build_dit(cfg)
    ctx = caption_input(wan, ["a", "b"], torch.device("cpu"))
    assert ctx.shape == (2, 7, cfg.text_dim) and ctx.dtype == torch.float32
    assert torch.equal(ctx, caption_input(wan, ["a", "b"], torch.device("cpu")))
    assert wan(torch.randn(2, 3, 2, 4, 4), torch.tensor([10.0, 500.0]), ctx).shape == (2, 3, 2, 4, 4)
