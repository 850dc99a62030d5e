"""Smoke run of experiments/mfu_overlap.py at its tiny size (CPU)."""
from tests.experiments.runner import load_result, run_script



def test_mfu_overlap_tiny_writes_a_complete_result(tmp_path):
    stdout = run_script(["-m", "experiments.mfu_overlap", "tiny=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    record = load_result(tmp_path, "mfu_overlap", "tiny")
    assert {"command", "commit", "hardware", "date"} <= record.keys()
    fp32 = [r for r in record["correctness"]["rows"] if r["precision"] == "fp32"]
    assert {r["variant"] for r in fp32} == {"overlap", "serial", "gpu_optimizer"}
    assert all(r["passed"] for r in fp32)
    assert record["complete"] and not any("error" in r for r in record["variants"])
    rows = {r["variant"]: r for r in record["variants"]}
    assert rows.keys() == {"overlap", "overlap_noclip", "serial", "gpu_optimizer"}
    for r in rows.values():
        assert r["step_s"] > 0 and r["compute_s"] > 0 and r["mfu_vs_measured_peak"] > 0
        assert 0 < r["overlap_efficiency"]
        # the engine moves exactly the bytes the planner predicts, in every mode
        assert r["h2d_bytes"] == r["predicted"]["h2d_bytes"] and r["d2h_bytes"] == r["predicted"]["d2h_bytes"]
        assert all(l == l for l in r["losses"])  # finite (no NaN)
    assert rows["gpu_optimizer"]["h2d_bytes"] > rows["overlap"]["h2d_bytes"]
    assert record["memory_wall"] == {"skipped": "no CUDA device"}
    assert record["overlap_speedup_vs_serial"] > 0
    assert record["ceilings"]["matmul_TFLOPs"] > 0 and record["wandb_dir"] is None  # WANDB_MODE=disabled
    assert "variant" in stdout.splitlines()[-6]  # the table is printed last
