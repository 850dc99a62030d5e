"""Smoke run of experiments/mfu_overlap.py at its tiny size (CPU)."""
import math

import pytest

from megaslide.config import DiTConfig, from_dict
from megaslide.perf.flops import dit_flops
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
    flops, ceil = record["model_flops_per_step"], record["ceilings"]
    cfg = from_dict(DiTConfig, record["model_cfg"])
    b = record["bench"]
    assert flops == dit_flops(cfg, b["batch"], cfg.token_grid(b["frames"], b["height"], b["width"])).train
    for r in rows.values():
        parts = [r["compute_s"], r["h2d_s"], r["d2h_s"], r["optimizer_s"]]
        assert r["step_s"] > 0 and r["compute_s"] > 0 and min(parts) >= 0
        # MFU and throughput recomputed from the JSON's own fields
        assert r["mfu_vs_measured_peak"] == pytest.approx(flops / r["step_s"] / (ceil["matmul_TFLOPs"] * 1e12))
        assert r["mfu_vs_datasheet"] == pytest.approx(flops / r["step_s"] / (ceil["datasheet_TFLOPs"] * 1e12))
        assert r["achieved_TFLOPs"] == pytest.approx(flops / r["step_s"] / 1e12)
        # no part of the step is busier than the step; overlap efficiency = busiest part / step
        assert r["overlap_efficiency"] == pytest.approx(max(parts) / r["step_s"]) and r["overlap_efficiency"] <= 1
        assert r["h2d_GBps"] == pytest.approx(r["h2d_bytes"] / r["h2d_s"] / 1e9)
        # the engine moves exactly the bytes the planner predicts, in every mode
        assert r["h2d_bytes"] == r["predicted"]["h2d_bytes"] and r["d2h_bytes"] == r["predicted"]["d2h_bytes"]
        assert len(r["losses"]) == len(r["grad_norms"]) == b["warmup_steps"] + b["timed_steps"] + 1  # every step
        assert all(math.isfinite(v) for v in r["losses"] + r["grad_norms"])
        # every timed step is timed on its own: the mean lies within their spread
        assert r["timed_steps"] == b["timed_steps"] == 2
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
        assert r["step_s_std"] <= (r["step_s_max"] - r["step_s_min"]) / 2 + 1e-12
    assert rows["gpu_optimizer"]["h2d_bytes"] > rows["overlap"]["h2d_bytes"]
    assert record["memory_wall"] == {"skipped": "no CUDA device"}
    serial = rows["serial"]  # nothing overlaps: the step takes at least the sum of its parts
    assert serial["compute_s"] + serial["h2d_s"] + serial["d2h_s"] + serial["optimizer_s"] <= serial["step_s"]
    assert record["overlap_speedup_vs_serial"] == pytest.approx(serial["step_s"] / rows["overlap"]["step_s"])
    assert record["ceilings"]["matmul_TFLOPs"] > 0 and record["wandb_dir"] is None  # WANDB_MODE=disabled
    assert "variant" in stdout.splitlines()[-6]  # the table is printed last


def test_mfu_overlap_plans_kept_attention_within_its_budgets(tmp_path):
    """offload.keep_attention=auto: the script plans the kept attention within the budgets the engine plans it
    with (the device's, or the host's on a CPU), and records where each block's attention is kept."""
    run_script(["-m", "experiments.mfu_overlap", "tiny=true", "offload.keep_attention=auto", "name=keep",
                "bench.variants=[overlap]", f"wandb.dir={tmp_path}/runs"], tmp_path)
    record = load_result(tmp_path, "mfu_overlap", "keep")
    kept = record["plan"]["kept_attention"]
    assert kept["mode"] == "auto" and kept["gpu"] == list(range(record["model_cfg"]["depth"])), kept
    budgets = record["budgets"]  # what experiments/planner_error.py plans the step again within
    assert budgets["budget_GB"] == budgets["host_budget_GB"] > 0   # on a CPU the engine plans with the host's RAM
    row = record["variants"][0]
    assert row["variant"] == "overlap" and all(math.isfinite(v) for v in row["losses"])
