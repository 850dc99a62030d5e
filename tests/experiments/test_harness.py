"""experiments/harness.py: the W&B run beside the result file."""
import json

from experiments.harness import ExperimentRun


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
