"""OOM thresholds: how many latent frames of 1080p video each (model, attention, training mode)
trains on, with the measured peak HBM beside the planner's prediction (paper table: OOM thresholds).

Clips are 1080p latents after an 8x VAE (135 x 240, height rounded to 136 so that the 1x2x2 patches
tile it: 68 x 120 tokens per latent frame), frames in `frames`. Attention: `attentions` (dense,
swin, dsa, with their group defaults); `rows` replaces attentions x modes x frames by explicit rows. Modes:
- resident: the resident trainer (fp32 weights and AdamW on the device, bf16 autocast) with
  per-block activation checkpointing;
- offload: the MegaSlide offload engine;
- chunked_offload: the offload engine with token-chunked blocks (execution.chunk_tokens), activation
  offload (saved block inputs parked in pinned host RAM) and, for attentions of bounded temporal
  reach (DSA), blocks over slabs of execution.slab_frames frames (0: off).
Every cell is a run of train.py's config: the script's own (its RunConfig groups: `python -m
experiments.oom_thresholds train.lr=... execution.chunk_tokens=...` as on train.py) changed by the cell's
overrides (model, attention, the mode's offload and execution, data.frames; hydra_config.compose_run), which
the cell records as `run_overrides`: `python -m experiments.plan <run_overrides>` plans that cell.
Models: the presets in `models`; those also in `host_depth` at the most blocks of their width that
host RAM holds (the planner, `host_ram_fraction` of it for the block state).

Each cell runs in a fresh process (forked from a server with torch loaded), so a CUDA OOM or a hang
cannot poison the next cell and the allocator's peak is the cell's own; a cell over
`cell_time_limit_s` is stopped and reported as such. A row (model, attention, mode) stops at its
first OOM, refusal or time limit; a cell whose warm-up and first timed step the planner's estimate
already puts over the limit is reported over it without running; with `time_budget_s` the table
starts no cell after that much time has passed, nor one the time left cannot hold at its estimate
(each cell's limit shrinks to what is left; those not started are reported `not run`). Per cell: fits
or OOM and in which phase (plan = refused before allocating, build, forward, loss, backward,
optimizer), the measured peak (CUDA: torch.cuda.max_memory_allocated; CPU: the live-tensor peak
of the timed steps, megaslide/perf/live_bytes.py) beside the planner's, and the step time:
- timing rule (recorded per cell as `timing_rule`): `warmup_steps` untimed steps, then
  `timed_steps` timed ones (n, median, spread; `first_step_s` is the cell's first step); a cell
  whose planner estimate is over `long_step_s` runs `long_warmup_steps` and `long_timed_steps`
  instead, and timed steps stop early where the next one would run past the cell's time limit;
- compute-only time (offload modes): the compute stream's busy time over the timed steps, CUDA
  events around every piece of compute (OffloadEngine.breakdown), transfers and host waits
  excluded; `step_over_compute` = step / compute-only, with the H2D, D2H and CPU AdamW times;
- attention share: the time inside the attention op (`attend`, DSA's offset net included: forward,
  recomputed forward, backward) over the step (experiments/attention_time.py);
- with `profile_steps` > 0, that many more steps under torch.profiler: the operators with the most device
  time per step and the compute kernels' sum beside the step (`profile`; experiments/op_profile.py);
- the planner's step-time estimate (matmul, attention and elementwise terms) and lower bound at the
  ceilings this run measured, beside it;
- with offload.keep_attention (selective recompute): which blocks kept their attention output and lse on the
  GPU, in host RAM or re-ran it, as planned (`predicted_kept_attention`) and as the engine kept them
  (`kept_attention`, with the bytes it held and its most on the device at once).
The fit decision: on CUDA the run itself (the planner refuses only cells it puts beyond
`refuse_over` x the free HBM, and any that host RAM cannot hold); on CPU, which has no allocator to
run out of, the planner against the stated `hbm_budget_GB`. The same run re-measures the ceilings:
matmul and PCIe (megaslide/perf/timing.py) and, per model and attention, `attend` alone on a clip of
`probe_frames` frames (the estimate's attention rate). The summary gives, per row, the most frames,
and whether the transfers hide: step <= `hide_ratio` x compute-only on every cell of at least
`hide_min_tokens` tokens. Writes results/oom_thresholds/<name>.json (tables: cells, summary),
<name>.png (frames vs peak HBM and step time) and the generated results/oom_thresholds.md; W&B
through harness.ExperimentRun.

    python -m experiments.oom_thresholds                     # GPU: the whole table (hours on an H200)
    python -m experiments.oom_thresholds time_budget_s=450   # GPU: what fits in 7.5 minutes
    python -m experiments.oom_thresholds oom_preset=headline # GPU: the long-clip headline (about 8 minutes)
    python -m experiments.oom_thresholds plan_only=true      # the planner's table, nothing run
    python -m experiments.oom_thresholds smoke=true          # tiny, CPU, stated HBM budget (CI)
    python -m experiments.oom_thresholds oom_preset=headline offload.keep_attention=auto  # selective recompute
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.attention_time import AttendTimer, attend_rate
from experiments.harness import ExperimentRun, pcie_ceiling, progress
from experiments.op_profile import profile_calls, top_operators
from experiments.hydra_config import (base_overrides, compose_run, require_ranges, script_config, script_main,
                                      train_overrides, trial_preset)
from experiments.report import render
from experiments.step_runs import Step, clip_fields, non_finite, run_isolated, synthetic_batch
from megaslide.config import AttentionConfig, RunConfig
from megaslide.device import precision_dtype
from megaslide.models.chunking import apply_execution
from megaslide.models.dit import DIT_PRESETS, VideoDiT
from megaslide.offload.engine import OffloadEngine
from megaslide.perf import planner
from megaslide.perf.host_memory import StateFormat
from megaslide.perf.live_bytes import LiveTensorBytes
from megaslide.perf.memory import hbm_available_bytes, host_available_bytes
from megaslide.perf.timing import Timing, copy_gbps, matmul_tflops, sync
from megaslide.train.resident import ResidentEngine

GB = 1e9
MODES = ("resident", "offload", "chunked_offload")
UNBOUNDED = 10 ** 15  # bytes: an HBM budget that bounds nothing
MIN_CELL_S = 10.0   # with less of the time budget left, a cell is not started
NEXT_STEP_MARGIN = 1.25  # a timed step starts only if this x the last step's time is left in the cell's limit
SMOKE = {"models": ["tiny"], "host_depth": [], "frames": [4, 8], "data": {"height": 16, "width": 16},
         "execution": {"chunk_tokens": 128}, "hbm_budget_GB": 0.009, "warmup_steps": 1, "timed_steps": 2,
         "cell_time_limit_s": 60.0, "matmul_n": 128, "pcie_probe_MiB": 4, "probe_frames": 4, "hide_min_tokens": 512}
# each mode's changes of the script's run (chunked_offload keeps the run's execution.chunk_tokens and slab_frames)
MODE_RUN = {"resident": ["offload=none", "execution.checkpoint_blocks=true", "execution.chunk_tokens=0",
                         "execution.slab_frames=0"],
            "offload": ["offload=engine", "execution.chunk_tokens=0", "execution.slab_frames=0"],
            "chunked_offload": ["offload=engine", "offload.activation_offload=true"]}


@dataclass(frozen=True)
class RowSpec:
    """Rows of the table given explicitly: one attention, its modes and its frames."""

    attention: str
    modes: list[str]
    frames: list[int]


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
    rows: list[RowSpec]
    warmup_steps: int
    timed_steps: int
    long_step_s: float
    long_warmup_steps: int
    long_timed_steps: int
    cell_time_limit_s: float
    time_budget_s: float
    refuse_over: float
    hbm_budget_GB: float
    host_budget_GB: float
    host_ram_fraction: float
    hide_min_tokens: int
    hide_ratio: float
    matmul_n: int
    pcie_probe_MiB: int
    probe_frames: int
    profile_steps: int
    profile_top: int
    wandb_dir: str
    wandb_project: str

    moved_keys: ClassVar[dict[str, str]] = {
        "height": "data.height", "width": "data.width", "batch": "train.batch_size",
        "chunk_tokens": "execution.chunk_tokens", "slab_frames": "execution.slab_frames",
        "precision": "train.precision"}   # RunConfig fields now, taken as on train.py

    def validate(self) -> None:
        unknown = sorted(set(self.modes).union(*(r.modes for r in self.rows)) - set(MODES))
        if unknown:
            raise ValueError(f"modes has unknown {unknown}; known: {list(MODES)}")
        for preset in [*self.models, *self.host_depth]:
            if preset not in DIT_PRESETS:
                raise ValueError(f"models has unknown preset {preset!r}; known: {sorted(DIT_PRESETS)}")
        for steps, warmup in ((self.timed_steps, self.warmup_steps), (self.long_timed_steps, self.long_warmup_steps)):
            if steps < 1 or warmup < 0:
                raise ValueError(f"timed steps ({self.timed_steps}, long: {self.long_timed_steps}) must be >= 1 and "
                                 f"warm-up steps ({self.warmup_steps}, long: {self.long_warmup_steps}) >= 0")
        require_ranges(self, positive=("long_step_s", "cell_time_limit_s", "refuse_over", "hide_ratio", "matmul_n",
                                       "pcie_probe_MiB", "probe_frames"),
                       non_negative=("time_budget_s", "hbm_budget_GB", "host_budget_GB", "hide_min_tokens",
                                     "profile_steps", "profile_top"),
                       fraction=("host_ram_fraction",))
        bad = [f for f in [*self.frames, *(f for r in self.rows for f in r.frames)] if f < 1]
        if bad:
            raise ValueError(f"frames {bad} must be >= 1 (latent frames of a cell)")

    def row_specs(self) -> list[RowSpec]:
        """`rows`, or every attention with all `modes` and `frames`."""
        return self.rows or [RowSpec(a, list(self.modes), list(self.frames)) for a in self.attentions]


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
    ceilings: planner.Ceilings  # the step-time figures': measured in this run where it could be
    timing_rule: str = ""     # how warmup_steps and timed_steps were chosen
    profile_steps: int = 0    # steps after the timed ones run under torch.profiler (experiments/op_profile.py)
    profile_top: int = 20     # operators kept from that profile
    time_limit_s: float = math.inf


# ---- the planner's view -----------------------------------------------------------------------------
def plan_cell(cell: Cell, device: torch.device, hbm_budget: int):
    """The planner's plan for a cell: `plan_resident` or `plan_offload` in the dtype the run uses, its kept
    attention (offload.keep_attention) placed within `hbm_budget` bytes of HBM (0: unbounded, as the table's
    estimate plans it before a cell runs; the cell re-plans within the free HBM it finds) and the host budget."""
    dtype = precision_dtype(cell.run.train.precision, device)
    if cell.mode == "resident":
        return planner.plan_resident(cell.run, autocast=dtype == torch.bfloat16)
    budgets = planner.Budgets(hbm_budget or UNBOUNDED, cell.host_budget, device.type)
    return planner.plan_offload(cell.run, param_dtype=dtype, ceilings=cell.ceilings, budgets=budgets)


def step_time_parts(cell: Cell, plan) -> dict:
    """The planner's step time at the cell's ceilings: its fitted estimate (the offload plan's max of compute,
    PCIe and CPU AdamW, or the resident step's compute) with the compute's terms, and its lower bound from
    ceilings only (every block recomputed: the engine's streamed blocks, the resident trainer's checkpointed
    ones; the engine's streamed blocks get their gradient from `BlockRunner.block_grad`), over the plan's slabs."""
    offload = isinstance(plan, planner.OffloadPlan)
    _, compute = planner.compute_seconds(cell.cfg, cell.batch, cell.grid, recomputed=cell.cfg.depth,
                                         ceilings=cell.ceilings, execution=plan.execution,
                                         block_grads=cell.cfg.depth - plan.resident_blocks if offload else 0,
                                         kept=len(plan.kept.gpu) + len(plan.kept.host) if offload else 0,
                                         compiled=cell.run.train.compile)
    bound = plan.lower_bound_s if offload else planner.compute_lower_bound_s(
        cell.cfg, cell.batch, cell.grid, recomputed=cell.cfg.depth, ceilings=cell.ceilings,
        execution=plan.execution)
    return {"predicted_estimate_s": plan.estimate_s if offload else sum(compute.values()),
            "predicted_lower_bound_s": bound, "predicted_matmul_s": compute["matmul"],
            "predicted_attention_s": compute["attention"], "predicted_elementwise_s": compute["elementwise"]}


def with_timing(cell: Cell, estimate_s: float, cfg: OOMConfig) -> Cell:
    """The cell's warm-up and timed steps by the timing rule (module docstring), the rule recorded."""
    if estimate_s > cfg.long_step_s:
        return dataclasses.replace(cell, warmup_steps=cfg.long_warmup_steps, timed_steps=cfg.long_timed_steps,
                                   timing_rule=f"estimate {estimate_s:.1f} s > long_step_s {cfg.long_step_s:g} s: "
                                               f"{cfg.long_warmup_steps} warm-up, {cfg.long_timed_steps} timed")
    return dataclasses.replace(cell, timing_rule=f"{cell.warmup_steps} warm-up, {cell.timed_steps} timed")


def planner_verdict(cell: Cell, plan, device: torch.device, budget: int) -> dict:
    """The planner's prediction and, where it decides, its refusal: host RAM it cannot hold, or (CPU)
    HBM over the stated budget, or (CUDA) HBM beyond refuse_over x the free memory. `slab_frames` is the plan's
    (execution.slab_frames=auto: the size it chose within `budget`)."""
    usable = planner.usable_hbm(budget)
    row = {"slab_frames": plan.execution.slab_frames, "predicted_peak_GB": plan.hbm_total / GB,
           "predicted_phase": plan.peak_phase, "budget_GB": budget / GB, "host_budget_GB": cell.host_budget / GB,
           "predicted_fits": plan.hbm_total <= usable}
    if isinstance(plan, planner.OffloadPlan):
        row["predicted_kept_attention"] = plan.kept.as_dict()
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
    run, train = cell.run, cell.train_config(device)
    if not run.offload.enabled:
        with torch.device(device):
            model = apply_execution(VideoDiT(run.model), run.execution)
        return ResidentEngine(model, device=device, train_cfg=train)
    return OffloadEngine.from_config(run.model, device=device, train_cfg=train, offload_cfg=run.offload,
                                     grid=run.grid, execution=run.execution)


def _step_s(engine, batch, device: torch.device, losses: list[float], lr: float) -> float:
    """One step's seconds; its loss is appended to `losses` (read after the step's time is taken)."""
    start = time.perf_counter()
    out = engine.train_step(batch, lr)
    sync(device)
    seconds = time.perf_counter() - start
    losses.append(float(out["loss"]))
    return seconds


def fits_no_more(last_step_s: float, deadline: float) -> bool:
    """Whether another step like the last one might run past `deadline` (time.monotonic())."""
    return time.monotonic() + NEXT_STEP_MARGIN * last_step_s > deadline


def timed_steps(cell: Cell, engine, batch, device: torch.device, deadline: float,
                losses: list[float]) -> tuple[dict, int | None]:
    """The cell's warm-up, then its timed steps (fewer where the next would pass `deadline`), with the
    attention op timed inside them, the CPU peak of live tensors and, on the offload engine, the compute
    stream's busy time: the row's timing fields and the measured peak (CPU; None on CUDA). Every step's
    loss goes to `losses`."""
    lr = cell.run.train.lr
    warm = [_step_s(engine, batch, device, losses, lr) for _ in range(cell.warmup_steps)]
    times, begin = [], engine.step
    live = LiveTensorBytes()              # CPU only: on CUDA the allocator counts, without slowing the steps
    attend = AttendTimer([block.attn for block in engine.model.blocks], device)
    with live if device.type == "cpu" else contextlib.nullcontext(), attend:
        live.track(*_persistent(engine), *(t for t in vars(batch).values() if isinstance(t, torch.Tensor)))
        while len(times) < cell.timed_steps and not (times and fits_no_more(times[-1], deadline)):
            times.append(_step_s(engine, batch, device, losses, lr))
    timing = Timing(tuple(times))
    rule = cell.timing_rule + ("" if len(times) == cell.timed_steps else
                               f"; stopped after {len(times)}: the next would pass the cell's time limit")
    row = {"step_s": timing.median, "step_s_min": timing.min, "step_s_max": timing.max, "step_s_std": timing.std,
           "timed_steps": len(times), "timing_rule": rule, "first_step_s": (warm + times)[0]}
    attention_s = attend.seconds()
    row.update(attention_s=attention_s / len(times), attention_share=attention_s / sum(times))
    if isinstance(engine, OffloadEngine):
        parts = engine.breakdown(range(begin, engine.step))
        row.update(compute_only_s=parts.compute_s, h2d_s=parts.h2d_s, d2h_s=parts.d2h_s, optimizer_s=parts.optimizer_s,
                   step_over_compute=parts.step_s / parts.compute_s)
    if cell.profile_steps:   # after the timing: the profiler slows the steps it watches
        prof = profile_calls(lambda: _step_s(engine, batch, device, losses, lr), cell.profile_steps, device)
        row["profile"] = top_operators(prof, cell.profile_steps, cell.profile_top, device)
    return row, (live.peak if device.type == "cpu" else None)


def run_cell(cell: Cell) -> dict:
    """Plan, then (unless refused) build and time one cell on this process's device."""
    deadline = time.monotonic() + cell.time_limit_s
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    budget = hbm_available_bytes(device) if device.type == "cuda" else cell.hbm_budget
    plan = plan_cell(cell, device, budget)
    row = planner_verdict(cell, plan, device, budget)
    if "status" in row:
        return {**row, "measured_peak_GB": None}
    engine, losses = None, []
    try:
        engine = _build(cell, device)
        row["slab_frames"] = engine.model.runner.execution.slab_frames   # what the engine runs (auto: resolved)
        batch = synthetic_batch(cell.run, device, engine.model.tokenizer)
        timing, measured = timed_steps(cell, engine, batch, device, deadline, losses)
        row.update(status="fits", phase="", losses=losses, **timing)
        if isinstance(engine, OffloadEngine):   # which blocks kept their attention where, and the bytes held
            store = engine.streamer.kept
            row["kept_attention"] = {**engine.kept_attention.as_dict(), "held_bytes": store.stored,
                                     "device_peak_bytes": store.device_peak}
        if device.type == "cuda":
            measured = torch.cuda.max_memory_allocated(device)
    except torch.OutOfMemoryError as err:
        phase = (engine.phase if engine is not None else "") or "build"  # the step's part the engine was in
        row.update(status="OOM", phase=phase.replace(" step", ""), error=str(err).splitlines()[0][:200])
        measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    except FloatingPointError as err:    # the engine refused a non-finite loss or gradient norm
        row.update(non_finite(err, losses))
        measured = None
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


# ---- the ceilings ---------------------------------------------------------------------------------------
def _ceilings(matmul_n: int, probe_MiB: int, probes: dict[tuple, RunConfig], queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))   # as the cells run
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    peak = matmul_tflops(device, n=matmul_n, dtype=torch.bfloat16 if cuda else torch.float32)
    attention = []
    for (model, name, chunked), run in probes.items():
        row = {"model": model, "attention": name, "chunked": chunked}
        try:
            row.update(attend_rate(run.model, run.grid, device, precision_dtype(run.train.precision, device),
                                   chunk_tokens=run.execution.chunk_tokens))
        except (torch.OutOfMemoryError, RuntimeError, ValueError) as err:
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        attention.append(row)
    queue.put({"matmul_TFLOPs": peak, "pcie": pcie_ceiling(device, probe_MiB * 2 ** 20) if cuda else None,
               "hbm_copy_GBps": copy_gbps(device) if cuda else None,
               "device": torch.cuda.get_device_name(device) if cuda else "cpu",
               "hbm_free_GB": hbm_available_bytes(device) / GB if cuda else None, "attention": attention})


def cell_ceilings(measured: dict | None, model: str, attention: str, chunked: bool) -> planner.Ceilings:
    """The step-time ceilings for a cell: this run's matmul, PCIe, HBM and attention rates where measured,
    else the planner's defaults."""
    if not measured:
        return planner.Ceilings()
    rate = next((r for r in measured["attention"] if (r["model"], r["attention"], r["chunked"]) ==
                 (model, attention, chunked) and "error" not in r), None)
    pcie = measured.get("pcie") or {}
    default = planner.Ceilings()
    return planner.Ceilings(tflops=measured["matmul_TFLOPs"], h2d_GBps=pcie.get("h2d_GBps", default.h2d_GBps),
                            d2h_GBps=pcie.get("d2h_GBps", default.d2h_GBps),
                            hbm_TBps=(measured.get("hbm_copy_GBps") or 1e3 * default.hbm_TBps) / 1e3,
                            attention=rate and planner.AttentionRate(rate["forward_tflops"], rate["backward_tflops"]))


# ---- the table ------------------------------------------------------------------------------------------
def host_budget(cfg: OOMConfig) -> int:
    """Host RAM the cells may use: host_budget_GB, or this machine's MemAvailable when 0."""
    return int(cfg.host_budget_GB * GB) or host_available_bytes()


def model_changes(cfg: OOMConfig, base: DictConfig) -> dict[str, list[str]]:
    """Each model of the table, by its label: the preset (`model=<preset>`), or for those in host_depth the
    most blocks of its width whose host state fits in host_ram_fraction of the host budget (by the planner)."""
    out = {}
    for preset in cfg.models:
        if preset in cfg.host_depth:
            model = compose_run(base, [f"model={preset}"]).model
            depth = planner.largest_depth(model, host_budget=int(cfg.host_ram_fraction * host_budget(cfg)),
                                          state_format=StateFormat(torch.bfloat16), pin_optimizer_state=False)
            out[f"{preset} width, depth {depth}"] = [f"model={preset}", f"model.depth={depth}"]
        else:
            out[preset] = [f"model={preset}"]
    return out


def cell_changes(model: list[str], attention: str, mode: str, frames: int) -> list[str]:
    """A cell's changes of the script's run: its model, attention, mode (MODE_RUN; chunked_offload runs over
    slabs only where the attention's reach along time is bounded) and frames."""
    a = AttentionConfig(attention)
    unbounded = mode == "chunked_offload" and a.variant.temporal_reach(a.options) is None
    return [*model, f"attention={attention}", *MODE_RUN[mode], *(["execution.slab_frames=0"] if unbounded else []),
            f"data.frames={frames}"]


def attention_probes(cfg: OOMConfig, base: DictConfig, models: dict[str, list[str]]) -> dict[tuple, RunConfig]:
    """(model, attention, chunked) -> the run of its row on the probe clip: one `attend` probe each."""
    probes = {}
    for label, model in models.items():
        for spec in cfg.row_specs():
            for mode in spec.modes:
                key = (label, spec.attention, mode == "chunked_offload")
                if key not in probes:
                    frames = min([cfg.probe_frames, *spec.frames])
                    probes[key] = compose_run(base, cell_changes(model, spec.attention, mode, frames))
    return probes


def cells_of_row(cfg: OOMConfig, base: DictConfig, label: str, model: list[str], spec: RowSpec,
                 mode: str) -> list[Cell]:
    """The row's cells, each the script's run with its changes (validated here, before anything runs); the
    ceilings come once they are measured."""
    cells = []
    for frames in sorted(spec.frames):
        changes = cell_changes(model, spec.attention, mode, frames)
        cells.append(Cell(compose_run(base, changes), tuple(train_overrides(base, changes)), label, mode,
                          cfg.warmup_steps, cfg.timed_steps, cfg.refuse_over, int(cfg.hbm_budget_GB * GB),
                          host_budget(cfg), planner.Ceilings(), profile_steps=cfg.profile_steps,
                          profile_top=cfg.profile_top))
    return cells


def cell_row(cell: Cell) -> dict:
    return {"model": cell.model, "attention": cell.cfg.attention.name, "mode": cell.mode,
            "frames": cell.run.data.frames, "tokens": cell.batch * math.prod(cell.grid),
            "slab_frames": cell.run.execution.slab_frames, "run_overrides": list(cell.run_overrides)}


def top_operator_rows(rows: list[dict]) -> list[dict]:
    """The profiled cells' operators as one table, each with its cell and the cell's step beside it."""
    return [{"model": r["model"], "attention": r["attention"], "mode": r["mode"], "frames": r["frames"],
             "step_s": r["step_s"], "kernels_s": r["profile"].get("kernel_ms_per_call", math.nan) / 1e3,
             "op": op["op"], "s_per_step": op["ms_per_call"] / 1e3, "share": op["share"],
             "calls_per_step": op["calls_per_call"]} for r in rows if "profile" in r for op in r["profile"]["top"]]


def summary(rows: list[dict], hide_min_tokens: int, hide_ratio: float) -> list[dict]:
    """The most frames each (model, attention, mode) trains with, what stopped it and, at the most, the
    step, peak, attention share and step / compute-only; whether the transfers hide: step <= hide_ratio
    x compute-only on every fitting cell of at least hide_min_tokens tokens (None: no such cell)."""
    out = {}
    for r in rows:
        key = (r["model"], r["attention"], r["mode"])
        s = out.setdefault(key, {"model": key[0], "attention": key[1], "mode": key[2], "max_frames": 0,
                                 "stopped_by": "", "step_s_at_max": None, "peak_GB_at_max": None,
                                 "attention_share_at_max": None, "step_over_compute_at_max": None,
                                 "long_clip_step_over_compute": None, "transfers_hide": None})
        if r["status"].startswith("fits"):
            s.update(max_frames=r["frames"], step_s_at_max=r.get("step_s"), peak_GB_at_max=r.get("measured_peak_GB"),
                     attention_share_at_max=r.get("attention_share"),
                     step_over_compute_at_max=r.get("step_over_compute"))
            if r["tokens"] >= hide_min_tokens and r.get("step_over_compute") is not None:
                worst = max(r["step_over_compute"], s["long_clip_step_over_compute"] or 0.0)
                s.update(long_clip_step_over_compute=worst, transfers_hide=worst <= hide_ratio)
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


def plan_only(cell: Cell, plan) -> dict:
    """The planner's verdict for a GPU run (precision auto: bf16) against the stated budgets."""
    row = planner_verdict(cell, plan, torch.device("cpu"), cell.hbm_budget)
    return {"status": "fits (predicted)", "phase": "", **row}


def over_time(cell: Cell, estimate_s: float, limit_s: float) -> bool:
    """Whether the cell's warm-up and one timed step cannot finish within `limit_s` at the planner's estimate."""
    return estimate_s * (cell.warmup_steps + 1) > limit_s


@script_main("oom_thresholds")
def main(hydra_cfg: DictConfig) -> None:
    base = OmegaConf.merge(hydra_cfg, trial_preset(hydra_cfg, smoke=SMOKE) or {})   # the script's run and its own keys
    cfg = script_config(OOMConfig, base)
    name = cfg.name or ("smoke" if cfg.smoke else "plan" if cfg.plan_only else "table")
    deadline = time.monotonic() + (cfg.time_budget_s if cfg.time_budget_s > 0 else math.inf)
    models = model_changes(cfg, base)
    table = [(label, spec, mode, cells_of_row(cfg, base, label, model, spec, mode))
             for label, model in models.items() for spec in cfg.row_specs() for mode in spec.modes]
    config = {**clip_fields(compose_run(base, [])), **dataclasses.asdict(cfg), "run_overrides": base_overrides(base)}
    run = ExperimentRun("oom_thresholds", name, config, cfg.wandb_dir, cfg.wandb_project,
                        trial=cfg.smoke or cfg.plan_only)
    # plan_only plans the GPU run (bf16); a run plans in the dtype of this machine's device
    device = torch.device("cuda" if cfg.plan_only or torch.cuda.is_available() else "cpu")
    ceilings = None if cfg.plan_only else run_isolated(
        _ceilings, (cfg.matmul_n, cfg.pcie_probe_MiB, attention_probes(cfg, base, models)), 300)
    progress(f"models {list(models)}; ceilings {ceilings}")
    rows: list[dict] = []
    payload = {"config": config, "ceilings": ceilings, "plan_only": cfg.plan_only, "tables": {"cells": rows}}
    for label, spec, mode, cells in table:
        rates = cell_ceilings(ceilings, label, spec.attention, mode == "chunked_offload")
        for cell in cells:
            cell = dataclasses.replace(cell, ceilings=rates)
            plan = plan_cell(cell, device, cell.hbm_budget)
            timing = step_time_parts(cell, plan)
            cell = with_timing(cell, timing["predicted_estimate_s"], cfg)
            limit = min(cfg.cell_time_limit_s, deadline - time.monotonic())
            if cfg.plan_only:
                result = plan_only(cell, plan)
            elif over_time(cell, timing["predicted_estimate_s"], cfg.cell_time_limit_s):
                result = {"status": "time limit", "phase": f"planner estimate {timing['predicted_estimate_s']:.0f} "
                          f"s/step", "predicted_peak_GB": plan.hbm_total / GB,
                          "predicted_phase": plan.peak_phase, "measured_peak_GB": None}
            elif limit < MIN_CELL_S or over_time(cell, timing["predicted_estimate_s"], limit):
                result = {"status": "not run", "phase": "time budget spent", "measured_peak_GB": None}
            else:
                result = run_isolated(_cell_process, (dataclasses.replace(cell, time_limit_s=limit),), limit)
            row = {**cell_row(cell), **timing, **result}
            if row.get("step_s"):
                row["estimate_over_step"] = timing["predicted_estimate_s"] / row["step_s"]
            rows.append(row)
            run.save(payload)
            progress(f"{label} {spec.attention} {mode} {cell.run.data.frames} frames: {row['status']} "
                     f"{row.get('phase', '')} measured {row.get('measured_peak_GB')} GB, planner "
                     f"{row.get('predicted_peak_GB')} GB; step {row.get('step_s')} s, estimate "
                     f"{timing['predicted_estimate_s']:.3g} s")
            if not row["status"].startswith(("fits", "not run")):   # a row stops at its first failure
                break
    payload["tables"]["summary"] = summary(rows, cfg.hide_min_tokens, cfg.hide_ratio)
    if cfg.profile_steps:
        payload["tables"]["top operators"] = top_operator_rows(rows)
    images = {}
    if not cfg.plan_only and any(r["status"] == "fits" for r in rows):
        images["frames vs peak HBM and step time"] = plot(rows, run.result_path.with_suffix(".png"))
    headline = {f"max_frames/{s['model']}/{s['attention']}/{s['mode']}": s["max_frames"]
                for s in payload["tables"]["summary"]}
    path = run.finish(payload, headline, images)
    progress(f"wrote {path} and {render('oom_thresholds', path.parent.parent)}")


if __name__ == "__main__":
    main()
