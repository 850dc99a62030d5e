"""experiments/plan.py: the planner's command line (Hydra), composed in-process."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from experiments.hydra_config import script_config
from experiments.plan import PlanConfig, make_plan, report
from megaslide.offload.planner import Ceilings, compute_seconds

CONF = Path(__file__).resolve().parents[2] / "experiments" / "conf"


def plan_config(*overrides: str) -> PlanConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return script_config(PlanConfig, compose("plan", overrides=list(overrides)))


def test_prints_the_plan_and_checks_this_machine(capsys):
    assert report(plan_config("model=tiny", "frames=4", "height=16", "width=16", "precision=fp32", "check=true")) == 0
    out = capsys.readouterr().out
    assert "host RAM:" in out and "HBM:" in out and "floor = max" in out and "fits this machine" in out
    assert report(plan_config("model=105B", "check=true")) == 1
    assert "does not fit this machine" in capsys.readouterr().out


def test_groups_and_keys_reach_the_plan():
    cfg = plan_config("model=7B", "model.depth=3", "attention=dsa", "resident_blocks=2", "optimizer_device=gpu",
                      "ceilings.tflops=300")
    plan = make_plan(cfg)
    assert cfg.model_preset == "7B" and plan.cfg.depth == 3 and plan.cfg.attention.name == "dsa"
    assert plan.resident_blocks == 2 and plan.optimizer_device == "gpu"
    default = make_plan(plan_config("model=7B", "model.depth=3", "attention=dsa", "resident_blocks=2",
                                    "optimizer_device=gpu"))
    matmul = compute_seconds(default.cfg, default.batch, default.grid, recomputed=1, ceilings=Ceilings())[1]["matmul"]
    assert plan.seconds["compute"] - default.seconds["compute"] == pytest.approx(matmul)  # only the matmul term doubles
    assert plan_config("model=quality_gpu").model.depth == 8  # a group's own keys are kept


def test_bad_arguments_are_named():
    with pytest.raises(HydraException, match="9B"):
        plan_config("model=9B")
    with pytest.raises(HydraException, match="resolution"):
        plan_config("resolution=64x128")
    with pytest.raises(ValueError, match="precision"):
        make_plan(plan_config("precision=fp16"))


def test_chunking_and_activation_offload_reach_the_plan():
    cfg = plan_config("model=7B", "model.depth=6", "model.chunk_tokens=4096", "activation_offload=true")
    plan = make_plan(cfg)
    assert plan.cfg.chunk_tokens == 4096 and plan.activation_offload
    assert any(k.startswith("parked block inputs") for k in plan.host)
    assert make_plan(plan_config("model=7B", "model.depth=6")).hbm_total > plan.hbm_total
