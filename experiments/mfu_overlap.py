"""MFU and step time of the MegaSlide-DiT offload engine with overlap, without overlap and
with the optimizer on the GPU; and the memory wall: the resident trainer on the same model.

    python -m experiments.mfu_overlap                   # H200: the largest DiT host RAM holds
    python -m experiments.mfu_overlap model.depth=12    # a fixed depth at the preset's width
    python -m experiments.mfu_overlap tiny=true         # CPU smoke test, seconds

The engine's run is one of train.py's config: the script's own (its RunConfig groups: model, attention,
data.frames, train.lr, offload.gpu_memory_fraction, ... as on train.py) with the depth and CPU AdamW threads
it settles on (hydra_config.compose_run); each variant changes offload.overlap, offload.optimizer_device and
train.grad_clip. The result records those overrides (`run_overrides`, per variant too), so
`python -m experiments.plan <them>` plans that run.

Order:
1. ceilings, measured in this run (megaslide/perf/timing.py): bf16 matmul (8192^3) and pinned PCIe
   (1 GiB, page-locked the way the engine pins its arena) H2D, D2H and both at once;
2. correctness: the engine against the resident `Trainer` on the tiny model in fp32, for
   every variant (losses and weights within 1e-4 relative; bit-identical on CPU), else stop;
   plus the same run in bf16, reported (bf16 block weights vs fp32 weights + autocast);
3. plan: the planner picks the depth (host RAM) and checks host RAM and HBM before allocating;
4. memory wall: the resident trainer's step (fp32 weights + AdamW on the GPU, bf16 autocast,
   activation checkpointing, built directly on the GPU) on the same model, under the same HBM
   cap as the engine;
5. the engine (OffloadEngine.from_config): the model built on the meta device, its stem and
   then each block materialised on the host one at a time with the model's own init rules;
6. per variant: warm-up steps, then timed steps; the window runs from the start of the first
   timed step to the start of the step after the last (steady state, no tail);
7. JSON (results/mfu_overlap/<name>.json or $MEGASLIDE_RESULTS_DIR) and the W&B run (config,
   tables, headline scalars), then a table.
MFU counts model FLOPs only (metrics/flops.py: 3 x forward, recompute not counted).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.harness import ExperimentRun, pcie_ceiling, progress
from experiments.hydra_config import compose_run, refuse_moved, script_main, train_overrides, trial_preset
from experiments.step_runs import clip_fields, non_finite, synthetic_batch
from megaslide.config import DataConfig, ExecutionConfig, OffloadConfig, RunConfig, TrainConfig
from megaslide.device import precision_dtype
from megaslide.diffusion.batches import Batch
from megaslide.models.chunking import apply_execution
from megaslide.models.dit import DIT_PRESETS, VideoDiT
from megaslide.models.text import HashTokenizer
from megaslide.offload.engine import OffloadEngine
from megaslide.perf import planner
from megaslide.perf.flops import H200_DATASHEET_BF16_TFLOPS, StepBreakdown, dit_flops, mfu
from megaslide.perf.host_memory import StateFormat
from megaslide.perf.memory import (
    hbm_available_bytes,
    host_available_bytes,
    memory_report,
    peak_hbm_bytes,
    reset_peak_hbm,
)
from megaslide.perf.timing import matmul_tflops
from megaslide.train.resident import ResidentEngine
from megaslide.train.trainer import Trainer

GB = 1e9
# name: (overlap, optimizer_device, clip). clip None: bench.grad_clip. "overlap_noclip" shows what the
# exact clipping scheme costs: without clipping the updates start during the backward.
VARIANTS = {"overlap": (True, "cpu", None), "overlap_noclip": (True, "cpu", 0.0), "serial": (False, "cpu", None),
            "gpu_optimizer": (True, "gpu", None)}
TARGETS = {"mfu": 0.61, "overlap_speedup_vs_serial": 2.0, "overlap_efficiency": 0.9, "h2d_frac_of_pinned": 0.9}
TINY = {"warmup_steps": 1, "timed_steps": 2, "correctness_steps": 2, "matmul_n": 128, "pcie_probe_MiB": 4}
TINY_RUN = ["model=tiny", "model.depth=3", "data.frames=4", "data.height=16", "data.width=16", "train.batch_size=1"]
BENCH_MOVED = {"batch": "train.batch_size", "frames": "data.frames", "height": "data.height", "width": "data.width",
               "depth": "model.depth", "lr": "train.lr", "grad_clip": "train.grad_clip",
               "cpu_threads": "offload.cpu_threads", "gpu_memory_fraction": "offload.gpu_memory_fraction",
               "resident_blocks": "offload.resident_blocks"}   # bench keys that are RunConfig fields now


def bench_config(cfg: DictConfig) -> DictConfig:
    """The script's own keys (`bench`, tiny's over them); a bench key that is a RunConfig field now is refused,
    naming its key."""
    bench = OmegaConf.to_container(cfg.bench, resolve=True)
    refuse_moved(bench, BENCH_MOVED, prefix="bench.", why="a field of the run, as on train.py")
    tiny = trial_preset(cfg, tiny={"bench": TINY, **{line.split("=")[0]: None for line in TINY_RUN}})
    return OmegaConf.create({**{k: v for k, v in bench.items() if k not in BENCH_MOVED}, **(TINY if tiny else {})})


def engine_changes(tiny: bool, cuda: bool, depth: int | None = None, threads: int | None = None) -> list[str]:
    """The engine's run as changes of the script's: tiny's model and clip, no HBM cap without CUDA, and (once
    settled) the depth and the CPU AdamW threads."""
    return [*(TINY_RUN if tiny else []), *([] if cuda else ["offload.gpu_memory_fraction=0.0"]),
            *([] if depth is None else [f"model.depth={depth}"]),
            *([] if threads is None else [f"offload.cpu_threads={threads}"])]


def variant_changes(name: str) -> list[str]:
    """A variant as changes of the engine's run: overlap, optimizer device and (when it has its own) clipping."""
    overlap, optimizer_device, clip = VARIANTS[name]
    return [f"offload.overlap={str(overlap).lower()}", f"offload.optimizer_device={optimizer_device}",
            *([] if clip is None else [f"train.grad_clip={clip}"])]
