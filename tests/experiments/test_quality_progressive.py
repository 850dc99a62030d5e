"""quality.py's progressive long clips, kept sample clips, run scheduling and compile probe; the GPU
study script at its DRY size."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import experiments.quality as quality
import experiments.quality_protocol as protocol
from experiments.quality_protocol import eval_set, load_samples, run_jobs, save_samples, score
from megaslide.checkpoint import save_checkpoint
from megaslide.config import DataConfig, TrainConfig
from tests.experiments.runner import REPO_ROOT, run_script
from tests.helpers import needs_inductor, tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

TINY = ["train.steps=2", "n_eval=2", "train.sample_steps=1", "seeds=[0]", "data.height=8", "data.width=8",
        "data.shape_size=4", "data.speed=2", "data.num_videos=8", "train.batch_size=2"]


def digest(checkpoint: Path) -> str:
    """The reference of weights_digest: sha256 over the raw weights, then the EMA, by name, as float32 bytes."""
    state = torch.load(checkpoint, weights_only=False)
    h = hashlib.sha256()
    for weights in (state["model"], state["ema"]):
        for name in sorted(weights):
            h.update(name.encode())
            h.update(weights[name].float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def test_progressive_long_runs_start_from_the_short_runs(tmp_path):
    """Two clips, two workers: each long run starts from exactly the weights (raw and EMA) its short run
    ended with, continues its step count, and says so in its row; every run keeps its sample clips."""
    run_script(["experiments/quality.py", f"out_dir={tmp_path}", *TINY, "clip_frames=[4,8]", "clip_steps=[3,2]",
                "progressive=true", "variants=[dense,dsa]", "workers=2", "train.ema_decay=0.9", "save_mp4=false"])
    result = json.loads((tmp_path / "results" / "quality" / "cpu_tiny.json").read_text())
    assert result["config"]["clip_steps"] == [3, 2] and result["config"]["progressive"] is True
    assert result["jobs_done"] == result["jobs_total"] == 4
    runs = {(r["variant"], r["frames"]): r for r in result["tables"]["per seed"] if r["variant"] != "ground_truth"}
    for variant in ("dense", "dsa"):
        short, long = runs[(variant, 4)], runs[(variant, 8)]
        assert (short["init_from"], short["init_step"], short["steps"]) == ("scratch", 0, 3)
        source = f"quality4f_{variant}_seed0/checkpoints/step_3.pt"
        assert (long["init_from"], long["init_step"], long["steps"]) == (source, 3, 5)
        saved = torch.load(tmp_path / source, weights_only=False)
        assert any(not torch.equal(saved["model"][k], saved["ema"][k]) for k in saved["model"])  # EMA is its own
        assert long["init_weights"] == short["final_weights"] == digest(tmp_path / source)
        assert long["init_weights"] != short["init_weights"]            # not a fresh start of the same seed
        assert long["final_weights"] == digest(tmp_path / f"quality8f_{variant}_seed0/checkpoints/step_5.pt")
        for row, frames in ((short, 4), (long, 8)):
            videos, captions, labels = load_samples(tmp_path / row["samples_file"])
            assert videos.shape == (2, 3, frames, 8, 8)
            assert captions == eval_set(DataConfig(frames=frames, height=8, width=8, shape_size=4, speed=2), 2,
                                        10007)[0]


def test_a_cut_study_run_again_ends_with_the_weights_of_an_uncut_one(tmp_path):
    """continue_runs=true: a study whose long run was cut after a checkpoint (its newest checkpoint and
    samples gone, as if the process died mid-step) is finished by the same command: the short run
    re-scores its final weights without training, the long run restarts from its own newest
    checkpoint, and both end with exactly the weights and scores of the uncut study. keep_checkpoints
    leaves two checkpoints per run."""
    uncut, cut = tmp_path / "uncut", tmp_path / "cut"
    args = [*TINY, "clip_frames=[4,8]", "clip_steps=[3,2]", "progressive=true", "variants=[dsa]", "save_mp4=false",
            "train.ckpt_every=1", "train.keep_checkpoints=2", "continue_runs=true", "train.log_every=1"]
    run_script(["experiments/quality.py", f"out_dir={uncut}", *args])
    expected = json.loads((uncut / "results" / "quality" / "cpu_tiny.json").read_text())["tables"]["per seed"]
    shutil.copytree(uncut, cut)
    long_run = cut / "quality8f_dsa_seed0"
    assert sorted(p.name for p in (long_run / "checkpoints").iterdir()) == ["step_4.pt", "step_5.pt"]
    (long_run / "checkpoints" / "step_5.pt").unlink()
    shutil.rmtree(long_run / "samples")
    shutil.rmtree(cut / "results")
    run_script(["experiments/quality.py", f"out_dir={cut}", *args])
    rows = json.loads((cut / "results" / "quality" / "cpu_tiny.json").read_text())["tables"]["per seed"]
    assert len(rows) == len(expected) == 4                         # ground truth at 4 and 8 frames, the runs
    for before, after in zip(expected, rows):
        if before["variant"] == "ground_truth":
            continue
        assert after["final_weights"] == before["final_weights"] and after["steps"] == before["steps"]
        assert {k: after[k] for k in protocol.SCORE_KEYS} == {k: before[k] for k in protocol.SCORE_KEYS}
        assert after["init_from"] == before["init_from"] and "restarted_from" not in before
    short, long = (r for r in rows if r["variant"] != "ground_truth")
    assert short["restarted_from"] == "quality4f_dsa_seed0/checkpoints/step_3.pt" and short["init_step"] == 3
    assert long["restarted_from"] == "quality8f_dsa_seed0/checkpoints/step_4.pt" and long["init_step"] == 4
    assert (long_run / "samples" / "eval.npz").is_file()
    for run in ("quality4f_dsa_seed0", "quality8f_dsa_seed0"):               # the log of every step, once
        logged = [[json.loads(line)["step"] for line in (root / run / "metrics.jsonl").read_text().splitlines()]
                  for root in (uncut, cut)]
        assert logged[0] == logged[1] and len(logged[0]) == (4 if run.startswith("quality4f") else 3)


def test_a_checkpoint_past_the_plan_is_refused(tmp_path):
    """continue_runs finds a run folder of a longer study: refused before a model is built."""
    save_checkpoint(tmp_path / "q4f_dense_seed0" / "checkpoints" / "step_9.pt", {"step": 9})
    with pytest.raises(ValueError, match="step 9, past this run's 2 steps: it belongs to another study"):
        protocol.run_variant("dense", tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=2), n_eval=1,
                             eval_seed=0, sample_batch=1, out_dir=tmp_path, project="p", tag="q4f",
                             continue_own=True)


def test_runs_of_other_settings_in_out_dir_never_mix(tmp_path):
    """A fresh study (continue_runs=false) into an out_dir that holds an earlier study's run of the same name but
    other settings starts without its checkpoints and samples (before: its step_4.pt stayed beside the new run's
    step_2.pt, for a later continue_runs=true to take as this run's); continue_runs=true on a checkpoint of
    other settings (train.lr) is refused, naming the setting, before anything is written (before: it re-scored
    the other run's weights as this run's and exited 0)."""
    args = ["experiments/quality.py", f"out_dir={tmp_path}", *TINY, "clip_frames=[4]", "variants=[dense]",
            "save_mp4=false", "train.ckpt_every=2", "train.lr=1e-3"]
    run_script([*args, "train.steps=4"])
    run = tmp_path / "quality4f_dense_seed0"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2.pt", "step_4.pt"]
    (run / "samples" / "eval_0.mp4").write_bytes(b"an earlier run's video")
    out = run_script([*args, "train.steps=2"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2.pt"]
    assert f"fresh run: removed {run / 'checkpoints' / 'step_4.pt'}, left by an earlier run" in out
    assert not (run / "samples" / "eval_0.mp4").exists() and (run / "samples" / "eval.npz").exists()
    result = (tmp_path / "results" / "quality" / "cpu_tiny.json").read_bytes()
    done = subprocess.run([sys.executable, *args, "train.steps=2", "train.lr=2e-3", "continue_runs=true"],
                          cwd=REPO_ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"error: continue_runs=true: {run / 'checkpoints' / 'step_2.pt'} is a checkpoint of a run with other "
            f"settings (train.lr: 0.001 in the checkpoint vs 0.002 now); pass continue_runs=false") in done.stderr
    assert (tmp_path / "results" / "quality" / "cpu_tiny.json").read_bytes() == result


def test_sample_files_rescore_like_the_clips(tmp_path):
    """Ground-truth clips at the GPU studies' size score the same after a round trip through uint8."""
    data = DataConfig(frames=16, height=16, width=16, shape_size=6, speed=3)
    captions, labels, videos = eval_set(data, 8, 10007)
    loaded, loaded_captions, loaded_labels = load_samples(save_samples(tmp_path / "s" / "eval.npz", videos, captions,
                                                                       labels))
    assert (loaded_captions, loaded_labels) == (captions, labels)
    assert (loaded - videos).abs().max() <= 1 / 127.5                   # uint8 rounding
    before, after = score(videos, labels), score(loaded, loaded_labels)
    for key in ("text_alignment", "color_match", "shape_match", "direction_match"):
        assert after[key] == before[key]
    assert after["temporal_consistency"] == pytest.approx(before["temporal_consistency"], abs=0.02)


def _job(tmp_path, variant: str, frames: int, steps: int, source: dict | None = None) -> dict:
    train = TrainConfig(steps=steps, resume=str(protocol.final_checkpoint(source)) if source else "")
    return dict(attention=variant, data=DataConfig(frames=frames), train=train, out_dir=tmp_path, tag=f"q{frames}f")


def test_run_jobs_follows_dependencies_and_keeps_going(tmp_path, monkeypatch):
    """A run that continues a failed or OOM run is recorded as not run (down the chain); a run that
    raises is recorded as failed, the others still run, and its error is raised at the end."""
    a4 = _job(tmp_path, "a", 4, 2)
    a8 = _job(tmp_path, "a", 8, 3, a4)
    a16 = _job(tmp_path, "a", 16, 4, a8)
    b4 = _job(tmp_path, "b", 4, 2)
    b8 = _job(tmp_path, "b", 8, 3, b4)
    c4 = _job(tmp_path, "c", 4, 2)
    outcome = {"a": "OOM: out of memory", "b": "ok"}
    ran = []

    def fake_run(**job):
        ran.append((job["attention"], job["data"].frames))
        if job["attention"] == "c":
            raise RuntimeError("broken")
        return {"variant": job["attention"], "frames": job["data"].frames, "status": outcome[job["attention"]]}

    monkeypatch.setattr(protocol, "run_variant", fake_run)
    published = []
    with pytest.raises(RuntimeError, match="broken"):
        run_jobs([a4, a8, a16, b4, b8, c4], 1, on_row=lambda rows: published.append([r["status"] for r in rows]))
    assert ran == [("a", 4), ("b", 4), ("b", 8), ("c", 4)]
    statuses = published[-1]
    assert statuses[0].startswith("OOM")
    assert statuses[1] == "not run: the run it continues (4 frames) ended OOM: out of memory"
    assert statuses[2].startswith("not run: the run it continues (8 frames) ended not run")
    assert statuses[3:5] == ["ok", "ok"] and statuses[5] == "failed: RuntimeError: broken"
    assert [len(p) for p in published] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="list each run after the run it continues"):
        run_jobs([a8, a4], 1)


