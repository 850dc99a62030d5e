"""The claims' long-clip and scaling claims (C3, C4's 105B floor, C9) on synthetic result files."""
import sys

import pytest

from experiments import planner_error
from experiments.claims import memory, page, throughput
from experiments.results_io import RESULTS_DIR, write_result

GRID = {"height": 136, "width": 240}
RUN = {"config": {**GRID, "batch": 1, "chunk_tokens": 16320}, "plan_only": False,   # a measured table's keys
       "ceilings": {"matmul_TFLOPs": 700.0, "pcie": {"h2d_GBps": 50.0, "d2h_GBps": 50.0}, "hbm_copy_GBps": 4000.0}}


def _cell(attention, mode, frames, status="fits", measured=None, predicted=None, **kw):
    return {"model": "1B", "attention": attention, "mode": mode, "frames": frames, "tokens": frames * 68 * 120,
            "status": status, "measured_peak_GB": measured, "predicted_peak_GB": predicted, "step_s": 10.0,
            "timed_steps": 1, **kw}


def test_clip_tokens_states_both_counts_from_the_grid():
    text = memory.clip_tokens(256, GRID, "1B")
    assert "256 frames x 68 x 120 = 2,088,960 tokens" in text and "64 latent frames = 522,240" in text


def test_most_frames_fitting_ignores_ooms_and_other_modes():
    cells = [("a", _cell("dsa", "offload", 32)), ("a", _cell("dsa", "offload", 128, status="OOM")),
             ("b", _cell("dsa", "offload", 8)), ("b", _cell("swin", "offload", 16))]
    assert memory.most_frames_fitting(cells) == {("1B", "dsa", "offload"): 32, ("1B", "swin", "offload"): 16}


def test_cells_measured_on_another_gpu_stay_out_of_the_claims(results, monkeypatch):
    """An H100 given in an H200's place: its cells, PCIe rates and steps stay on their own pages."""
    write_result("oom_thresholds", "h200_a", {**RUN, "tables": {"cells": [_cell("dsa", "offload", 8)]}},
                 results_dir=results)
    monkeypatch.setattr("experiments.results_io.hardware", lambda: {"cpu": "x", "gpus": ["NVIDIA H100 80GB HBM3"]})
    write_result("oom_thresholds", "h100_b", {**RUN, "tables": {"cells": [_cell("dsa", "offload", 16)]}},
                 results_dir=results)
    assert [name for name, _ in memory.measured_cells(memory.read_results(results, "oom_thresholds"))] == ["h200_a"]
    assert [f for f, _, _ in throughput.pcie_rates(results)] == ["oom_thresholds/h200_a"]
    assert [s.file for s in planner_error.h200_timed_steps(results)] == ["oom_thresholds/h200_a.json"]


def test_planner_error_takes_the_worst_fitting_cell_and_the_rule_is_ten_percent():
    cells = [("a", _cell("dsa", "offload", 8, measured=10.0, predicted=10.5)),
             ("a", _cell("swin", "offload", 8, measured=10.0, predicted=8.8)),
             ("a", _cell("swin", "offload", 64, status="OOM", measured=None, predicted=300.0))]
    err, cell = memory.planner_error(cells, lambda c: c["predicted_peak_GB"])
    assert err == pytest.approx(0.12) and cell["attention"] == "swin"
    assert memory.accuracy_word(err) == "not met" and memory.accuracy_word(0.10) == "met"
    assert memory.planner_error(cells, lambda c: None) is None


def test_c3_reads_measured_cells_and_says_256_frames_not_met(results):
    write_result("oom_thresholds", "run", {**RUN, "tables": {"cells": [
        _cell("dsa", "chunked_offload", 128, measured=100.0, predicted=98.0),
        _cell("dsa", "offload", 128, status="OOM", phase="plan: backward")]}}, results_dir=results)
    write_result("oom_thresholds", "plan", {"config": GRID, "plan_only": True, "tables": {"cells": [
        _cell("dsa", "chunked_offload", 128, status="fits (predicted)", predicted=99.0, budget_GB=146.8),
        _cell("dsa", "chunked_offload", 256, status="OOM", predicted=215.0, predicted_phase="backward",
              budget_GB=146.8)]}}, results_dir=results)
    ours, verdict = memory.c3(results)
    assert "1B dsa chunked_offload: 128" in ours and "1,044,480 tokens" in ours and "100.0 GB measured" in ours
    assert "215 GB peak HBM in the backward" in ours and "146.8 GB budget" in ours and "522,240" in ours
    assert "256-frame target (1B at 256 frames): not met" in verdict and "most for 1B is 128" in verdict
    assert "recorded by the runs: met (worst |predicted/measured - 1| = 2%" in verdict
    assert "today's planner (plan.json) on the same cells: met (worst |predicted/measured - 1| = 1%" in verdict
    target, peak = verdict.split("; ~", 1)
    assert "supported" not in target and peak.startswith("115 GB peak HBM at 256 frames: not assessed: no measured")


