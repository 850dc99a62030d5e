"""experiments/ncu_dsa.py on CPU: its parser on a real ncu report (two launches of the H200 run at d12f822,
tests/experiments/data/), and a clean refusal without a GPU or with a bad config."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.ncu_dsa import NcuConfig, parse_report
from tests.experiments.runner import REPO_ROOT

REPORT = Path(__file__).parent / "data" / "ncu_h200_d12f822.txt"


def test_parse_report_of_an_h200_run():
    fwd, key = parse_report(REPORT.read_text())
    assert (fwd["kernel"], fwd["grid"], fwd["block"]) == ("_dsa_fwd_kernel", [32768, 16, 1], [128, 1, 1])
    assert fwd["duration_ms"] == 27.33 and fwd["issue_slots_busy_pct"] == 82.18 and fwd["ipc"] == 3.29
    # "Memory Throughput" is a % in Speed Of Light and Gbyte/s in Memory Workload Analysis: both kept apart
    assert fwd["memory_throughput_pct"] == 56.88 and fwd["dram_GBps"] == 113.54
    assert (fwd["busiest_pipe"], fwd["busiest_pipe_pct"]) == ("ALU", 65.9)
    assert (fwd["registers"], fwd["achieved_occupancy_pct"], fwd["l1_hit_pct"]) == (90, 31.08, 26.64)
    assert key["kernel"] == "_key_kernel" and key["l1_throughput_pct"] == 82.79 and key["duration_ms"] == 6.8


def test_parse_report_converts_microseconds():
    text = REPORT.read_text().replace("Duration                         ms         27.33",
                                      "Duration                         us        868.64", 1)
    assert parse_report(text)[0]["duration_ms"] == pytest.approx(0.86864)


def test_parse_report_names_a_cuda_cpp_kernel_by_its_template():
    """nvcc kernels are reported with their signature, which has spaces (the CUDA halo forward's, for one)."""
    text = REPORT.read_text().replace("  _dsa_fwd_kernel (32768", "  void halo_fwd_kernel<32, 64>(Geometry, const "
                                      "__nv_bfloat16 *, float *, int) (32768", 1)
    fwd = parse_report(text)[0]
    assert (fwd["kernel"], fwd["grid"], fwd["duration_ms"]) == ("halo_fwd_kernel<32, 64>", [32768, 16, 1], 27.33)


def test_config_checks():
    ok = dict(name="x", child=False, ops=["dsa"], shape=[1, 2, 3, 4, 1, 16], launch_count=5, ncu="",
              wandb_dir="runs", wandb_project="p")
    NcuConfig(**ok).validate()
    with pytest.raises(ValueError, match=r"ops=\['flash'\]"):
        NcuConfig(**{**ok, "ops": ["flash"]}).validate()
    with pytest.raises(ValueError, match="shape="):
        NcuConfig(**{**ok, "shape": [1, 2, 3]}).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_refuses_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "experiments.ncu_dsa"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
    assert (done.returncode, done.stderr.strip()) == (2, "ncu_dsa needs a CUDA GPU")
