"""experiments/compact_state.py end to end at its smoke size, its verdict rule, and its refusals."""
import pytest

from experiments import compact_state
from experiments.compact_state import verdict
from tests.experiments.runner import load_result, run_script
from tests.experiments.test_bad_input import run_main


@pytest.mark.slow
def test_compact_state_smoke_writes_curves_summary_and_verdicts(tmp_path):
    stdout = run_script(["-m", "experiments.compact_state", "smoke=true", f"out_dir={tmp_path}/runs",
                         f"wandb.dir={tmp_path}/runs"], tmp_path)
    record = load_result(tmp_path, "compact_state", "smoke")
    assert {"command", "commit", "hardware", "date", "rule"} <= record.keys()
    summary = {r["variant"]: r for r in record["summary"]}
    assert summary.keys() == {"fp32", "both"}
    assert summary["fp32"]["host_bytes_per_param"] == 16 and summary["both"]["host_bytes_per_param"] == 6.125
    assert summary["fp32"]["rel_diff"] == 0 and summary["fp32"]["verdict"] == "pass"
    assert all(len(curve) == record["steps"] == 4 for curve in record["curves"].values())
    run = next(r for r in record["runs"] if r["variant"] == "both")
    assert run["final_loss"] == pytest.approx(sum(record["curves"]["both_seed0"][-2:]) / 2)
    assert "verdict" in stdout and "rule: pass when" in stdout


def test_verdict_is_within_tolerance_either_way():
    assert verdict(0.0099, 0.01) == verdict(-0.01, 0.01) == "pass"
    assert verdict(0.0101, 0.01) == verdict(-0.02, 0.01) == "fail"


@pytest.mark.parametrize("args,message", [
    (["variants=[both]"], "variants=['both']: choose among ['fp32', 'bf16_master', 'int8_moments', 'both'], fp32"),
    (["tail=5000"], "tail=5000 exceeds train.steps=1000"),
    (["offload=none"], "use offload=engine"),
    (["offload.moments=int4"], "offload.moments='int4': choose one of ['fp32', 'int8']"),
])
def test_bad_settings_are_refused_before_anything_is_written(args, message, tmp_path, monkeypatch, capsys):
    err = run_main(compact_state, ["out_dir=runs/x", *args], tmp_path, monkeypatch, capsys)
    assert message in err
    assert list(tmp_path.iterdir()) == []


def test_gpu_preset_composes_a_valid_study():
    from hydra import compose, initialize_config_dir

    from experiments.compact_state import CompactStateConfig
    from experiments.hydra_config import CONF_DIR, run_config, script_config
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("compact_state", overrides=["compact_preset=gpu"])
    run, study = run_config(cfg, check_device=False), script_config(CompactStateConfig, cfg)
    study.check_run(run)
    assert run.train.device == "cuda" and run.train.steps >= 1000 and run.offload.enabled
    assert study.results_name == "h200" and len(study.seeds) == 3 and study.variants[0] == "fp32"
