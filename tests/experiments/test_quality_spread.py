"""A quality study spread over calls and machines (quality.py continue_runs + max_runs): the runs its result JSON
holds are kept, only runs of the same settings, and a progressive run never continues a checkpoint that is gone."""
import json
import shutil
import sys

import pytest

import experiments.quality
from tests.experiments.test_bad_input import run_main
from tests.experiments.test_tune_recipe import TINY


def _study(tmp_path, monkeypatch, *args: str) -> list[dict]:
    """quality.py in this process with TINY sizes and `args`; the jobs it trained, in order."""
    ran = []
    real = experiments.quality_protocol.run_jobs
    monkeypatch.setattr(experiments.quality_protocol, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs)
                        or real(jobs, *a, **k))
    monkeypatch.setattr(sys, "argv", ["quality.py", f"out_dir={tmp_path}/runs", f"results_dir={tmp_path}/res", *TINY,
                                      "variants=[dense,dsa]", "seeds=[0]", "save_mp4=false", *args])
    experiments.quality.main()
    return ran


def _result(tmp_path) -> dict:
    return json.loads((tmp_path / "res" / "quality" / "cpu_tiny.json").read_text())


def test_a_study_spread_over_machines_keeps_what_its_result_holds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    ran = _study(tmp_path, monkeypatch, "clip_frames=[4]", "max_runs=1")          # one call's share
    assert [j["attention"] for j in ran] == ["dense"]
    first = _result(tmp_path)
    assert (first["jobs_done"], first["jobs_total"]) == (1, 2)
    shutil.rmtree(tmp_path / "runs")                                              # a fresh machine
    ran = _study(tmp_path, monkeypatch, "clip_frames=[4]", "continue_runs=true")
    assert [j["attention"] for j in ran] == ["dsa"]
    done = _result(tmp_path)
    assert done["jobs_done"] == done["jobs_total"] == 2
    rows = {r["variant"]: r for r in done["tables"]["per seed"]}
    assert {k: v for k, v in rows["dense"].items() if k != "ran_in"} == first["tables"]["per seed"][0]
    assert rows["dense"]["ran_in"]["commit"] == first["commit"] and "ran_in" not in rows["dsa"]
    # a run of other settings (the result config does not name train.lr) is not kept: it trains again
    shutil.rmtree(tmp_path / "runs")
    ran = _study(tmp_path, monkeypatch, "clip_frames=[4]", "continue_runs=true", "train.lr=2e-3")
    assert [j["attention"] for j in ran] == ["dense", "dsa"]


def test_a_progressive_run_never_continues_a_checkpoint_that_is_gone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    clips = ["clip_frames=[4,8]", "progressive=true", "clip_steps=[2,1]", "variants=[dense]"]
    _study(tmp_path, monkeypatch, *clips, "max_runs=1")                           # the short clip only
    shutil.rmtree(tmp_path / "runs")                                              # its checkpoint gone with it
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _study(tmp_path, monkeypatch, *clips, "continue_runs=true")
    err = capsys.readouterr().err
    assert "continues quality4f_dense_seed0, which the result holds but whose final checkpoint" in err
    assert "is not on this machine" in err


@pytest.mark.parametrize("value", ["-1", "true", "1.5"])
def test_max_runs_must_be_a_count(value, tmp_path, monkeypatch, capsys):
    err = run_main(experiments.quality, ["out_dir=runs/x", "train.steps=1", f"max_runs={value}"], tmp_path,
                   monkeypatch, capsys)
    assert f"max_runs={value if value != 'true' else 'True'} must be an integer >= 0" in err
    assert list(tmp_path.iterdir()) == []
