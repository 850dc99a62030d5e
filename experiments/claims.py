"""Generate results/README.md: every claim of the three papers beside our own figure.

    python experiments/claims.py                                    # the repository's results/
    python experiments/claims.py --results runs/ablate_offsets/results   # your own runs' results folder

The paper's figures are quoted as the papers state them (shared PAPERS.md); every figure
of ours is read from a result JSON under the results folder (its file is linked) or computed here
analytically and said to be so. Every verdict is computed from the data by a rule stated
here, or the cell states a fact without a verdict word; a claim we could not measure says why.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from experiments.quality_protocol import aggregate
from experiments.report import result_files
from experiments.results_io import RESULTS_DIR, descends_from, dirty_note, is_partial
from megaslide.config import DiTConfig, from_dict
from megaslide.models.dit import DIT_PRESETS, count_params
from megaslide.perf import planner

TB = 1e12
PAPER_MFU, PAPER_MFU_SERIAL, PAPER_MFU_GPU_OPT = 0.61, 0.28, 0.15   # C4, C5 as the paper states them
QUADRATIC_SLOPE = 1.8   # C2: a log-log slope of dense time over tokens at least this counts as quadratic
MIN_TIMED_STEPS = 5     # fewer timed steps give no median and spread (experiments/harness.py)


def load(results_dir: Path, experiment: str, name: str) -> dict | None:
    """`<results_dir>/<experiment>/<name>.json` read, or None if it does not exist."""
    path = results_dir / experiment / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def link(results_dir: Path, experiment: str, name: str) -> str:
    """A result file's link, marked when the result ran on a dirty tree."""
    return f"[{experiment}/{name}.json]({experiment}/{name}.json){dirty_note(load(results_dir, experiment, name) or {})}"


@dataclass
class Claim:
    id: str
    paper: str
    ours: Callable[[Path], tuple[str, str]]   # results folder -> (our figure with its source, verdict)


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,} tokens"


def c1(results_dir: Path):
    n = count_params(DIT_PRESETS["105B"])
    total, moments = 14 * n, 8 * n
    return (f"analytic: our `105B` preset has {n / 1e9:.1f} B params; 14 B/param = {total / TB:.2f} TB, "
            f"moments {moments / 1e9:.0f} GB (`count_params`, no run)", "consistent (arithmetic)")


def _loglog_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log(y) against log(x) over (x, y) points."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def c2(results_dir: Path):
    s = load(results_dir, "attention", "h200_sweep")
    if not s:
        return "not measured", "-"
    dense = sorted({(r["tokens"], r["ms"]) for r in s["tables"]["sweep"] + s["tables"]["target"]
                    if r["variant"] == "dense" and r["status"] == "ok"})
    n, ms = dense[-1]
    slope = _loglog_slope(dense)
    grid = next((r["config"] for _, r in oom_results(results_dir)), {"height": 136, "width": 240})
    n2m = math.prod(DIT_PRESETS["1B"].token_grid(TARGET_FRAMES, grid["height"], grid["width"]))
    return (f"256 frames of 1080p latents (8x spatial VAE, patch 2): {clip_tokens(TARGET_FRAMES, grid, '1B')}. "
            f"Dense flash fwd+bwd of one 16x64-head layer: {ms:.0f} ms at {n / 1e3:.0f}K tokens "
            f"({link(results_dir, 'attention', 'h200_sweep')}); x(N ratio)^2 extrapolates to "
            f"{ms * (n2m / n) ** 2 / 1e3:.0f} s at {n2m / 1e6:.2f} M (extrapolated, not run)",
            f"{'supported' if slope >= QUADRATIC_SLOPE else 'not supported'}: measured dense time grows as "
            f"N^{slope:.2f} over {dense[0][0] / 1e3:.0f}K-{n / 1e3:.0f}K tokens ({len(dense)} sizes)")


PLANNER_TARGET = 0.10   # C3: the planner's peak-HBM prediction counts as accurate within 10% of the measured peak
TARGET_FRAMES = 256     # C3: the paper's clip length
DSA_HEAD_GROUPS = "ddc31f7"  # the commit from which DSA's backward bounds its scratch (the planner's model); the
# binned backward (2a5644f) changed the scratch per head from 8 N d to N (40 K + 8) bytes: +0.14 GB at the headline
VAE_TEMPORAL = 4        # a video VAE's temporal compression (e.g. Wan's): 4 video frames per latent frame


