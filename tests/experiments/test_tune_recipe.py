"""Recipes tuned on validation clips (experiments/tune_recipe.py, experiments/recipe.py) and read by quality.py."""
import dataclasses
import hashlib
import json
import re
import shutil
import sys

import pytest

import experiments.quality
import experiments.quality_protocol as protocol
import experiments.tune_recipe
from experiments.recipe import candidate_means, choose, read_recipe, tuned_for
from megaslide.config import DataConfig, DiTConfig, TrainConfig
from tests.experiments.test_bad_input import run_main

TINY = ["train.steps=2", "n_eval=2", "train.sample_steps=1", "data.height=8", "data.width=8", "data.shape_size=4",
        "data.speed=2", "data.frames=4", "data.num_videos=8", "train.batch_size=2", "sample_batch=2"]


def _run(seed, variant, lr, ta, tc=0.5, warmup=10, status="ok"):
    return {"variant": variant, "seed": seed, "lr": lr, "warmup_steps": warmup, "status": status,
            "text_alignment": ta, "temporal_consistency": tc}


def test_choose_takes_the_best_mean_validation_caption_match_per_variant():
    rows = [_run(0, "dsa", 1e-3, 0.9), _run(1, "dsa", 1e-3, 0.5),        # mean 0.7
            _run(0, "dsa", 3e-3, 0.8), _run(1, "dsa", 3e-3, 0.8),        # mean 0.8: chosen
            _run(0, "swin", 1e-3, 0.3, tc=0.4), _run(0, "swin", 3e-4, 0.3, tc=0.6),   # tie on TA: the higher TC
            _run(0, "dense", 1e-3, 0.2), _run(0, "dense", 3e-4, 0.2),    # tie on both: the lower lr
            _run(0, "dense", 1e-2, 0.99, status="failed: NaN"),          # a failed run never wins
            _run(0, "dsa_zero", 1e-3, 0.0, status="OOM")]                # nothing finished: no recipe
    recipe = {r["variant"]: r for r in choose(candidate_means(rows), truth_ta=1.0)}
    assert set(recipe) == {"dsa", "swin", "dense"}
    assert (recipe["dsa"]["lr"], recipe["dsa"]["seeds"]) == (3e-3, 2)
    assert recipe["dsa"]["val_text_alignment"] == pytest.approx(0.8) and recipe["dsa"]["learned"]
    assert recipe["swin"]["lr"] == 3e-4 and not recipe["swin"]["learned"]     # 0.3 < half of 1.0
    assert recipe["dense"]["lr"] == 3e-4


def test_choose_breaks_a_tie_between_swin_windows_by_the_smaller_window():
    rows = [{**_run(0, "swin", 1e-3, 0.7), "window": [4, 8, 8]}, {**_run(0, "swin", 1e-3, 0.7), "window": [2, 8, 8]},
            {**_run(0, "swin", 1e-3, 0.6), "window": [2, 4, 4]}, _run(0, "dense", 1e-3, 0.5)]
    candidates = candidate_means(rows)
    assert [c.get("window") for c in candidates] == [[4, 8, 8], [2, 8, 8], [2, 4, 4], None]
    recipe = {r["variant"]: r for r in choose(candidates, truth_ta=1.0)}
    assert recipe["swin"]["window"] == [2, 8, 8] and recipe["swin"]["learned"] and "window" not in recipe["dense"]


def _recipe_file(tmp_path, **change):
    data, model = DataConfig(frames=4, height=8, width=8), DiTConfig()
    config = {"val_seed": 20011, "eval_seed": 10007, "tuned_for": tuned_for(data, model, 100, 4), **change}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"config": config, "recipe": [{"variant": "dsa", "lr": 3e-3, "warmup_steps": 50}]}))
    return str(path), tuned_for(data, model, 100, 4)


def test_read_recipe_gives_each_variant_its_candidate(tmp_path):
    path, expected = _recipe_file(tmp_path)
    assert read_recipe(path, ["dsa"], expected, eval_seed=10007) == {"dsa": {"lr": 3e-3, "warmup_steps": 50}}