def test_c3_lists_modes_cut_by_the_time_budget_only_while_none_of_their_cells_was_measured(results):
    write_result("oom_thresholds", "run", {**RUN, "tables": {"cells": [
        _cell("dense", "offload", 8, status="not run"), _cell("dense", "chunked_offload", 16, status="not run"),
        _cell("dense", "chunked_offload", 8, measured=10.0, predicted=10.0)]}}, results_dir=results)
    assert "not run (time budget), no cell measured: 1B dense offload;" in memory.c3(results)[0]


def test_c3_says_met_when_a_256_frame_cell_fits_and_replans_with_its_slabs(results):
    write_result("oom_thresholds", "run", {**RUN, "tables": {"cells": [
        _cell("dsa", "chunked_offload", 256, measured=99.0, predicted=100.0, slab_frames=32)]}}, results_dir=results)
    write_result("oom_thresholds", "plan", {"config": GRID, "plan_only": True, "tables": {"cells": [
        _cell("dsa", "chunked_offload", 256, status="OOM", predicted=215.0, predicted_phase="backward",
              budget_GB=146.8)]}}, results_dir=results)
    write_result("oom_thresholds", "plan_slabs", {"config": GRID, "plan_only": True, "tables": {"cells": [
        _cell("dsa", "chunked_offload", 256, status="fits (predicted)", predicted=120.0, predicted_phase="backward",
              budget_GB=146.8, slab_frames=32)]}}, results_dir=results)
    ours, verdict = memory.c3(results)
    assert "256-frame target (1B at 256 frames): met (a measured 1B cell of 256 frames fits)" in verdict
    assert "120 GB peak HBM in the backward" in ours and "within the 146.8 GB budget" in ours
    assert "on the same cells: not met (worst |predicted/measured - 1| = 21%" in verdict   # the slab plan, not 215


def test_first_walls_name_the_wall_beyond_what_fits_and_skip_cut_or_superseded_cells():
    cells = [("a", _cell("dsa", "chunked_offload", 32, status="time limit", phase="over 60 s")),   # an earlier limit
             ("b", _cell("dsa", "chunked_offload", 256)),
             ("b", _cell("dense", "chunked_offload", 32)),
             ("b", _cell("dense", "chunked_offload", 128, status="OOM", phase="backward")),
             ("b", _cell("dense", "chunked_offload", 64, status="time limit", phase="planner floor 231 s/step")),
             ("b", _cell("swin", "offload", 8, status="not run"))]
    assert memory.first_walls(cells) == ["1B dense chunked_offload at 64 frames: time limit (planner floor 231 s/step)"]


def test_estimate_rule_is_the_held_out_error_with_what_was_left_out(results):
    """C3's step-time verdict: experiments/planner_error.py's held-out steps of the results folder, the worst
    against ESTIMATE_TARGET, with the excluded steps counted by reason."""
    cells = [_cell("dense", "chunked_offload", 8), _cell("dsa", "chunked_offload", 8)]   # dsa: no rate measured

    def text_with_step(ratio):
        write_result("oom_thresholds", "h200_x", {**RUN, "tables": {"cells": cells}}, results_dir=results)
        (step,) = [s for s in planner_error.h200_timed_steps(results) if s.cell["attention"] == "dense"]
        cells[0]["step_s"] = planner_error.estimate_s(step) / ratio
        write_result("oom_thresholds", "h200_x", {**RUN, "tables": {"cells": cells}}, results_dir=results)
        return memory.estimate_text(results)

    met = text_with_step(1.1)
    assert "on the 1 measured H200 steps it was not fitted on: met" in met and "worst +10% at h200_x-dense" in met
    assert "left out: 1 x DSA step whose run measured no attention rate" in met
    assert "not met" in text_with_step(0.7) and "worst -30%" in text_with_step(0.7)
    assert "no held-out measured H200 step" in memory.estimate_text(results / "elsewhere")


def _scaling_row(preset, params_B, speedup, ran=True, cap="fits"):
    row = {"preset": preset, "params_B": params_B, "predicted_peak_GB": 10.0, "predicted_fits_cap": True,
           "predicted_host_GB": 100.0, "predicted_forward_speedup": 1.5, "measured": "run" if ran else "predicted"}
    return row | ({"full_status": "fits", "cap_status": cap, "full_measured_peak_GB": 11.0,
                   "full_forward_speedup": speedup} if ran else {})


