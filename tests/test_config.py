import dataclasses

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from megaslide.attention.dsa import module as dsa_module
from megaslide.attention.dsa.module import DSAOptions
from megaslide.attention.dsa.op import check_kernel_size
from megaslide.config import (
    AttentionConfig,
    DataConfig,
    DiTConfig,
    from_dict,
)
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


class _TensorOps(TorchDispatchMode):
    """Records every tensor op run inside it, allocations included."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernel_size,message", [
    ((3, 2, 3), r"attention.kernel_size=\(3, 2, 3\) must be three odd positive ints"),   # even
    ((0, 3, 3), r"attention.kernel_size=\(0, 3, 3\) must be three odd positive ints"),   # zero
    ((3, 3), r"attention.kernel_size=\(3, 3\) must be three odd positive ints"),         # two entries
    ((3, 3, 3, 3), r"attention.kernel_size=\(3, 3, 3, 3\) must be three"),              # four
    ((5, 3, 3), r"attention.kernel_size=\(5, 3, 3\) is larger than the token grid \(4, 8, 8\) along t \(5 > 4\); "
                r"use a smaller odd kernel or more tokens"),                             # past the clip's grid
])
def test_a_bad_kernel_size_is_refused_once_at_config_time(tmp_path, monkeypatch, kernel_size, message):
    """A training run's DSA kernel_size is refused by the one check (dsa.op.check_kernel_size), once, while its
    configs are read and validated: no tensor op has run and nothing is written."""
    refusals = []

    def spy(*args):
        try:
            return check_kernel_size(*args)
        except ValueError as error:
            refusals.append(error)
            raise
    monkeypatch.setattr(dsa_module, "check_kernel_size", spy)
    with _TensorOps() as ops, pytest.raises(ValueError, match=message) as refused:
        _trainer(tmp_path, model=tiny_model_cfg("dsa", kernel_size=kernel_size))
    assert refusals == [refused.value]
    assert ops.ops == []
    assert list(tmp_path.iterdir()) == []


def test_heads_not_dividing_dim(tmp_path):
    with pytest.raises(ValueError, match=r"model.num_heads=5 does not divide model.dim=64"):
        _trainer(tmp_path, model=dataclasses.replace(tiny_model_cfg(), num_heads=5))


def test_missing_data_folder(tmp_path):
    with pytest.raises(ValueError, match=r"data.root=.* is not a folder"):
        DataConfig(name="video_folder", root=str(tmp_path / "nope")).validate()


def test_unknown_config_key_lists_known():
    with pytest.raises(ValueError, match=r"unknown DataConfig field\(s\) \['fps'\]"):
        from_dict(DataConfig, {"fps": 3})


def test_attention_config_reads_the_flat_hydra_form_and_its_own_asdict_form():
    flat = from_dict(AttentionConfig, {"name": "dsa", "kernel_size": [3, 5, 5], "max_offset": 2,
                                       "backend": "reference"})
    assert flat.options == DSAOptions((3, 5, 5), 2.0, "reference")
    assert from_dict(AttentionConfig, dataclasses.asdict(flat)) == flat
    assert from_dict(AttentionConfig, {}) == AttentionConfig("dense")
    swin = from_dict(DiTConfig, {"attention": {"name": "swin", "window": [1, 2, 2]}})
    assert swin.attention.options.window == (1, 2, 2)


def test_attention_config_refuses_an_option_of_another_variant():
    with pytest.raises(ValueError, match=r"\['window'\] unknown to the 'dsa' attention"):
        from_dict(AttentionConfig, {"name": "dsa", "window": [2, 4, 4]})
    with pytest.raises(ValueError,
                       match=r"\['backend', 'halo_kernel', 'halo_reach', 'kernel_size', 'max_offset'\] unknown to the "
                             r"'dense'"):
        dataclasses.replace(AttentionConfig("dsa"), name="dense")
    cfg = AttentionConfig("dsa")
    cfg.name = "swin"                       # a reassigned name is checked again by validate()
    with pytest.raises(ValueError, match="unknown to the 'swin' attention"):
        cfg.validate()
    with pytest.raises(AttributeError):
        cfg.window = (2, 4, 4)              # no silent attribute: options live in cfg.options


def test_for_variant_keeps_the_options_the_other_variant_takes():
    dsa = AttentionConfig("dsa", {"kernel_size": (3, 5, 5), "max_offset": 2.0})
    assert dsa.for_variant("dsa_zero") == AttentionConfig("dsa_zero", dsa.options)
    assert dsa.for_variant("swin", window=(1, 2, 2)) == AttentionConfig("swin", {"window": (1, 2, 2)})
    assert dsa.for_variant("dense") == AttentionConfig("dense")


@pytest.mark.parametrize("cfg,match", [
    (lambda: tiny_train_cfg(lr=float("nan")), r"train.lr=nan must be a finite number"),
    (lambda: tiny_train_cfg(grad_clip=float("nan")), r"train.grad_clip=nan must be a finite number"),
    (lambda: tiny_train_cfg(betas=(0.9, float("inf"))), r"train.betas=\(0.9, inf\) must be a finite number"),
    (lambda: tiny_train_cfg(seed=2 ** 64), r"train.seed=18446744073709551616 must be in \[0, 2\*\*63\)"),
    (lambda: tiny_train_cfg(seed=-1), r"train.seed=-1 must be in \[0, 2\*\*63\)"),
    (lambda: tiny_data_cfg(speed=float("nan")), r"data.speed=nan must be a finite number"),
    (lambda: tiny_data_cfg(seed=2 ** 63), r"data.seed=9223372036854775808 must be in")])
def test_non_finite_values_and_overflowing_seeds_are_refused(cfg, match):
    """NaN passes every `<` check (grad_clip=nan would turn clipping off silently); a seed past 2**63 overflows."""
    with pytest.raises(ValueError, match=match):
        cfg().validate()
