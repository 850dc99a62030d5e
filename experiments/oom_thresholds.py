"""OOM thresholds: how many latent frames of 1080p video each (model, attention, training mode)
trains on, with the measured peak HBM beside the planner's prediction (paper table: OOM thresholds).

Clips are 1080p latents after an 8x VAE (135 x 240, height rounded to 136 so that the 1x2x2 patches
tile it: 68 x 120 tokens per latent frame), frames in `frames`. Attention: `attentions` (dense,
swin, dsa, with their group defaults). Modes:
- resident: the resident trainer (fp32 weights and AdamW on the device, bf16 autocast) with
  per-block activation checkpointing;
- offload: the MegaSlide offload engine;
- chunked_offload: the offload engine with token-chunked blocks (`chunk_tokens`) and activation
  offload (saved block inputs parked in pinned host RAM).
Models: the presets in `models`; those also in `host_depth` at the most blocks of their width that
host RAM holds (the planner, `host_ram_fraction` of it for the block state).

Each cell runs in a fresh process (forked from a server with torch loaded), so a CUDA OOM or a hang
cannot poison the next cell and the allocator's peak is the cell's own; a cell over
`cell_time_limit_s` is stopped and reported as such. A row (model, attention, mode) stops at its
first OOM, refusal or time limit; a cell whose steps the planner's floor already puts over the
limit is reported over it without running; with `time_budget_s` the whole table stops starting
cells when that much time has passed (each cell's limit shrinks to what is left). Per cell: fits
or OOM and in which phase (plan = refused before allocating, build, forward, loss, backward,
optimizer), the measured peak (CUDA: torch.cuda.max_memory_allocated; CPU: the live-tensor peak
of the timed steps, megaslide/perf/live_bytes.py) beside the planner's, and one warm step
timed `timed_steps` times after `warmup_steps` (n, median, spread). The fit decision: on CUDA the run itself (the
planner refuses only cells it puts beyond `refuse_over` x the free HBM, and any that host RAM
cannot hold); on CPU, which has no allocator to run out of, the planner against the stated
`hbm_budget_GB`. The same run re-measures the matmul and PCIe ceilings (experiments/harness.py).
Writes results/oom_thresholds/<name>.json (tables: cells, summary), <name>.png (frames vs peak
HBM and step time) and the generated results/oom_thresholds.md; W&B through harness.ExperimentRun.

    python -m experiments.oom_thresholds                     # GPU: the whole table (hours on an H200)
    python -m experiments.oom_thresholds time_budget_s=450   # GPU: what fits in 7.5 minutes
    python -m experiments.oom_thresholds plan_only=true      # the planner's table, nothing run
    python -m experiments.oom_thresholds smoke=true          # tiny, CPU, stated HBM budget (CI)
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun, Timing, matmul_tflops, pcie_gbps, progress, sync
from experiments.hydra_config import script_config, script_main
from experiments.mfu_overlap import synthetic_batch
from experiments.report import render
from megaslide.config import AttentionConfig, DiTConfig, OffloadConfig, TrainConfig
from megaslide.device import precision_dtype
from megaslide.perf.flops import dit_flops
from megaslide.perf.live_bytes import LiveTensorBytes
from megaslide.perf.memory import hbm_available_bytes, host_available_bytes
from megaslide.models.dit import DIT_PRESETS, VideoDiT
from megaslide.offload import planner
from megaslide.offload.engine import OffloadEngine
from megaslide.train.resident import ResidentEngine

GB = 1e9
MODES = ("resident", "offload", "chunked_offload")
MIN_CELL_S = 10.0   # with less of the time budget left, a cell is not started
SMOKE = {"models": ["tiny"], "host_depth": [], "frames": [4, 8], "height": 16, "width": 16, "chunk_tokens": 128,
         "hbm_budget_GB": 0.009, "warmup_steps": 1, "timed_steps": 2, "cell_time_limit_s": 60.0,
         "matmul_n": 128, "pcie_probe_MiB": 4}


@dataclass(frozen=True)
class OOMConfig:
    """The keys of experiments/conf/oom_thresholds.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    plan_only: bool
    models: list[str]
    host_depth: list[str]
    attentions: list[str]
    modes: list[str]
    frames: list[int]
    height: int
    width: int
    batch: int
    chunk_tokens: int
    precision: str
    warmup_steps: int
    timed_steps: int
    cell_time_limit_s: float
    time_budget_s: float
    refuse_over: float
    hbm_budget_GB: float
    host_budget_GB: float
    host_ram_fraction: float
    matmul_n: int
    pcie_probe_MiB: int
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown:
            raise ValueError(f"modes has unknown {unknown}; known: {list(MODES)}")
        for preset in [*self.models, *self.host_depth]:
            if preset not in DIT_PRESETS:
                raise ValueError(f"models has unknown preset {preset!r}; known: {sorted(DIT_PRESETS)}")
        if self.timed_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"timed_steps={self.timed_steps} must be >= 1 and warmup_steps={self.warmup_steps} >= 0")


