"""profile_step.py at tiny CPU size: step times and top operators land in the JSON."""
from tests.experiments.runner import load_result, run_script


def test_profile_step_smoke(tmp_path):
    out = run_script(["experiments/profile_step.py", "--device", "cpu", "--variants", "dense", "dsa", "--dim", "32",
                      "--depth", "1", "--heads", "2", "--frames", "3", "--size", "8", "--batch", "1",
                      "--warmup", "1", "--steps", "1", "--top", "2"], results_dir=tmp_path)
    data = load_result(tmp_path, "profile_step", "cpu_tiny")
    assert [r["variant"] for r in data["rows"]] == ["dense", "dsa"]
    assert all(r["step_ms"] > 0 and r["tokens_per_step"] == 3 * 4 * 4 for r in data["rows"])
    top = data["tables"]["top operators"]
    assert len(top) == 4 and all(0 < t["share"] <= 1 for t in top)
    assert "dsa" in out
