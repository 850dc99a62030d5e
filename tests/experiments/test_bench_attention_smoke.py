import json
import os
import subprocess
import sys


def test_bench_attention_smoke(tmp_path):
    env = {**os.environ, "MEGASLIDE_RESULTS_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "experiments/bench_attention.py", "--smoke"], check=True, env=env,
                   capture_output=True, text=True)
    data = json.loads((tmp_path / "attention" / "smoke.json").read_text())
    rows = data["tables"]["sweep"]
    ok = {r["variant"] for r in rows if r.get("status") == "ok"}
    assert {"dense", "swin2x4x4", "dsa_reference"} <= ok
    assert all(r["ms"] > 0 for r in rows if r.get("status") == "ok")
