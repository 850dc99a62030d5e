"""experiments/wan_step.py: train.py's run, timed on a synthetic clip, from random init and from a folder."""
import dataclasses
import json

import pytest

from megaslide.models.dit import VideoDiT
from tests.experiments.runner import load_result, run_script
from tests.helpers import tiny_model_cfg

TINY = ["model=tiny", "model.block=wan", "offload=engine", "data.frames=4", "data.height=16", "data.width=16",
        "warmup=1", "timed=2", "train.batch_size=1", "name=smoke"]


@pytest.mark.parametrize("start", ["random", "pretrained"])
def test_times_steps_of_the_run_and_plans_it(tmp_path, start):
    more = ["offload.init_on_host=false"]
    if start == "pretrained":
        VideoDiT(dataclasses.replace(tiny_model_cfg(), block="wan")).save_pretrained(tmp_path / "wan")
        more = [f"model.pretrained={tmp_path / 'wan'}"]
    out = run_script(["-m", "experiments.wan_step", *TINY, *more, f"hydra.run.dir={tmp_path}"],
                     results_dir=tmp_path / "results")
    result = load_result(tmp_path / "results", "wan_step", "smoke")
    assert "step_s" in out and len(result["losses"]) == 3 and all(loss > 0 for loss in result["losses"])
    assert result["tokens"] == 4 * 8 * 8 and result["plan_host_GB"] > 0 and result["peak_host_rss_GB"] > 0
    assert any(o.startswith("model=") for o in result["run_overrides"])


def test_a_cpu_run_is_a_trial_that_leaves_results_alone(tmp_path, monkeypatch):
    """With no MEGASLIDE_RESULTS_DIR, a CPU run writes under runs/wan_step/<name>/results/, never results/."""
    from experiments import wan_step
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEGASLIDE_RESULTS_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr("experiments.results_io.RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["wan_step.py", *TINY, "offload.init_on_host=false"])
    wan_step.main()
    trial = tmp_path / "runs" / "wan_step" / "smoke" / "results" / "wan_step" / "smoke.json"
    assert len(json.loads(trial.read_text())["losses"]) == 3
    assert not (tmp_path / "results").exists()
