"""train.deterministic: two runs give the same bits, the flag turns PyTorch's deterministic algorithms on (which
switches DSA's fused backward to sorted lists) for the Trainer's lifetime only, and bad input is refused.

A CPU run is repeatable with the flag off too, so the bit-identical test alone could not fail for the flag's sake:
the others check what the flag switches."""
import contextlib
import os

import pytest
import torch

from tests.attention.test_dsa_triton import backward  # sets TRITON_INTERPRET before megaslide builds kernels

from megaslide.config import TrainConfig, from_dict  # noqa: E402
from megaslide.train import determinism  # noqa: E402
from megaslide.train.determinism import CUBLAS_ENV, deterministic_mode, fix_cublas_workspace  # noqa: E402
from megaslide.train.trainer import Trainer  # noqa: E402
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg  # noqa: E402

SWITCHES = (torch.are_deterministic_algorithms_enabled, torch.is_deterministic_algorithms_warn_only_enabled,
            lambda: torch.backends.cudnn.deterministic, lambda: torch.backends.cudnn.benchmark,
            lambda: torch.utils.deterministic.fill_uninitialized_memory)


def switches() -> tuple:
    return tuple(read() for read in SWITCHES)


def train_run(tmp_path, name: str, **train) -> tuple[list[float], dict]:
    """Losses of 2 steps of a tiny DSA model, and its final weights; the Trainer is closed."""
    trainer = Trainer(tiny_model_cfg("dsa"), tiny_data_cfg(frames=3, height=8, width=8, shape_size=3),
                      tiny_train_cfg(steps=2, deterministic=True, **train), tmp_path / name)
    losses = [float(trainer.train_step()["loss"]) for _ in range(2)]
    weights = {k: v.clone() for k, v in trainer.engine.model.state_dict().items()}
    trainer.close()
    return losses, weights


def test_two_deterministic_runs_are_bit_identical(tmp_path):
    before = switches()
    (losses_a, weights_a), (losses_b, weights_b) = train_run(tmp_path, "a"), train_run(tmp_path, "b")
    assert losses_a == losses_b and all(map(torch.isfinite, map(torch.tensor, losses_a)))
    assert weights_a.keys() == weights_b.keys()
    for name, a in weights_a.items():
        assert torch.equal(a, weights_b[name]), name
    assert switches() == before


def test_the_flag_switches_the_modes_for_the_trainers_lifetime(tmp_path, monkeypatch):
    """On from construction to close(), then back to what they were (cuDNN benchmarking set before, say)."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    before = switches()
    assert before == (False, False, False, True, True)
    plain = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(), tmp_path / "plain")
    assert switches() == before           # the flag off leaves them alone
    trainer = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(deterministic=True), tmp_path / "det")
    assert switches() == (True, False, True, False, False)   # the flag, without PyTorch's fill of new memory
    trainer.train_step()
    trainer.close()
    plain.close()
    assert switches() == before


def test_a_refused_trainer_turns_the_modes_back_off(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(deterministic=True, resume=str(tmp_path / "no.pt")),
                tmp_path)
    assert not torch.are_deterministic_algorithms_enabled()


class Binned(Exception):
    """Stops the DSA backward at its binning, the step that reads the switch."""


def test_the_mode_switches_dsa_to_its_striped_backward(monkeypatch):
    """The switch the fused DSA backward reads is the one deterministic_mode sets: it asks for the striped lists
    (`bin_entries(..., stripes)`; tests/attention/test_dsa_binned.py checks what they do) inside the mode
    only. Its query pass is stubbed out and it stops at the binning: no kernel runs."""
    B, T, H, W, heads, d, K = 1, 3, 3, 3, 1, 16, 27
    q = torch.randn(B, T, H, W, heads, d)
    offsets = torch.zeros(B, T, H, W, heads, K, 3)
    lse = torch.zeros(B, heads, T * H * W)
    asked = []

    def spy(*args):
        asked.append(args[9] is not None)   # stripes: the deterministic lists
        raise Binned

    monkeypatch.setattr(backward, "query_pass", lambda *args: None)
    monkeypatch.setattr(backward, "bin_entries", spy)
    for mode in (contextlib.nullcontext(), deterministic_mode(torch.device("cpu")), contextlib.nullcontext()):
        with pytest.raises(Binned), mode:
            backward.dsa_backward(q, q, q, offsets, q, lse, q, (3, 3, 3), 0.25, offsets_grad=True)
    assert asked == [False, True, False]


def test_cublas_workspace_is_fixed_before_cuda_starts(monkeypatch):
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    fix_cublas_workspace()
    assert os.environ[CUBLAS_ENV] == ":4096:8"
    monkeypatch.setenv(CUBLAS_ENV, ":16:8")   # a deterministic config already set is kept
    fix_cublas_workspace()
    assert os.environ[CUBLAS_ENV] == ":16:8"


def test_cublas_workspace_refusals(monkeypatch):
    """Set otherwise, or unset once CUDA has started: refused naming the key and the fix, nothing changed."""
    monkeypatch.setenv(CUBLAS_ENV, ":0:0")
    with pytest.raises(ValueError, match=r"train.deterministic=true needs CUBLAS_WORKSPACE_CONFIG.*':0:0'"):
        fix_cublas_workspace()
    monkeypatch.delenv(CUBLAS_ENV)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="export CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting"):
        with deterministic_mode(torch.device("cuda")):
            pass
    assert CUBLAS_ENV not in os.environ and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_deterministic_that_is_not_a_bool_is_refused(value):
    with pytest.raises(ValueError, match="train.deterministic"):
        from_dict(TrainConfig, {"deterministic": value}, key="train")
    with pytest.raises(ValueError, match="train.deterministic=.* must be true or false"):
        TrainConfig(deterministic=value).validate()


def test_seed_everything_seeds_every_generator():
    import random

    import numpy as np
    determinism.seed_everything(2 ** 40 + 3)
    drawn = random.random(), np.random.rand(), torch.rand(1).item()
    determinism.seed_everything(2 ** 40 + 3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn
