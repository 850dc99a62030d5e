"""Labelled progress lines (megaslide/train/progress.py) and Trainer.fit's choice of them over a tqdm bar."""
import io
import re

import pytest

from megaslide.train.progress import ProgressLines
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

LINE = re.compile(r"\[(?P<label>[^\]]+)\] step (?P<step>\d+)/(?P<total>\d+) \((?P<pct>\d+)%\)(?P<rest>.*), \d+ s")


def _lines(label: str, total: int, initial: int = 0, losses: bool = False) -> list[re.Match]:
    out = io.StringIO()
    with ProgressLines(label, total, initial, stream=out) as bar:
        for step in range(initial + 1, total + 1):
            if losses:
                bar.set_postfix(loss=f"{1 / step:.4f}")
            bar.update(1)
    return [LINE.fullmatch(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize("total, initial, steps", [(300, 0, [30, 60, 90, 120, 150, 180, 210, 240, 270, 300]),
                                                   (25, 0, [3, 5, 8, 10, 13, 15, 18, 20, 23, 25]),
                                                   (3, 0, [1, 2, 3]),              # under ten steps: every step
                                                   (300, 100, [120, 150, 180, 210, 240, 270, 300])])  # resumed
def test_a_line_at_each_tenth_and_at_the_end(total, initial, steps):
    lines = _lines("dsa 16f seed 0", total, initial)
    assert all(lines) and {m["label"] for m in lines} == {"dsa 16f seed 0"}
    assert [int(m["step"]) for m in lines] == steps and {int(m["total"]) for m in lines} == {total}
    assert [int(m["pct"]) for m in lines] == [100 * s // total for s in steps]


def test_a_line_shows_the_last_loss_and_disable_prints_nothing():
    assert [m["rest"] for m in _lines("run", 2, losses=True)] == [" loss 1.0000", " loss 0.5000"]
    out = io.StringIO()
    with ProgressLines("run", 2, disable=True, stream=out) as bar:
        bar.update(2)
    assert out.getvalue() == ""


def test_fit_prints_labelled_lines_and_no_bar(tmp_path, capfd):
    Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=2), tmp_path).fit(label="w0", progress="lines")
    err = capfd.readouterr().err
    assert "\r" not in err                                          # no bar redrawn in place
    lines = [LINE.fullmatch(line) for line in err.splitlines() if "step" in line]
    assert [(m["label"], m["step"], m["rest"].split()[0]) for m in lines] == [("w0", "1", "loss"), ("w0", "2", "loss")]


def test_fit_refuses_an_unknown_progress(tmp_path):
    trainer = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=1), tmp_path)
    with pytest.raises(ValueError, match="progress='dots' must be 'bar'"):
        trainer.fit(progress="dots")
    assert trainer.step == 0
