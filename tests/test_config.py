import dataclasses

import pytest

from megaslide.config import AttentionConfig, DataConfig, from_dict
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg


def _trainer(tmp_path, model=None, data=None, train=None):
    return Trainer(model or tiny_model_cfg(), data or tiny_data_cfg(), train or tiny_train_cfg(), tmp_path)


def test_frames_not_divisible_by_temporal_patch(tmp_path):
    model = dataclasses.replace(tiny_model_cfg(), patch_size=(2, 2, 2))
    with pytest.raises(ValueError, match=r"data.frames=5 is not divisible by the patch size 2"):
        _trainer(tmp_path, model=model, data=tiny_data_cfg(frames=5))


def test_swin_window_larger_than_grid(tmp_path):
    with pytest.raises(ValueError, match=r"attention.window=\(2, 16, 16\) is larger than the token grid"):
        _trainer(tmp_path, model=tiny_model_cfg("swin", window=(2, 16, 16)))


def test_dsa_kernel_larger_than_grid(tmp_path):
    with pytest.raises(ValueError, match=r"attention.kernel_size=\(5, 3, 3\) is larger"):
        _trainer(tmp_path, model=tiny_model_cfg("dsa", kernel_size=(5, 3, 3)))


def test_heads_not_dividing_dim(tmp_path):
    with pytest.raises(ValueError, match=r"model.num_heads=5 does not divide model.dim=64"):
        _trainer(tmp_path, model=dataclasses.replace(tiny_model_cfg(), num_heads=5))


def test_unknown_attention_and_preset():
    from experiments.hydra_config import model_config
    with pytest.raises(ValueError, match=r"attention.name='flash3' is unknown"):
        AttentionConfig(name="flash3").validate()
    with pytest.raises(ValueError, match=r"model.preset='huge' is unknown"):
        model_config({"preset": "huge"}, {"name": "dense"})


def test_missing_data_folder(tmp_path):
    with pytest.raises(ValueError, match=r"data.root=.* is not a folder"):
        DataConfig(name="video_folder", root=str(tmp_path / "nope")).validate()


def test_unknown_config_key_lists_known():
    with pytest.raises(ValueError, match=r"unknown DataConfig field\(s\) \['fps'\]"):
        from_dict(DataConfig, {"fps": 3})