@pytest.mark.parametrize("case, message", [
    ("no file", "is not a file; pass a recipe JSON written by experiments/tune_recipe.py"),
    ("not json", "is not JSON"),
    ("unfinished", "holds no finished recipe"),
    ("tuned on the test clips", "was tuned on clips of data seed 10007, this study's eval_seed"),
    ("other steps", "was tuned for other training (steps: 100 vs 200)"),
    ("other data", "data.speed: 2.0 vs 3.0"),
    ("missing variant", "has no recipe for ['swin']"),
])
def test_read_recipe_refuses_what_it_was_not_tuned_for(tmp_path, case, message):
    path, expected = _recipe_file(tmp_path, **({"val_seed": 10007} if case == "tuned on the test clips" else {}))
    variants = ["dsa", "swin"] if case == "missing variant" else ["dsa"]
    if case == "no file":
        path = str(tmp_path / "absent.json")
    elif case == "not json":
        (tmp_path / "recipe.json").write_text("{")
    elif case == "unfinished":
        (tmp_path / "recipe.json").write_text(json.dumps({"config": {"val_seed": 1}, "jobs_done": 1}))
    elif case == "other steps":
        expected = {**expected, "steps": 200}
    elif case == "other data":
        expected = {**expected, "data": {**expected["data"], "speed": 3.0}}
    with pytest.raises(ValueError, match="recipe=") as err:
        read_recipe(path, variants, expected, eval_seed=10007)
    assert message in str(err.value)


def test_tuning_never_samples_the_test_clips_and_the_study_trains_with_its_recipe(tmp_path, monkeypatch):
    """Every clip tuning samples or scores is a validation clip (val_seed), never a test clip (eval_seed); the
    recipe it writes sets each variant's lr and warm-up in quality.py's runs."""
    seeds = []
    real_eval_set = protocol.eval_set
    monkeypatch.setattr(protocol, "eval_set", lambda data, n, seed: seeds.append(seed) or real_eval_set(data, n, seed))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["tune_recipe.py", f"out_dir={tmp_path}/tune", *TINY, "variants=[dense,dsa]",
                                      "lrs=[1e-3,2e-3]", "warmups=[0,5]"])
    experiments.tune_recipe.main()
    assert seeds and set(seeds) == {20011}                     # val_seed only: eval_seed 10007 never drawn
    path = tmp_path / "tune" / "results" / "quality_recipe" / "cpu_tiny.json"
    result = json.loads(path.read_text())
    assert result["jobs_done"] == result["jobs_total"] == 8     # 2 variants x 2 lrs x 2 warm-ups x 1 seed
    assert len(result["tables"]["candidates"]) == 8
    assert {r["variant"] for r in result["recipe"]} == {"dense", "dsa"}
    assert {(r["lr"], r["warmup_steps"]) for r in result["tables"]["per seed"] if r["variant"] == "dsa"} == {
        (1e-3, 0), (1e-3, 5), (2e-3, 0), (2e-3, 5)}

    jobs = []
    monkeypatch.setattr(experiments.quality, "run_study", lambda experiment, cfg, js, *rest, **kw: jobs.extend(js))
    monkeypatch.setattr(sys, "argv", ["quality.py", f"out_dir={tmp_path}/study", *TINY, "variants=[dense,dsa]",
                                      "clip_frames=[4]", "seeds=[0,1]", f"recipe={path}"])
    experiments.quality.main()
    chosen = {r["variant"]: (r["lr"], r["warmup_steps"]) for r in result["recipe"]}
    assert len(jobs) == 4 and all((j["train"].lr, j["train"].warmup_steps) == chosen[j["attention"]] for j in jobs)


