"""Bad input to the typed configs: `from_dict` refuses a value of the wrong type with a ValueError that names
the key (the scripts' refusals of bad overrides are tested in tests/experiments/test_bad_input.py)."""
from __future__ import annotations

import pytest

from megaslide.config import DiTConfig, TrainConfig, from_dict


def test_typed_configs_check_types_once_for_every_field():
    """from_dict checks each field against its annotation: ints, floats, bools, strings, tuples, lists."""
    typed = from_dict(TrainConfig, {"steps": 3.0, "lr": 1, "betas": [0.9, 0.95], "resume": 7})
    assert (typed.steps, typed.lr, typed.betas, typed.resume) == (3, 1.0, (0.9, 0.95), "7")
    for data, message in [({"steps": "3"}, "train.steps='3' must be an integer"),
                          ({"compile": "yes"}, "train.compile='yes' must be true or false"),
                          ({"device": True}, "train.device=True must be a string"),
                          ({"betas": 0.9}, "train.betas=0.9 must be a list"),
                          ({"betas": [0.9, "x"]}, r"train.betas\[1\]='x' must be a number")]:
        with pytest.raises(ValueError, match=message):
            from_dict(TrainConfig, data, key="train")
    with pytest.raises(ValueError, match=r"model.patch_size=\[1, 2\] must have 3 entries"):
        from_dict(DiTConfig, {"patch_size": [1, 2]}, key="model")
