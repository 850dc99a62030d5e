"""The offload engine with compact optimizer state (offload.master_dtype=bf16, offload.moments=int8) on CPU: it
trains like the fp32 state, parameters without a gradient stay untouched, a checkpoint resumes bit for bit, and
a bad setting or a checkpoint of the other format is refused with the fix."""
import dataclasses

import pytest
import torch

from megaslide.checkpoint import BLOCK_LAYOUT, SHARDED_STATE, block_weights, load_checkpoint
from megaslide.config import OffloadConfig
from megaslide.offload.compact import QuantizedMoment
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

FORMATS = [pytest.param("bf16", "fp32", id="bf16-master"), pytest.param("fp32", "int8", id="int8-moments"),
           pytest.param("bf16", "int8", id="both")]


def _trainer(path, master_dtype="fp32", moments="fp32", model_cfg=None, **train):
    model_cfg = model_cfg or dataclasses.replace(tiny_model_cfg(), depth=3)
    offload = OffloadConfig(enabled=True, master_dtype=master_dtype, moments=moments)
    train = {"steps": 4, "grad_clip": 0.05, "weight_decay": 0.01, **train}
    return Trainer(model_cfg, tiny_data_cfg(), tiny_train_cfg(**train), path, offload_cfg=offload)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("master_dtype,moments", FORMATS)
def test_compact_state_trains_like_fp32_state(tmp_path, master_dtype, moments, precision):
    """Same seed and batches: the first loss is equal (adaLN-Zero: the blocks start as the identity), the next
    ones stay within 2% (the weights differ by
    rounding only). bf16 weights with a bf16 master share one buffer."""
    full, compact = _trainer(tmp_path / "a", precision=precision), _trainer(tmp_path / "b", master_dtype, moments,
                                                                            precision=precision)
    losses = [(full.train_step()["loss"].item(), compact.train_step()["loss"].item()) for _ in range(3)]
    assert losses[0][0] == losses[0][1]
    assert all(abs(a - b) <= 0.02 * a for a, b in losses)
    compact.engine.flush()
    block = compact.engine.host.blocks[0]
    assert block.master.dtype == (torch.bfloat16 if master_dtype == "bf16" else torch.float32)
    assert (block.master is block.weights) == (master_dtype == precision)
    assert torch.equal(block.weights, block.master.to(block.weights.dtype))   # the streamed weights are the master's
    assert isinstance(block.exp_avg, QuantizedMoment) == (moments == "int8")


def test_parameters_without_gradient_stay_untouched(tmp_path):
    """dsa_zero's offset net gets no gradient: its weights (bf16 master) and 8-bit moments are not touched."""
    model_cfg = dataclasses.replace(tiny_model_cfg("dsa_zero"), depth=2)
    trainer = _trainer(tmp_path, "bf16", "int8", model_cfg, weight_decay=0.1)
    before = trainer.engine.model_state_dict()
    trainer.train_step()
    trainer.train_step()
    after = trainer.engine.model_state_dict()
    assert torch.equal(before["blocks.0.attn.offset_proj.weight"], after["blocks.0.attn.offset_proj.weight"])
    assert not torch.equal(before["blocks.0.attn.qkv.weight"], after["blocks.0.attn.qkv.weight"])
    layout, block = trainer.engine.layout, trainer.engine.host.blocks[0]
    slot = next(s for s in layout.slots if s.name == "attn.offset_proj.weight")
    assert not block.exp_avg.codes[slot.offset:slot.end].any()


@pytest.mark.parametrize("master_dtype,moments", FORMATS)
def test_resume_continues_exactly(tmp_path, master_dtype, moments):
    straight = _trainer(tmp_path / "a", master_dtype, moments)
    straight.fit()
    first = _trainer(tmp_path / "b", master_dtype, moments, steps=2)
    first.fit()
    resumed = _trainer(tmp_path / "b", master_dtype, moments, resume="auto")
    resumed.fit()
    assert resumed.step == 4
    a, b = straight.engine.model_state_dict(), resumed.engine.model_state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    for x, y in zip(straight.engine.host.blocks, resumed.engine.host.blocks):
        assert all(torch.equal(t, y.tensors()[name]) for name, t in x.tensors().items())
    assert straight.train_step()["loss"].item() == resumed.train_step()["loss"].item()


def test_a_checkpoint_of_the_other_format_is_refused_and_weights_read_as_fp32(tmp_path):
    trainer = _trainer(tmp_path / "a", "bf16", "int8", steps=1)
    trainer.fit()
    folder = tmp_path / "a" / "checkpoints" / "step_1"
    shard = load_checkpoint(folder / "block_0000.pt")
    assert shard["master"].dtype == torch.bfloat16 and set(shard["exp_avg"]) == {"codes", "scales"}
    weights = block_weights(folder, load_checkpoint(folder / SHARDED_STATE)[BLOCK_LAYOUT], 3)
    assert weights["blocks.0.attn.qkv.weight"].dtype == torch.float32
    exported = trainer.engine.model_state_dict()["blocks.0.attn.qkv.weight"]
    assert torch.equal(weights["blocks.0.attn.qkv.weight"], exported)
    with pytest.raises(ValueError, match="holds torch.bfloat16 master weights.*offload.master_dtype=bf16"):
        _trainer(tmp_path / "b", "fp32", "int8", resume=str(folder)).maybe_resume()
    with pytest.raises(ValueError, match="holds int8 exp_avg.*offload.moments=int8"):
        _trainer(tmp_path / "c", "bf16", "fp32", resume=str(folder)).maybe_resume()


@pytest.mark.parametrize("offload,message", [
    ({"master_dtype": "fp16"}, r"offload.master_dtype='fp16': choose one of \['fp32', 'bf16'\]"),
    ({"moments": "int4"}, r"offload.moments='int4': choose one of \['fp32', 'int8'\]"),
    ({"moments": "int8", "optimizer_device": "gpu"}, "optimizer_device=gpu ablation streams fp32 state"),
    ({"master_dtype": "bf16", "enabled": False}, "offload.master_dtype=bf16 is compact optimizer state of the "
                                                 "offload engine, but offload.enabled=false"),
])
def test_bad_settings_are_refused_with_the_fix(offload, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**{"enabled": True, **offload}).validate()
