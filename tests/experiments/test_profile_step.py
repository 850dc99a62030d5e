"""profile_step.py at tiny CPU size: step times and top operators land in the JSON."""
from tests.experiments.runner import load_result, run_script


def test_profile_step_smoke(tmp_path):
    out = run_script(["-m", "experiments.profile_step", "device=cpu", "variants=[dense,dsa]", "model.dim=32",
                      "model.depth=1", "model.num_heads=2", "model.ffn_dim=128", "frames=3", "size=8", "batch=1",
                      "warmup=1", "steps=5", "top=2", f"wandb.dir={tmp_path}/runs"], results_dir=tmp_path)
    data = load_result(tmp_path, "profile_step", "cpu_tiny")
    assert [r["variant"] for r in data["rows"]] == ["dense", "dsa"]
    assert all(0 < r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] and r["tokens_per_step"] == 3 * 4 * 4
               for r in data["rows"])
    assert data["config"]["model"]["dim"] == 32
    top = data["tables"]["top operators"]
    assert len(top) == 4 and all(0 < t["share"] <= 1 for t in top)
    assert "dsa" in out
