"""profile_step.py at tiny CPU size: step times and top operators land in the JSON."""
import pytest

from tests.experiments.runner import load_trial_result, run_script


def test_profile_step_smoke(tmp_path):
    out = run_script(["-m", "experiments.profile_step", "device=cpu", "variants=[dense,dsa]", "model.dim=32",
                      "model.depth=1", "model.num_heads=2", "model.ffn_dim=128", "frames=3", "size=8", "batch=1",
                      "warmup=1", "steps=5", "top=2", f"wandb.dir={tmp_path}/runs"], MEGASLIDE_RESULTS_DIR="")
    data = load_trial_result(tmp_path / "runs", "profile_step", "cpu_tiny")   # a CPU run is a trial
    assert [r["variant"] for r in data["rows"]] == data["config"]["variants"] == ["dense", "dsa"]
    assert all(0 < r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] and r["tokens_per_step"] == 3 * 4 * 4
               for r in data["rows"])
    assert data["config"]["model"]["dim"] == 32
    top = data["tables"]["top operators"]
    for r in data["rows"]:
        ops = [t for t in top if t["variant"] == r["variant"]]
        times = [t["ms_per_step"] for t in ops]
        assert len(ops) == 2 and times == sorted(times, reverse=True) and times[-1] > 0
        # the kept operators are a part of the profiled step: their self times sum to at most its total
        assert sum(times) <= r["profiled_ms_per_step"]
        for t in ops:
            assert t["share"] == pytest.approx(t["ms_per_step"] / r["profiled_ms_per_step"])
            assert t["calls_per_step"] > 0 and (2 * t["calls_per_step"]).is_integer()  # counts over 2 steps
    assert "dsa" in out
