"""Smoke run of experiments/bench_cpu_adam.py at its tiny size."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_adam_tiny_writes_a_complete_result(tmp_path):
    env = {**os.environ, "MEGASLIDE_RESULTS_DIR": str(tmp_path), "WANDB_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "experiments.bench_cpu_adam", "--tiny"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "cpu_adam" / "tiny.json").read_text())
    assert {"command", "commit", "hardware", "date"} <= record.keys()
    assert all(c["passed"] and c["moments_and_bf16_exact"] for c in record["correctness"])
    assert record["bandwidth"]["copy_GBps"] > 0 and record["bandwidth"]["inplace_add_GBps"] > 0
    rows = record["results"]
    workloads = {r["workload"] for r in rows}
    assert workloads == {"fp32 grad", "bf16 grad", "bf16 grad + bf16 out"}
    ours = [r for r in rows if r["variant"] == "megaslide"]
    assert len(ours) == 3 and all(r["gparams_per_s"] > 0 and r["GBps"] > 0 for r in ours)
    assert {r["bytes_per_param"] for r in ours} == {28, 26}
    fused = [r for r in rows if r["variant"] == "torch-fused"]
    assert all(("error" in r) or r["speedup_vs_torch_fused"] == 1.0 for r in fused)
    assert "Gparam/s" in done.stdout.splitlines()[-len(rows) - 1]  # the table is printed last
