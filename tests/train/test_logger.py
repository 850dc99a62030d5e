"""RunLogger: what reaches W&B (a stand-in module records it) and what is written with W&B disabled."""
import json
import sys
import types

from megaslide.train.logger import RunLogger


class FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.summary, self.dir = init, [], {}, init["dir"] + "/wandb/run-x/files"

    def log(self, values, step=None):
        self.logged.append(values)

    def finish(self):
        pass


def fake_wandb(monkeypatch):
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: FakeRun(**kw)
    mod.Table = lambda columns, data: ("table", columns, data)
    mod.Image = lambda path: ("image", path)
    mod.Settings = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "wandb", mod)


def test_tables_images_and_summary_reach_wandb(tmp_path, monkeypatch):
    fake_wandb(monkeypatch)
    logger = RunLogger(tmp_path, config={"heads": 2}, mode="offline")
    logger.log_table("sweep", [{"variant": "dense", "ms": 1.5}, {"variant": "dsa", "grid": [4, 8], "peak": None}])
    logger.log_image("plot", tmp_path / "p.png")
    logger.summary({"speedup": 2.0})
    run = logger.run
    assert run.init["config"] == {"heads": 2} and run.init["mode"] == "offline"
    assert run.init["settings"] == {"silent": True}            # W&B's banners are off unless asked for
    assert run.logged[0] == {"sweep": ("table", ["variant", "ms", "grid", "peak"],
                                       [["dense", 1.5, None, None], ["dsa", None, "[4, 8]", None]])}
    assert run.logged[1] == {"plot": ("image", str(tmp_path / "p.png"))}
    assert run.summary == {"speedup": 2.0}
    assert logger.wandb_dir == str(tmp_path / "wandb" / "run-x")
    logger.finish()
    monkeypatch.setenv("WANDB_SILENT", "false")
    assert RunLogger(tmp_path / "loud", mode="offline").run.init["settings"] == {"silent": False}


def test_disabled_writes_nothing_for_wandb(tmp_path):
    logger = RunLogger(tmp_path, mode="disabled")
    logger.log_table("t", [{"a": 1}])
    logger.log_image("i", tmp_path / "missing.png")
    logger.summary({"a": 1})
    logger.finish()
    assert logger.wandb_dir is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_metrics_hold_one_run_fresh_or_resumed(tmp_path):
    """A fresh run empties metrics.jsonl; a resumed run keeps the rows up to its resume checkpoint (the
    first row of that step), so the steps it trains again and a re-run evaluation are not listed twice
    (a line cut off by a crash goes too)."""
    first = RunLogger(tmp_path, mode="disabled")
    for step in (1, 2, 3, 4):
        first.log({"loss": 1.0}, step)
    first.log({"eval/score": 1.0}, 4)           # logged after the checkpoint of step 4
    first.finish()
    finished = RunLogger(tmp_path, mode="disabled", resume_step=4)   # a finished run, evaluated again
    assert finished.last_train == {"step": 4, "loss": 1.0}           # what its training logged last
    finished.log({"eval/score": 1.0}, 4)
    finished.finish()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][3:] == [
        {"step": 4, "loss": 1.0}, {"step": 4, "eval/score": 1.0}]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    resumed = RunLogger(tmp_path, mode="disabled", resume_step=2)
    resumed.log({"loss": 0.5}, 3)
    assert resumed.last_train == {"step": 3, "loss": 0.5}
    resumed.finish()
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3]
    fresh = RunLogger(tmp_path, mode="disabled")
    fresh.log({"loss": 0.1}, 1)
    fresh.finish()
    assert _steps(tmp_path / "metrics.jsonl") == [1]


def test_a_column_of_mixed_kinds_reaches_a_real_wandb_table_as_text(tmp_path, monkeypatch):
    """W&B's Table refuses a column whose cells change type (offset_stats' per-block rows, then block "all"): such
    a column goes as text, other columns keep their type."""
    import wandb
    fake_wandb(monkeypatch)
    sys.modules["wandb"].Table = wandb.Table     # the real table, with its type checks
    logger = RunLogger(tmp_path, mode="offline")
    rows = [{"block": 0, "p50": 0.5}, {"block": 1, "p50": None}, {"block": "all", "p50": 0.7}]
    logger.log_table("blocks", rows)
    table = logger.run.logged[0]["blocks"]
    assert table.data == [["0", 0.5], ["1", None], ["all", 0.7]]
