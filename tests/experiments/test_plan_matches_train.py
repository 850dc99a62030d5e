"""`python -m experiments.plan <train.py overrides>` plans the run train.py makes: the same RunConfig."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.hydra_config import run_config
from experiments.plan import plan_config

CONF = Path(__file__).resolve().parents[2] / "experiments" / "conf"

OVERRIDES = [
    [],
    ["model=S", "model.in_channels=3", "attention=dsa", "data.frames=8", "train.batch_size=2", "train.device=cpu"],
    ["offload=engine", "offload.activation_offload=true", "execution.chunk_tokens=64", "train.precision=fp32"],
    ["attention=dsa", "execution.slab_frames=4", "execution.chunk_tokens=32", "model.depth=3",
     "offload.resident_blocks=1", "data=moving_shapes_fast", "name=long", "parallel.sp_mode=ring"],
    ["model=1B", "model.in_channels=3", "offload=engine", "offload.optimizer_device=gpu", "train.grad_clip=0"],
]


@pytest.mark.parametrize("overrides", OVERRIDES, ids=lambda o: " ".join(o) or "defaults")
def test_plan_composes_the_run_config_of_train(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        train = run_config(compose("train", overrides=overrides), check_device=False)
        plan = plan_config(compose("plan", overrides=overrides))
    assert plan.run == train
