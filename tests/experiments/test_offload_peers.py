"""experiments/offload_peers.py: the smoke run (CPU, gloo) and its refusal of a bad key."""
import importlib.util
import math
import sys

import pytest

import experiments.offload_peers as offload_peers
from experiments.report import render
from tests.experiments.runner import load_result, run_script

pytestmark = pytest.mark.slow


def test_smoke_rows_start_alike_and_record_every_step(tmp_path):
    run_script(["-m", "experiments.offload_peers", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    record = load_result(tmp_path, "offload_peers", "smoke")
    rows = {r["peer"]: r for r in record["rows"]}
    assert list(rows) == ["ours", "fsdp2", "deepspeed"] and record["complete"]
    steps = record["script"]["warmup_steps"] + record["script"]["timed_steps"]
    ours, fsdp2 = rows["ours"], rows["fsdp2"]
    for r in (ours, fsdp2):
        assert r["status"] == "ok", r
        assert len(r["losses"]) == len(r["grad_norms"]) == steps
        assert all(math.isfinite(v) for v in r["losses"] + r["grad_norms"])
        assert r["losses"][0] == r["step0_loss"] and r["timed_steps"] == 5
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
    # the same initial weights, the same batch and loss, and step 0's gradient within the stated tolerance
    assert fsdp2["init_weight_sum"] == pytest.approx(ours["init_weight_sum"], rel=1e-12)
    assert fsdp2["step0_loss_ours"] == ours["step0_loss"] and fsdp2["step0_match"] is True
    assert fsdp2["step0_loss_rel_diff"] <= record["tolerances"]["loss_rtol"]
    assert fsdp2["step0_grad_norm_rel_diff"] <= record["tolerances"]["grad_norm_rtol"]
    assert "pin_memory=False" in fsdp2["setup"]            # no accelerator: said in the row
    assert fsdp2["step_s_vs_ours"] == pytest.approx(fsdp2["step_s"] / ours["step_s"])
    assert fsdp2["mfu_vs_measured_peak"] == pytest.approx(
        record["model_flops_per_step"] / fsdp2["step_s"] / (record["ceilings"]["matmul_TFLOPs"] * 1e12))
    if importlib.util.find_spec("deepspeed") is None:
        assert rows["deepspeed"]["status"] == "skipped"
        assert "pip install -e '.[peers]'" in rows["deepspeed"]["reason"]
    else:
        assert rows["deepspeed"] == {"peer": "deepspeed", "status": "skipped",
                                     "reason": "DeepSpeed ZeRO-3 offload needs a CUDA device"}
    page = render("offload_peers", tmp_path).read_text()   # the generic results page shows the rows
    assert "| peer | " in page and "| fsdp2 | " in page


def test_results_page_of_no_runs_is_none(tmp_path):
    assert render("offload_peers", tmp_path) is None


def test_too_few_timed_steps_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the bad key was not refused first")

    for stage in ("matmul_tflops", "run_isolated", "ExperimentRun"):
        monkeypatch.setattr(offload_peers, stage, must_not_run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", [offload_peers.__file__, "smoke=true", "timed_steps=2"])
    with pytest.raises(SystemExit) as exit_:
        offload_peers.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: timed_steps=2") and "at least 5" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_row_whose_step_0_differs_from_ours_fails_untimed():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.hydra_config import CONF_DIR, RUN_GROUPS, run_config

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.merge(compose("offload_peers"), offload_peers.SMOKE)
    run = run_config({k: OmegaConf.to_container(cfg[k]) for k in RUN_GROUPS})
    spec = offload_peers.RowSpec("ours", run, 1, 5, {"step0_loss": 1.0, "step0_grad_norm": 1.0}, 0.02, 0.05)
    row = offload_peers.run_row(spec)
    assert row["status"] == "failed" and row["step0_match"] is False and "step_s" not in row
    assert row["step0_loss_ours"] == 1.0 and row["losses"] == [row["step0_loss"]] != [1.0]