def test_per_clip_values_are_checked():
    assert quality.per_clip([], 5, "clip_steps", "train.steps", [16, 64]) == [5, 5]
    assert quality.per_clip([3, 2], 5, "clip_steps", "train.steps", [16, 64]) == [3, 2]
    for bad in ([8], [8, 0]):                                          # one too few; a zero
        with pytest.raises(ValueError, match=r"clip_steps=.* needs one value >= 1 per entry of clip_frames"):
            quality.per_clip(bad, 5, "clip_steps", "train.steps", [16, 64])


def test_compile_gain():
    eager = {"steps_per_s": 10.0, "warmup_s": 1.0}
    assert quality.compile_gain(eager, {"steps_per_s": 20.0, "warmup_s": 11.0}) == {"speedup": 2.0,
                                                                                    "break_even_steps": 200}
    assert quality.compile_gain(eager, {"steps_per_s": 8.0, "warmup_s": 11.0})["break_even_steps"] is None


def test_time_steps_reports_a_failure_as_its_status(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(quality, "Trainer", broken)
    row = quality.time_steps(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(compile=True), str(tmp_path), 1, 1)
    assert row == {"compile": True, "status": "failed: RuntimeError: no compiler"}


@needs_inductor
def test_compile_probe_rows(tmp_path):
    """The probe runs on the CPU too: one eager and one compiled row per variant (measured in two processes
    at once), the gain from both."""
    run_script(["experiments/quality.py", f"out_dir={tmp_path}", *TINY, "clip_frames=[4]", "compile_probe=true",
                "variants=[dense]", "probe_warmup=1", "probe_steps=2", "workers=2"])
    result = json.loads((tmp_path / "results" / "quality_compile" / "cpu_tiny.json").read_text())
    assert result["jobs_done"] == result["jobs_total"] == 2
    eager, compiled = result["rows"]
    assert (eager["compile"], compiled["compile"]) == (False, True)
    assert eager["status"] == compiled["status"] == "ok"
    assert eager["steps_per_s"] > 0 and compiled["steps_per_s"] > 0 and compiled["warmup_s"] > 0
    gain = quality.compile_gain(eager, compiled)
    assert compiled["speedup"] == pytest.approx(gain["speedup"])
    assert compiled["break_even_steps"] == gain["break_even_steps"]
    assert result["config"] == {"frames": 4, "size": [8, 8], "batch_size": 2, "warmup": 1, "steps": 2,
                                "variants": ["dense"], "workers": 2, "deterministic": False}


def test_gpu_study_script_dry_run(tmp_path):
    """experiments/gpu/quality_study.sh at its DRY size: probe, plan, a progressive study that finishes, and
    the runs' samples and logs in two tars (a tiny size limit forces the split) without any checkpoint.
    DETERMINISTIC=1 reaches the probe and every run (train.deterministic=true in their JSONs). Its time budgets
    are set far beyond any machine's speed (a step would have to take hours to matter), so no stage is cut and the
    plan is the DRY step caps however busy the machine is."""
    env = {**os.environ, "DRY": "1", "PROBE_S": "1000000", "BUDGET_S": "1000000",
           "RESULTS": str(tmp_path / "results"), "RUNS": str(tmp_path / "runs"), "WANDB_MODE": "disabled",
           "TAR_MAX_KIB": "1", "DETERMINISTIC": "1"}
    done = subprocess.run(["bash", "experiments/gpu/quality_study.sh"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "probe exit status 0" in done.stdout and "study exit status 0" in done.stdout
    assert "plan: train.compile=" in done.stdout and "train.deterministic=true in the probe" in done.stdout
    results = tmp_path / "results"
    probe = json.loads((results / "quality_compile" / "cpu_dry.json").read_text())
    assert probe["rows"][0]["compile"] is False and probe["rows"][0]["status"] == "ok"
    assert probe["config"]["deterministic"] is True
    study = json.loads((results / "quality" / "cpu_dry.json").read_text())
    assert study["jobs_done"] == study["jobs_total"] == 8 and study["config"]["progressive"] is True
    assert study["config"]["clip_steps"] == [4, 3]   # the DRY caps SHORT_MAX and LONG_MAX: no budget bound them
    assert study["config"]["deterministic"] is True
    names = {}
    for part in ("logs", "samples"):
        with tarfile.open(results / f"cpu_dry_runs_{part}.tar.gz") as tar:
            names[part] = set(tar.getnames())
    assert not (results / "cpu_dry_runs.tar.gz").exists()
    assert not any("checkpoints" in n for n in names["logs"] | names["samples"])
    rows = [r for r in study["tables"]["per seed"] if r["variant"] != "ground_truth"]
    assert {f"./{r['samples_file']}" for r in rows} == names["samples"]
    assert {"./logs/probe.log", "./logs/study.log"} <= names["logs"]
    assert {f"./{Path(r['samples_file']).parts[0]}/metrics.jsonl" for r in rows} <= names["logs"]


def test_gpu_study_script_finishes_a_study_with_resume(tmp_path):
    """PLAN fixes the steps (no probe); RESUME=1 runs the same study again over its RUNS: the runs its result
    holds are kept, and a finished run it lacks restarts from its own final checkpoint, trains no further and
    scores the same. RESUME without PLAN, and a second study over the same RUNS without RESUME, are refused."""
    env = {**os.environ, "DRY": "1", "RESULTS": str(tmp_path / "results"), "RUNS": str(tmp_path / "runs"),
           "WANDB_MODE": "disabled", "PLAN": "3 2", "BUDGET_S": "1000000"}   # no stage cut for time

    def study(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "experiments/gpu/quality_study.sh"], cwd=REPO_ROOT, env={**env, **extra},
                              capture_output=True, text=True)

    def rows() -> list[dict]:
        result = json.loads((tmp_path / "results" / "quality" / "cpu_dry.json").read_text())
        assert result["jobs_done"] == result["jobs_total"] == 8 and result["config"]["clip_steps"] == [3, 2]
        return [r for r in result["tables"]["per seed"] if r["variant"] != "ground_truth"]

    first = study()
    assert first.returncode == 0, first.stdout + first.stderr
    assert "compile probe" not in first.stdout and not (tmp_path / "results" / "quality_compile").exists()
    before = rows()
    assert not any("restarted_from" in r for r in before)
    again = study(PLAN="")
    assert again.returncode == 2 and "holds an earlier study" in again.stderr
    again = study(RESUME="1", PLAN="")
    assert again.returncode == 2 and "RESUME=1 needs PLAN" in again.stderr
    again = study(RESUME="1", DETERMINISTIC="yes")
    assert again.returncode == 2 and "DETERMINISTIC=yes must be 0 or 1" in again.stderr
    again = study(RESUME="1", PROXY="huge", DRY="0")
    assert again.returncode == 2 and "PROXY=huge must be small or large" in again.stderr
    again = study(RESUME="1", RECIPE=str(tmp_path / "absent.json"))
    assert again.returncode == 2 and "absent.json is not a file: pass a recipe JSON" in again.stderr
    path = tmp_path / "results" / "quality" / "cpu_dry.json"
    cut = json.loads(path.read_text())          # seed 1's rows lost, as if its calls had not published them
    cut["tables"]["per seed"] = [r for r in cut["tables"]["per seed"] if r["seed"] != 1]
    path.write_text(json.dumps({**cut, "jobs_done": 4}))
    again = study(RESUME="1")
    assert again.returncode == 0, again.stdout + again.stderr
    after = rows()
    for b, a in zip(before, after):
        if b["seed"] == 0:                      # held by the result: kept as they were
            assert {k: v for k, v in a.items() if k != "ran_in"} == b and a["ran_in"]["commit"] == cut["commit"]
            continue
        assert a["restarted_from"].endswith(f"checkpoints/step_{b['steps']}.pt") and a["init_step"] == b["steps"]
        assert (a["final_weights"], a["text_alignment"]) == (b["final_weights"], b["text_alignment"])
        assert a["final_loss"] == b["final_loss"]   # a finished run re-scored keeps its logged loss (not nan)


def test_gpu_study_script_spreads_a_study_over_machines(tmp_path):
    """MAX_RUNS=2 trains the first two runs; a fresh machine (RUNS gone) with RESUME=1 and the result JSON alone
    keeps them and trains the rest."""
    env = {**os.environ, "DRY": "1", "RESULTS": str(tmp_path / "results"), "RUNS": str(tmp_path / "runs"),
           "WANDB_MODE": "disabled", "PLAN": "3 0", "BUDGET_S": "1000000"}   # one clip: runs independent

    def study(**extra: str) -> dict:
        done = subprocess.run(["bash", "experiments/gpu/quality_study.sh"], cwd=REPO_ROOT, env={**env, **extra},
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads((tmp_path / "results" / "quality" / "cpu_dry.json").read_text())

    first = study(MAX_RUNS="2")
    assert first["jobs_done"] == 2 < first["jobs_total"]
    shutil.rmtree(tmp_path / "runs")
    full = study(RESUME="1")
    assert full["jobs_done"] == full["jobs_total"]
    rows = [r for r in full["tables"]["per seed"] if r["variant"] != "ground_truth"]
    assert [r.get("ran_in", {}).get("commit") for r in rows[:2]] == [first["commit"]] * 2
    assert not any("ran_in" in r for r in rows[2:])


def test_a_continued_study_names_a_grid_that_lacks_the_kept_runs_after_the_variants_it_shows(tmp_path, monkeypatch):
    """Runs kept from an earlier call have no samples here: a grid of the runs sampled now is named after their
    variants and leaves the earlier call's full grid alone; with every finished run sampled it takes the plain name;
    with no model sampled (a continued call before its first run ends) no grid is written."""
    grids = []
    monkeypatch.setattr(protocol, "save_grid", lambda path, rows: grids.append((path.name, rows)) or True)

    def row(variant, seed, samples):
        r = {"variant": variant, "frames": 4, "seed": seed, "status": "ok", "text_alignment": 0.5,
             "temporal_consistency": 0.5, "motion_error": 0.1, "flickering": 0.9, "frame_consistency": 0.9}
        return {**r, "samples": torch.zeros(1, 4, 3, 8, 8)} if samples else r
    truth = [{**row("ground_truth", 0, True), "captions": ["c"]}]

    def publish(rows):
        grids.clear()
        protocol.publish("quality", "s", tmp_path, {}, rows, truth, 4, {"_4f": 4})
        return [name for name, _ in grids]
    assert publish([row("dense", 0, False), row("dsa", 0, False)]) == []
    assert publish([row("dense", 0, False), row("swin", 0, True), row("swin", 1, True)]) == ["s_4f_samples_swin.png"]
    assert [r["variant"] for r in grids[0][1]] == ["ground_truth", "dense", "swin", "swin"]
    assert publish([row("dense", 0, True), row("swin", 0, True)]) == ["s_4f_samples.png"]