def test_c9_reads_a_gpu_run_before_the_plan_and_its_rule_needs_the_claimed_size(results):
    _write_scaling_plan(results)
    config = {"frames": 8, "height": 64, "width": 128, "attention": "dsa", "cap_GB": 94.0, "forward_repeats": 5}
    write_result("scaling", "run", {"plan_only": False, "config": config, "tables": {"presets": [
        _scaling_row("7B", 7.2, 1.33), _scaling_row("1B", 1.0, 1.22), _scaling_row("33B", 34.5, 0, ran=False)]}},
        results_dir=results)
    ours, verdict = throughput.c9(results)
    assert "7B (7.2 B): full HBM fits, 94 GB cap fits, peak 11.0 GB (planner 10.0)" in ours
    assert "33B (34.5 B): predicted only (needs 100 GB host RAM)" in ours and "[scaling/run.json]" in ours
    assert verdict.startswith("speedup 2.11x at 28.4 B: not measured at 28.4 B (the largest preset run is 7.2 B)")
    assert "grows with size (1.22x at 1.0 B -> 1.33x at 7.2 B)" in verdict and "cap is 7B (7.2 B)" in verdict
    assert throughput.scaling_word([_scaling_row("28B", 28.4, 2.2), _scaling_row("33B", 34.5, 2.3)]) == "supported"
    assert throughput.scaling_word([_scaling_row("28B", 28.4, 2.2), _scaling_row("33B", 34.5, 2.0)]) == "not reproduced"


def test_step_floor_overlaps_directions_and_scales_adam_to_the_host_cores():
    f = throughput.step_floors(1e9, [("x", 50.0, 25.0)], (1e9, 1, 8))
    assert f["h2d_GB"] == 4 and f["d2h_GB"] == 2
    assert f["pcie_s"] == (pytest.approx(0.08), pytest.approx(0.08))       # max(4 GB / 50, 2 GB / 25)
    assert f["pcie_serial_s"][0] == pytest.approx(0.16)
    assert f["adam_s"] == pytest.approx(1e9 / (1e9 * throughput.HOST_CORES / 8))


def test_adam_rate_takes_the_engine_workload_at_the_largest_size():
    result = {"threads": 16, "results": [
        {"variant": "megaslide", "workload": "bf16 grad + bf16 out", "params": 10, "gparams_per_s": 5.0},
        {"variant": "megaslide", "workload": "bf16 grad + bf16 out", "params": 20, "gparams_per_s": 4.0},
        {"variant": "torch-fused", "workload": "bf16 grad + bf16 out", "params": 40, "gparams_per_s": 9.0},
        {"variant": "megaslide", "workload": "fp32 grad", "params": 40, "gparams_per_s": 9.0}]}
    assert throughput.adam_rate(result) == (4e9, 20, 16)


def _write_scaling_plan(results_dir, name="h200_predicted"):
    rows = [{"preset": p, "params_B": b, "predicted_peak_GB": hbm, "predicted_fits_cap": hbm < 94,
             "predicted_host_GB": host, "host_holds_it": host < 125, "predicted_forward_speedup": 1.8}
            for p, b, hbm, host in (("1B", 1.0, 6, 19), ("7B", 7.2, 16, 116), ("33B", 34.5, 43, 538))]
    write_result("scaling", name, {"plan_only": True, "config": {
        "frames": 8, "height": 64, "width": 128, "attention": "dsa", "hbm_budget_GB": 146.8, "host_budget_GB": 125.0,
        "cap_GB": 94.0}, "tables": {"presets": rows}}, results_dir=results_dir)


def test_c9_is_predicted_from_a_plan_only_result_and_not_measured_without_one(results):
    assert throughput.c9(results)[1] == "not measured" and "python -m experiments.scaling" in throughput.c9(results)[0]
    _write_scaling_plan(results)
    ours, verdict = throughput.c9(results)
    assert verdict.startswith("predicted, not measured") and "is 7B (7.2 B)" in verdict
    assert "33B (34.5 B): 43 GB HBM, fits 94 GB yes, host 538 GB (not held)" in ours


def test_results_option_reads_the_users_folder_and_the_page_names_it(tmp_path, monkeypatch, capsys):
    own = tmp_path / "my_results"
    _write_scaling_plan(own, name="mine")
    monkeypatch.setattr(sys, "argv", ["claims", "--results", str(own)])
    page.main()
    text = (own / "README.md").read_text()                       # written beside the results it links
    assert (f"Generated by `python -m experiments.claims --results {own}` from the JSON files under my_results/"
            in text)
    assert "[scaling/mine.json](scaling/mine.json)" in text and "is 7B (7.2 B)" in text   # C9 from the user's folder
    assert "h200_predicted" not in text and "h200_sweep" not in text     # nothing from the repository's results/
    assert f"from {own}" in capsys.readouterr().out
    assert "under results/ (each linked)" in page.readme(RESULTS_DIR)   # the default names no option
    monkeypatch.setattr(sys, "argv", ["claims", "--results", str(tmp_path / "missing")])
    with pytest.raises(SystemExit) as exit_:
        page.main()
    assert exit_.value.code == 2 and "is not a folder" in capsys.readouterr().err
