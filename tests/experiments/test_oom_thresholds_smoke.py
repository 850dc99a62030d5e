"""Smoke run of experiments/oom_thresholds.py at its tiny size (CPU, stated HBM budget) and its cell isolation."""
import math
import time

import pytest

from experiments.oom_thresholds import run_isolated
from megaslide.perf.planner import usable_hbm
from tests.experiments.runner import load_result, run_script


def test_oom_thresholds_smoke_reaches_fitting_and_oom_cells(tmp_path):
    run_script(["-m", "experiments.oom_thresholds", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "oom_thresholds", "smoke")
    cells, summary = data["tables"]["cells"], data["tables"]["summary"]
    rows = {(c["attention"], c["mode"]) for c in cells}
    assert rows == {(a, m) for a in ("dense", "swin", "dsa") for m in ("resident", "offload", "chunked_offload")}
    budget = usable_hbm(int(0.009e9)) / 1e9
    fits = [c for c in cells if c["status"] == "fits"]
    ooms = [c for c in cells if c["status"] == "OOM"]
    assert fits and ooms
    for c in ooms:                      # on CPU the planner decides, against the stated budget, before allocating
        assert c["phase"].startswith("plan: ") and c["predicted_peak_GB"] > budget and c["measured_peak_GB"] is None
    for c in fits:
        assert c["predicted_peak_GB"] <= budget and c["measured_peak_GB"] > 0
        assert c["timed_steps"] == 2 and 0 < c["step_s_min"] <= c["step_s"] <= c["step_s_max"]
        assert c["timing_rule"] == "1 warm-up, 2 timed" and c["first_step_s"] > 0
        assert len(c["losses"]) == 3 and all(math.isfinite(v) for v in c["losses"])   # warm-up and timed
        assert 0 < c["attention_s"] < c["step_s"] and 0 < c["attention_share"] < 1
        assert c["predicted_estimate_s"] >= c["predicted_matmul_s"] + c["predicted_attention_s"] > 0
        assert c["predicted_lower_bound_s"] > 0
        assert c["estimate_over_step"] == c["predicted_estimate_s"] / c["step_s"]
        if c["mode"] != "resident":     # the compute stream's busy time: all of the step but the transfers
            assert 0 < c["compute_only_s"] <= c["step_s_max"] and c["step_over_compute"] >= 1
            assert c["h2d_s"] > 0 and c["d2h_s"] > 0 and c["optimizer_s"] > 0
        if c["attention"] != "dsa":     # CPU runs DSA's gather backend; the planner models the fused kernels
            assert 0.85 < c["predicted_over_measured"] < 1.1
    for (attention, mode) in rows:      # a row stops at its first OOM
        statuses = [c["status"] for c in cells if (c["attention"], c["mode"]) == (attention, mode)]
        assert "fits" not in statuses[statuses.index("OOM"):] if "OOM" in statuses else True
    best = {(s["attention"], s["mode"]): s["max_frames"] for s in summary}
    hide = {(s["attention"], s["mode"]): s["transfers_hide"] for s in summary}
    assert hide[("dense", "resident")] is None and hide[("dense", "chunked_offload")] in (True, False)
    assert best[("dense", "resident")] == 4 and best[("dense", "chunked_offload")] == 8
    assert data["ceilings"]["matmul_TFLOPs"] > 0 and data["wandb_dir"] is None
    probes = data["ceilings"]["attention"]     # attend alone per (model, attention, chunked): the estimate's rates
    assert (tmp_path / "oom_thresholds.md").read_text().count("| tiny |") == len(cells) + len(summary) + len(probes)
    assert (tmp_path / "oom_thresholds" / "smoke.png").stat().st_size > 0


def sleep_then_answer(seconds: float, queue) -> None:
    time.sleep(seconds)
    queue.put({"status": "fits"})


def test_a_cell_over_its_time_limit_is_stopped_and_reported():
    """The sleeper would answer "fits" after 10 minutes: "time limit" means it was stopped at its limit."""
    assert run_isolated(sleep_then_answer, (600.0,), time_limit_s=1.0)["status"] == "time limit"
    assert run_isolated(sleep_then_answer, (0.0,), time_limit_s=600.0) == {"status": "fits"}


def test_profile_steps_record_the_top_operators_after_the_timed_steps(tmp_path):
    run_script(["-m", "experiments.oom_thresholds", "smoke=true", "rows=[{attention:dense,modes:[offload],frames:[4]}]",
                "profile_steps=1", "profile_top=3", f"wandb.dir={tmp_path}/runs"], tmp_path)
    tables = load_result(tmp_path, "oom_thresholds", "smoke")["tables"]
    cell, = tables["cells"]
    assert cell["status"] == "fits" and len(cell["losses"]) == 1 + 2 + 1    # warm-up, timed, profiled
    profile = cell["profile"]
    times = [op["ms_per_call"] for op in profile["top"]]
    assert len(times) == 3 and times == sorted(times, reverse=True) and times[-1] > 0
    assert sum(times) <= profile["profiled_ms_per_call"]
    assert all(op["calls_per_call"] >= 1 for op in profile["top"])
    assert [op["s_per_step"] * 1e3 for op in tables["top operators"]] == pytest.approx(times, rel=1e-12)  # ms->s->ms
    assert "| dense | offload | 4 |" in (tmp_path / "oom_thresholds.md").read_text()
