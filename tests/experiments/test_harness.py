"""experiments/harness.py: the W&B run beside the result file."""
import json
import os
import subprocess
import sys

import pytest

from experiments import results_io
from experiments.harness import ExperimentRun
from tests.experiments.runner import REPO_ROOT


class RecordingLogger:
    wandb_dir = "runs/x/wandb/offline-run-1"

    def __init__(self):
        self.tables, self.scalars, self.images, self.finished = {}, None, {}, False

    def log_table(self, key, rows):
        self.tables[key] = rows

    def summary(self, values):
        self.scalars = values

    def log_image(self, key, path):
        self.images[key] = path

    def finish(self):
        self.finished = True


def test_experiment_run_logs_every_table_and_records_the_wandb_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASLIDE_RESULTS_DIR", str(tmp_path / "results"))
    run = ExperimentRun("bench", "smoke", {"heads": 2}, out_dir=tmp_path / "runs")
    assert json.loads(run.save({"partial": True}).read_text())["wandb_dir"] is None  # WANDB_MODE=disabled
    assert not (tmp_path / "runs" / "bench" / "smoke" / "wandb").exists()
    run.logger = RecordingLogger()
    payload = {"rows": [{"a": 1}], "tables": {"sweep": [{"b": 2}]}, "summary": {"x": 1.0}}
    path = run.finish(payload, {"x": 1.0}, {"plot": tmp_path / "p.png"})
    assert run.logger.tables == {"rows": [{"a": 1}], "sweep": [{"b": 2}]}
    assert run.logger.scalars == {"x": 1.0} and run.logger.images == {"plot": tmp_path / "p.png"}
    assert run.logger.finished
    assert json.loads(path.read_text())["wandb_dir"] == RecordingLogger.wandb_dir


def test_a_trial_run_writes_under_its_run_folder_unless_told(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGASLIDE_RESULTS_DIR", raising=False)
    trial = ExperimentRun("bench", "smoke", {}, out_dir=tmp_path / "runs", trial=True)
    assert trial.result_path == tmp_path / "runs" / "bench" / "smoke" / "results" / "bench" / "smoke.json"
    assert trial.save({}) == trial.result_path and trial.result_path.is_file()
    assert ExperimentRun("bench", "table", {}, out_dir=tmp_path / "runs").result_path == \
        results_io.RESULTS_DIR / "bench" / "table.json"        # a full run publishes
    monkeypatch.setenv("MEGASLIDE_RESULTS_DIR", str(tmp_path / "mine"))
    assert ExperimentRun("bench", "smoke", {}, out_dir=tmp_path / "runs", trial=True).result_path == \
        tmp_path / "mine" / "bench" / "smoke.json"             # asked for: anywhere, results/ too


def test_a_plan_only_run_leaves_the_tracked_results_alone(tmp_path):
    """`oom_thresholds plan_only=true` from a user's folder: the result and its page under runs/, none in results/."""
    env = {k: v for k, v in os.environ.items() if k != "MEGASLIDE_RESULTS_DIR"}
    done = subprocess.run([sys.executable, "-m", "experiments.oom_thresholds", "plan_only=true", "smoke=true",
                           "name=trial_check"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**env, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    results = tmp_path / "runs" / "oom_thresholds" / "trial_check" / "results"
    assert (results / "oom_thresholds" / "trial_check.json").is_file() and (results / "oom_thresholds.md").is_file()
    assert not (results_io.RESULTS_DIR / "oom_thresholds" / "trial_check.json").exists()
    status = subprocess.run(["git", "status", "--porcelain", "--", "results"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout
    assert "oom_thresholds" not in status


def test_a_wandb_failure_at_finish_keeps_the_result(tmp_path, monkeypatch):
    """finish writes the result before W&B sees its tables, so a W&B error cannot lose a finished measurement."""
    monkeypatch.setenv("MEGASLIDE_RESULTS_DIR", str(tmp_path / "results"))
    run = ExperimentRun("bench", "kept", {}, out_dir=tmp_path / "runs")

    class Failing(RecordingLogger):
        def log_table(self, key, rows):
            raise TypeError("Data row contained incompatible types")

    run.logger = Failing()
    with pytest.raises(TypeError):
        run.finish({"tables": {"t": [{"a": 1}]}}, {})
    assert json.loads(run.result_path.read_text())["tables"] == {"t": [{"a": 1}]}
