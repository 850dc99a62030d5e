"""experiments/planner_error.py: the fitted step-time estimate's error on the committed H200 steps it was not
fitted on, read from the result files, with every other step listed with its reason."""
import dataclasses
import json
import shutil
import statistics

import pytest

from experiments import planner_error
from megaslide.perf.planner import FITTED
from tests.experiments.runner import run_script


@pytest.fixture(scope="module")
def committed():
    return planner_error.held_out_error()


def test_every_timed_step_is_held_out_or_excluded_with_a_reason(committed):
    steps = planner_error.h200_timed_steps()
    used = [name for name, *_ in committed.used]
    excluded = dict(committed.excluded)
    assert sorted(used + list(excluded)) == sorted(s.name for s in steps)     # no step dropped silently
    assert len(used) == len(set(used)) and not set(used) & set(excluded)
    assert all(reason.strip() for reason in excluded.values())
    assert sum(committed.reasons().values()) == len(excluded)
    # the 7B-width DSA cell (its run measured its attention rate) is held out
    assert "h200_7Bwidth_dsa-dsa-chunked_offload-16" in used


def test_fitting_cells_are_excluded(committed):
    steps = planner_error.h200_timed_steps()
    fitting = [s.name for s in steps if any(f.matches(s.file, s.cell) for f in FITTED.step_cells)]
    assert len(fitting) == len(FITTED.step_cells)                # each fitting cell is among the steps
    excluded = dict(committed.excluded)
    assert all(excluded[name].startswith("fitted on it") for name in fitting)


def test_median_and_max_are_those_of_the_held_out_errors(committed):
    errors = [e / s - 1 for _, e, s in committed.used]
    assert committed.median_abs == pytest.approx(statistics.median(abs(e) for e in errors))
    name, worst = committed.worst
    assert abs(worst) == max(abs(e) for e in errors) and name in dict((n, e) for n, e, _ in committed.used)
    text = planner_error.report(committed)
    assert f"{len(committed.used)} held-out H200 steps" in text and f"excluded ({len(committed.excluded)})" in text


def test_the_error_is_read_from_the_files(tmp_path, committed):
    """Halving a held-out cell's measured step in a copy of the results doubles estimate / measured there."""
    for folder in ("oom_thresholds", "mfu_overlap"):
        (tmp_path / folder).mkdir()
        for path in (planner_error.RESULTS / folder).glob("h200*.json"):
            shutil.copy(path, tmp_path / folder)
    path = tmp_path / "oom_thresholds" / "h200_dense_wall.json"
    data = json.loads(path.read_text())
    (cell,) = [c for c in data["tables"]["cells"] if c.get("step_s")]
    cell["step_s"] /= 2
    path.write_text(json.dumps(data))
    changed = planner_error.held_out_error(tmp_path)
    name = "h200_dense_wall-dense-chunked_offload-32"
    before, after = ({n: (e, s) for n, e, s in h.used}[name] for h in (committed, changed))
    assert after[1] == before[1] / 2 and after[0] == pytest.approx(before[0])
    assert after[0] / after[1] == pytest.approx(2 * before[0] / before[1])
    assert changed.excluded == committed.excluded


def test_a_selective_recompute_step_is_estimated_within_the_budgets_its_run_recorded(tmp_path, committed):
    """The 7B-width run that kept attention recorded no budgets: excluded with that reason. A copy that records
    them (room for every block's kept attention on the device, as the run placed it) is held out."""
    name = "h200_7Bwidth_d20_keep-overlap"
    assert dict(committed.excluded)[name].startswith("selective recompute whose run recorded no budgets")
    (tmp_path / "mfu_overlap").mkdir()
    data = json.loads((planner_error.RESULTS / "mfu_overlap" / "h200_7Bwidth_d20_keep.json").read_text())
    assert data["plan"]["kept_attention"]["recompute"] == [] and "budgets" not in data
    data["budgets"] = {"budget_GB": 140.0, "host_budget_GB": 110.0}
    (tmp_path / "mfu_overlap" / "h200_7Bwidth_d20_keep.json").write_text(json.dumps(data))
    held = planner_error.held_out_error(tmp_path)
    assert [n for n, *_ in held.used] == [name] and held.excluded == []


def test_a_folder_without_h200_steps_holds_out_nothing(tmp_path):
    empty = planner_error.held_out_error(tmp_path)
    assert empty.used == [] and empty.excluded == [] and planner_error.report(empty).startswith("no held-out")


def test_each_step_is_planned_with_the_engine_backward_that_ran_it():
    """Steps measured before the engine's slab-wise block gradient are planned without it: their estimate is the
    older backward's, and it is longer (more forwards) than the same run planned with block_grad."""
    steps = {s.name: s for s in planner_error.h200_timed_steps()}
    old = steps["h200_headline_256-dsa-chunked_offload-256"]
    new = steps["h200_headline_256_compiled-dsa-chunked_offload-256"]
    assert not old.block_grad and new.block_grad
    with_block_grad = planner_error.estimate_s(dataclasses.replace(old, block_grad=True))
    assert planner_error.estimate_s(old) > with_block_grad


def test_the_command_reports_the_folder_it_is_given(tmp_path, committed):
    """`python -m experiments.planner_error results=DIR` (Hydra) reads DIR: the repository's steps by default, and
    no step at all from an empty folder."""
    out = run_script(["-m", "experiments.planner_error"])
    assert out.startswith(f"step-time estimate on {len(committed.used)} held-out H200 steps")
    assert f"excluded ({len(committed.excluded)})" in out
    assert run_script(["-m", "experiments.planner_error", f"results={tmp_path}"]).startswith("no held-out H200 step")


def test_compiled_elementwise_figure_reproduces_the_step_it_was_fitted_on():
    """FITTED.elementwise_bytes_compiled: today's estimate of the compiled cell it was fitted on equals that cell's
    measured step (to the figure's rounding), and an eager estimate of the same step is slower (eager moves more)."""
    (fitted,) = FITTED.elementwise_compiled_fitted_on
    (step,) = [s for s in planner_error.h200_timed_steps() if fitted.matches(s.file, s.cell)]
    assert step.run.train.compile
    assert planner_error.estimate_s(step) == pytest.approx(step.step_s, rel=0.01)
    eager = dataclasses.replace(step, run=dataclasses.replace(step.run, train=dataclasses.replace(
        step.run.train, compile=False)))
    assert planner_error.estimate_s(eager) > 1.2 * step.step_s