def test_a_candidate_that_diverges_is_a_tuning_result_not_a_failed_tuning(tmp_path, monkeypatch, capsys):
    """A learning rate too high for a variant ends its run with a non-finite loss: that candidate is recorded as
    diverged and left out of the choice, the other candidates still choose the recipe, and the script succeeds."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    argv = [f"out_dir={tmp_path}/tune", *TINY, "train.steps=4", "variants=[dense]", "lrs=[1e6,1e-3]", "warmups=[0]"]
    monkeypatch.setattr(sys, "argv", ["tune_recipe.py", *argv])
    experiments.tune_recipe.main()
    result = json.loads((tmp_path / "tune" / "results" / "quality_recipe" / "cpu_tiny.json").read_text())
    status = {r["lr"]: r["status"] for r in result["tables"]["per seed"] if r.get("variant") == "dense"}
    assert status[1e-3] == "ok" and status[1e6].startswith("diverged: step ") and "not finite" not in status[1e-3]
    assert [(r["variant"], r["lr"]) for r in result["recipe"]] == [("dense", 1e-3)]
    assert re.search(r"^dense lr 1e\+06 warm-up 0 seed \d+: diverged: step \d+", capsys.readouterr().out, re.M)


BAD = {
    "no lrs": (["lrs=[]"], "lrs=[] must be a non-empty list of learning rates > 0"),
    "negative lr": (["lrs=[-1e-3]"], "lrs=[-0.001] must be a non-empty list of learning rates > 0"),
    "lrs not a list": (["lrs=1e-3"], "lrs=0.001 must be a list"),
    "fractional warm-up": (["warmups=[1.5]"], "warmups=[1.5] must be a non-empty list of integers >= 0"),
    "negative max_runs": (["max_runs=-1"], "max_runs=-1 must be an integer >= 0"),
    "a window of two sides": (["swin_windows=[[4,8]]"], "swin_windows=[[4, 8]] must be a list of (t, h, w) windows"),
    "a zero window": (["swin_windows=[[0,8,8]]"], "swin_windows=[[0, 8, 8]] must be a list of (t, h, w) windows"),
    "swin_windows not a list": (["swin_windows=4"], "swin_windows=4 must be a list"),
    "validation on the test clips": (["val_seed=10007"], "val_seed=10007 equals eval_seed=10007"),
    "validation on the training clips": (["val_seed=0"], "val_seed=0 equals eval_seed=10007 or data.seed=0"),
}


@pytest.mark.parametrize("kind", BAD)
def test_tune_recipe_refuses_bad_candidates_before_writing_anything(kind, tmp_path, monkeypatch, capsys):
    args, message = BAD[kind]
    err = run_main(experiments.tune_recipe, ["out_dir=runs/x", "train.steps=1", *args], tmp_path, monkeypatch, capsys)
    assert message in err
    assert list(tmp_path.iterdir()) == []


def test_continue_runs_without_a_result_says_that_every_run_starts(tmp_path, monkeypatch, capsys):
    """continue_runs=true where results_dir holds no earlier result (a fresh machine the result was not copied to)
    runs from the beginning, and says so with the path it looked at, before the first run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["tune_recipe.py", f"out_dir={tmp_path}/tune", f"results_dir={tmp_path}/res",
                                      *TINY, "variants=[dense]", "lrs=[1e-3,2e-3]", "warmups=[0]",
                                      "continue_runs=true", "max_runs=1"])
    experiments.tune_recipe.main()
    out = capsys.readouterr().out
    expected = f"continue_runs=true: no result at {tmp_path}/res/quality_recipe/cpu_tiny.json to continue"
    assert expected in out and out.index(expected) < out.index("| variant |")
    done = json.loads((tmp_path / "res" / "quality_recipe" / "cpu_tiny.json").read_text())
    assert (done["jobs_done"], done["jobs_total"]) == (1, 2)


