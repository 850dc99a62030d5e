"""experiments/hydra_config.py: the Hydra groups (experiments/conf) composed into the typed configs, and the
model group's presets."""
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from baselines.swin_attention import SwinOptions
from experiments.hydra_config import CONF_DIR, model_config, typed_configs
from megaslide.attention.base import NoOptions
from megaslide.attention.dsa.module import DSAOptions
from megaslide.config import AttentionConfig, DiTConfig


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