CORRECTNESS_RTOL = 1e-4


# ---- 2. correctness -------------------------------------------------------------------------
def _max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def check_correctness(device: torch.device, steps: int) -> dict:
    """Tiny model, fp32: engine (each variant) vs the resident reference trainer; bf16 reported."""
    model_cfg = dataclasses.replace(DIT_PRESETS["tiny"], depth=4)
    data_cfg = DataConfig(frames=4, height=16, width=16, num_videos=16, shape_size=6)
    out = tempfile.mkdtemp(prefix="mfu_overlap_")
    rows = []
    for precision in ("fp32", "bf16"):
        train = TrainConfig(steps=steps, batch_size=2, lr=1e-3, warmup_steps=1, grad_clip=0.05, weight_decay=0.01,
                            device=device.type, precision=precision, log_every=10 ** 9, ckpt_every=10 ** 9)
        ref = Trainer(model_cfg, data_cfg, train, out)
        ref_losses = [ref.train_step()["loss"].item() for _ in range(steps)]
        ref_weights = {k: v.detach().float().cpu() for k, v in ref.engine.model.named_parameters()}
        checks = [v for v, (_, _, clip) in VARIANTS.items() if clip is None] if precision == "fp32" else ["overlap"]
        for variant in checks:
            overlap, opt, _ = VARIANTS[variant]
            eng = Trainer(model_cfg, data_cfg, train, out,
                          offload_cfg=OffloadConfig(enabled=True, overlap=overlap, optimizer_device=opt))
            losses = [eng.train_step()["loss"].item() for _ in range(steps)]
            loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            weight_rel = _max_rel(eng.engine.model_state_dict(), ref_weights)
            rows.append({"precision": precision, "variant": variant, "losses": losses, "reference_losses": ref_losses,
                         "max_loss_rel_diff": loss_rel, "max_weight_rel_diff": weight_rel,
                         "passed": None if precision == "bf16"
                         else bool(max(loss_rel, weight_rel) <= CORRECTNESS_RTOL)})
            eng.close()
            progress(f"correctness {precision} {variant}: loss rel diff {loss_rel:.2e}, "
                     f"weight rel diff {weight_rel:.2e}")
    return {"model": "tiny, depth 4", "steps": steps, "rtol": CORRECTNESS_RTOL, "rows": rows}