def test_continue_runs_keeps_the_runs_the_result_holds_and_runs_the_rest(tmp_path, monkeypatch, capsys):
    """max_runs=1 runs the first run only, and writes no recipe. A tuning cut short on a machine that is gone:
    continue_runs=true with only its result JSON runs just the runs it lacks, keeps the others as they were
    (marked with the commit that ran them), and chooses the recipe over all; a result of other settings is
    refused, naming continue_runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    argv = ["tune_recipe.py", f"out_dir={tmp_path}/tune", f"results_dir={tmp_path}/res", *TINY, "variants=[dense]",
            "lrs=[1e-3,2e-3]", "warmups=[0]"]
    monkeypatch.setattr(sys, "argv", [*argv, "max_runs=1"])            # one call's share of the runs
    experiments.tune_recipe.main()
    path = tmp_path / "res" / "quality_recipe" / "cpu_tiny.json"
    first = json.loads(path.read_text())
    assert (first["jobs_done"], first["jobs_total"]) == (1, 2) and "recipe" not in first
    assert [r["lr"] for r in first["tables"]["per seed"] if r.get("variant") == "dense"] == [1e-3]
    monkeypatch.setattr(sys, "argv", argv)
    experiments.tune_recipe.main()
    full = json.loads(path.read_text())
    cut = {**{k: v for k, v in full.items() if k != "recipe"}, "jobs_done": 1,
           "tables": {**full["tables"], "per seed": [r for r in full["tables"]["per seed"] if r.get("lr") != 2e-3]}}
    path.write_text(json.dumps(cut))
    shutil.rmtree(tmp_path / "tune")                                    # a fresh machine: no run folders
    ran = []
    real = protocol.run_jobs
    monkeypatch.setattr(protocol, "run_jobs",
                        lambda jobs, *a, **k: ran.extend(jobs) or real(jobs, *a, **k))
    monkeypatch.setattr(sys, "argv", [*argv, "continue_runs=true"])
    experiments.tune_recipe.main()
    assert [j["train"].lr for j in ran] == [2e-3]
    again = json.loads(path.read_text())
    assert again["jobs_done"] == again["jobs_total"] == 2 and again["recipe"]
    rows = {r["lr"]: r for r in again["tables"]["per seed"] if r.get("variant") == "dense"}
    kept = {k: v for k, v in rows[1e-3].items() if k != "ran_in"}
    assert kept == next(r for r in full["tables"]["per seed"] if r.get("lr") == 1e-3)
    assert rows[1e-3]["ran_in"] == {"commit": full["commit"], "date": full["date"], "hardware": full["hardware"]}
    assert full["hardware"]["cpu_cores"] > 0 and "ran_in" not in rows[2e-3]   # the machine that ran it, recorded
    ran.clear()                                                         # a grid extended: only the new candidate
    monkeypatch.setattr(sys, "argv", [*argv[:-2], "lrs=[1e-3,2e-3,4e-3]", "warmups=[0]", "continue_runs=true"])
    experiments.tune_recipe.main()
    assert [j["train"].lr for j in ran] == [4e-3]
    extended = json.loads(path.read_text())
    assert extended["jobs_done"] == extended["jobs_total"] == 3 and extended["config"]["lrs"] == [1e-3, 2e-3, 4e-3]
    assert [r["lr"] for r in extended["tables"]["candidates"]] == [1e-3, 2e-3, 4e-3]
    monkeypatch.setattr(sys, "argv", [*argv[:-2], "lrs=[1e-3,3e-3]", "warmups=[0]", "continue_runs=true"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        experiments.tune_recipe.main()
    err = capsys.readouterr().err
    assert re.search(r"continue_runs=true: .* other settings \(lrs\); pass another results_name", err)


def test_swin_windows_extend_a_tuning_and_the_study_trains_swin_at_the_recipe_window(tmp_path, monkeypatch, capsys):
    """swin_windows adds Swin windows to a tuning's candidates: continued, only the new window's runs train (the
    earlier Swin runs, at swin_window, keep their names); Swin's recipe row carries its window, and quality.py
    builds Swin with it and records it, or refuses a command-line swin_window that differs from it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    argv = ["tune_recipe.py", f"out_dir={tmp_path}/tune", f"results_dir={tmp_path}/res", *TINY,
            "variants=[dense,swin]", "lrs=[1e-3]", "warmups=[0]"]
    monkeypatch.setattr(sys, "argv", argv)
    experiments.tune_recipe.main()
    ran = []
    real = protocol.run_jobs
    monkeypatch.setattr(protocol, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs) or real(jobs, *a, **k))
    monkeypatch.setattr(sys, "argv", [*argv, "swin_windows=[[4,4,4],[2,4,4]]", "continue_runs=true"])
    experiments.tune_recipe.main()
    assert [(j["attention"], j["model"].attention.options.window, j["tag"]) for j in ran] == [
        ("swin", (4, 4, 4), "tune_recipe_lr0.001_w0_win4x4x4")]
    path = tmp_path / "res" / "quality_recipe" / "cpu_tiny.json"
    result = json.loads(path.read_text())
    assert result["config"]["swin_windows"] == [[4, 4, 4]] and result["jobs_done"] == result["jobs_total"] == 3
    assert sorted(c["window"] for c in result["tables"]["candidates"] if c["variant"] == "swin") == [[2, 4, 4],
                                                                                                     [4, 4, 4]]
    swin = next(r for r in result["recipe"] if r["variant"] == "swin")
    assert swin["window"] in ([2, 4, 4], [4, 4, 4])
    swin["window"] = [4, 4, 4]                    # as if the new window had won: the study must build Swin with it
    path.write_text(json.dumps(result))

    studies = []
    monkeypatch.setattr(experiments.quality, "run_study",
                        lambda experiment, cfg, js, truth, config, grids, **kw: studies.append((js, config, kw)))
    study = ["quality.py", f"out_dir={tmp_path}/study", *TINY, "variants=[dense,swin]", "clip_frames=[4]",
             f"recipe={path}"]
    monkeypatch.setattr(sys, "argv", study)
    experiments.quality.main()
    jobs, config, kw = studies[0]
    assert {j["attention"]: j["model"].attention.options.window for j in jobs if j["attention"] == "swin"} == {
        "swin": (4, 4, 4)}
    assert config["swin_window"] == [4, 4, 4] and config["recipe"]["swin"]["window"] == [4, 4, 4]
    assert kw["per_run"] == ("recipe", "swin_window")
    monkeypatch.setattr(sys, "argv", [*study, "swin_window=[2,4,4]"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        experiments.quality.main()
    assert "swin_window=[2, 4, 4] differs from the recipe's Swin window [4, 4, 4]" in capsys.readouterr().err


def test_held_runs_lets_per_run_keys_differ_and_keeps_only_rows_of_the_same_settings(tmp_path):
    """A study continued under a changed recipe (one variant's lr) keeps the rows of the variants whose settings are
    unchanged and trains the changed one again; without per_run, or where another config key differs, it refuses."""
    def job(variant, lr):
        return {"attention": variant, "model": DiTConfig(), "data": DataConfig(), "tag": "s",
                "train": TrainConfig(seed=0, lr=lr), "n_eval": 2, "eval_seed": 1, "n_train_eval": 0}
    before = [job("dense", 1e-3), job("swin", 1e-3)]
    rows = [{"run": name, "status": "ok", "settings": protocol.settings_digest(j)}
            for name, j in zip(protocol.job_names(before), before)]
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"config": {"recipe": {"swin": {"lr": 1e-3}}, "seeds": [0]},
                                "tables": {"per seed": rows}, "commit": "c", "date": "d", "hardware": {}}))
    after = [job("dense", 1e-3), job("swin", 3e-3)]
    config = {"recipe": {"swin": {"lr": 3e-3}}, "seeds": [0]}
    kept = protocol.held_runs(path, config, after, per_run=("recipe",))
    assert list(kept) == protocol.job_names(after)[:1] and kept[rows[0]["run"]]["ran_in"]["commit"] == "c"
    with pytest.raises(ValueError, match=r"other settings \(recipe\)"):
        protocol.held_runs(path, config, after)
    with pytest.raises(ValueError, match=r"other settings \(seeds\)"):
        protocol.held_runs(path, {**config, "seeds": [1]}, after, per_run=("recipe",))



def test_a_setting_added_since_digests_is_left_out_at_its_old_value():
    """A row of a run made before an attention option existed still matches a job that leaves the option at the
    value those runs had (ADDED_SINCE_DIGESTS): the digest equals one hashed without the option. Any other value
    of it is another setting."""
    def job(**options):
        model = DiTConfig(attention=DiTConfig().attention.for_variant("dsa", **options))
        return {"attention": "dsa", "model": model, "data": DataConfig(), "tag": "s", "train": TrainConfig(),
                "n_eval": 2, "eval_seed": 1, "n_train_eval": 0}
    default, cuda = job(), job(halo_kernel="cuda", halo_reach=1)
    assert protocol.settings_digest(job(halo_reach=1)) != protocol.settings_digest(cuda)
    model = dataclasses.asdict(default["model"])
    del model["attention"]["options"]["halo_kernel"]                  # as a run before the option hashed it
    train = {k: v for k, v in dataclasses.asdict(TrainConfig()).items() if k not in protocol.BOOKKEEPING}
    what = {"model": model, "data": dataclasses.asdict(DataConfig()), "train": train, "attention": "dsa",
            "n_eval": 2, "eval_seed": 1, "n_train_eval": 0}
    old = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert protocol.settings_digest(default) == old
