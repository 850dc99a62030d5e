"""megaslide/testing.py: the tolerance rule and its rounding floor, and a failing rank stopping `spawn`."""
import pytest
import torch

from megaslide.testing import rounding_floor, spawn, within_tolerance


def test_within_tolerance_is_twice_the_reference_plus_floor():
    assert within_tolerance(2.0, 1.0, 0.0)
    assert not within_tolerance(2.0 + 1e-9, 1.0, 0.0)
    assert within_tolerance(2.5, 1.0, 0.5)
    assert not within_tolerance(float("nan"), 1.0, 1.0)


def test_rounding_floor():
    eps = torch.finfo(torch.bfloat16).eps
    assert rounding_floor(torch.bfloat16, torch.tensor([-8.0, 3.0])) == 2 * eps * 8
    assert rounding_floor(torch.float32, torch.tensor([0.1]), ulps=1) == torch.finfo(torch.float32).eps


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise RuntimeError("rank 1 fails")


def test_spawn_raises_when_a_rank_fails():
    with pytest.raises(Exception, match="rank 1 fails"):
        spawn(_fail_on_rank_1, 2)