@dataclass(frozen=True)
class Step:
    """A training step's model, clip (batch x frames x height x width latents: what
    mfu_overlap.synthetic_batch reads) and precision."""

    cfg: DiTConfig
    frames: int
    height: int
    width: int
    batch: int
    precision: str

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.cfg.token_grid(self.frames, self.height, self.width)


@dataclass(frozen=True)
class Cell(Step):
    """One (model, attention, mode, frames) run: everything the child process needs."""

    model: str
    mode: str
    warmup_steps: int
    timed_steps: int
    refuse_over: float
    hbm_budget: int           # bytes; used on CPU (and in plan_only) only
    host_budget: int          # bytes


# ---- the planner's view -----------------------------------------------------------------------------
def plan_cell(cell: Cell, device: torch.device):
    """The planner's plan for a cell: `plan_resident` or `plan_offload` in the dtype the run uses."""
    dtype = precision_dtype(cell.precision, device)
    if cell.mode == "resident":
        return planner.plan_resident(cell.cfg, batch=cell.batch, grid=cell.grid, autocast=dtype == torch.bfloat16)
    return planner.plan_offload(cell.cfg, batch=cell.batch, grid=cell.grid, param_dtype=dtype,
                                activation_offload=cell.mode == "chunked_offload")


def floor_s(cell: Cell, plan) -> float:
    """The planner's lower bound on a step's time: the offload plan's floor, or the resident
    step's executed FLOPs (forward, backward, checkpoint recompute) at the default ceiling."""
    if hasattr(plan, "floor_s"):
        return plan.floor_s
    return dit_flops(cell.cfg, cell.batch, cell.grid).executed / (planner.Ceilings().tflops * 1e12)


def planner_verdict(cell: Cell, plan, device: torch.device, budget: int) -> dict:
    """The planner's prediction and, where it decides, its refusal: host RAM it cannot hold, or (CPU)
    HBM over the stated budget, or (CUDA) HBM beyond refuse_over x the free memory."""
    usable = planner.usable_hbm(budget)
    row = {"predicted_peak_GB": plan.hbm_total / GB, "predicted_phase": plan.peak_phase,
           "budget_GB": budget / GB, "predicted_fits": plan.hbm_total <= usable}
    try:
        cell.cfg.attention.validate(cell.grid)
    except ValueError as err:
        return {**row, "status": "skipped", "phase": str(err)[:120]}
    host_total = getattr(plan, "host_total", None)
    if host_total is not None:
        row["predicted_host_GB"] = host_total / GB
        if host_total > cell.host_budget:
            return {**row, "status": "refused", "phase": "plan: host RAM"}
    limit = usable if device.type == "cpu" else cell.refuse_over * budget
    if plan.hbm_total > limit:
        return {**row, "status": "OOM", "phase": f"plan: {planner.phase_over(plan.hbm_phases, usable)}"}
    return row


