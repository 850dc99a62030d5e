import json
import os
import subprocess
import sys


def test_gpu_check_dsa_smoke(tmp_path):
    env = {**os.environ, "MEGASLIDE_RESULTS_DIR": str(tmp_path), "PYTHONPATH": "."}
    subprocess.run([sys.executable, "experiments/gpu_check_dsa.py", "--smoke"], check=True, env=env,
                   capture_output=True, text=True)
    data = json.loads((tmp_path / "attention" / "dsa_gpu_check_smoke.json").read_text())
    assert data["passed"] is True and data["rows"]
