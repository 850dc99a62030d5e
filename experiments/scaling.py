"""Scaling (paper claim C9: on an H100 NVL, models up to 33.3B train; asynchronous streaming makes
the forward 2.11x faster at 28.4B).

For each preset of `presets`, smallest first: does an offloaded training step fit the full HBM
and a `cap_GB` cap (an H100 NVL's 94 GB, emulated with the per-process memory fraction,
offload.gpu_memory_fraction), and how much faster is the streamed forward (no grad) with
overlapped H2D than serially (the same work, synchronised after every piece). The planner's
predictions stand beside each: host RAM, peak HBM, and the forward's overlapped and serial estimates
(max and sum of its compute and weight H2D at the planner's ceilings). A preset that host RAM
cannot hold is not run: its row holds the planner's figures only, marked `predicted`. Each run
is a fresh process with a time limit (experiments/step_runs.run_isolated); on CPU, which
has no HBM to run out of, the fits decisions are the planner's against the stated
`hbm_budget_GB` and `cap_GB`. With `plan_only` nothing is run or measured: every row holds the
planner's figures only, against the stated `hbm_budget_GB`, `host_budget_GB` and `cap_GB`.
Every run is one of train.py's config: the script's own (its RunConfig groups: `python -m experiments.scaling
attention=swin data.frames=16` as on train.py) with `model=<preset>` and, under the cap,
`offload.gpu_memory_fraction` (hydra_config.compose_run); each row records them (`run_overrides`,
`cap_run_overrides`), so `python -m experiments.plan <them>` plans that run.
Writes results/scaling/<name>.json (tables: presets) and the W&B run (harness.ExperimentRun).

    python -m experiments.scaling                      # GPU: presets up to what host RAM holds
    python -m experiments.scaling smoke=true           # tiny on CPU, plus the planner's 105B row
    python -m experiments.scaling plan_only=true hbm_budget_GB=146.8 host_budget_GB=125   # planner only
"""
from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.harness import ExperimentRun, pcie_ceiling, progress
from experiments.hydra_config import (base_overrides, compose_run, require_ranges, script_config, script_main,
                                      train_overrides, trial_preset)
from experiments.step_runs import Step, clip_fields, non_finite, run_isolated, synthetic_batch
from megaslide.config import RunConfig
from megaslide.device import precision_dtype
from megaslide.models.dit import DIT_PRESETS, count_params
from megaslide.offload.engine import OffloadEngine
from megaslide.perf import planner
from megaslide.perf.flops import dit_flops
from megaslide.perf.memory import hbm_available_bytes, host_available_bytes
from megaslide.perf.timing import matmul_tflops, sync, timed

GB = 1e9
SMOKE = {"presets": ["tiny", "105B"], "data": {"frames": 4, "height": 16, "width": 16}, "hbm_budget_GB": 1.0,
         "cap_GB": 0.005, "forward_repeats": 5, "matmul_n": 128, "pcie_probe_MiB": 4}


