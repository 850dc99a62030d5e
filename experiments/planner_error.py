"""The planner's fitted step-time estimate against the committed H200 training steps it was not fitted on.

    python -m experiments.planner_error                      # the repository's results/
    python -m experiments.planner_error results=DIR          # another results folder

The steps (`h200_timed_steps`): every timed cell of results/oom_thresholds/h200*.json and every variant of
results/mfu_overlap/h200*.json, each planned again with today's planner at the ceilings its run measured
(matmul, PCIe each way, HBM copy, and the attention rate of its model, attention and chunking where the run
measured one; the planner's defaults for the rest). tests/experiments/test_planner_h200_cells.py checks the
lower bound on the same steps. Every step is held out (its |estimate / measured - 1| counted) unless a reason
excludes it, and every excluded step is listed with its reason (`exclusion`):
- a cell a figure of the estimate was fitted on (`megaslide.perf.planner.FITTED`: one eager step, one compiled);
- the serial ablation (overlap off): the estimate is of the overlapped step;
- a DSA step whose run measured no attention rate: the estimate would take the default DSA rate, timed on
  another run's kernel build, not the kernel this step ran;
- a selective-recompute step whose run recorded no budgets: which blocks' attention today's planner would keep
  depends on them.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from experiments.hydra_config import run_of, script_main
from experiments.report import result_files
from experiments.results_io import REFERENCE_GPU, descends_from, ran_on
from megaslide.config import AttentionConfig, DiTConfig, ExecutionConfig, OffloadConfig, RunConfig, SLAB_AUTO, from_dict
from megaslide.device import precision_dtype
from megaslide.models.dit import DIT_PRESETS
from megaslide.perf.planner import (FITTED, AttentionRate, Budgets, Ceilings, compute_seconds, grid_run,
                                   plan_offload)

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCK_GRAD = "257f6d4"  # the merge from which the offload engine's streamed blocks use BlockRunner.block_grad


@dataclass(frozen=True)
class TimedStep:
    """One committed training step with its measured time, as the planner plans it."""

    name: str               # file stem and cell: "h200_1B-dsa-offload-8", "h200_7Bwidth_d20-overlap"
    file: str               # the result, under results/
    cell: dict              # the oom_thresholds cell or the mfu_overlap variant, as recorded
    run: RunConfig
    ceilings: Ceilings      # measured by its run where it could be
    attention_measured: bool  # the run measured its attention rate (in `ceilings`)
    step_s: float
    block_grad: bool        # the engine that ran took streamed blocks' gradients from block_grad (BLOCK_GRAD)


@dataclass(frozen=True)
class HeldOutError:
    """The estimate's relative error (estimate / measured - 1) on the held-out steps, and the excluded ones."""

    used: list[tuple[str, float, float]]     # (name, estimate s, measured s)
    excluded: list[tuple[str, str]]         # (name, reason)

    def reasons(self) -> dict[str, int]:
        """How many steps each kind of reason excludes (a reason's words before its first colon)."""
        return dict(Counter(reason.split(":")[0] for _, reason in self.excluded))

    @property
    def errors(self) -> list[float]:
        return [estimate / step - 1 for _, estimate, step in self.used]

    @property
    def median_abs(self) -> float:
        return statistics.median(abs(e) for e in self.errors)

    @property
    def worst(self) -> tuple[str, float]:
        """The held-out step of the largest |error|, with its signed error."""
        return max(((name, e) for (name, *_), e in zip(self.used, self.errors)), key=lambda ne: abs(ne[1]))


def cell_model(name: str) -> DiTConfig:
    """The DiT of an oom_thresholds model name: a preset ("1B"), or a preset's width at a depth
    ("7B width, depth 23")."""
    preset, _, depth = name.partition(" width, depth ")
    return dataclasses.replace(DIT_PRESETS[preset], depth=int(depth)) if depth else DIT_PRESETS[preset]


def measured_ceilings(recorded: dict, attention: AttentionRate | None = None) -> Ceilings:
    """The ceilings a run measured (matmul, PCIe each way alone, HBM copy), the defaults for what it did not."""
    default, pcie = Ceilings(), recorded.get("pcie") or {}
    return Ceilings(tflops=recorded["matmul_TFLOPs"], h2d_GBps=pcie.get("h2d_GBps", default.h2d_GBps),
                    d2h_GBps=pcie.get("d2h_GBps", default.d2h_GBps),
                    hbm_TBps=(recorded.get("hbm_copy_GBps") or 1e3 * default.hbm_TBps) / 1e3, attention=attention)


