"""experiments/hydra_config.py: the Hydra groups (experiments/conf) composed into the typed configs, and the
model group's presets."""
import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from baselines.swin_attention import SwinOptions
from experiments.hydra_config import CONF_DIR, model_config, run_config, typed_configs
from megaslide.attention.base import NoOptions
from megaslide.attention.dsa.module import DSAOptions
from megaslide.config import (
    AttentionConfig,
    DiTConfig,
    ExecutionConfig,
    OffloadConfig,
    ParallelConfig,
    RunConfig,
    from_dict,
)
from tests.helpers import tiny_model_cfg


def test_unknown_attention_and_preset():
    with pytest.raises(ValueError, match=r"attention.name='flash3' is unknown"):
        AttentionConfig(name="flash3").validate()
    with pytest.raises(ValueError, match=r"model.preset='huge' is unknown"):
        model_config({"preset": "huge"}, {"name": "dense"})


@pytest.mark.parametrize("overrides,options", [
    (["attention=swin", "attention.window=[1,2,2]"], SwinOptions((1, 2, 2))),
    (["attention=dsa", "attention.kernel_size=[3,5,5]", "attention.max_offset=2", "attention.backend=reference"],
     DSAOptions((3, 5, 5), 2.0, "reference")),
    (["attention=dsa_zero"], DSAOptions()),
    (["attention=dense"], NoOptions())])
def test_hydra_attention_overrides(overrides, options):
    assert _compose(overrides).attention.options == options


def test_hydra_refuses_an_option_of_another_variant():
    with pytest.raises(ConfigCompositionException, match="Could not override 'attention.window'"):
        _compose(["attention=dsa", "attention.window=[2,4,4]"])
    with pytest.raises(ValueError, match=r"\['window'\] unknown to the 'dsa' attention, which takes only"):
        _compose(["attention=dsa", "+attention.window=[2,4,4]"])


def _compose(overrides: list[str]) -> DiTConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return typed_configs(compose("train", overrides=overrides))[0]


def _run(overrides: list[str]):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return run_config(compose("train", overrides=overrides), check_device=False)


def test_one_run_config_tree_from_the_groups():
    run = _run(["attention=dsa", "execution.chunk_tokens=64", "execution.slab_frames=2", "parallel.sp_mode=ring",
                "offload=engine", "offload.activation_offload=true", "data.frames=4"])
    assert run.model.attention.name == "dsa" and run.grid == (4, 16, 16)
    assert (run.execution.chunk_tokens, run.execution.slab_frames) == (64, 2)
    assert run.offload.enabled and run.offload.activation_offload and run.parallel.sp_mode == "ring"


def test_every_offload_field_is_overridable_without_plus():
    listed = (CONF_DIR / "offload" / "_fields.yaml").read_text()
    assert [f.name for f in dataclasses.fields(OffloadConfig) if f"\n{f.name}: " not in listed] == []
    for group in ("none", "engine"):
        offload = _run([f"offload={group}", "offload.resident_blocks=1", "offload.cpu_threads=2"]).offload
        assert (offload.resident_blocks, offload.cpu_threads) == (1, 2)
    with pytest.raises(ValueError, match=r"offload.activation_offload=true needs the offload engine"):
        _run(["offload.activation_offload=true"])


def test_how_blocks_run_is_refused_under_model_and_dropped_from_saved_configs():
    with pytest.raises(ValueError, match=r"model.chunk_tokens is now execution.chunk_tokens.*execution.chunk_tokens="):
        _run(["model.chunk_tokens=8"])
    saved = {**dataclasses.asdict(tiny_model_cfg()), "checkpoint_blocks": True, "chunk_tokens": 8, "slab_frames": 0}
    assert from_dict(DiTConfig, saved) == tiny_model_cfg()     # a checkpoint written before ExecutionConfig


def test_parallel_and_execution_errors_name_the_key():
    with pytest.raises(ValueError, match=r"parallel.sp_mode='zigzag': choose one of"):
        ParallelConfig(sp_mode="zigzag").validate()
    with pytest.raises(ValueError, match=r"parallel.ring_degree=0 must be >= 1"):
        ParallelConfig(ring_degree=0).validate()
    with pytest.raises(ValueError, match=r"train.batch_size=4 \(the global batch\) is not divisible by parallel.dp=3"):
        _run(["parallel.dp=3"])
    assert _run(["parallel.dp=2"]).parallel.dp == 2     # the world size is checked where the processes are
    with pytest.raises(ValueError, match=r"execution.slab_frames=2 needs a self-attention"):
        _run(["execution.slab_frames=2"])
    assert RunConfig().parallel == ParallelConfig() and RunConfig().execution == ExecutionConfig()
