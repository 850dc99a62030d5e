"""Smoke run of experiments/scaling.py: tiny runs on CPU under a stated full HBM and a cap it does not fit;
105B, beyond host RAM, is the planner's row only."""
import math

from tests.experiments.runner import load_result, run_script


def test_scaling_smoke_runs_what_host_ram_holds_and_predicts_the_rest(tmp_path):
    run_script(["-m", "experiments.scaling", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "scaling", "smoke")
    rows = {r["preset"]: r for r in data["tables"]["presets"]}
    assert list(rows) == ["tiny", "105B"]                       # smallest first
    tiny, big = rows["tiny"], rows["105B"]
    assert tiny["measured"] == "run" and tiny["full_status"] == "fits" and tiny["full_predicted_fits"]
    assert tiny["cap_status"] == "OOM" and tiny["cap_phase"] == "plan" and not tiny["predicted_fits_cap"]
    losses = tiny["full_losses"]                              # warm-up steps plus one, each finite
    assert len(losses) == data["config"]["warmup_steps"] + 1 and all(math.isfinite(v) for v in losses)
    assert tiny["full_forward_overlap_s"] > 0 and tiny["full_forward_serial_s"] > 0 and tiny["full_forward_speedup"] > 0
    assert big["measured"] == "predicted" and not big["host_holds_it"] and "full_status" not in big
    assert big["predicted_host_GB"] > 1000 and 100 < big["params_B"] < 112
    for r in rows.values():
        assert r["predicted_forward_speedup"] >= 1
        assert r["predicted_forward_overlap_s"] <= r["predicted_forward_serial_s"]
    assert data["ceilings"]["matmul_TFLOPs"] > 0 and data["wandb_dir"] is None