def measured_rate(recorded: dict, model: str, attention: str, chunked: bool) -> AttentionRate | None:
    """The attention rate an oom_thresholds run measured for (model, attention, chunked); None if it did not."""
    rate = next((r for r in recorded.get("attention") or [] if (r["model"], r["attention"], r["chunked"]) ==
                 (model, attention, chunked) and "error" not in r), None)
    return rate and AttentionRate(rate["forward_tflops"], rate["backward_tflops"])


def oom_cell_run(config: dict, cell: dict) -> RunConfig:
    """The run of an oom_thresholds cell: from the train.py overrides it records (`run_overrides`), or for a cell
    written before the scripts composed train.py's config, from its table's flat keys. A cell run with
    execution.slab_frames=auto gets the slab size it ran with (its `slab_frames`, what the planner chose then)."""
    if "run_overrides" in cell:
        run = run_of(cell["run_overrides"])
        if run.execution.slab_frames != SLAB_AUTO:
            return run
        return dataclasses.replace(run, execution=dataclasses.replace(run.execution, slab_frames=cell["slab_frames"]))
    chunked = cell["mode"] == "chunked_offload"
    cfg = dataclasses.replace(cell_model(cell["model"]), attention=AttentionConfig(cell["attention"]))
    execution = ExecutionConfig(chunk_tokens=config["chunk_tokens"] if chunked else 0,
                                slab_frames=cell.get("slab_frames", 0), checkpoint_blocks=True)
    offload = OffloadConfig(enabled=cell["mode"] != "resident", activation_offload=chunked)
    return grid_run(cfg, cfg.token_grid(cell["frames"], config["height"], config["width"]),
                    batch=config["batch"], execution=execution, offload=offload)


def h200_timed_steps(results_dir: Path = RESULTS) -> list[TimedStep]:
    """Every committed H200 training step with its measured time: the OOM tables' timed cells and the
    mfu_overlap variants."""
    steps = []
    for path in result_files("oom_thresholds", results_dir):
        table = json.loads(path.read_text())
        if table.get("plan_only") or not ran_on(table, REFERENCE_GPU):
            continue
        config = table["config"]
        for cell in table["tables"]["cells"]:
            if not cell.get("step_s"):
                continue
            chunked = cell["mode"] == "chunked_offload"
            run = oom_cell_run(config, cell)
            rate = measured_rate(table["ceilings"], cell["model"], cell["attention"], chunked)
            steps.append(TimedStep(f"{path.stem}-{cell['attention']}-{cell['mode']}-{cell['frames']}",
                                   f"oom_thresholds/{path.name}", cell, run, measured_ceilings(table["ceilings"], rate),
                                   rate is not None, cell["step_s"], descends_from(table["commit"], BLOCK_GRAD)))
    for path in result_files("mfu_overlap", results_dir):
        result = json.loads(path.read_text())
        if not ran_on(result, REFERENCE_GPU):
            continue
        cfg, bench = from_dict(DiTConfig, result["model_cfg"]), result["bench"]
        execution = ExecutionConfig(chunk_tokens=result["model_cfg"].get("chunk_tokens", 0))
        for variant in result["variants"]:
            if "run_overrides" in variant:
                run = run_of(variant["run_overrides"])
            else:
                offload = OffloadConfig(enabled=True, optimizer_device=variant["optimizer_device"],
                                        resident_blocks=bench.get("resident_blocks", 0))
                run = grid_run(cfg, cfg.token_grid(bench["frames"], bench["height"], bench["width"]),
                               batch=bench["batch"], grad_clip=variant["grad_clip"], execution=execution,
                               offload=offload)
            cell = {**variant, **result.get("budgets", {})}  # the budgets its kept attention was placed within
            steps.append(TimedStep(f"{path.stem}-{variant['variant']}", f"mfu_overlap/{path.name}", cell, run,
                                   measured_ceilings(result["ceilings"]), False, variant["step_s"],
                                   descends_from(result["commit"], BLOCK_GRAD)))
    return steps


PLACES = ("gpu", "host", "recompute")   # where a block's kept attention went (offload.keep_attention)


def budgets_recorded(cell: dict) -> bool:
    """Whether a step recorded the budgets its kept attention was placed within (`kept_budgets` reads them)."""
    return "budget_GB" in cell and bool({"host_budget_GB", "predicted_host_GB"} & set(cell))