# ---- 4. memory wall -----------------------------------------------------------------------------
def resident_step(run: RunConfig, batch: Batch, device: torch.device) -> dict:
    """One step of the resident engine (megaslide/train/resident.py: fp32 weights and AdamW on
    the device, bf16 autocast), with the model built directly on the device and activation
    checkpointing per block (its strongest setting: what remains is the parameter wall,
    16 B/param of weights, gradients and moments)."""
    reset_peak_hbm(device)
    model = engine = None
    try:
        with torch.device(device):
            model = apply_execution(VideoDiT(run.model), ExecutionConfig(checkpoint_blocks=True))
        train = dataclasses.replace(run.train, device=device.type)
        engine = ResidentEngine(model, device=device, train_cfg=train)
        result = {"fits": True, "loss": engine.train_step(batch, train.lr)["loss"].item()}
    except torch.OutOfMemoryError as err:
        result = {"fits": False, "oom_phase": engine.phase if engine else "build", "error": str(err).splitlines()[0]}
    finally:
        model = engine = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["peak_hbm_GB"] = peak_hbm_bytes(device) / GB
    return result


# ---- 6. variants ----------------------------------------------------------------------------------
def run_variant(engine: OffloadEngine, name: str, run: RunConfig, batch: Batch, bench, flops_train: float,
                peak_tflops: float, pcie: dict | None, plan: planner.OffloadPlan) -> dict:
    """The variant's run (`run`: the engine's with variant_changes) timed on the engine."""
    overlap, optimizer_device, clip = run.offload.overlap, run.offload.optimizer_device, run.train.grad_clip
    engine.set_mode(overlap=overlap, optimizer_device=optimizer_device, grad_clip=clip)
    reset_peak_hbm(engine.device)
    warm = [engine.train_step(batch, run.train.lr) for _ in range(bench.warmup_steps)]
    start = engine.step
    outs = [engine.train_step(batch, run.train.lr) for _ in range(bench.timed_steps + 1)]
    # one breakdown per timed step (each ends where the next one starts), so the step time has a spread
    per_step = [engine.breakdown(range(s, s + 1)) for s in range(start, start + bench.timed_steps)]
    losses = [o["loss"].item() for o in warm + outs]
    parts = StepBreakdown(*(statistics.fmean(getattr(p, f.name) for p in per_step)
                            for f in dataclasses.fields(StepBreakdown)))
    steps_s = [p.step_s for p in per_step]
    row = {"variant": name, "overlap": overlap, "optimizer_device": optimizer_device, "grad_clip": clip,
           "losses": losses, "grad_norms": [o["grad_norm"].item() for o in warm + outs],
           **parts.as_dict(), "timed_steps": len(steps_s), "step_s_min": min(steps_s), "step_s_max": max(steps_s),
           "step_s_std": statistics.pstdev(steps_s),
           "mfu_vs_measured_peak": mfu(flops_train, parts.step_s, peak_tflops),
           "mfu_vs_datasheet": mfu(flops_train, parts.step_s, H200_DATASHEET_BF16_TFLOPS),
           "achieved_TFLOPs": flops_train / parts.step_s / 1e12,
           "memory": memory_report(engine.device, engine.host.pinned_bytes).as_dict(),
           "predicted": {"estimate_s": plan.estimate_s, "lower_bound_s": plan.lower_bound_s, "bound": plan.bound,
                         "seconds": plan.seconds,
                         "h2d_bytes": plan.h2d_bytes, "d2h_bytes": plan.d2h_bytes, "hbm_GB": plan.hbm_total / GB}}
    if pcie is not None:
        row["h2d_frac_of_pinned"] = parts.h2d_GBps / pcie["h2d_GBps"]
    progress(f"{name}: step {parts.step_s:.3f} s, MFU {row['mfu_vs_measured_peak']:.1%} of measured peak, "
             f"overlap efficiency {parts.overlap_efficiency:.2f}")
    return row