@dataclass(frozen=True)
class ScalingConfig:
    """The keys of experiments/conf/scaling.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    plan_only: bool
    presets: list[str]
    cap_GB: float
    warmup_steps: int
    forward_repeats: int
    cell_time_limit_s: float
    hbm_budget_GB: float
    host_budget_GB: float
    matmul_n: int
    pcie_probe_MiB: int
    wandb_dir: str
    wandb_project: str

    moved_keys: ClassVar[dict[str, str]] = {
        "frames": "data.frames", "height": "data.height", "width": "data.width", "batch": "train.batch_size",
        "precision": "train.precision"}   # RunConfig fields now, taken as on train.py

    def validate(self) -> None:
        unknown = [p for p in self.presets if p not in DIT_PRESETS]
        if unknown:
            raise ValueError(f"presets has unknown {unknown}; known: {sorted(DIT_PRESETS)}")
        if not self.cap_GB > 0:
            raise ValueError(f"cap_GB={self.cap_GB} must be > 0 (94 for an H100 NVL)")
        require_ranges(self, positive=("forward_repeats", "cell_time_limit_s", "matmul_n", "pcie_probe_MiB"),
                       non_negative=("warmup_steps", "hbm_budget_GB", "host_budget_GB"))
        if self.plan_only and (self.hbm_budget_GB <= 0 or self.host_budget_GB <= 0):
            raise ValueError(f"plan_only=true needs the stated budgets: hbm_budget_GB={self.hbm_budget_GB} and "
                             f"host_budget_GB={self.host_budget_GB} must be > 0 (an H200: 146.8 and 125)")


@dataclass(frozen=True)
class Job(Step):
    """One run of one preset: the training step under the full HBM (and the forward's timing), or under the cap
    (on CUDA its run's offload.gpu_memory_fraction)."""

    cap_GB: float | None      # None: the full HBM
    warmup_steps: int
    forward_repeats: int
    hbm_budget: int           # bytes (CPU: the stated full HBM)


def forward_estimates(plan: planner.OffloadPlan, ceilings: planner.Ceilings | None = None) -> dict:
    """The streamed forward's estimated time: overlapped = max(compute, weight H2D), serial = their sum;
    compute as the planner counts one forward pass (attention at its own rate, planner.compute_seconds;
    default ceilings: the planner's)."""
    ceilings = ceilings or planner.Ceilings()
    _, parts = planner.compute_seconds(plan.cfg, plan.batch, plan.grid, recomputed=0, ceilings=ceilings, backward=False,
                                       execution=plan.execution)
    compute = sum(parts.values())
    weights = plan.cfg.depth * planner.block_layout(plan.cfg).numel * plan.param_dtype.itemsize
    h2d = weights / (ceilings.h2d_GBps * 1e9)
    return {"predicted_forward_overlap_s": max(compute, h2d), "predicted_forward_serial_s": compute + h2d,
            "predicted_forward_speedup": (compute + h2d) / max(compute, h2d)}


def hbm_budget(device: torch.device, job: Job) -> int:
    """HBM a run may use: free memory (under the run's offload.gpu_memory_fraction) on CUDA, the stated budgets
    on CPU."""
    if device.type == "cpu":
        return int(job.cap_GB * GB) if job.cap_GB else job.hbm_budget
    return hbm_available_bytes(device, job.run.offload.gpu_memory_fraction)


def cap_changes(cap_GB: float, ceilings: dict | None) -> list[str]:
    """The cap as a change of the run: the memory fraction of the measured card's total HBM (CUDA); none on CPU,
    where the planner decides against cap_GB."""
    total = (ceilings or {}).get("hbm_total_GB")
    return [f"offload.gpu_memory_fraction={min(1.0, cap_GB / total)}"] if total else []


def run_job(job: Job, queue) -> None:
    """In a fresh process: plan; unless the planner refuses, build the engine, time the forward (full
    HBM only) and run warm-up steps plus one (their losses in `losses`): fits, OOM (phase) or a
    non-finite loss, and the measured peak."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = precision_dtype(job.run.train.precision, device)
    plan = planner.plan_offload(job.run, param_dtype=dtype)
    budget = hbm_budget(device, job)
    row = {"predicted_peak_GB": plan.hbm_total / GB, "budget_GB": budget / GB,
           "predicted_fits": plan.hbm_total <= planner.usable_hbm(budget)}
    if not row["predicted_fits"] and device.type == "cpu":
        queue.put({**row, "status": "OOM", "phase": "plan"})
        return
    run, lr = job.run, job.run.train.lr
    engine, losses = None, []
    try:
        engine = OffloadEngine.from_config(run.model, device=device, train_cfg=job.train_config(device),
                                           offload_cfg=run.offload, grid=run.grid, execution=run.execution)
        batch = synthetic_batch(run, device, engine.model.tokenizer)
        if job.cap_GB is None:
            for overlap in (True, False):
                engine.set_mode(overlap=overlap, optimizer_device="cpu")
                t = timed(lambda: engine.velocity(batch.x0, batch.t * 1000, batch.context), device, job.forward_repeats)
                row.update({f"forward_{'overlap' if overlap else 'serial'}_s": t.median,
                            f"forward_{'overlap' if overlap else 'serial'}_s_spread": t.max - t.min})
            row["forward_speedup"] = row["forward_serial_s"] / row["forward_overlap_s"]
            engine.set_mode(overlap=True, optimizer_device="cpu")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(job.warmup_steps + 1):
            losses.append(float(engine.train_step(batch, lr)["loss"]))
        sync(device)
        row.update(status="fits", phase="", losses=losses)
    except torch.OutOfMemoryError as err:
        phase = (engine.phase if engine is not None else "") or "build"  # the step's part the engine was in
        row.update(status="OOM", phase=phase.replace(" step", ""), error=str(err).splitlines()[0][:200])
    except FloatingPointError as err:    # the engine refused a non-finite loss or gradient norm
        row.update(non_finite(err, losses))
    except ValueError as err:
        row.update(status="OOM", phase="plan: engine check", error=str(err)[:300])
    finally:
        if engine is not None:
            engine.close()
        engine = None
        gc.collect()
    if device.type == "cuda":
        row["measured_peak_GB"] = torch.cuda.max_memory_allocated(device) / GB
    queue.put(row)


def _ceilings(matmul_n: int, probe_MiB: int, queue) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    queue.put({"matmul_TFLOPs": matmul_tflops(device, n=matmul_n, dtype=torch.bfloat16 if cuda else torch.float32),
               "pcie": pcie_ceiling(device, probe_MiB * 2 ** 20) if cuda else None,
               "hbm_total_GB": torch.cuda.get_device_properties(device).total_memory / GB if cuda else None})


def preset_row(cfg: ScalingConfig, run: RunConfig, preset: str) -> tuple[dict, planner.OffloadPlan]:
    """The preset's prediction row and the planner's plan of its run in bf16 (the GPU run's dtype)."""
    dit, grid, batch = run.model, run.grid, run.train.batch_size
    plan = planner.plan_offload(run, param_dtype=torch.bfloat16)
    host = int(cfg.host_budget_GB * GB) or host_available_bytes()
    row = {"preset": preset, "params_B": count_params(dit) / 1e9, "depth": dit.depth,
           "tokens": batch * math.prod(grid), "predicted_host_GB": plan.host_total / GB,
           "host_holds_it": plan.host_total <= host, "predicted_peak_GB": plan.hbm_total / GB,
           "predicted_model_tflop_per_step": dit_flops(dit, batch, grid).train / 1e12, **forward_estimates(plan)}
    return row, plan


@script_main("scaling")
def main(hydra_cfg: DictConfig) -> None:
    base = OmegaConf.merge(hydra_cfg, trial_preset(hydra_cfg, smoke=SMOKE) or {})   # the script's run and its own keys
    cfg = script_config(ScalingConfig, base)
    name = cfg.name or ("smoke" if cfg.smoke else "plan" if cfg.plan_only else "table")
    runs = {p: compose_run(base, [f"model={p}"]) for p in cfg.presets}   # every run checked before any starts
    base_run = next(iter(runs.values()))
    config = {**clip_fields(base_run), "attention": base_run.model.attention.name, **dataclasses.asdict(cfg),
              "run_overrides": base_overrides(base)}
    run = ExperimentRun("scaling", name, config, cfg.wandb_dir, cfg.wandb_project, trial=cfg.smoke or cfg.plan_only)
    ceilings = None if cfg.plan_only else run_isolated(_ceilings, (cfg.matmul_n, cfg.pcie_probe_MiB), 300)
    progress(f"ceilings {ceilings}")
    rows: list[dict] = []
    payload = {"config": config, "ceilings": ceilings, "plan_only": cfg.plan_only, "tables": {"presets": rows}}
    for preset in sorted(cfg.presets, key=lambda p: count_params(runs[p].model)):
        row, plan = preset_row(cfg, runs[preset], preset)
        row["run_overrides"] = train_overrides(base, [f"model={preset}"])
        full_hbm = ((ceilings or {}).get("hbm_total_GB") or cfg.hbm_budget_GB) * GB
        row.update(predicted_fits_full=plan.hbm_total <= planner.usable_hbm(int(full_hbm)),
                   predicted_fits_cap=plan.hbm_total <= planner.usable_hbm(int(cfg.cap_GB * GB)))
        if cfg.plan_only or not row["host_holds_it"]:
            row["measured"] = "predicted"     # planner only, or beyond host RAM: the planner's figures only
        else:
            row["measured"] = "run"
            for cap in (None, cfg.cap_GB):
                changes = [f"model={preset}", *(cap_changes(cap, ceilings) if cap else [])]
                job = Job(compose_run(base, changes), tuple(train_overrides(base, changes)), cap, cfg.warmup_steps,
                          cfg.forward_repeats, int(cfg.hbm_budget_GB * GB))
                result = run_isolated(run_job, (job,), cfg.cell_time_limit_s)
                where = "full" if cap is None else "cap"
                row.update({f"{where}_{k}": v for k, v in result.items() if k not in ("predicted_peak_GB",)})
                if cap:
                    row["cap_run_overrides"] = list(job.run_overrides)
        rows.append(row)
        run.save(payload)
        progress(f"{preset}: {row}")
    runs = [r for r in rows if r.get("full_forward_speedup")]
    headline = {f"forward_speedup/{r['preset']}": r["full_forward_speedup"] for r in runs}
    headline.update({f"fits_cap/{r['preset']}": r.get("cap_status", "predicted " + str(r["predicted_fits_cap"]))
                     for r in rows})
    progress(f"wrote {run.finish(payload, headline)}")


if __name__ == "__main__":
    main()
