"""The planner against the committed H200 results (results/oom_thresholds/h200*.json, written by
experiments/oom_thresholds.py, and results/mfu_overlap/h200*.json): its HBM prediction for each measured
cell, and its step-time lower bound against each timed step (the steps of experiments/planner_error.py, which
reports the fitted estimate's error on them)."""
import json
from pathlib import Path

import pytest
import torch

from experiments.claims import DSA_HEAD_GROUPS
from experiments.planner_error import budgets_recorded, h200_timed_steps, kept_budgets, oom_cell_run
from experiments.results_io import descends_from
from megaslide.perf.planner import Budgets, compute_lower_bound_s, plan_offload, plan_resident

GB = 1e9


# cells the planner misses by more than 10%, each kept as a strict expected failure (so that it is seen, and so that
# the test says when the planner comes within 10%), with the figures behind it
KNOWN_MISSES = {"h200_7B_64f_compact-dsa-chunked_offload-64": "planner 83.2 GB vs 73.9 GB measured (+12.7%): "
                "the 7B preset with boundary_stride 2 and compact state; open in the long-clip issue",
                "h200_headline_256_keep_auto-dsa-chunked_offload-256":
                "planner 138.5 GB vs 122.7 GB measured (+12.8%): selective recompute at 256 frames, 5 blocks' "
                "attention kept on the GPU; open in the long-clip issue",
                "h200_dsa32_chunk65280-dsa-chunked_offload-32":
                "planner 27.5 GB vs 24.8 GB measured (+10.9%): at 8-frame slices the peak is a finishing slice's "
                "backward, which the planner counts as eager autograd keeps it (fp32 norm inputs and outputs); "
                "compiled (train.compile) it keeps less; the planner errs high, on the safe side"}


def _h200_measured_cells():
    """Every cell of the committed H200 OOM tables (results/oom_thresholds/h200*.json) that fit and was measured;
    DSA cells measured before the head-grouped backward, which kept dK/dV scratch for every head, are left out."""
    root = Path(__file__).parents[2]
    for path in sorted(root.glob("results/oom_thresholds/h200*.json")):
        table = json.loads(path.read_text())
        current = descends_from(table.get("commit", ""), DSA_HEAD_GROUPS, root)
        for cell in table["tables"]["cells"]:
            if cell.get("measured_peak_GB") and (current or cell["attention"] != "dsa"):
                name = f"{path.stem}-{cell['attention']}-{cell['mode']}-{cell['frames']}"
                marks = [pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[name])] if name in KNOWN_MISSES else []
                yield pytest.param(table["config"], cell, id=name, marks=marks)


@pytest.mark.parametrize("config,cell", list(_h200_measured_cells()))
def test_hbm_prediction_is_within_ten_percent_of_the_h200_oom_cells(config, cell):
    """The planner, rerun on today's code for each measured H200 cell (1B preset, 1080p latents, bf16),
    lies within 10% of the measured peak; Swin's cells were 7-32% under before its math-path SDPA was
    counted in fp32 (SwinAttention.attend_memory)."""
    run = oom_cell_run(config, cell)
    if cell["mode"] == "resident":
        plan = plan_resident(run, autocast=True)
    else:
        plan = plan_offload(run, param_dtype=torch.bfloat16, budgets=kept_budgets(run, cell))
    assert plan.hbm_total / GB == pytest.approx(cell["measured_peak_GB"], rel=0.10)


@pytest.mark.parametrize("step", [pytest.param(s, id=s.name) for s in h200_timed_steps()])
def test_lower_bound_never_exceeds_a_measured_h200_step(step):
    """The lower bound, at the ceilings the run measured, lies below the step it timed (bf16: the lighter
    transfers, so the bound holds for an fp32 run too); the compute bound alone does for the resident trainer.
    A selective-recompute run that recorded no budgets is bounded with room for every block's kept attention on
    the device: the least recompute, so a bound no higher than at the placement the run chose."""
    run, ceilings = step.run, step.ceilings
    if run.offload.enabled:
        unrecorded = run.offload.keep_attention != "off" and not budgets_recorded(step.cell)
        budgets = Budgets(hbm=1 << 50, host=1 << 50) if unrecorded else kept_budgets(run, step.cell)
        bound = plan_offload(run, param_dtype=torch.bfloat16, ceilings=ceilings, budgets=budgets).lower_bound_s
    else:
        bound = compute_lower_bound_s(run.model, run.train.batch_size, run.grid, recomputed=run.model.depth,
                                      ceilings=ceilings, execution=run.execution)
    assert 0 < bound <= step.step_s