def print_table(p: dict) -> None:
    c, plan = p["ceilings"], p["plan"]
    print(f"\nmfu_overlap  device={p['device']}  model: {plan['params'] / 1e9:.2f} B params (depth {p['depth']}), "
          f"{plan['tokens']} tokens/step, {p['attention']} attention")
    print(f"ceilings: {c['matmul_dtype']} matmul {c['matmul_TFLOPs']:.1f} TFLOP/s (H200 bf16 datasheet "
          f"{H200_DATASHEET_BF16_TFLOPS:.0f}); "
          + (f"pinned H2D {c['pcie']['h2d_GBps']:.1f}, D2H {c['pcie']['d2h_GBps']:.1f}, both "
             f"{c['pcie']['both_total_GBps']:.1f} GB/s" if c["pcie"] else "no PCIe (CPU)"))
    print(f"planner estimate {plan['estimate_s']:.3f} s ({plan['bound']}), lower bound {plan['lower_bound_s']:.3f} s; "
          f"host {plan['host_total_bytes'] / GB:.1f} GB, "
          f"HBM {plan['hbm_total_bytes'] / GB:.1f} GB predicted")
    wall = p["memory_wall"]
    print("memory wall: " + ("skipped (" + wall["skipped"] + ")" if "skipped" in wall else
                             f"resident trainer {'fits' if wall['fits'] else 'OOM at ' + wall['oom_phase']} under "
                             f"{p['gpu_memory_fraction']:.0%} HBM cap (peak {wall['peak_hbm_GB']:.1f} GB); "
                             f"the engine runs under the same cap"))
    print(f"correctness (fp32, rtol {p['correctness']['rtol']}): "
          f"{'passed' if all(r['passed'] for r in p['correctness']['rows'] if r['passed'] is not None) else 'FAILED'}")
    head = (f"{'variant':<14} {'step s':>7} {'MFU meas':>8} {'MFU ds':>7} {'compute':>8} {'H2D':>7} {'D2H':>7} "
            f"{'optim':>7} {'overlap':>7} {'H2D GB/s':>9} {'of pin':>7} {'HBM GB':>7} {'pred s':>7} {'pred GB':>7}")
    print(head)
    for r in p["variants"]:
        if "error" in r:
            print(f"{r['variant']:<14} failed: {r['error']}")
            continue
        frac = f"{r['h2d_frac_of_pinned']:.0%}" if "h2d_frac_of_pinned" in r else "-"
        print(f"{r['variant']:<14} {r['step_s']:>7.3f} {r['mfu_vs_measured_peak']:>8.1%} {r['mfu_vs_datasheet']:>7.1%} "
              f"{r['compute_s']:>8.3f} {r['h2d_s']:>7.3f} {r['d2h_s']:>7.3f} {r['optimizer_s']:>7.3f} "
              f"{r['overlap_efficiency']:>7.2f} {r['h2d_GBps']:>9.1f} {frac:>7} {r['memory']['peak_hbm_GB']:>7.1f} "
              f"{r['predicted']['estimate_s']:>7.3f} {r['predicted']['hbm_GB']:>7.1f}")
    if p.get("overlap_speedup_vs_serial"):
        print(f"overlap speedup vs serial: {p['overlap_speedup_vs_serial']:.2f}x "
              f"(target {TARGETS['overlap_speedup_vs_serial']}x)")