# ---- one cell, in its own process ---------------------------------------------------------------------
def offload_phase(err: BaseException) -> str:
    """Where in an offloaded step an exception was raised, from its traceback."""
    names = [(Path(f.filename).name, f.name) for f in traceback.extract_tb(err.__traceback__)]
    for where, phase in ((("streamer.py", "backward"), "backward"), (("streamer.py", "forward"), "forward"),
                         (("dit.py", "embed"), "forward"), (("optimizer.py", "step"), "optimizer"),
                         (("engine.py", "_global_norm"), "optimizer")):
        if where in names:
            return phase
    return "loss" if ("engine.py", "train_step") in names else "build"


def _persistent(engine) -> list[torch.Tensor]:
    """The device tensors a step starts from, for the CPU peak: weights, gradients, optimizer state."""
    if isinstance(engine, OffloadEngine):
        params = engine.resident_params + [t for s in engine.streamer.shells for t in (s.weights, s.grads)]
    else:
        params = list(engine.model.parameters())
    grads = [p.grad for p in params if getattr(p, "grad", None) is not None]
    state = [t for s in engine.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return params + grads + state


def _build(cell: Cell, device: torch.device):
    train = TrainConfig(lr=1e-5, grad_clip=1.0, batch_size=cell.batch, device=device.type, precision=cell.precision)
    if cell.mode == "resident":
        with torch.device(device):
            model = VideoDiT(dataclasses.replace(cell.cfg, checkpoint_blocks=True))
        return ResidentEngine(model, device=device, train_cfg=train)
    offload = OffloadConfig(enabled=True, activation_offload=cell.mode == "chunked_offload")
    return OffloadEngine.from_config(cell.cfg, device=device, train_cfg=train, offload_cfg=offload, grid=cell.grid)


def run_cell(cell: Cell) -> dict:
    """Plan, then (unless refused) build and time one cell on this process's device."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    budget = hbm_available_bytes(device) if device.type == "cuda" else cell.hbm_budget
    plan = plan_cell(cell, device)
    row = planner_verdict(cell, plan, device, budget)
    if "status" in row:
        return {**row, "measured_peak_GB": None}
    engine = None
    try:
        engine = _build(cell, device)
        batch = synthetic_batch(cell.cfg, cell, device, engine.model.tokenizer)
        for _ in range(cell.warmup_steps):
            engine.train_step(batch, 1e-5)
        sync(device)
        times = []
        live = LiveTensorBytes()              # CPU only: on CUDA the allocator counts, without slowing the steps
        with live if device.type == "cpu" else contextlib.nullcontext():
            live.track(*_persistent(engine), *(t for t in vars(batch).values() if isinstance(t, torch.Tensor)))
            for _ in range(cell.timed_steps):
                start = time.perf_counter()
                engine.train_step(batch, 1e-5)
                sync(device)
                times.append(time.perf_counter() - start)
        timing = Timing(tuple(times))
        row.update(status="fits", phase="", step_s=timing.median, step_s_min=timing.min, step_s_max=timing.max,
                   step_s_std=timing.std, timed_steps=len(times))
        measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else live.peak
    except torch.OutOfMemoryError as err:
        phase = getattr(engine, "phase", "") or offload_phase(err)
        row.update(status="OOM", phase=phase.replace(" step", ""), error=str(err).splitlines()[0][:200])
        measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    except ValueError as err:            # the engine's own planner check refused it
        row.update(status="refused", phase="plan: engine check", error=str(err)[:300])
        measured = None
    finally:
        if isinstance(engine, OffloadEngine):
            engine.close()
        engine = None
        gc.collect()
    row["measured_peak_GB"] = None if measured is None else measured / GB
    if measured:
        row["predicted_over_measured"] = plan.hbm_total / measured
    return row


def _cell_process(cell: Cell, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    try:
        queue.put(run_cell(cell))
    except Exception as err:  # noqa: BLE001  (anything else: report it as the cell's result)
        queue.put({"status": "error", "phase": "", "error": f"{type(err).__name__}: {err}"[:300]})


def run_isolated(target, args: tuple, time_limit_s: float) -> dict:
    """target(*args, queue) in a fresh process forked from a torch-preloaded server; its result, or
    {"status": "time limit"} past `time_limit_s` (the process is killed), or {"status": "crashed"}."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "megaslide.offload.engine", "experiments.mfu_overlap"])
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    deadline = time.monotonic() + time_limit_s
    while proc.is_alive() and queue.empty() and time.monotonic() < deadline:
        proc.join(timeout=0.2)
    if not queue.empty():
        result = queue.get()
        proc.join()
        return result
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"status": "time limit", "phase": f"over {time_limit_s:.0f} s"}
    return {"status": "crashed", "phase": f"exit code {proc.exitcode}"}


