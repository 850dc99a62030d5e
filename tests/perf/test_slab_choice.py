"""execution.slab_frames=auto: the planner takes the fewest balanced frame slabs whose step fits the HBM budget
(megaslide/perf/slab_choice.py), and both engines train over the slabs it chose."""
import dataclasses

import pytest
import torch

from megaslide.config import SLAB_AUTO, DataConfig, ExecutionConfig, OffloadConfig, RunConfig, TrainConfig, from_dict
from megaslide.models.chunking import BlockRunner
from megaslide.models.slabs import frame_slabs
from megaslide.offload import engine as engine_module
from megaslide.perf import planner
from megaslide.perf.slab_choice import choose_slab_frames, slab_candidates
from megaslide.train import trainer as trainer_module
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

GRID = (32, 4, 4)   # token frames, rows, columns (8 x 8 px, patch 2); DSA's reach at max_offset 0.5: 4 frames


@pytest.mark.parametrize("frames,sizes", [(1, [0]), (2, [0, 1]), (7, [0, 4, 3, 2, 1]),
                                          (12, [0, 6, 4, 3, 2, 1]), (256, None)])
def test_candidates_are_balanced_slab_counts_largest_first(frames, sizes):
    got = slab_candidates(frames)
    if sizes is not None:
        assert got == sizes
    assert got[0] == 0 and got[-1] == (1 if frames > 1 else 0)
    assert all(a > b for a, b in zip(got[1:], got[2:]))
    counts = [len(frame_slabs(frames, s, 7)) for s in got]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)   # each size a new, larger slab count
    if frames == 256:
        assert got[:5] == [0, 128, 86, 64, 52]


def _run(attention="dsa", frames=GRID[0], slab=SLAB_AUTO, **offload):
    model = dataclasses.replace(tiny_model_cfg(attention, max_offset=0.5) if attention.startswith("dsa")
                                else tiny_model_cfg(attention), depth=3)
    data = DataConfig(frames=frames, height=GRID[1] * 2, width=GRID[2] * 2)
    return RunConfig(model, ExecutionConfig(chunk_tokens=24, slab_frames=slab), data, TrainConfig(batch_size=1),
                     OffloadConfig(enabled=True, **offload))


def test_choice_is_the_first_candidate_that_fits():
    seen = []

    def fits(run):
        seen.append(run.execution.slab_frames)
        return run.execution.slab_frames and run.execution.slab_frames <= 8

    assert choose_slab_frames(_run(), fits).execution.slab_frames == 8
    assert seen == [0, 16, 11, 8]
    assert choose_slab_frames(_run(), lambda run: False).execution.slab_frames == 1   # none: the smallest
    explicit = _run(slab=5)
    assert choose_slab_frames(explicit, fits) is explicit                             # a number is kept


@pytest.mark.parametrize("attention", ["dense", "swin"])
def test_an_attention_of_unbounded_reach_gets_no_slabs(attention):
    assert choose_slab_frames(_run(attention), lambda run: False).execution.slab_frames == 0


def _with_slabs(run, slab):
    return dataclasses.replace(run, execution=dataclasses.replace(run.execution, slab_frames=slab))


def _hbm(run, slab):
    """Planned peak HBM of `run` over slabs of `slab` frames: the offload engine's, or with offload off the
    resident trainer's."""
    if run.offload.enabled:
        return planner.plan_offload(_with_slabs(run, slab), param_dtype=torch.float32).hbm_total
    return planner.plan_resident(_with_slabs(run, slab), autocast=False).hbm_total


def _budget_between(run, larger, smaller):
    """An HBM budget whose usable part holds the plan with `smaller` slabs and not the one with `larger`."""
    low, high = _hbm(run, smaller), _hbm(run, larger)
    assert low < high
    return int((low + high) / 2 / (1 - planner.HBM_MARGIN))


