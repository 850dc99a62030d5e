"""experiments/wan_step.py: train.py's run, timed on a synthetic clip, from random init and from a folder."""
import dataclasses

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
