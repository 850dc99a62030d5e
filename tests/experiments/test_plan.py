"""experiments/plan.py: the planner's command line (Hydra), composed in-process from train.py's overrides."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from experiments.plan import PlanConfig, make_plan, plan_config, report
from megaslide.perf.planner import Ceilings, ResidentPlan, compute_seconds

CONF = Path(__file__).resolve().parents[2] / "experiments" / "conf"
BIG = ["model.in_channels=3", "offload=engine", "train.batch_size=1", "train.precision=bf16", "data.frames=16",
       "data.height=64", "data.width=128"]   # a big preset on RGB clips, planned for the offload engine


def composed(*overrides: str) -> PlanConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return plan_config(compose("plan", overrides=list(overrides)))


def test_prints_the_plan_and_checks_this_machine(capsys):
    tiny = ["offload=engine", "data.frames=4", "data.height=16", "data.width=16", "train.precision=fp32"]
    assert report(composed(*tiny, "check=true")) == 0
    out = capsys.readouterr().out
    assert "host RAM:" in out and "HBM:" in out and "fits this machine" in out
    assert "step time, fitted estimate (s):" in out and "estimate = max" in out and "lower bound = max" in out
    assert report(composed("model=105B", *BIG, "check=true")) == 1
    assert "does not fit this machine" in capsys.readouterr().out


def test_without_offload_it_plans_the_resident_trainer(capsys):
    plan = make_plan(composed("data.frames=4"))
    assert isinstance(plan, ResidentPlan) and plan.grid == (4, 16, 16)
    assert report(composed("data.frames=4")) == 0
    assert "resident trainer" in capsys.readouterr().out


def test_groups_and_keys_reach_the_plan():
    keys = ["model=7B", "model.depth=3", "attention=dsa", "offload.resident_blocks=2", "offload.optimizer_device=gpu",
            *BIG]
    cfg = composed(*keys, "ceilings.tflops=300")
    plan = make_plan(cfg)
    assert plan.cfg.depth == 3 and plan.cfg.attention.name == "dsa"
    assert plan.resident_blocks == 2 and plan.optimizer_device == "gpu"
    default = make_plan(composed(*keys))
    matmul = compute_seconds(default.cfg, default.batch, default.grid, recomputed=1, ceilings=Ceilings())[1]["matmul"]
    assert plan.seconds["compute"] - default.seconds["compute"] == pytest.approx(matmul)  # only the matmul term doubles
    assert composed("model=quality_gpu").run.model.depth == 8  # a group's own keys are kept


def test_bad_arguments_are_named():
    with pytest.raises(HydraException, match="9B"):
        composed("model=9B")
    with pytest.raises(HydraException, match="resolution"):
        composed("resolution=64x128")
    with pytest.raises(ValueError, match="train.precision"):
        make_plan(composed("train.precision=fp16"))
    with pytest.raises(ValueError, match="model.in_channels=16, but data=moving_shapes is RGB"):
        composed("model=7B")                                    # as train.py refuses it
    for key, value in (("tflops", "0"), ("h2d_GBps", "-3"), ("cpu_adam_gparams", "nan"), ("hbm_TBps", "inf")):
        with pytest.raises(ValueError, match=f"ceilings.{key}={value} must be a finite number > 0"):
            composed(f"ceilings.{key}={value}")             # refused even where the plan would not use it


def test_chunking_and_activation_offload_reach_the_plan():
    cfg = composed("model=7B", "model.depth=6", *BIG, "execution.chunk_tokens=4096", "offload.activation_offload=true")
    plan = make_plan(cfg)
    assert plan.execution.chunk_tokens == 4096 and plan.activation_offload
    assert any(k.startswith("parked block inputs") for k in plan.host)
    assert make_plan(composed("model=7B", "model.depth=6", *BIG)).hbm_total > plan.hbm_total
