"""Smoke run of experiments/mfu_overlap.py at its tiny size (CPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_mfu_overlap_tiny_writes_a_complete_result(tmp_path):
    env = {**os.environ, "MEGASLIDE_RESULTS_DIR": str(tmp_path), "WANDB_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "experiments.mfu_overlap", "tiny=true"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "mfu_overlap" / "tiny.json").read_text())
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
    assert "variant" in done.stdout.splitlines()[-6]  # the table is printed last
