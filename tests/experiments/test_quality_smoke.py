"""ablate_offsets.py and quality.py end to end at the smallest size: train, sample, score, JSON."""
import json
from pathlib import Path

import imageio.v2 as imageio
import torch

from experiments.quality_protocol import (MIN_FRAME_PX, SCORE_KEYS, TRAINSET_KEYS, eval_set, grid_rows, summary_table,
                                          upscaled)
from megaslide.config import DataConfig
from megaslide.data.build import build_dataset
from megaslide.data.video_io import to_uint8_frames
from tests.experiments.runner import run_script_streams

TINY = ["train.steps=2", "n_eval=2", "train.sample_steps=1", "seeds=[0]", "data.height=8", "data.width=8",
        "data.shape_size=4", "data.speed=2", "data.frames=4", "data.num_videos=8", "train.batch_size=2"]
# the ablation's model has 4x4 patches: 16 px frames give the 3x3 window its 4x4 tokens
ABLATION = [o.replace("=8", "=16") if o.startswith(("data.height", "data.width")) else o for o in TINY]


def _run(script, tmp_path, *extra, streams=False):
    """The result JSON and the printout of one script run at its smoke size (with `streams`, its stderr too)."""
    out = run_script_streams([f"experiments/{script}", f"out_dir={tmp_path}",
                              *(ABLATION if "ablate" in script else TINY), *extra])
    result = json.loads(next((tmp_path / "results").rglob("cpu_tiny.json")).read_text())
    return (result, *out) if streams else (result, out[0])


def test_ablate_offsets_smoke(tmp_path):
    data, out = _run("ablate_offsets.py", tmp_path)
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
    assert not any(k in r for r in per_seed for k in TRAINSET_KEYS)     # n_train_eval=0 by default here,
    assert not any(k.startswith("trainset_") for r in data["rows"] for k in r)   # and none aggregated

    table = out[out.index("variant"):].split("\n\n")[0].splitlines()  # the printout: a narrow summary,
    assert max(map(len, table)) <= 100, out                             # then where everything is
    assert [line.split()[0] for line in table[1:]] == ["ground_truth", "dsa", "dsa_zero"]
    assert "on train" not in table[0]                                   # no run scored training clips
    paths = {line.split(": ")[0]: Path(line.split(": ")[-1]) for line in out.splitlines() if ": " in line}
    png = paths["sample grid, each caption's ground truth first"]
    mp4s = [p for label, p in paths.items() if label.startswith("sample video")]
    assert png.is_file() and len(mp4s) == 2 and all(p.is_file() for p in mp4s)
    with imageio.get_reader(mp4s[0]) as reader:
        assert min(reader.get_meta_data()["size"]) >= MIN_FRAME_PX     # 16 px frames upscaled to 96


def test_quality_smoke(tmp_path):
    data, _ = _run("quality.py", tmp_path, "clip_frames=[4]")
    assert {r["variant"] for r in data["rows"]} == {"dense", "swin", "dsa", "dsa_zero", "ground_truth"}
    assert all(r["seeds"] == 1 for r in data["rows"] if r["variant"] != "ground_truth")
    assert data["config"]["deterministic"] is False     # train.deterministic, recorded with the study
    per_seed = data["tables"]["per seed"]                # n_train_eval defaults to n_eval: training clips scored too
    assert all(0 <= r[k] <= 1 for r in per_seed for k in TRAINSET_KEYS)
    truth = next(r for r in per_seed if r["variant"] == "ground_truth")
    assert truth["trainset_text_alignment"] == 1.0       # the true training clips match their captions


def test_trainset_clips_are_the_training_data():
    """n_train_eval scores the first clips the trainer draws from (data seed data.seed), not held-out ones."""
    data = DataConfig(frames=4, height=8, width=8, shape_size=4, speed=2, num_videos=8, seed=3)
    captions, _, videos = eval_set(data, 2, data.seed)
    train = build_dataset(data)
    assert captions == [train[i]["caption"] for i in range(2)]
    torch.testing.assert_close(videos, torch.stack([train[i]["video"] for i in range(2)]))
    assert eval_set(data, 2, 10007)[0] != captions or not torch.equal(eval_set(data, 2, 10007)[2], videos)


def test_parallel_workers_give_the_same_rows(tmp_path):
    """workers=2 (spawned processes) trains and scores the same runs as workers=1, and each worker's progress
    is on lines of its own, labelled with its run: no bar redrawn over the other's line."""
    serial = _run("ablate_offsets.py", tmp_path / "serial")[0]["tables"]["per seed"]
    parallel = _run("ablate_offsets.py", tmp_path / "parallel", "workers=2", streams=True)
    rows, progress = parallel[0]["tables"]["per seed"], parallel[2]
    assert [r["variant"] for r in rows] == [r["variant"] for r in serial]
    for a, b in zip(serial, rows):
        if a["variant"] != "ground_truth":
            assert abs(a["final_loss"] - b["final_loss"]) <= 1e-4 * abs(a["final_loss"])
    assert "\r" not in progress, progress
    labels = ("[dsa 4f seed 0] ", "[dsa_zero 4f seed 0] ")
    lines = [line for line in progress.splitlines() if " step " in line]
    for label in labels:    # train.steps=2: a line at each step, "step 1/2" and "step 2/2"
        assert [line[len(label):].split()[1] for line in lines if line.startswith(label)] == ["1/2", "2/2"], progress
    assert len(lines) == 4 and all(line.count(" step ") == 1 for line in lines), progress


def test_upscaled_repeats_pixels_to_the_minimum_size():
    video = torch.rand(3, 2, 16, 20) * 2 - 1                            # (3, T, H, W)
    frames = upscaled(video)
    assert frames.shape == (2, 96, 120, 3)                               # 16 px -> x6
    torch.testing.assert_close(torch.from_numpy(frames[:, ::6, ::6]), torch.from_numpy(to_uint8_frames(video)))
    assert (frames[:, :6, :6] == frames[:, :1, :1]).all()


def test_summary_table_fits_100_columns():
    row = {"variant": "ground_truth", "frames": 64, "seeds": 3,
           **{f"{k}_mean": 0.123456 for k in SCORE_KEYS + TRAINSET_KEYS}}
    lines = summary_table([row, {**row, "variant": "dsa_zero"}]).splitlines()
    assert len(lines) == 3 and max(map(len, lines)) <= 100
    assert lines[0].split() == ["variant", "frames", "seeds", "colour", "shape", "direction", "caption",
                                "on", "train", "consistency", "motion", "err"]
    unscored = {**row, "trainset_text_alignment_mean": float("nan")}   # one row without training-clip scores
    assert summary_table([row, unscored]).splitlines()[2].split()[7] == "-"
    assert "on train" not in summary_table([unscored])


def test_the_grid_shows_several_captions_each_with_the_truth_and_every_variant():
    def row(variant, seed, status="ok"):
        return {"variant": variant, "seed": seed, "status": status, "captions": ["a", "b", "c", "d"],
                "samples": [torch.full((3, 2, 4, 4), float(seed + i)) for i in range(4)]}
    rows = [row("ground_truth", 9), row("dsa", 1), row("dsa", 0), row("dsa_zero", 0, status="OOM")]
    shown = grid_rows(rows)
    assert [label for _, label in shown] == ["ground_truth s9: a", "dsa s0: a", "ground_truth s9: b", "dsa s0: b",
                                             "ground_truth s9: c", "dsa s0: c"]
    assert float(shown[3][0][0, 0, 0, 0]) == 1.0                 # dsa seed 0's second sample
    assert len(grid_rows(rows, captions=1)) == 2