def kept_budgets(run: RunConfig, cell: dict) -> Budgets | None:
    """The budgets a selective-recompute run (an oom_thresholds cell, or an mfu_overlap variant with its result's
    `budgets`) placed its kept attention within: the free HBM it recorded and its host budget, or for a cell that
    did not record that, its planned host total (the placement had filled the host budget to within one block);
    None for a run that kept nothing."""
    if run.offload.keep_attention == "off":
        return None
    host = cell["host_budget_GB"] if "host_budget_GB" in cell else cell["predicted_host_GB"]
    return Budgets(hbm=int(cell["budget_GB"] * 1e9), host=int(host * 1e9))


def estimate_s(step: TimedStep) -> float:
    """Today's step-time estimate of the step (bf16, as the H200 runs trained): the offload plan's, of the
    engine's backward as it ran then (with or without block_grad), or for the resident trainer its compute (every
    block checkpointed, so recomputed)."""
    run = step.run
    if run.offload.enabled:
        plan = plan_offload(run, param_dtype=precision_dtype("auto", torch.device("cuda")), ceilings=step.ceilings,
                            block_grad=step.block_grad, budgets=kept_budgets(run, step.cell))
        recorded = step.cell.get("kept_attention")
        if recorded and [recorded[k] for k in PLACES] != [list(getattr(plan.kept, k)) for k in PLACES]:
            raise ValueError(f"{step.name}: today's planner keeps the attention of blocks "
                             f"{ {k: list(getattr(plan.kept, k)) for k in PLACES} }, the run kept "
                             f"{ {k: recorded[k] for k in PLACES} }; its estimate would be of another step")
        return plan.estimate_s
    _, compute = compute_seconds(run.model, run.train.batch_size, run.grid, recomputed=run.model.depth,
                                 ceilings=step.ceilings, execution=run.execution, compiled=run.train.compile)
    return sum(compute.values())


def exclusion(step: TimedStep) -> str | None:
    """Why the step is not held out (module docstring), or None: it is."""
    for figure in ("elementwise_fitted_on", "elementwise_compiled_fitted_on"):
        if any(f.matches(step.file, step.cell) for f in getattr(FITTED, figure)):
            return f"fitted on it: FITTED.{figure} (megaslide/perf/planner.py)"
    if step.run.offload.keep_attention != "off" and not budgets_recorded(step.cell):
        return ("selective recompute whose run recorded no budgets: the blocks whose attention today's planner "
                "would keep, and so its estimate, are unknown")
    if step.cell.get("overlap") is False:
        return "the serial ablation (overlap off): the estimate is of the overlapped step"
    if step.run.model.attention.name == "dsa" and not step.attention_measured:
        files = ", ".join(sorted({f.file for f in FITTED.dsa_rate_measured_on}))
        return (f"DSA step whose run measured no attention rate: the estimate's default DSA rate was timed on "
                f"another run's kernel build ({files}), not the kernel this step ran")
    return None


def held_out_error(results_dir: Path = RESULTS) -> HeldOutError:
    """The estimate against every committed H200 step it was not fitted on; every other step with its reason."""
    used, excluded = [], []
    for step in h200_timed_steps(results_dir):
        reason = exclusion(step)
        if reason:
            excluded.append((step.name, reason))
        else:
            used.append((step.name, estimate_s(step), step.step_s))
    return HeldOutError(used, excluded)


def report(h: HeldOutError) -> str:
    if not h.used:
        return f"no held-out H200 step; excluded ({len(h.excluded)})"
    name, worst = h.worst
    lines = [f"step-time estimate on {len(h.used)} held-out H200 steps: median |error| {100 * h.median_abs:.0f}%, "
             f"max {100 * abs(worst):.0f}% ({name}, estimate {'over' if worst > 0 else 'under'} the step)"]
    lines += [f"  {n:<48} estimate {e:8.2f} s  measured {s:8.2f} s  {100 * (e / s - 1):+5.0f}%" for n, e, s in h.used]
    lines += [f"excluded ({len(h.excluded)}):"] + [f"  {n:<48} {reason}" for n, reason in h.excluded]
    return "\n".join(lines)


@script_main("planner_error")
def main(cfg: DictConfig) -> None:
    folder = Path(cfg.results) if cfg.results else RESULTS
    if not folder.is_dir():
        raise ValueError(f"results={cfg.results} is not a folder; pass the folder that holds oom_thresholds/ and "
                         f"mfu_overlap/ (the repository's results/ when results is unset)")
    print(report(held_out_error(folder)))


if __name__ == "__main__":
    main()