# ---- the table ------------------------------------------------------------------------------------------
def _ceilings(matmul_n: int, probe_MiB: int, queue) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    peak = matmul_tflops(device, n=matmul_n, dtype=torch.bfloat16 if cuda else torch.float32)
    queue.put({"matmul_TFLOPs": peak, "pcie": pcie_gbps(device, probe_MiB * 2 ** 20) if cuda else None,
               "device": torch.cuda.get_device_name(device) if cuda else "cpu",
               "hbm_free_GB": hbm_available_bytes(device) / GB if cuda else None})


def host_budget(cfg: OOMConfig) -> int:
    """Host RAM the cells may use: host_budget_GB, or this machine's MemAvailable when 0."""
    return int(cfg.host_budget_GB * GB) or host_available_bytes()


def model_configs(cfg: OOMConfig) -> dict[str, DiTConfig]:
    """Each model of the table: the preset, or for those in host_depth the most blocks of its width
    whose host state fits in host_ram_fraction of the host budget (by the planner)."""
    out = {}
    for preset in cfg.models:
        model = DIT_PRESETS[preset]
        if preset in cfg.host_depth:
            depth = planner.largest_depth(model, host_budget=int(cfg.host_ram_fraction * host_budget(cfg)),
                                          param_dtype=torch.bfloat16, pin_optimizer_state=False)
            out[f"{preset} width, depth {depth}"] = dataclasses.replace(model, depth=depth)
        else:
            out[preset] = model
    return out


def cells_of_row(cfg: OOMConfig, label: str, model: DiTConfig, attention: str, mode: str) -> list[Cell]:
    dit = dataclasses.replace(model, attention=AttentionConfig(attention),
                              chunk_tokens=cfg.chunk_tokens if mode == "chunked_offload" else 0)
    return [Cell(dit, f, cfg.height, cfg.width, cfg.batch, cfg.precision, label, mode, cfg.warmup_steps,
                 cfg.timed_steps, cfg.refuse_over, int(cfg.hbm_budget_GB * GB), host_budget(cfg))
            for f in sorted(cfg.frames)]


def cell_row(cell: Cell) -> dict:
    return {"model": cell.model, "attention": cell.cfg.attention.name, "mode": cell.mode, "frames": cell.frames,
            "tokens": cell.batch * math.prod(cell.grid)}


def summary(rows: list[dict]) -> list[dict]:
    """The most frames each (model, attention, mode) trains with, and what stopped it."""
    out = {}
    for r in rows:
        key = (r["model"], r["attention"], r["mode"])
        s = out.setdefault(key, {"model": key[0], "attention": key[1], "mode": key[2], "max_frames": 0,
                                 "stopped_by": "", "step_s_at_max": None, "peak_GB_at_max": None})
        if r["status"].startswith("fits"):
            s.update(max_frames=r["frames"], step_s_at_max=r.get("step_s"), peak_GB_at_max=r.get("measured_peak_GB"))
        elif not s["stopped_by"]:
            s["stopped_by"] = f"{r['status']} at {r['frames']} frames ({r.get('phase', '')})"
    return list(out.values())


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (mem, step) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in dict.fromkeys((r["model"], r["attention"], r["mode"]) for r in rows):
        pts = [r for r in rows if (r["model"], r["attention"], r["mode"]) == key and r["status"] == "fits"]
        if not pts:
            continue
        label = " / ".join(key)
        frames = [r["frames"] for r in pts]
        line, = mem.plot(frames, [r["measured_peak_GB"] or float("nan") for r in pts], "o-", label=label)
        mem.plot(frames, [r["predicted_peak_GB"] for r in pts], "x--", color=line.get_color())
        step.plot(frames, [r["step_s"] for r in pts], "o-", label=label)
    mem.set(xscale="log", yscale="log", xlabel="latent frames (1080p)", ylabel="peak HBM, GB (x--: planner)")
    step.set(xscale="log", yscale="log", xlabel="latent frames (1080p)", ylabel="step time, s")
    for ax in (mem, step):
        ax.grid(True, which="both", alpha=0.3)
    step.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plan_only(cell: Cell) -> dict:
    """The planner's verdict for a GPU run (precision auto: bf16) against the stated budgets, with its
    step-time floor."""
    plan = plan_cell(cell, torch.device("cuda"))
    row = planner_verdict(cell, plan, torch.device("cpu"), cell.hbm_budget)
    return {"status": "fits (predicted)", "phase": "", **row, "predicted_floor_s": floor_s(cell, plan)}