def clip_tokens(frames: int, config: dict, model: str) -> str:
    """Both token counts of a `frames`-frame clip on a result's latent grid (`config` height, width):
    frames taken as latent frames, and through a VAE_TEMPORAL x temporal VAE."""
    dit = DIT_PRESETS[model]
    full, compressed = (dit.token_grid(f, config["height"], config["width"]) for f in (frames, frames // VAE_TEMPORAL))
    return (f"{frames} frames x {full[1]} x {full[2]} = {math.prod(full):,} tokens without temporal compression, "
            f"{compressed[0]} latent frames = {math.prod(compressed):,} with a {VAE_TEMPORAL}x temporal VAE")


def read_results(results_dir: Path, experiment: str) -> list[tuple[str, dict]]:
    """(name, data) of every result JSON of `experiment` in the results folder, by name."""
    return [(f.stem, json.loads(f.read_text())) for f in result_files(experiment, results_dir)]


def oom_results(results_dir: Path) -> list[tuple[str, dict]]:
    """The oom_thresholds results, as (name, data): measured GPU runs and planner-only tables."""
    return read_results(results_dir, "oom_thresholds")


def measured_cells(results: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(file, cell) of every cell measured on a GPU (planner-only tables excluded)."""
    return [(name, {**c, "file": name}) for name, r in results
            if not r.get("plan_only") and r.get("hardware", {}).get("gpus") for c in r["tables"]["cells"]]


def most_frames_fitting(cells: list[tuple[str, dict]]) -> dict[tuple[str, str, str], int]:
    """(model, attention, mode) -> the most frames of a cell that measured "fits"."""
    most: dict[tuple[str, str, str], int] = {}
    for _, c in cells:
        if c["status"] == "fits":
            key = (c["model"], c["attention"], c["mode"])
            most[key] = max(most.get(key, 0), c["frames"])
    return most


def first_walls(cells: list[tuple[str, dict]]) -> list[str]:
    """Per (model, attention, mode), its fewest-frames cell beyond the most frames that fit that ran into a wall
    (OOM, a time limit, host RAM): what the wall is, in the cell's own words ("not run" cells, cut by the run's
    budget, are no wall; nor is an earlier run's limit on a length that another run fits)."""
    most, walls = most_frames_fitting(cells), {}
    for _, c in cells:
        key = (c["model"], c["attention"], c["mode"])
        if (c["status"] not in ("fits", "not run") and c["frames"] > most.get(key, 0)
                and (key not in walls or c["frames"] < walls[key]["frames"])):
            walls[key] = c
    return [f"{m} {a} {mode} at {c['frames']} frames: {c['status']}" + (f" ({c['phase']})" if c.get("phase") else "")
            for (m, a, mode), c in sorted(walls.items())]


def planner_error(cells: list[tuple[str, dict]], predicted: Callable[[dict], float | None]) -> tuple[float, dict] | None:
    """The worst |predicted / measured - 1| of peak HBM over cells that fit, with its cell; None if none.
    `predicted(cell)` gives the prediction in GB (None: no prediction for that cell: not compared)."""
    errors = [(abs(p / c["measured_peak_GB"] - 1), c) for _, c in cells
              if c["status"] == "fits" and c.get("measured_peak_GB") and (p := predicted(c))]
    return max(errors, key=lambda ec: ec[0], default=None)


def accuracy_word(error: float) -> str:
    """C3's planner rule: "met" if every measured cell that fits is within PLANNER_TARGET, else "not met"."""
    return "met" if error <= PLANNER_TARGET else "not met"


def plan_row(plans: list[dict], model: str, attention: str, mode: str, frames: int, slab_frames: int = 0
             ) -> dict | None:
    """The planner-only row of that cell, run with the same frame slabs (a cell without the key had none)."""
    return next((c for plan in plans for c in plan["tables"]["cells"]
                 if (c["model"], c["attention"], c["mode"], c["frames"], c.get("slab_frames", 0))
                 == (model, attention, mode, frames, slab_frames)), None)


def _cell_name(c: dict) -> str:
    return f"{c['model']} {c['attention']} {c['mode']} {c['frames']} frames"


def _error_text(found: tuple[float, dict] | None, whose: str, predicted: Callable[[dict], float]) -> str:
    if found is None:
        return f"{whose}: no measured cell to check"
    err, c = found
    return (f"{whose}: {accuracy_word(err)} (worst |predicted/measured - 1| = {100 * err:.0f}% at {_cell_name(c)}: "
            f"{predicted(c):.1f} vs {c['measured_peak_GB']:.1f} GB; target {100 * PLANNER_TARGET:.0f}%)")


FLOOR_TARGET = 0.25     # C3 / issue 15: the planner's step-time floor counts as accurate within 25% of the measured step


def cell_model(name: str) -> DiTConfig:
    """The DiT of an oom_thresholds model name: a preset ("1B"), or a preset's width at a depth ("7B width, depth 23")."""
    preset, _, depth = name.partition(" width, depth ")
    return dataclasses.replace(DIT_PRESETS[preset], depth=int(depth)) if depth else DIT_PRESETS[preset]


def todays_floor(c: dict) -> float:
    """A measured cell's step-time floor with today's compute model: its run's floor (the max of compute, PCIe and
    AdamW), with the compute's matmul and attention terms as the run planned them plus today's elementwise term
    (recorded by runs that had it; else every block's forward, its recompute, a slab re-run with several slabs
    and a 2-pass backward, at the planner's HBM ceiling)."""
    if "predicted_elementwise_s" in c:
        return c["predicted_floor_s"]
    passes = 4 + (0 < c.get("slab_frames", 0) < c["frames"])
    elementwise = planner.elementwise_seconds(cell_model(c["model"]), c["tokens"], passes, planner.Ceilings())
    return max(c["predicted_floor_s"], c["predicted_matmul_s"] + c["predicted_attention_s"] + elementwise)


def floor_text(cells: list[tuple[str, dict]]) -> str:
    """C3's floor rule: "met" if today's floor of every measured cell that fits is within FLOOR_TARGET of its step."""
    ratios = [(todays_floor(c) / c["step_s"], c) for _, c in cells
              if c["status"] == "fits" and c.get("step_s") and "predicted_matmul_s" in c]
    if not ratios:
        return "step-time floor: no measured cell to check"
    worst, c = max(ratios, key=lambda rc: abs(rc[0] - 1))
    return (f"step-time floor, today's compute model on {len(ratios)} measured cells (its elementwise term calibrated "
            f"on one of them, see megaslide/perf/planner.py ELEMENTWISE_BYTES): "
            f"{'met' if abs(worst - 1) <= FLOOR_TARGET else 'not met'} (worst floor/step = {worst:.2f} at "
            f"{_cell_name(c)}: {todays_floor(c):.1f} vs {c['step_s']:.1f} s; target within {100 * FLOOR_TARGET:.0f}%)")


def c3(results_dir: Path):
    results = oom_results(results_dir)
    cells = measured_cells(results)
    plans = [(n, r) for n, r in results if r.get("plan_only")]
    if not cells:
        return "not measured", "-"
    files = {n for n, _ in cells}
    src = ", ".join(link(results_dir, "oom_thresholds", n) for n in sorted(files))
    most = most_frames_fitting(cells)
    fitting = "; ".join(f"{m} {a} {mode}: {f}" for (m, a, mode), f in sorted(most.items()))
    model, attention, mode = "1B", "dsa", "chunked_offload"
    top = max((c for _, c in cells if (c["model"], c["attention"], c["mode"], c["status"]) ==
               (model, attention, mode, "fits")), key=lambda c: c["frames"], default=None)
    config = next(r["config"] for n, r in results if n in files)
    ours = [f"measured on one H200, most frames per (model, attention, mode) that fit: {fitting} ({src})"]
    if top:
        ours.append(f"headline: {model} {attention}, chunked blocks + activation offload, {top['frames']} latent frames "
                    f"of {config['height']}x{config['width']} ({top['tokens']:,} tokens): {top['step_s']:.1f} s/step "
                    f"(n={top['timed_steps']} timed step{'s' if top['timed_steps'] != 1 else ''}), peak "
                    f"{top['measured_peak_GB']:.1f} GB measured vs {top['predicted_peak_GB']:.1f} GB predicted")
    reached = max((f for (m, _, _), f in most.items() if m == model), default=0)
    verdict = [f"{TARGET_FRAMES}-frame target ({model} at {TARGET_FRAMES} frames): "
               + (f"met (a measured {model} cell of {reached} frames fits)" if reached >= TARGET_FRAMES else
                  f"not met: no measured cell of {TARGET_FRAMES} frames fits; the most for {model} is {reached} frames"),
               _error_text(planner_error(cells, lambda c: c.get("predicted_peak_GB")), "planner accuracy as recorded "
                           "by the runs", lambda c: c["predicted_peak_GB"])]
    if plans:
        names, tables = ", ".join(f"{n}.json" for n, _ in plans), [r for _, r in plans]
        row = plan_row(tables, model, attention, mode, TARGET_FRAMES, top.get("slab_frames", 0) if top else 0)
        if row:
            where = "within" if row["predicted_peak_GB"] <= row["budget_GB"] else "over"
            ours.append(f"{TARGET_FRAMES} frames ({clip_tokens(TARGET_FRAMES, plans[-1][1]['config'], model)}): the "
                        f"planner predicts {row['predicted_peak_GB']:.0f} GB peak HBM in the {row['predicted_phase']} "
                        f"for {model} {attention} {mode}, {where} the {row['budget_GB']:.1f} GB budget it assumed "
                        f"(predicted; {', '.join(link(results_dir, 'oom_thresholds', n) for n, _ in plans)})")

        def replanned(c):
            if c["attention"] == "dsa" and c["file"] not in current:
                return None        # measured with the old DSA backward, whose scratch today's planner no longer counts
            r = plan_row(tables, c["model"], c["attention"], c["mode"], c["frames"], c.get("slab_frames", 0))
            return r and r["predicted_peak_GB"]
        current = {n for n, r in results if descends_from(r.get("commit", ""), DSA_HEAD_GROUPS)}
        verdict.append(_error_text(planner_error(cells, replanned), f"today's planner ({names}) on the same cells",
                                   replanned))
    verdict.append(floor_text(cells))
    walls = first_walls(cells)
    if walls:
        ours.append("first cell that does not fit per (model, attention, mode): " + "; ".join(walls))
    not_run = sorted({f"{c['model']} {c['attention']} {c['mode']}" for _, c in cells if c["status"] == "not run"
                      and (c["model"], c["attention"], c["mode"]) not in most})
    if not_run:
        ours.append(f"not run (time budget), no cell measured: {', '.join(not_run)}")
    return "; ".join(ours + [layer_peaks(results_dir)]), "; ".join(verdict)


def layer_peaks(results_dir: Path) -> str:
    """The attention layer alone at the sweep's largest clip: fwd+bwd peak HBM of fused DSA and Swin."""
    s = load(results_dir, "attention", "h200_sweep")
    if not s:
        return "attention layer alone not measured"
    sweep = s["tables"]["sweep"]
    big = {r["variant"]: r for r in sweep if r["tokens"] == max(x["tokens"] for x in sweep)}
    target = {r["variant"]: r for r in s["tables"]["target"]}
    d, t = target["dense"], target["dsa_fused"]
    f, w = big["dsa_fused"], big["swin2x4x4"]
    return (f"attention layer alone at {f['tokens'] / 1e6:.2f} M tokens, fwd+bwd peak: DSA fused {f['peak_gb']:.1f} GB, "
            f"Swin {w['peak_gb']:.1f} GB; at {d['tokens'] / 1e3:.0f}K tokens fused DSA peaks "
            f"{'above' if t['peak_gb'] > d['peak_gb'] else 'at or below'} dense flash ({t['peak_gb']:.1f} vs "
            f"{d['peak_gb']:.1f} GB); dense flash not run past {d['tokens'] / 1e3:.0f}K tokens (time, not memory, "
            f"is its wall) ({link(results_dir, 'attention', 'h200_sweep')})")


PAPER_STEP_S, PAPER_PARAMS = 3.1, 105e9   # C4 as the paper states it: 3.1 s per step of its 105B model
HOST_CORES = 16                             # the CPU the CPU AdamW floor is scaled to


def pcie_rates(results_dir: Path) -> list[tuple[str, float, float]]:
    """(file, H2D GB/s, D2H GB/s) of every GPU result that measured PCIe (`ceilings.pcie`)."""
    found = []
    for f in sorted(results_dir.glob("*/*.json")):
        pcie = (json.loads(f.read_text()).get("ceilings") or {}).get("pcie")
        if pcie:
            found.append((f"{f.parent.name}/{f.stem}", pcie["h2d_GBps"], pcie["d2h_GBps"]))
    return found


def adam_rate(result: dict, workload: str = "bf16 grad + bf16 out") -> tuple[float, int, int]:
    """Our CPU AdamW's rate (params/s) on `workload` (the engine's pass: bf16 grads in, bf16 weights out)
    at the largest size measured: (rate, params it was measured at, threads)."""
    rows = [r for r in result["results"] if r["variant"] == "megaslide" and r["workload"] == workload]
    top = max(rows, key=lambda r: r["params"])
    return top["gparams_per_s"] * 1e9, top["params"], result["threads"]


def step_floors(params: float, rates: list[tuple[str, float, float]], adam: tuple[float, int, int]) -> dict:
    """Lower bounds on one offloaded training step of `params` parameters: bf16 weights H2D twice (forward and
    the backward's re-stream) and bf16 gradients D2H once. Both directions overlap, so PCIe needs
    max(H2D, D2H) bytes / rate (serially their sum); CPU AdamW needs params / rate, scaled to HOST_CORES."""
    h2d, d2h = 2 * 2 * params, 2 * params
    overlapped = [max(h2d / (up * 1e9), d2h / (down * 1e9)) for _, up, down in rates]
    serial = [h2d / (up * 1e9) + d2h / (down * 1e9) for _, up, down in rates]
    rate, _, threads = adam
    return {"h2d_GB": h2d / 1e9, "d2h_GB": d2h / 1e9, "pcie_s": (min(overlapped), max(overlapped)),
            "pcie_serial_s": (min(serial), max(serial)), "adam_s": params / (rate * HOST_CORES / threads)}


def physics_105b(results_dir: Path) -> tuple[str, str] | None:
    """C1/C4: the paper's 105B step time against the floors at our measured PCIe and CPU AdamW rates."""
    rates, adam = pcie_rates(results_dir), load(results_dir, "cpu_adam", "h200")
    if not rates or not adam:
        return None
    rate, size, threads = adam_rate(adam)
    f = step_floors(PAPER_PARAMS, rates, (rate, size, threads))
    lo, hi = f["pcie_s"]
    ups, downs = [u for _, u, _ in rates], [d for _, _, d in rates]
    scaled = "" if threads == HOST_CORES else f", scaled from {threads} threads to {HOST_CORES} cores"
    floor = max(lo, f["adam_s"])
    text = (f"floor of one step of the paper's {PAPER_PARAMS / 1e9:.0f}B model (computed, not run): bf16 weights H2D "
            f"twice ({f['h2d_GB']:.0f} GB) and bf16 grads D2H once ({f['d2h_GB']:.0f} GB) at the measured PCIe "
            f"{min(ups):.1f}-{max(ups):.1f} GB/s H2D, {min(downs):.1f}-{max(downs):.1f} GB/s D2H ({len(rates)} H200 "
            f"results' `ceilings.pcie`) need >= {lo:.1f}-{hi:.1f} s with both directions overlapped "
            f"({f['pcie_serial_s'][0]:.1f}-{f['pcie_serial_s'][1]:.1f} s serially); CPU AdamW at the measured "
            f"{rate / 1e9:.2f} G params/s (bf16 grad + bf16 out, {size / 1e6:.0f}M params, {threads} threads"
            f"{scaled}; {link(results_dir, 'cpu_adam', 'h200')}) needs >= {f['adam_s']:.1f} s")
    word = "below our floor" if PAPER_STEP_S < floor else "above our floor"
    return text, (f"the paper's {PAPER_STEP_S} s/step at {PAPER_PARAMS / 1e9:.0f}B is {word} of {floor:.1f} s "
                  f"(rule: compared with max(PCIe floor, CPU AdamW floor))")


MFU_RESULT = "h200_7Bwidth_d20_5steps"   # C4, C5: the offload engine at the 7B width, 5 timed steps


def c4(results_dir: Path):
    ours, verdict = mfu_c4(results_dir)
    physics = physics_105b(results_dir)
    return (ours, verdict) if physics is None else (f"{ours}; {physics[0]}", f"{verdict}; {physics[1]}")


def mfu_c4(results_dir: Path):
    m = load(results_dir, "mfu_overlap", MFU_RESULT)
    if not m:
        return "not measured", "-"
    v = {r["variant"]: r for r in m["variants"]}
    o, s, b = v["overlap"], v["serial"], m["bench"]
    params = count_params(from_dict(DiTConfig, m["model_cfg"]))
    patch = m["model_cfg"]["patch_size"]
    tokens = b["batch"] * b["frames"] // patch[0] * (b["height"] // patch[1]) * (b["width"] // patch[2])
    peak, sheet, gain = o["mfu_vs_measured_peak"], o["mfu_vs_datasheet"], s["step_s"] / o["step_s"]
    reached = [x >= PAPER_MFU for x in (peak, sheet)]
    word = "supported" if all(reached) else "reproduced against the measured peak only" if any(reached) else \
        "not reproduced"
    timed = b["timed_steps"]
    spread = timed >= MIN_TIMED_STEPS and any(k.startswith("step_s_") for k in o)
    timing = (f"; {timed} timed steps, {o['step_s_min']:.2f}-{o['step_s_max']:.2f} s" if spread else
              f"; the JSON holds {timed} timed steps and no spread: one measurement, not a median over "
              f">= {MIN_TIMED_STEPS}")
    return (f"{m['attention']} attention, {m['model_cfg']['dim']}-wide, {m['depth']} blocks ({params / 1e9:.2f} B "
            f"params), {_tokens(tokens)} tokens/step, one H200: {o['step_s']:.2f} s/step with overlap, MFU "
            f"{100 * peak:.1f}% of the measured matmul peak ({100 * sheet:.1f}% of the "
            f"{m['ceilings']['datasheet_TFLOPs']:.0f} TFLOP/s datasheet); serial {100 * s['mfu_vs_measured_peak']:.1f}% "
            f"({100 * s['mfu_vs_datasheet']:.1f}%){timing} "
            f"({link(results_dir, 'mfu_overlap', MFU_RESULT)})",
            f"{word}: MFU {100 * peak:.1f}% (measured peak) / {100 * sheet:.1f}% (datasheet) vs "
            f"{100 * PAPER_MFU:.0f}%; overlap gain {gain:.2f}x vs {PAPER_MFU / PAPER_MFU_SERIAL:.2f}x"
            + ("" if spread else f" (from {timed} timed steps, no spread)"))


SCALING_COMMAND = "python -m experiments.scaling"


CLAIMED_SPEEDUP = 2.11   # C9: the streamed forward's overlapped-vs-serial speedup the paper reports ...
CLAIMED_AT_B = 28.4      # ... at this many billion parameters


def c9(results_dir: Path):
    """C9 from the latest GPU scaling run; without one, from the planner-only result (predicted, never measured)."""
    results = read_results(results_dir, "scaling")
    runs = [(n, r) for n, r in results if not r.get("plan_only") and r.get("hardware", {}).get("gpus")]
    if runs:
        return measured_scaling(results_dir, *runs[-1])
    plans = [(n, r) for n, r in results if r.get("plan_only")]
    if not plans:
        return f"not measured: no scaling result; run `{SCALING_COMMAND}` on a GPU", "not measured"
    name, plan = plans[-1]
    return predicted_scaling(results_dir, name, plan)


def scaling_word(ran: list[dict]) -> str:
    """C9's speedup rule: "supported" if every preset run at CLAIMED_AT_B or more reaches CLAIMED_SPEEDUP,
    "not reproduced" if one falls short, "not measured" at that size if no preset that large ran."""
    at_size = [r["full_forward_speedup"] for r in ran if r["params_B"] >= CLAIMED_AT_B]
    if not at_size:
        largest = max((r["params_B"] for r in ran), default=0.0)
        return f"not measured at {CLAIMED_AT_B} B (the largest preset run is {largest:.1f} B)"
    return "supported" if min(at_size) >= CLAIMED_SPEEDUP else "not reproduced"


def measured_scaling(results_dir: Path, name: str, run: dict) -> tuple[str, str]:
    """C9's cell from a GPU scaling run: per preset run, fits or not under the full HBM and the cap, measured
    peak and forward speedup beside the planner's; presets host RAM cannot hold, the planner's figures."""
    c, rows = run["config"], run["tables"]["presets"]
    ran = sorted((r for r in rows if r["measured"] == "run"), key=lambda r: r["params_B"])
    gpu = run["hardware"]["gpus"][0]
    per = [f"{r['preset']} ({r['params_B']:.1f} B): full HBM {r['full_status']}, {c['cap_GB']:.0f} GB cap "
           f"{r['cap_status']}, peak {r['full_measured_peak_GB']:.1f} GB (planner {r['predicted_peak_GB']:.1f}), "
           f"forward overlapped vs serial {r['full_forward_speedup']:.2f}x (planner {r['predicted_forward_speedup']:.2f}x)"
           for r in ran]
    per += [f"{r['preset']} ({r['params_B']:.1f} B): predicted only (needs {r['predicted_host_GB']:.0f} GB host RAM), "
            f"fits the cap {'yes' if r['predicted_fits_cap'] else 'no'}, forward {r['predicted_forward_speedup']:.2f}x"
            for r in rows if r["measured"] != "run"]
    fits_cap = [r for r in ran if r["cap_status"] == "fits"]
    speedups = [r["full_forward_speedup"] for r in ran]
    grows = len(speedups) > 1 and all(a < b for a, b in zip(speedups, speedups[1:]))
    trend = " -> ".join(f"{r['full_forward_speedup']:.2f}x at {r['params_B']:.1f} B" for r in ran)
    return (f"measured on one {gpu}, the {c['cap_GB']:.0f} GB card emulated with the memory fraction "
            f"({link(results_dir, 'scaling', name)}; {c['frames']}x{c['height']}x{c['width']} latents, "
            f"{c['attention']}, {c['forward_repeats']} timed forwards per mode): " + "; ".join(per),
            f"speedup {CLAIMED_SPEEDUP}x at {CLAIMED_AT_B} B: {scaling_word(ran)}; the speedup "
            f"{'grows' if grows else 'does not grow'} with size ({trend}); the largest preset measured to fit the "
            f"{c['cap_GB']:.0f} GB cap is " + (f"{fits_cap[-1]['preset']} ({fits_cap[-1]['params_B']:.1f} B)"
                                               if fits_cap else "none"))


def predicted_scaling(results_dir: Path, name: str, plan: dict) -> tuple[str, str]:
    """C9's cell from a plan_only scaling result: per preset the planner's peak HBM against the full HBM and the
    cap, whether host RAM holds it, and the streamed forward's predicted overlap-vs-serial speedup."""
    c, rows = plan["config"], plan["tables"]["presets"]
    per = "; ".join(f"{r['preset']} ({r['params_B']:.1f} B): {r['predicted_peak_GB']:.0f} GB HBM, fits "
                    f"{c['cap_GB']:.0f} GB {'yes' if r['predicted_fits_cap'] else 'no'}, host "
                    f"{r['predicted_host_GB']:.0f} GB ({'held' if r['host_holds_it'] else 'not held'}), forward "
                    f"{r['predicted_forward_speedup']:.2f}x" for r in rows)
    both = [r for r in rows if r["predicted_fits_cap"] and r["host_holds_it"]]
    largest = max(both, key=lambda r: r["params_B"], default=None)
    return (f"planner only, nothing run ({link(results_dir, 'scaling', name)}; "
            f"{c['frames']}x{c['height']}x{c['width']} latents, "
            f"{c['attention']}; budgets {c['hbm_budget_GB']} GB HBM, {c['host_budget_GB']:.0f} GB host, "
            f"{c['cap_GB']:.0f} GB cap; forward speedup at the planner's default ceilings): {per}",
            f"predicted, not measured: the largest preset that fits the {c['cap_GB']:.0f} GB cap and "
            f"{c['host_budget_GB']:.0f} GB host RAM is "
            + (f"{largest['preset']} ({largest['params_B']:.1f} B)" if largest else "none")
            + f"; GPU run: `{SCALING_COMMAND}`")


def c5(results_dir: Path):
    m = load(results_dir, "mfu_overlap", MFU_RESULT)
    if not m:
        return "not measured", "-"
    g = next(r for r in m["variants"] if r["variant"] == "gpu_optimizer")
    return (f"GPU optimizer (master + moments streamed): MFU {100 * g['mfu_vs_measured_peak']:.1f}% "
            f"({link(results_dir, 'mfu_overlap', MFU_RESULT)})",
            "supported" if g["mfu_vs_measured_peak"] <= PAPER_MFU_GPU_OPT else
            f"drop measured, smaller than the paper's: {100 * g['mfu_vs_measured_peak']:.1f}% vs {100 * PAPER_MFU_GPU_OPT:.0f}%")


# ---- quality claims (C6-C8): pooling over seeds and one verdict rule ----

# Run settings that two quality results must share to pool, besides their config (seeds aside) and the
# scorer version: setting -> where a result records it (config keys, then Hydra overrides of its command).
POOL_SETTINGS = {"model": ("model",), "batch": ("batch_size", "batch_sizes", "train.batch_size"),
                 "n_eval": ("n_eval",), "eval_seed": ("eval_seed",)}
VERDICT_KEYS = ("text_alignment", "temporal_consistency")
NOT_WORSE = -0.05   # C6 "DSA matches dense": DSA may score this much lower (the paper's own gaps are 0.01-0.02)


def _overrides(command: str) -> dict:
    """The `key=value` Hydra overrides of a recorded command line, values parsed as YAML."""
    pairs = (tok.split("=", 1) for tok in shlex.split(command or "") if "=" in tok and not tok.startswith("-"))
    return {k: yaml.safe_load(v) for k, v in pairs}


def scorer_version(result: dict) -> int:
    """The MovingShapes scorer version of a result's scored rows; scored rows that carry none were scored
    by v1. Rows that were not scored (OOM, failed, not run: a status other than "ok") say nothing."""
    versions = {int(r.get("scorer_version", 1)) for r in result.get("tables", {}).get("per seed", [])
                if r.get("status", "ok") == "ok"}
    if len(versions) > 1:
        raise ValueError(f"a result mixes rows of scorer versions {sorted(versions)}; score a run with one scorer")
    return versions.pop() if versions else 1


def run_settings(result: dict) -> dict | None:
    """What two quality results must share to pool: their config without seeds, the POOL_SETTINGS
    (None where a result records them nowhere) and the scorer version. None if it has no config."""
    if "config" not in result:
        return None
    config = {k: v for k, v in result["config"].items() if k != "seeds"}
    given = {**_overrides(result.get("command", "")), **config}
    settings = {name: next((given[k] for k in keys if k in given), None) for name, keys in POOL_SETTINGS.items()}
    return {**config, **settings, "scorer_version": scorer_version(result)}


def config_key(result: dict) -> str | None:
    settings = run_settings(result)
    return None if settings is None else json.dumps(settings, sort_keys=True, default=str)


@dataclass
class Pooled:
    rows: dict          # (variant, frames) -> mean / sample-std row over the pooled seeds (ground truth included)
    per_seed: list      # the row of each pooled run (seed_runs; no ground truth)
    settings: dict      # run_settings shared by the pooled files
    links: list[str]

    @property
    def training(self) -> str:
        """The training of one run: "N steps", or per clip with each clip's batch ("2800 + 1400 steps
        (batch 8, 8)" for a progressive study)."""
        clip_steps, batch = self.settings.get("clip_steps"), self.settings.get("batch")
        if not clip_steps or len(clip_steps) < 2:
            return f"{self.settings['steps']} steps"
        shown = f" (batch {', '.join(str(b) for b in batch)})" if isinstance(batch, list) else ""
        return " + ".join(str(s) for s in clip_steps) + " steps" + shown

    def eval_error(self, variant: str, frames: int, key: str) -> float:
        """A run's sampling error of `key` from scoring n_eval clips: the mean of its per-seed standard
        errors where rows record them, else sqrt(p (1 - p) / n_eval) (exact for the 0/1 caption match, an
        upper bound for a [0, 1] score); NaN if n_eval is unknown."""
        recorded = [r[f"{key}_se"] for r in self.per_seed
                    if (r["variant"], r["frames"]) == (variant, frames) and f"{key}_se" in r]
        if recorded:
            return sum(recorded) / len(recorded)
        p, n = self.rows[(variant, frames)][f"{key}_mean"], self.settings["n_eval"]
        return math.sqrt(p * (1 - p) / n) if n else math.nan


def seed_runs(group: list[tuple[str, dict]]) -> dict[tuple, tuple[str, dict]]:
    """(variant, frames, seed) -> (file name, per-seed row) over the files of one pool. A run that several
    files hold (a seed run again, e.g. a pilot and the study that repeated it) counts once: its
    finished row before one that did not finish, then the newest file's (by date, then name)."""
    runs: dict[tuple, tuple[str, dict]] = {}
    for name, r in sorted(group, key=lambda nr: (nr[1].get("date", ""), nr[0])):
        for row in r["tables"]["per seed"]:
            key = (row["variant"], row["frames"], row.get("seed"))
            if row["variant"] != "ground_truth" and (row.get("status") == "ok" or key not in runs
                                                     or runs[key][1].get("status") != "ok"):
                runs[key] = (name, row)
    return runs


def training_clips(settings: dict) -> int:
    """Clips one run of a recipe trains on: steps x batch, summed over its clip lengths."""
    batches, steps = settings.get("batch") or 0, settings.get("clip_steps") or [settings.get("steps") or 0]
    batches = batches if isinstance(batches, list) else [batches] * len(steps)
    return sum(int(s) * int(b) for s, b in zip(steps, batches))


def pooled(results_dir: Path, experiment: str) -> Pooled | None:
    """The GPU results of `experiment` pooled over their per-seed rows (seed_runs): of the files that
    share one run_settings key, the group of the newest scorer, then of the recipe that trains each
    run on the most clips (training_clips: the claims are about trained models, and a recipe is
    chosen by its design, never by its scores), then with the most finished runs (e.g. a run cut
    short and the run that added its missing seeds). None if there is no GPU result."""
    groups: dict[str, list] = {}
    for name, r in read_results(results_dir, experiment):
        if r.get("hardware", {}).get("gpus") and "config" in r:
            groups.setdefault(config_key(r), []).append((name, r))

    def rank(group):
        finished = sum(row.get("status") == "ok" for _, row in seed_runs(group).values())
        return scorer_version(group[0][1]), training_clips(run_settings(group[0][1])), finished
    if not groups:
        return None
    group = max(groups.values(), key=rank)
    runs = seed_runs(group)
    per_seed = [row for _, row in runs.values()]
    truth = [row for row in group[0][1]["tables"]["per seed"] if row["variant"] == "ground_truth"]
    rows = {(r["variant"], r["frames"]): r for r in aggregate(per_seed + truth, ddof=1)}
    used = {name for name, _ in runs.values()}
    return Pooled(rows, per_seed, run_settings(group[0][1]),
                  [link(results_dir, experiment, n) for n, _ in group if n in used])


def _scores(r: dict) -> str:
    return (f"TC {r['temporal_consistency_mean']:.2f}, TA {r['text_alignment_mean']:.2f}, "
            f"motion err {r['motion_error_mean']:.2f} ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''})")


def undertrained(p: Pooled, frames: int) -> str | None:
    """Why the pooled models at this clip length are too weak to test a claim (their best TA < half the
    ground truth's at that length, or the pool's best ground truth where it scored none there), or None.
    Per clip length: models that learned the captions at 16 frames may not have at 64."""
    def top(models: bool, at: int | None) -> float:
        return max((r["text_alignment_mean"] for (v, fr), r in p.rows.items()
                    if (v != "ground_truth") == models and at in (None, fr)
                    and not math.isnan(r["text_alignment_mean"])), default=math.nan)
    best, truth = top(True, frames), top(False, frames)
    truth = top(False, None) if math.isnan(truth) else truth
    return f"under-trained: best TA {best:.2f} vs ground truth {truth:.2f}" if best < truth / 2 else None


@dataclass
class Gap:
    """a - b of one pooled score and the margin it must clear to count."""
    key: str
    diff: float
    margin: float   # 2 x the combined spread of one run of each: seed-to-seed sample std and sampling error


def gap(p: Pooled, a: str, b: str, frames: int, key: str) -> Gap:
    ra, rb = p.rows[(a, frames)], p.rows[(b, frames)]
    spread = sum(r[f"{key}_std"] ** 2 + p.eval_error(v, frames, key) ** 2 for v, r in ((a, ra), (b, rb)))
    return Gap(key, ra[f"{key}_mean"] - rb[f"{key}_mean"], 2 * math.sqrt(spread))


def decide(gaps: list[Gap], claimed: float, weak: str | None) -> tuple[str, str]:
    """The one verdict rule of C6-C8, for a claim that a - b > `claimed` on every gap.

    inconclusive if the models are under-trained (`weak`) or a margin is unknown (one seed, or
    n_eval unknown); else supported if every diff - margin > claimed, contradicted if some
    diff + margin < claimed, inconclusive otherwise. Returns (word, why)."""
    if weak:
        return "inconclusive", weak
    if any(math.isnan(g.margin) for g in gaps):
        return "inconclusive", "margin unknown (one seed, or n_eval not recorded)"
    if all(g.diff - g.margin > claimed for g in gaps):
        return "supported", "beyond the margin"
    if any(g.diff + g.margin < claimed for g in gaps):
        return "contradicted", "the other way beyond the margin"
    return "inconclusive", "inside the margin"


ABBREV = {"text_alignment": "TA", "temporal_consistency": "TC"}


SUPERSEDED = "not counted"


@dataclass(frozen=True)
class QualityClaim:
    """Paper: `variant` - `baseline` > `claimed` on each of `keys`, tested at every clip length of each study.
    Only the studies scored by the newest scorer among them vote, as within one study's pool (`pooled`):
    the older scorer's scores are reported, but v1 let a frozen clip score full consistency."""
    variant: str
    baseline: str
    keys: tuple[str, ...]
    claimed: float
    studies: tuple[str, ...]

    def judge(self, results_dir: Path) -> tuple[str, str]:
        found = [(e, p) for e in self.studies if (p := pooled(results_dir, e))]
        if not found:
            return "not measured at GPU scale", "open"
        ours, parts = [], []
        newest = max(p.settings["scorer_version"] for _, p in found)
        for experiment, p in found:
            version = p.settings["scorer_version"]
            for frames in sorted({fr for v, fr in p.rows if v == "ground_truth"}):   # every clip of the study
                where = f"{experiment}, {frames} frames"
                missing = [v for v in (self.variant, self.baseline) if (v, frames) not in p.rows]
                if missing:
                    ours.append(f"{where}: no finished run of {' or '.join(missing)}")
                    word, text = "inconclusive", f"not measured (no finished run of {' or '.join(missing)})"
                else:
                    a, b = p.rows[(self.variant, frames)], p.rows[(self.baseline, frames)]
                    gaps = [gap(p, self.variant, self.baseline, frames, k) for k in VERDICT_KEYS]
                    word, why = decide([g for g in gaps if g.key in self.keys], self.claimed, undertrained(p, frames))
                    ours.append(f"{where}: {self.variant} {_scores(a)} vs {self.baseline} {_scores(b)}")
                    measured = ", ".join(f"{ABBREV[g.key]} {g.diff:+.2f} (margin ±{g.margin:.2f})" for g in gaps)
                    text = f"{why}; {self.variant} minus {self.baseline} {measured}"
                if version < newest:
                    word, text = SUPERSEDED, f"scorer v{version}, the verdict uses v{newest} ({word}, {text})"
                parts.append((word, f"{where}: {word}, {text}"))
            truth = max(fr for v, fr in p.rows if v == "ground_truth")
            gt = p.rows[("ground_truth", truth)]
            ours.append(f"{experiment} ground truth TC {gt['temporal_consistency_mean']:.2f}, TA "
                        f"{gt['text_alignment_mean']:.2f}; {p.training}, n_eval {p.settings['n_eval']}, scorer "
                        f"v{version}, H200 ({', '.join(p.links)})")
        words = {w for w, _ in parts} - {SUPERSEDED}
        overall = "contradicted" if "contradicted" in words else "supported" if words == {"supported"} else \
            "inconclusive"
        return "; ".join(ours), f"{overall}: " + "; ".join(text for _, text in parts)


QUALITY_CLAIMS = {
    "C6": QualityClaim("dsa", "dense", VERDICT_KEYS, NOT_WORSE, ("quality",)),
    "C7": QualityClaim("dsa", "swin", ("temporal_consistency",), 0.0, ("quality",)),
    "C8": QualityClaim("dsa", "dsa_zero", ("temporal_consistency",), 0.0, ("ablate_offsets", "quality")),
}


def widest(results_dir: Path, experiment: str, ranks_key: str, timed: str | None = None) -> tuple[str, dict] | None:
    """The GPU result of `experiment` with the most ranks, as (name, data); CPU smoke runs excluded.
    `timed`: only results with a finished timing of that variant (runs may time a subset)."""
    found = [(n, d) for n, d in read_results(results_dir, experiment) if str(d.get("device", "")).startswith("cuda")
             and (timed is None or any(r["variant"] == timed and "time_s" in r for r in d.get("timings", [])))]
    return max(found, key=lambda nd: nd[1].get(ranks_key, 0), default=None)


def _ladder(result: dict) -> list[tuple[str, float]]:
    """The causal optimisation ladder of a result at its own rank count: (rung, total seconds) in order."""
    return [(r["variant"].removeprefix("causal: "), r["total_s"]) for r in result["rows"]
            if r["variant"].startswith("causal") and r["ranks"] == result["ranks"]]


def _slower_rungs(ladder: list[tuple[str, float]]) -> list[str]:
    return [f"{rung} ({before:.2f} -> {after:.2f} s)" for (_, before), (rung, after) in zip(ladder, ladder[1:])
            if after > before]


def s_claim(which):
    def f(results_dir: Path):
        one, wide = load(results_dir, "sp_inference", "wan-1.3b_P1"), widest(results_dir, "sp_inference", "ranks")
        if not one:
            return "not measured", "-"
        name, p = wide if wide and wide[1]["ranks"] > 1 else ("wan-1.3b_P1", one)
        P, s, src = p["ranks"], p["summary"], link(results_dir, "sp_inference", name)
        where = f"{P} H200{'s' if P > 1 else ''}"
        if which == "S3":
            vs = s["speedup_vs_full_sequence_total"]
            scaling = (f"; {s['speedup_vs_1gpu_total']:.2f}x over 1 GPU (target 1.8x)" if P > 1 else
                       "; 2 and 8 GPUs not run")
            return (f"{where}, wan-1.3b shapes, 21 latent frames: causal {s['total_s']:.2f} s vs full-sequence "
                    f"{s['total_s'] * vs:.2f} s = {vs:.2f}x{scaling} ({src})",
                    f"{'supported' if s['speedup_vs_full_meets_1.58x'] else 'not reproduced'} on {where} "
                    f"(paper: 8 GPUs)")
        if which == "S4":
            one_ms = one["summary"]["ttff_ms"]
            more = f", {s['ttff_ms']:.0f} ms on {where} ({src})" if P > 1 else ""
            return (f"first chunk final after {one_ms:.0f} ms on 1 H200 "
                    f"({link(results_dir, 'sp_inference', 'wan-1.3b_P1')})"
                    f"{more}; VAE decode excluded",
                    "supported (< 1 s)" if one["summary"]["ttff_1gpu_below_1s"] else "not reproduced")
        ladders = [(1, "wan-1.3b_P1", one)] + ([(P, name, p)] if P > 1 else [])
        texts, findings = [], []
        for gpus, file, result in ladders:
            ladder, slower = _ladder(result), _slower_rungs(_ladder(result))
            texts.append(f"{gpus} H200{'s' if gpus > 1 else ''}: {ladder[0][1]:.2f} s -> {ladder[-1][1]:.2f} s "
                         f"({link(results_dir, 'sp_inference', file)})")
            on = f"on {gpus} GPU{'s' if gpus > 1 else ''}"
            findings.append(f"mixed {on}: {len(slower)} of {len(ladder) - 1} rungs got slower, {', '.join(slower)}"
                            if slower else f"supported {on} (every rung faster)")
        return f"optimisation ladder, seconds per 5 s video: {'; '.join(texts)}", "; ".join(findings)
    return f


# ---- SwiftFusion ----

def degenerate_modes(result: dict) -> dict[str, str]:
    """Modes that compute exactly what another mode computes at this run's size: {mode: the mode it is}.

    From the world size and the USP degrees (U, R): with one rank every mode is local attention;
    with R = 1 the hybrids (usp, hybrid_ring_intra) are Ulysses and swiftfusion is torus; with
    U = 1 the hybrids are ring. (The JSON's own `degenerate` flag marks only one rank.)"""
    world, (u, r) = result["world_size"], result["usp_degrees"]
    if world == 1:
        return {m: "local attention" for m in ("ulysses", "ring", "usp", "hybrid_ring_intra", "torus", "swiftfusion")}
    if r == 1:
        return {"usp": "ulysses", "hybrid_ring_intra": "ulysses", "swiftfusion": "torus"}
    return {"usp": "ring", "hybrid_ring_intra": "ring"} if u == 1 else {}


def noise_band(result: dict) -> tuple[float, float] | None:
    """(min, max) layer-time ratio vs USP of the modes that compute exactly what USP does: timing noise."""
    same = degenerate_modes(result)
    usp = same.get("usp", "usp")
    ratios = [t["speedup_vs_usp"] for t in result["timings"] if t["variant"] != "usp" and "time_s" in t
              and same.get(t["variant"], t["variant"]) == usp]
    return (min(ratios), max(ratios)) if ratios else None


def _band(band: tuple[float, float] | None) -> str:
    return "no identical modes timed" if band is None else f"{band[0]:.3f}-{band[1]:.3f}x"


def against_band(values: list[float], band: tuple[float, float] | None) -> str:
    """Where speedups lie against the noise band of identical modes: "inside", "above", "below", or several."""
    if band is None:
        return "noise band unknown"
    where = {"inside" if band[0] <= x <= band[1] else "above" if x > band[1] else "below" for x in values}
    return f"{' or '.join(sorted(where))} the noise band"


def _degenerate_note(result: dict) -> str:
    same = degenerate_modes(result)
    groups: dict[str, list[str]] = {}
    for mode, target in same.items():
        groups.setdefault(target, []).append(mode)
    return "; ".join(f"{' = '.join(modes)} = {target}" for target, modes in groups.items()) or "none"


def f1(results_dir: Path, s: dict, wide: tuple[str, dict] | None) -> tuple[str, str]:
    sim = s["simulation"]
    wins = sum(r["winner_placement"] == "ring_intra" for r in sim)
    gaps = [r["ring_intra"]["total_s"] / r["usp"]["total_s"] - 1 for r in sim]
    lens = sorted({r["seq_len"] for r in sim})
    ours = (f"simulated by our cost model (not measured), {', '.join(_tokens(n) for n in lens)} tokens on "
            f"2-8 nodes: ring_intra wins {wins} of {len(sim)} cases; its predicted time is within "
            f"{100 * min(gaps):+.1f}% to {100 * max(gaps):+.1f}% of the best USP-placement plan "
            f"({link(results_dir, 'swiftfusion', 'h200_1gpu')})")
    errors = [t["measured_over_predicted"] for t in (wide[1]["timings"] if wide else [])
              if t["variant"] != "sdpa_1gpu" and "measured_over_predicted" in t]
    if not errors:
        return ours, "undetermined: the cost model was never checked against a multi-GPU measurement"
    lo, hi = min(errors), max(errors)
    checked = (f"the cost model's own error on measured SP runs (measured/predicted {lo:.2f}-{hi:.2f} on "
               f"{wide[1]['world_size']} H200s, {link(results_dir, 'swiftfusion', wide[0])})")
    if max(abs(g) for g in gaps) < abs(lo - 1):
        return ours, (f"undetermined until the model is calibrated on measurements: the predicted gaps "
                      f"({100 * min(gaps):+.1f}% to {100 * max(gaps):+.1f}%) are far smaller than {checked}")
    return ours, (f"{'supported' if wins == len(sim) else 'not supported'} by the model ({wins} of {len(sim)} "
                  f"wins; {checked}); needs multi-node hardware")


def swift(which):
    def f(results_dir: Path):
        s = load(results_dir, "swiftfusion", "h200_1gpu")
        if not s:
            return "not measured", "-"
        main = (widest(results_dir, "swiftfusion", "world_size", "torus")
                or widest(results_dir, "swiftfusion", "world_size"))
        if which == "F1":
            return f1(results_dir, s, main)
        wide = (widest(results_dir, "swiftfusion", "world_size", "ring_onesided") or main) if which == "F3" else main
        if not wide or wide[1]["world_size"] < 2:
            return ("only 1 GPU was lent: every mode degenerates to local attention "
                    f"({link(results_dir, 'swiftfusion', 'h200_1gpu')}); 2- and 8-GPU runs open", "not measured")
        name, w = wide
        P, src, band = w["world_size"], link(results_dir, "swiftfusion", name), noise_band(main[1])
        context = (f"degenerate at {P} GPUs (USP degrees {w['usp_degrees'][0]}x{w['usp_degrees'][1]}): "
                   f"{_degenerate_note(w)}; noise band of identical modes {_band(band)} "
                   f"({link(results_dir, 'swiftfusion', main[0])})")
        layer = {v: _speedups(w["timings"], v, "speedup_vs_usp", "seq_len") for v in ("torus", "swiftfusion")}
        step = {v: _speedups(w.get("denoising_step", []), v, "speedup_vs_usp", "tokens") for v in ("torus",)}
        fmt = lambda d: ", ".join(f"{_tokens(n)} {x:.2f}x" for n, x in sorted(d.items())) or "none measured"  # noqa: E731
        if which == "F2":
            at64 = layer["torus"].get(65536)
            return (f"{P} H200s, Torus vs USP, attention layer: {fmt(layer['torus'])}; denoising step: "
                    f"{fmt(step['torus'])} ({src}); {context}",
                    "target 1.2x at 64K: " + ("not measured" if at64 is None else
                                              f"{'met' if at64 >= 1.2 else 'missed'} ({at64:.2f}x, "
                                              f"{against_band([at64], band)})"))
        if which == "F3":
            ring = {r["seq_len"]: r for r in w["timings"] if r["variant"] == "ring" and "time_s" in r}
            one_sided = [r for r in w["timings"] if r["variant"] == "ring_onesided"]
            if not one_sided or one_sided[0]["status"] == "unavailable":
                why = one_sided[0].get("reason", "not run") if one_sided else "not run"
                return f"one-sided ring unavailable on {P} H200s: {why} ({src})", "not measured"
            gains = {r["seq_len"]: ring[r["seq_len"]]["time_s"] / r["time_s"] for r in one_sided
                     if "time_s" in r and r["seq_len"] in ring}
            where = against_band(list(gains.values()), band)
            word = {"above the noise band": "supported", "inside the noise band": "not shown"}.get(where, "mixed")
            return (f"{P} H200s of one node, one-sided ring vs P2P ring, attention layer: {fmt(gains)} ({src}); "
                    f"noise band of identical modes {_band(band)} ({link(results_dir, 'swiftfusion', main[0])})",
                    f"{word}: the one-sided ring's gains lie {where}")
        both = {n: x for d in layer.values() for n, x in d.items()}
        if not both:
            return f"{P} H200s: no Torus timing finished ({src})", "not measured"
        best = {n: max(d.get(n, 0) for d in layer.values()) for n in both}
        mean = sum(best.values()) / len(best)
        every = [x for d in layer.values() for x in d.values()]
        return (f"{P} H200s, vs USP per length: torus {fmt(layer['torus'])}; swiftfusion {fmt(layer['swiftfusion'])}; "
                f"range {min(every):.2f}-{max(every):.2f}x, mean of the better per length {mean:.2f}x ({src}); {context}",
                f"{'reproduced' if mean >= 1.35 else 'not reproduced'} on {P} GPUs of one node (paper: multi-node); "
                f"the speedups lie {against_band(every, band)}")
    return f


def _speedups(rows: list[dict], variant: str, key: str, length: str) -> dict[int, float]:
    return {r[length]: r[key] for r in rows if r["variant"] == variant and r.get(key)}


CLAIMS = {
    "MegaSlide-DiT": [
        Claim("C1", "105B state ~1.47 TB; moments ~840 GB", c1),
        Claim("C2", "256 frames 1080p > 2M tokens; global attention O(N^2)", c2),
        Claim("C3", "256 frames at ~115 GB peak HBM; dense OOMs at 64 frames; Swin fits", c3),
        Claim("C4", "~3.1 s/step, 61% MFU with prefetch; 28% without overlap", c4),
        Claim("C5", "optimizer on GPU: MFU 15%", c5),
        Claim("C6", "64 frames: alignment 0.81 vs dense 0.82; consistency 0.85 vs 0.87", QUALITY_CLAIMS["C6"].judge),
        Claim("C7", "256 frames: consistency 0.83 vs Swin 0.65", QUALITY_CLAIMS["C7"].judge),
        Claim("C8", "zero offsets: consistency 0.83 -> 0.67", QUALITY_CLAIMS["C8"].judge),
        Claim("C9", "H100 NVL, up to 33.3B: async streaming 2.11x forward at 28.4B", c9),
    ],
    "Causal-RoPE SP": [
        Claim("S1", "SP over 8 GPUs with RoPE positions computed locally", lambda results_dir: (
            "implemented; equal to one process on 2 and 3 gloo ranks (tests/inference/test_sp.py); 8 GPUs not run",
            "implemented, not run at 8")),
        Claim("S2", "precomputed tables, fused operators", s_claim("S2")),
        Claim("S3", "1.58x faster 5 s video", s_claim("S3")),
        Claim("S4", "first frame < 1 s; quality unchanged", s_claim("S4")),
    ],
    "SwiftFusion": [
        Claim("F1", "Ring intra-node, Ulysses inter-node placement", swift("F1")),
        Claim("F2", "Torus overlap of communication with attention", swift("F2")),
        Claim("F3", "one-sided communication", swift("F3")),
        Claim("F4", "1.35x average (up to 1.77x) over USP", swift("F4")),
    ],
}


def _same_config(path: Path, result: dict) -> list[Path]:
    """Other result files of the same experiment whose run settings match `result`'s (seeds aside)."""
    mine = config_key(result)
    return [g for g in sorted(path.parent.glob("*.json"))
            if g != path and mine is not None and config_key(json.loads(g.read_text())) == mine]


def pooled_table(experiment: str, p: Pooled) -> list[str]:
    """Markdown lines: mean ± sample std over seeds per (variant, frames) of a pooled quality study."""
    def cell(r, key):
        std = r[f"{key}_std"]
        return f"{r[f'{key}_mean']:.2f}" + ("" if math.isnan(std) else f" ± {std:.2f}")
    keys = ["text_alignment", "temporal_consistency", "motion_error"]
    parts = ["color_match", "shape_match", "direction_match"]   # older result files lack them
    if all(not math.isnan(r.get(f"{k}_mean", math.nan)) for r in p.rows.values() for k in parts):
        keys[1:1] = parts
    out = [f"### {experiment} ({p.training}, n_eval {p.settings['n_eval']}, scorer v{p.settings['scorer_version']}; "
           f"{', '.join(p.links)})", "",
           "| variant | frames | seeds | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
           "|---|---|---|" + "---|" * len(keys)]
    for (variant, frames), r in sorted(p.rows.items(), key=lambda kv: (kv[0][1], kv[0][0] == "ground_truth")):
        out.append(f"| {variant} | {frames} | {r['seeds']} | " + " | ".join(cell(r, k) for k in keys) + " |")
    return out + [""]


QUALITY_NOTE = (
    "Mean ± sample standard deviation over seeds of the GPU runs behind C6-C8 (MovingShapes scores; "
    "a table pools only runs of one config, model, batch, n_eval, eval seed and scorer version). Each "
    "ground_truth row is what that table's scorer gives the true clips of the same captions: the ceiling "
    "a model can reach. The verdict rule of C6-C8: inconclusive while every model is under-trained (best "
    "caption match below half the ground truth's, at each clip length); else a difference counts when it "
    "clears a margin of twice the combined spread of one run of each side (seed-to-seed sample std and the sampling error of scoring "
    "n_eval clips); supported if every difference clears it in the claimed direction, contradicted if any "
    "clears it the other way, inconclusive otherwise. Scorer v1 (rows without a version) let a frozen clip "
    "score full temporal consistency; v2 multiplies it by how well the object moves with the caption's "
    "velocity. Of a claim's studies only those of the newest scorer vote; the others are shown, marked "
    "'not counted'.")


def readme(results_dir: Path) -> str:
    """The claims page (markdown) from the result JSON files under `results_dir`, which it names."""
    option = "" if results_dir.resolve() == RESULTS_DIR.resolve() else f" --results {results_dir}"
    out = ["# Paper claims beside our measurements", "",
           f"Generated by `python experiments/claims.py{option}` from the JSON files under {results_dir.name}/ "
           "(each linked); do not edit by hand. Paper figures are the papers' own (see shared PAPERS.md) and are "
           "never ours.", ""]
    for paper, claims in CLAIMS.items():
        out += [f"## {paper}", "", "| claim | paper | ours | verdict |", "|---|---|---|---|"]
        for c in claims:
            ours, verdict = c.ours(results_dir)
            out.append(f"| {c.id} | {c.paper} | {ours} | {verdict} |")
        out.append("")
    studies = [(e, p) for e in ("ablate_offsets", "quality") if (p := pooled(results_dir, e))]
    if studies:
        out += ["## Quality studies pooled over seeds", "", QUALITY_NOTE, ""]
        for experiment, p in studies:
            out += pooled_table(experiment, p)
    partial = [(f, r) for f in sorted(results_dir.glob("*/*.json"))
               if is_partial(r := json.loads(f.read_text()))]
    if partial:
        out += ["## Runs cut short", "",
                "These runs hit the device time limit; their tables hold only the runs that finished:", ""]
        out += [f"- {link(results_dir, f.parent.name, f.stem)}: {r['jobs_done']} of {r['jobs_total']} planned runs"
                + "".join(f"; more seeds of its config in {link(results_dir, g.parent.name, g.stem)}"
                          for g in _same_config(f, r))
                for f, r in partial]
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, metavar="DIR",
                    help="the results folder: <DIR>/<experiment>/*.json in (default: the repository's results/)")
    ap.add_argument("--out", type=Path, default=None, help="the page to write (default: <DIR>/README.md)")
    args = ap.parse_args()
    if not args.results.is_dir():
        ap.error(f"--results {args.results} is not a folder; pass the folder that holds <experiment>/*.json "
                 f"(a study writes them under its results_dir, e.g. runs/ablate_offsets/results)")
    out = args.out or args.results / "README.md"
    out.write_text(readme(args.results))
    print(f"wrote {out} from {args.results}")


if __name__ == "__main__":
    main()
