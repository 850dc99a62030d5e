"""determinism.py at tiny CPU size: a row per (variant, train.deterministic) with its step times, whether its runs
gave the same bits (a CPU run does either way) and the cost; bad keys are refused before anything runs."""
import pytest

import experiments.determinism
from tests.experiments.runner import load_trial_result, run_script
from tests.experiments.test_bad_input import run_main

TINY = ["train.device=cpu", "model=tiny", "model.depth=1", "data.frames=3", "data.height=8", "data.width=8",
        "data.shape_size=3", "train.batch_size=1"]


def test_determinism_smoke(tmp_path):
    out = run_script(["-m", "experiments.determinism", *TINY, "variants=[dsa]", "warmup=1", "steps=5",
                      f"wandb.dir={tmp_path}/runs"], MEGASLIDE_RESULTS_DIR="")
    data = load_trial_result(tmp_path / "runs", "determinism", "cpu_tiny")   # a CPU run is a trial
    plain, det = data["rows"]
    assert [(r["variant"], r["deterministic"], r["status"]) for r in (plain, det)] == [("dsa", False, "ok"),
                                                                                         ("dsa", True, "ok")]
    for r in (plain, det):
        assert 0 < r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] and r["runs"] == 2
        assert r["same_losses"] and r["same_weights"] and r["max_loss_diff"] == 0
    assert det["final_loss"] == plain["final_loss"]     # the flag changes no result on the CPU
    assert det["cost"] == pytest.approx(det["step_ms"] / plain["step_ms"]) and "cost" not in plain
    assert data["config"]["train"]["batch_size"] == 1 and data["config"]["repeats"] == 2
    assert "dsa" in out


@pytest.mark.parametrize("args, says", [(["repeats=1"], "repeats=1 must be >= 2"),
                                        (["steps=4"], "steps=4 must be >= 5"),
                                        (["variants=[flash]"], "flash")])
def test_determinism_refuses_bad_keys(args, says, tmp_path, monkeypatch, capsys):
    err = run_main(experiments.determinism, [*TINY, *args], tmp_path, monkeypatch, capsys)
    assert says in err
    assert not any(tmp_path.iterdir())
