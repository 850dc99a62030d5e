"""ablate_offsets.py and quality.py end to end at the smallest size: train, sample, score, JSON."""
import json

from tests.experiments.runner import run_script

TINY = ["train.steps=2", "n_eval=2", "train.sample_steps=1", "seeds=[0]", "data.height=8", "data.width=8",
        "data.shape_size=4", "data.speed=2", "data.frames=4", "data.num_videos=8", "train.batch_size=2"]


def _run(script, tmp_path, *extra):
    run_script([f"experiments/{script}", f"out_dir={tmp_path}", *TINY, *extra])
    return json.loads(next((tmp_path / "results").rglob("cpu_tiny.json")).read_text())


def test_ablate_offsets_smoke(tmp_path):
    data = _run("ablate_offsets.py", tmp_path)
    variants = {r["variant"] for r in data["rows"]}
    assert variants == {"dsa", "dsa_zero", "ground_truth"}
    per_seed = data["tables"]["per seed"]
    assert len({r["params"] for r in per_seed if "params" in r}) == 1   # equal parameter counts
    gt = next(r for r in data["rows"] if r["variant"] == "ground_truth")
    assert gt["text_alignment_mean"] == 1.0                            # the ceiling is reachable
    assert gt["color_match_mean"] == gt["shape_match_mean"] == gt["direction_match_mean"] == 1.0
    for r in per_seed:                                                 # all of the caption implies each part
        assert r["text_alignment"] <= min(r["color_match"], r["shape_match"], r["direction_match"])
    assert data["jobs_done"] == data["jobs_total"] == 2                 # complete, not a partial result


def test_quality_smoke(tmp_path):
    data = _run("quality.py", tmp_path, "clip_frames=[4]")
    assert {r["variant"] for r in data["rows"]} == {"dense", "swin", "dsa", "dsa_zero", "ground_truth"}
    assert all(r["seeds"] == 1 for r in data["rows"] if r["variant"] != "ground_truth")


def test_parallel_workers_give_the_same_rows(tmp_path):
    """workers=2 (spawned processes) trains and scores the same runs as workers=1."""
    serial = _run("ablate_offsets.py", tmp_path / "serial")["tables"]["per seed"]
    parallel = _run("ablate_offsets.py", tmp_path / "parallel", "workers=2")["tables"]["per seed"]
    assert [r["variant"] for r in parallel] == [r["variant"] for r in serial]
    for a, b in zip(serial, parallel):
        if a["variant"] != "ground_truth":
            assert abs(a["final_loss"] - b["final_loss"]) <= 1e-4 * abs(a["final_loss"])
