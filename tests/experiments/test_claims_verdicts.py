"""Verdicts of C1, C3's sub-claims, C5, S1 and S4 follow their data: each test copies committed result JSON into a
temporary results folder, edits one field, and checks that the verdict flips with it and states its rule."""
import json
import shutil

import pytest

from experiments.claims import causal_sp, memory, throughput
from experiments.results_io import RESULTS_DIR


def copied(tmp_path, experiment, *names):
    """The committed `results/<experiment>/<name>.json` files copied into tmp_path, as {name: path}."""
    (tmp_path / experiment).mkdir(exist_ok=True)
    paths = {n: tmp_path / experiment / f"{n}.json" for n in names}
    for n, path in paths.items():
        shutil.copy(RESULTS_DIR / experiment / f"{n}.json", path)
    return paths


def edit(path, change):
    """Rewrite a copied result with `change(data)` applied."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def cell(data, attention, frames):
    return next(c for c in data["tables"]["cells"] if (c["attention"], c["frames"]) == (attention, frames))


@pytest.mark.parametrize("status, phase, word, why", [
    ("time limit", "planner floor 231 s/step", "not assessed", "its wall there is time, not memory"),
    ("not run", "time budget spent", "not assessed", "cut by its run's time budget"),
    ("OOM", "plan: backward", "not assessed", "the planner refused it before allocating"),
    ("OOM", "backward", "supported", "1B dense chunked_offload 64 frames: OOM (backward)"),
    ("fits", "", "not supported", "1B dense chunked_offload 64 frames: fits at 41.0 GB"),
])
def test_dense_oom_at_64_frames_needs_a_measured_oom(tmp_path, status, phase, word, why):
    (path,) = copied(tmp_path, "oom_thresholds", "h200_dense_wall").values()
    edit(path, lambda d: cell(d, "dense", 64).update(status=status, phase=phase, measured_peak_GB=41.0))
    verdict = memory.c3(tmp_path)[1]
    part = verdict[verdict.index("dense OOMs at 64 frames: "):verdict.index("Swin fits 256 frames: ")]
    assert part.startswith(f"dense OOMs at 64 frames: {word}") and why in part
    assert "rule: supported if a measured dense cell of 64 frames runs out of memory" in part


def test_the_committed_dense_wall_is_time_not_memory(tmp_path):
    copied(tmp_path, "oom_thresholds", "h200_dense_wall")
    verdict = memory.c3(tmp_path)[1]
    assert ("dense OOMs at 64 frames: not assessed: 1B dense chunked_offload 64 frames: time limit (planner floor "
            "231 s/step), predicted peak 41 GB: its wall there is time, not memory") in verdict


@pytest.mark.parametrize("status, phase, word", [
    (None, None, "not assessed: no measured swin cell of 256 frames (the most frames a measured swin cell fits: 32"),
    ("fits", "", "supported (1B swin chunked_offload 256 frames: fits at 140.0 GB"),
    ("OOM", "forward", "not supported (1B swin chunked_offload 256 frames: OOM (forward)"),
    ("time limit", "over 60 s", "not assessed: 1B swin chunked_offload 256 frames: time limit (over 60 s)"),
])
def test_swin_fits_256_frames_needs_a_measured_256_frame_swin_cell(tmp_path, status, phase, word):
    (path,) = copied(tmp_path, "oom_thresholds", "h200_1B_swin_dense").values()
    if status:
        def add(d):
            c = {**cell(d, "swin", 32), "frames": 256, "status": status, "phase": phase}
            d["tables"]["cells"].append({**c, "measured_peak_GB": 140.0 if status == "fits" else None})
        edit(path, add)
    verdict = memory.c3(tmp_path)[1]
    assert verdict[verdict.index("Swin fits 256 frames: "):].startswith(f"Swin fits 256 frames: {word}")


@pytest.mark.parametrize("peak, status, word", [
    (86.4, "fits", "supported (lowest measured peak 86.4 GB at 1B dsa chunked_offload 256 frames"),
    (115.0, "fits", "supported (lowest measured peak 115.0 GB"),
    (120.0, "fits", "not supported (lowest measured peak 120.0 GB"),
    (None, "OOM", "not assessed: no measured dsa cell of 256 frames fits"),
])
def test_peak_at_256_frames_is_compared_with_the_papers_115_gb(tmp_path, peak, status, word):
    (path,) = copied(tmp_path, "oom_thresholds", "h200_headline_256_compiled").values()
    edit(path, lambda d: cell(d, "dsa", 256).update(measured_peak_GB=peak, status=status))
    verdict = memory.c3(tmp_path)[1]
    part = verdict[verdict.index("~115 GB peak HBM at 256 frames: "):verdict.index("dense OOMs")]
    assert part.startswith(f"~115 GB peak HBM at 256 frames: {word}")
    assert "rule: supported if a measured dsa cell of 256 frames fits at a peak at or below the paper's 115 GB" in part


def test_c1_is_consistent_only_while_the_preset_is_within_tolerance(monkeypatch):
    verdict = memory.c1(RESULTS_DIR)[1]
    assert verdict.startswith("consistent (arithmetic): state 1.49 vs ~1.47 TB (+1.1%), moments 849 vs ~840 GB")
    assert "rule: consistent if both lie within 5% of the paper's figures" in verdict
    monkeypatch.setattr(memory, "count_params", lambda cfg: 120e9)    # 1.68 TB: +14%
    assert memory.c1(RESULTS_DIR)[1].startswith("not consistent (arithmetic): state 1.68 vs ~1.47 TB (+14.3%)")


def _gpu_optimizer(d):
    return next(v for v in d["variants"] if v["variant"] == "gpu_optimizer")


@pytest.mark.parametrize("change, word", [
    ({}, "not reproduced: MFU 44.3% -> 36.0% (measured peak)"),
    ({"step_s_min": 6.0}, "not supported"),                    # its fastest step inside the CPU optimizer's range
    ({"mfu_vs_measured_peak": 0.14, "mfu_vs_datasheet": 0.10}, "supported"),
    ({"mfu_vs_measured_peak": 0.20, "mfu_vs_datasheet": 0.14}, "reproduced against the datasheet only"),
    ({"timed_steps": 2}, f"not assessed (fewer than {throughput.MIN_TIMED_STEPS} timed steps or no spread)"),
])
def test_c5_needs_a_measured_drop_and_the_papers_level(tmp_path, change, word):
    (path,) = copied(tmp_path, "mfu_overlap", throughput.MFU_RESULT).values()
    edit(path, lambda d: _gpu_optimizer(d).update(change))
    verdict = throughput.c5(tmp_path)[1]
    assert verdict.startswith(f"{word}")
    assert "rule: a drop counts when the GPU optimizer's fastest timed step is slower than the CPU" in verdict
    assert "under the previous rule (supported if the GPU optimizer's MFU is at or below 15%" in verdict


def test_s1_and_s4_quality_need_the_parallel_output_to_equal_one_gpus(tmp_path):
    paths = copied(tmp_path, "sp_inference", "wan-1.3b_P1", "wan-1.3b_P2")
    s4 = causal_sp.s_claim("S4")
    assert causal_sp.s1(tmp_path)[1].startswith("supported on 2 H200s, not run at 8 (paper: 8 GPUs)")
    assert "under the previous rule (fixed text, no rule): implemented, not run at 8" in causal_sp.s1(tmp_path)[1]
    assert "quality unchanged (read as the same output" in s4(tmp_path)[1] and "): supported on 2 H200s" in \
        s4(tmp_path)[1]
    edit(paths["wan-1.3b_P2"], lambda d: d["tables"]["correctness"][0].update(causal_max_abs_diff_P_vs_1=0.2))
    assert causal_sp.s1(tmp_path)[1].startswith("not supported on 2 H200s")   # 0.2 > 2 x 0.0503
    assert "): not supported on 2 H200s" in s4(tmp_path)[1]
    paths["wan-1.3b_P2"].unlink()
    assert causal_sp.s1(tmp_path)[1].startswith("not assessed: no sequence-parallel run on more than one GPU")
    assert "): not assessed: no sequence-parallel run" in s4(tmp_path)[1]


@pytest.mark.parametrize("ttff_ms, word", [(106.3, "supported"), (1200.0, "not supported")])
def test_s4_first_frame_counts_every_measured_rank_count(tmp_path, ttff_ms, word):
    paths = copied(tmp_path, "sp_inference", "wan-1.3b_P1", "wan-1.3b_P2")
    edit(paths["wan-1.3b_P2"], lambda d: d["summary"].update(ttff_ms=ttff_ms))
    assert causal_sp.s_claim("S4")(tmp_path)[1].startswith(
        f"first frame < 1 s: {word} (rule: every measured first-chunk time below 1 s)")


def test_one_gpu_figures_come_from_the_newest_one_gpu_run_named_by_its_card(tmp_path):
    """S2 and S4's one-GPU half reads the newest one-GPU result, whichever card ran it, and says which card."""
    paths = copied(tmp_path, "sp_inference", "wan-1.3b_P1", "h100_wan-1.3b_P1")
    s2, s4 = causal_sp.s_claim("S2"), causal_sp.s_claim("S4")
    assert "1 H100: 2.59 s -> 2.10 s ([sp_inference/h100_wan-1.3b_P1.json]" in s2(tmp_path)[0]
    assert s4(tmp_path)[0].startswith("first chunk final after 155 ms on 1 H100")
    edit(paths["wan-1.3b_P1"], lambda d: d.update(date="2027-01-01T00:00:00+00:00"))   # the H200 run now newest
    assert "1 H200: 3.26 s -> 2.13 s ([sp_inference/wan-1.3b_P1.json]" in s2(tmp_path)[0]
    assert s4(tmp_path)[0].startswith("first chunk final after 158 ms on 1 H200")
    edit(paths["wan-1.3b_P1"], lambda d: d["hardware"].update(gpus=["NVIDIA H200", "NVIDIA H100 80GB HBM3"]))
    assert "on 1 GPU (" in s4(tmp_path)[0]   # cards that differ are not named