@script_main("mfu_overlap")
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(cfg, resolve=True)
    bench = bench_config(cfg)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"
    unknown = sorted(set(bench.variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"bench.variants has unknown {unknown}; known: {sorted(VARIANTS)}")
    run = compose_run(cfg, engine_changes(cfg.tiny, cuda))   # the script's run, checked before anything is measured
    threads = run.offload.cpu_threads or max(1, (os.cpu_count() or 2) - 1)
    progress(f"device {device}; {threads} CPU AdamW threads")

    # 1. ceilings
    matmul_dtype = torch.bfloat16 if cuda else torch.float32  # the engine computes in fp32 on a CPU
    peak = matmul_tflops(device, n=bench.matmul_n, dtype=matmul_dtype)
    pcie = pcie_ceiling(device, bench.pcie_probe_MiB * 2 ** 20) if cuda else None
    progress(f"ceilings: matmul {peak:.1f} TFLOP/s; pcie {pcie}")

    # 2. correctness
    correctness = check_correctness(device, bench.correctness_steps)
    if not all(r["passed"] for r in correctness["rows"] if r["passed"] is not None):
        sys.exit(f"correctness check failed, not timing: {correctness['rows']}")

    # 3. plan: depth from host RAM (model.depth unset), then both checks before anything big is allocated
    dtype = precision_dtype(run.train.precision, device)
    depth = c["model"]["depth"] if not cfg.tiny else run.model.depth
    if depth is None:
        depth = planner.largest_depth(run.model, host_budget=int(bench.host_ram_fraction * host_available_bytes()),
                                      state_format=StateFormat.of(dtype, run.offload),
                                      pin_optimizer_state=bench.pin_optimizer_state)
    changes = engine_changes(cfg.tiny, cuda, depth, threads)
    run = compose_run(cfg, changes)
    model_cfg, grid = run.model, run.grid
    runs = {v: compose_run(cfg, changes + variant_changes(v)) for v in bench.variants}
    fraction = run.offload.gpu_memory_fraction
    hbm, host = hbm_available_bytes(device, fraction), host_available_bytes()
    budgets = planner.Budgets(host if hbm is None else hbm, host, device.type)   # as the engine plans its run
    plans = {v: planner.plan_offload(r, param_dtype=dtype, pin_optimizer_state=bench.pin_optimizer_state,
                                     budgets=budgets)
             for v, r in runs.items()}
    plan = plans[bench.variants[0]]
    print(plan.table(), flush=True)
    for p in plans.values():
        planner.check_fits(p, host_available=host, hbm_available=hbm)
    flops = dit_flops(model_cfg, run.train.batch_size, grid)

    # 4. memory wall, under the cap the engine will run under
    if cuda and fraction > 0:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    batch = synthetic_batch(run, device, HashTokenizer(model_cfg.vocab_size, model_cfg.text_len))
    if bench.resident_baseline and cuda:
        progress("memory wall: the resident trainer's step on the same model")
        wall = resident_step(run, batch, device)
        progress(f"memory wall: {wall}")
    else:
        wall = {"skipped": "no CUDA device" if not cuda else "bench.resident_baseline=false"}

    # 5. the engine
    t0 = time.perf_counter()
    engine = OffloadEngine.from_config(model_cfg, device=device, train_cfg=dataclasses.replace(run.train,
                                       device=device.type), offload_cfg=run.offload, grid=grid,
                                       execution=run.execution, pin_optimizer_state=bench.pin_optimizer_state)
    progress(f"engine built in {time.perf_counter() - t0:.1f} s: host state {engine.host.total_bytes / GB:.1f} GB "
             f"({engine.host.pinned_bytes / GB:.1f} GB pinned), {depth} blocks initialised one at a time")
    preset = "tiny" if cfg.tiny else c["model"]["preset"]
    payload = {"device": str(device), "tiny": bool(cfg.tiny), "preset": preset, "depth": depth,
               "attention": model_cfg.attention.name, "model_cfg": dataclasses.asdict(model_cfg),
               "bench": {**OmegaConf.to_container(bench), **clip_fields(run)}, "cpu_threads": threads,
               "gpu_memory_fraction": fraction, "run_overrides": train_overrides(cfg, changes),
               "ceilings": {"matmul_TFLOPs": peak, "matmul_n": bench.matmul_n, "matmul_dtype": str(matmul_dtype),
                            "datasheet_TFLOPs": H200_DATASHEET_BF16_TFLOPS, "pcie": pcie},
               "model_flops_per_step": flops.train, "executed_flops_per_step": plan.executed_flops,
               "correctness": correctness, "plan": plan.as_dict(), "memory_wall": wall,
               "budgets": {"budget_GB": budgets.hbm / GB, "host_budget_GB": budgets.host / GB},
               "engine_setup_s": time.perf_counter() - t0, "host_state": engine.host.bytes_report(),
               "variants": [], "targets": TARGETS, "complete": False}
    name = cfg.name or ("tiny" if cfg.tiny else f"{device.type}_{payload['preset']}_d{depth}")
    run = ExperimentRun("mfu_overlap", name, c, cfg.wandb.dir, cfg.wandb.project, trial=cfg.tiny)

    # 6. variants; the result file is rewritten after each, so a failure late keeps the rest
    for variant in bench.variants:
        try:
            row = run_variant(engine, variant, runs[variant], batch, bench, flops.train, peak, pcie, plans[variant])
            row["run_overrides"] = train_overrides(cfg, changes + variant_changes(variant))
        except FloatingPointError as err:   # the engine is left refusing: no later variant can run
            row = {"variant": variant, **non_finite(err, [])}
            progress(f"{variant} failed: {row['error']}")
            payload["variants"].append(row)
            run.save(payload)
            break
        except (torch.OutOfMemoryError, RuntimeError) as err:
            row = {"variant": variant, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
            progress(f"{variant} failed: {row['error']}")
        payload["variants"].append(row)
        run.save(payload)
    engine.close()
    by_name = {r["variant"]: r for r in payload["variants"] if "error" not in r}
    if "overlap" in by_name and "serial" in by_name:
        payload["overlap_speedup_vs_serial"] = by_name["serial"]["step_s"] / by_name["overlap"]["step_s"]
    payload["complete"] = True
    headline = {"matmul_TFLOPs": peak, "overlap_speedup_vs_serial": payload.get("overlap_speedup_vs_serial")}
    headline.update({f"{k}/{v}": r[k] for v, r in by_name.items() for k in ("step_s", "mfu_vs_measured_peak")})
    progress(f"wrote {run.finish(payload, headline)}")
    print_table(payload)


if __name__ == "__main__":
    main()