def test_offload_plan_takes_the_fewest_slabs_within_its_hbm_budget():
    run = _run()
    budget = _budget_between(run, 16, 11)
    plan = planner.plan_offload(run, param_dtype=torch.float32, budgets=planner.Budgets(budget, 10 ** 12, "cuda"))
    assert plan.execution.slab_frames == 11 and plan.as_dict()["slab_frames"] == 11
    assert plan.hbm_total == _hbm(run, 11) <= planner.usable_hbm(budget)
    assert "slabs 11" in plan.table()
    roomy = planner.plan_offload(run, param_dtype=torch.float32, budgets=planner.Budgets(10 ** 12, 10 ** 12))
    assert roomy.execution.slab_frames == 0


def test_auto_slabs_need_a_budget():
    with pytest.raises(ValueError, match=r"execution\.slab_frames=auto.*pass budgets="):
        planner.plan_offload(_run(), param_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"execution\.slab_frames=auto.*resident_slabs"):
        planner.plan_resident(_run(), autocast=False)


def test_resident_plan_takes_the_fewest_slabs_within_its_budget():
    run = dataclasses.replace(_run(), offload=OffloadConfig())
    chosen = planner.resident_slabs(run, _budget_between(run, 16, 11), autocast=False)
    assert chosen.execution.slab_frames == 11
    assert planner.plan_resident(chosen, autocast=False).execution.slab_frames == 11


def test_config_takes_auto_and_refuses_other_words():
    assert from_dict(ExecutionConfig, {"slab_frames": "auto"}).slab_frames == SLAB_AUTO
    ExecutionConfig(slab_frames=SLAB_AUTO).validate(tiny_model_cfg("dense").attention)   # resolves to 0 there
    for bad in ("all", -2):
        with pytest.raises(ValueError, match=r"execution\.slab_frames=.* must be >= 0 or auto"):
            from_dict(ExecutionConfig, {"slab_frames": bad}).validate()


def test_a_block_runner_refuses_an_unresolved_auto():
    with pytest.raises(ValueError, match=r"slab_frames=auto is resolved by the training planner"):
        BlockRunner(ExecutionConfig(slab_frames=SLAB_AUTO))


def _trainer(tmp_path, name, slab, offload):
    model_cfg = dataclasses.replace(tiny_model_cfg("dsa", max_offset=0.5), depth=3)
    return Trainer(model_cfg, tiny_data_cfg(frames=GRID[0], height=GRID[1] * 2, width=GRID[2] * 2, shape_size=3),
                   tiny_train_cfg(steps=2, batch_size=1), tmp_path / name, offload_cfg=offload,
                   execution=ExecutionConfig(chunk_tokens=24, slab_frames=slab))


@pytest.mark.parametrize("engine", ["offload", "resident"])
def test_engines_train_over_the_slabs_the_plan_chose(tmp_path, monkeypatch, engine):
    """Under an HBM budget between the plans of 16- and 11-frame slabs, auto trains over 11-frame slabs: the same
    losses, bit for bit, as a run given slab_frames=11."""
    monkeypatch.setenv("MEGASLIDE_CPU_ADAM_BACKEND", "torch")
    offload = OffloadConfig(enabled=engine == "offload", activation_offload=engine == "offload")
    run = dataclasses.replace(_run(), train=tiny_train_cfg(steps=2, batch_size=1), offload=offload)
    budget = _budget_between(run, 16, 11)
    if engine == "offload":
        monkeypatch.setattr(engine_module, "hbm_available_bytes", lambda device, fraction=0.0: budget)
    else:
        monkeypatch.setattr(trainer_module, "hbm_available_bytes", lambda device: budget)
    auto = _trainer(tmp_path, "auto", SLAB_AUTO, offload)
    assert auto.engine.model.runner.execution.slab_frames == auto.execution.slab_frames == 11
    fixed = _trainer(tmp_path, "fixed", 11, offload)
    for _ in range(2):
        a, b = auto.train_step(), fixed.train_step()
        assert torch.equal(a["loss"], b["loss"]) and torch.isfinite(a["loss"])