def over_time(cell: Cell, limit_s: float) -> dict | None:
    """A cell whose steps cannot finish within the limit even at the planner's floor is not run."""
    plan = plan_cell(cell, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    floor = floor_s(cell, plan)
    if floor * (cell.warmup_steps + cell.timed_steps) <= limit_s:
        return None
    return {"status": "time limit", "phase": f"planner floor {floor:.0f} s/step", "predicted_peak_GB":
            plan.hbm_total / GB, "predicted_phase": plan.peak_phase, "measured_peak_GB": None}


@script_main("oom_thresholds")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(OOMConfig, hydra_cfg, SMOKE if hydra_cfg.smoke else None)
    name = cfg.name or ("smoke" if cfg.smoke else "plan" if cfg.plan_only else "table")
    deadline = time.monotonic() + (cfg.time_budget_s if cfg.time_budget_s > 0 else math.inf)
    run = ExperimentRun("oom_thresholds", name, dataclasses.asdict(cfg), cfg.wandb_dir, cfg.wandb_project)
    models = model_configs(cfg)
    ceilings = None if cfg.plan_only else run_isolated(_ceilings, (cfg.matmul_n, cfg.pcie_probe_MiB), 300)
    progress(f"models {list(models)}; ceilings {ceilings}")
    rows: list[dict] = []
    payload = {"config": dataclasses.asdict(cfg), "ceilings": ceilings, "plan_only": cfg.plan_only,
               "tables": {"cells": rows}}
    for label, model in models.items():
        for attention in cfg.attentions:
            for mode in cfg.modes:
                for cell in cells_of_row(cfg, label, model, attention, mode):
                    limit = min(cfg.cell_time_limit_s, deadline - time.monotonic())
                    if cfg.plan_only:
                        result = plan_only(cell)
                    elif limit < MIN_CELL_S:
                        result = {"status": "not run", "phase": "time budget spent", "measured_peak_GB": None}
                    else:
                        result = over_time(cell, limit) or run_isolated(_cell_process, (cell,), limit)
                    row = {**cell_row(cell), **result}
                    rows.append(row)
                    run.save(payload)
                    progress(f"{label} {attention} {mode} {cell.frames} frames: {row['status']} {row.get('phase', '')} "
                             f"measured {row.get('measured_peak_GB')} GB, planner {row.get('predicted_peak_GB')} GB")
                    if not row["status"].startswith("fits"):
                        break
    payload["tables"]["summary"] = summary(rows)
    images = {}
    if not cfg.plan_only and any(r["status"] == "fits" for r in rows):
        images["frames vs peak HBM and step time"] = plot(rows, run.result_path.with_suffix(".png"))
    headline = {f"max_frames/{s['model']}/{s['attention']}/{s['mode']}": s["max_frames"]
                for s in payload["tables"]["summary"]}
    path = run.finish(payload, headline, images)
    progress(f"wrote {path} and {render('oom_thresholds', path.parent.parent)}")


if __name__ == "__main__":
    main()
