"""MegaSlide-DiT C1-C3: the 105B state (arithmetic), the activation wall of dense attention over long
clips (the attention sweep) and the frames that fit one H200 (the OOM tables), with the planner's
peak-HBM and step-time predictions checked against the measured cells."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from experiments.claims.common import link, load, read_results
from experiments.planner_error import estimate_s, h200_timed_steps, held_out_error
from experiments.results_io import REFERENCE_GPU, descends_from, ran_on
from megaslide.config import OffloadConfig
from megaslide.models.dit import DIT_PRESETS, count_params

TB = 1e12
QUADRATIC_SLOPE = 1.8   # C2: a log-log slope of dense time over tokens at least this counts as quadratic
LAYER_SWEEP = "h200_sweep_v2"   # C3: fused DSA and Swin layer peaks up to 1M tokens, at a clean commit
DENSE_SWEEP = "h100_dense_sweep"   # C2: dense flash alone over 6 clip sizes, 5 repeats, at a clean commit


PAPER_STATE_TB, PAPER_MOMENTS_GB = 1.47, 840   # C1 as the paper states them (~)
ARITHMETIC_TOLERANCE = 0.05   # C1: our arithmetic counts as consistent with the paper's rounded figures within 5%


def c1(results_dir: Path):
    n = count_params(DIT_PRESETS["105B"])
    total, moments = 14 * n / TB, 8 * n / 1e9
    gaps = (total / PAPER_STATE_TB - 1, moments / PAPER_MOMENTS_GB - 1)
    word = "consistent" if all(abs(g) <= ARITHMETIC_TOLERANCE for g in gaps) else "not consistent"
    return ((f"analytic: our `105B` preset has {n / 1e9:.1f} B params; 14 B/param = {total:.2f} TB, "
             f"moments {moments:.0f} GB (`count_params`, no run)"),
            (f"{word} (arithmetic): state {total:.2f} vs ~{PAPER_STATE_TB} TB ({100 * gaps[0]:+.1f}%), moments "
             f"{moments:.0f} vs ~{PAPER_MOMENTS_GB} GB ({100 * gaps[1]:+.1f}%) (rule: consistent if both lie within "
             f"{100 * ARITHMETIC_TOLERANCE:.0f}% of the paper's figures)"))


def _loglog_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log(y) against log(x) over (x, y) points."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def c2(results_dir: Path):
    s = load(results_dir, "attention", DENSE_SWEEP)
    if not s:
        return "not measured", "-"
    dense = sorted({(r["tokens"], r["ms"]) for r in s["tables"]["sweep"] + s["tables"]["target"]
                    if r["variant"] == "dense" and r["status"] == "ok"})
    n, ms = dense[-1]
    slope = _loglog_slope(dense)
    grid = next((r["config"] for _, r in oom_results(results_dir)), {"height": 136, "width": 240})
    n2m = math.prod(DIT_PRESETS["1B"].token_grid(TARGET_FRAMES, grid["height"], grid["width"]))
    return ((f"256 frames of 1080p latents (8x spatial VAE, patch 2): {clip_tokens(TARGET_FRAMES, grid, '1B')}. "
             f"Dense flash fwd+bwd of one 16x64-head layer: {ms:.0f} ms at {n / 1e3:.0f}K tokens on one "
             f"{s['hardware']['gpus'][0]} ({link(results_dir, 'attention', DENSE_SWEEP)}); x(N ratio)^2 "
             f"extrapolates to "
             f"{ms * (n2m / n) ** 2 / 1e3:.0f} s at {n2m / 1e6:.2f} M (extrapolated, not run)"),
            (f"{'supported' if slope >= QUADRATIC_SLOPE else 'not supported'}: measured dense time grows as "
             f"N^{slope:.2f} over {dense[0][0] / 1e3:.0f}K-{n / 1e3:.0f}K tokens ({len(dense)} sizes)"))


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


def oom_results(results_dir: Path) -> list[tuple[str, dict]]:
    """The oom_thresholds results, as (name, data): measured GPU runs and planner-only tables."""
    return read_results(results_dir, "oom_thresholds")


def measured_cells(results: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(file, cell) of every cell measured on the claims' GPU (planner-only tables excluded)."""
    return [(name, {**c, "file": name}) for name, r in results
            if not r.get("plan_only") and ran_on(r, REFERENCE_GPU) for c in r["tables"]["cells"]]


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
    return [f"{m} {a} {mode} at {c['frames']} frames: {status_text(c)}" for (m, a, mode), c in sorted(walls.items())]


def status_text(c: dict) -> str:
    """A cell's status with its phase, as the page shows it: "OOM (plan: backward)"."""
    return c["status"] + (f" ({c['phase']})" if c.get("phase") else "")


PAPER_PEAK_GB = 115      # C3: the paper's peak HBM at TARGET_FRAMES frames
DENSE_OOM_FRAMES = 64    # C3: the paper's dense baseline runs out of memory at this many frames
CLAIMED = {"fits": "fits", "OOM": "runs out of memory"}   # a length claim's outcome -> how the rule says it


def memory_outcome(c: dict) -> str | None:
    """What a measured cell shows about memory: "fits", "OOM" (it ran and ran out), or None: nothing (a time limit
    or the run's time budget stopped it, or the planner refused it before allocating: predicted, not measured)."""
    if c["status"] == "fits":
        return "fits"
    return "OOM" if c["status"] == "OOM" and not str(c.get("phase", "")).startswith("plan:") else None


def _no_outcome(c: dict) -> str:
    """Why a cell without a memory outcome measured none."""
    if c["status"] == "time limit":
        return "its wall there is time, not memory"
    if c["status"] == "not run":
        return "cut by its run's time budget"
    if c["status"] in ("OOM", "refused"):
        return "the planner refused it before allocating: predicted, not measured"
    return "its status measures no memory"


def length_verdict(cells: list[tuple[str, dict]], attention: str, frames: int, claimed: str) -> str:
    """C3's rule for a paper's claim that `attention` `claimed` ("fits" or "OOM") at `frames` frames, in any model
    and mode: supported if a measured cell of that attention and length shows it, not supported if those cells show
    only the other outcome, not assessed if none of them shows a memory outcome (memory_outcome)."""
    at = [c for _, c in cells if (c["attention"], c["frames"]) == (attention, frames)]
    shown = [c for c in at if memory_outcome(c) == claimed]
    other = [c for c in at if memory_outcome(c) not in (claimed, None)]
    rule = (f"rule: supported if a measured {attention} cell of {frames} frames {CLAIMED[claimed]}, not supported if "
            f"those measured show only the other outcome, not assessed if none ran to a memory outcome")
    if shown or other:
        c = (shown or other)[0]
        peak = f" at {c['measured_peak_GB']:.1f} GB" if c["status"] == "fits" else ""
        seen = f"{_cell_name(c)}: {status_text(c)}{peak}"
        return f"{'supported' if shown else 'not supported'} ({seen}; {c['file']}; {rule})"
    if not at:
        most = [f for (_, a, _), f in most_frames_fitting(cells).items() if a == attention]
        fits = (f"the most frames a measured {attention} cell fits: {max(most)}" if most else
                f"no measured {attention} cell fits at any length")
        return f"not assessed: no measured {attention} cell of {frames} frames ({fits}; {rule})"
    why = "; ".join(f"{_cell_name(c)}: {status_text(c)}"
                    + (f", predicted peak {c['predicted_peak_GB']:.0f} GB" if c.get("predicted_peak_GB") else "")
                    + f": {_no_outcome(c)}" for c in at)
    return f"not assessed: {why} ({rule})"


def peak_verdict(cells: list[tuple[str, dict]]) -> str:
    """C3's rule for the paper's peak HBM at TARGET_FRAMES frames: supported if a measured DSA cell of that length
    fits at a peak at or below PAPER_PEAK_GB (the paper's figure read as the HBM its step needs), not supported if
    every one that fits peaks above it, not assessed if none fits."""
    fit = [c for _, c in cells if (c["attention"], c["frames"], c["status"]) == ("dsa", TARGET_FRAMES, "fits")]
    rule = (f"rule: supported if a measured dsa cell of {TARGET_FRAMES} frames fits at a peak at or below the paper's "
            f"{PAPER_PEAK_GB} GB, not supported if every one peaks above it, not assessed if none fits")
    if not fit:
        return f"not assessed: no measured dsa cell of {TARGET_FRAMES} frames fits ({rule})"
    low = min(fit, key=lambda c: c["measured_peak_GB"])
    return (f"{'supported' if low['measured_peak_GB'] <= PAPER_PEAK_GB else 'not supported'} (lowest measured peak "
            f"{low['measured_peak_GB']:.1f} GB at {_cell_name(low)}, {low['file']}, of {len(fit)} such "
            f"cell{'s' if len(fit) != 1 else ''}; {rule})")


def planner_error(cells: list[tuple[str, dict]], predicted: Callable[[dict], float | None]
                  ) -> tuple[float, dict] | None:
    """The worst |predicted / measured - 1| of peak HBM over cells that fit, with its cell; None if none.
    `predicted(cell)` gives the prediction in GB (None: no prediction for that cell: not compared)."""
    errors = [(abs(p / c["measured_peak_GB"] - 1), c) for _, c in cells
              if c["status"] == "fits" and c.get("measured_peak_GB") and (p := predicted(c))]
    return max(errors, key=lambda ec: ec[0], default=None)


def accuracy_word(error: float) -> str:
    """C3's planner rule: "met" if every measured cell that fits is within PLANNER_TARGET, else "not met"."""
    return "met" if error <= PLANNER_TARGET else "not met"


UNPLANNED = ("offload.keep_attention", "offload.master_dtype", "offload.moments", "offload.boundary_stride")


def unplanned_settings(c: dict) -> list[str]:
    """The cell's train.py overrides of UNPLANNED keys away from their defaults: the plan-only tables planned
    every cell with the defaults, so a cell run otherwise is another step than their row of it."""
    defaults = OffloadConfig()
    changed = []
    for override in c.get("run_overrides", []):
        key, _, value = override.partition("=")
        if key in UNPLANNED and value != str(getattr(defaults, key.removeprefix("offload."))):
            changed.append(override)
    return changed


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


ESTIMATE_TARGET = 0.25  # C3: the fitted step-time estimate counts as accurate within 25% of each held-out step


def estimate_text(results_dir: Path) -> str:
    """C3's step-time rule: "met" if the fitted estimate is within ESTIMATE_TARGET of every measured H200 step it
    was not fitted on (experiments/planner_error.py), with the median and the worst, and what was left out."""
    h = held_out_error(results_dir)
    left_out = "; ".join(f"{n} x {reason}" for reason, n in h.reasons().items())
    if not h.used:
        return f"step-time estimate: no held-out measured H200 step (excluded: {left_out or 'none'})"
    name, worst = h.worst
    return (f"step-time estimate (fitted: megaslide/perf/planner.py FITTED), today's planner at each run's measured "
            f"ceilings on the {len(h.used)} measured H200 steps it was not fitted on: "
            f"{'met' if abs(worst) <= ESTIMATE_TARGET else 'not met'} (median |estimate/step - 1| = "
            f"{100 * h.median_abs:.0f}%, worst {100 * worst:+.0f}% at {name}; target within "
            f"{100 * ESTIMATE_TARGET:.0f}%; left out: {left_out}; per step: python -m experiments.planner_error); "
            + previous_estimate_rule(results_dir))


def previous_estimate_rule(results_dir: Path) -> str:
    """The same target under the rule this verdict had before the held-out rule replaced it: today's estimate on
    every measured oom_thresholds step, the step it was fitted on included and nothing left out."""
    steps = [(s.name, estimate_s(s) / s.step_s - 1) for s in h200_timed_steps(results_dir)
             if s.file.startswith("oom_thresholds/")]
    if not steps:
        return "under the previous rule: no measured oom_thresholds step"
    name, worst = max(steps, key=lambda ne: abs(ne[1]))
    verdict = "met" if abs(worst) <= ESTIMATE_TARGET else "not met"
    return (f"under the previous rule (every measured oom_thresholds step, the fitted one included; replaced by the "
            f"held-out rule when experiments/planner_error.py was added): {verdict} on "
            f"{len(steps)} steps (worst {100 * worst:+.0f}% at {name})")


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
    dates = {n: r.get("date", "") for n, r in results}
    top = max((c for _, c in cells if (c["model"], c["attention"], c["mode"], c["status"]) ==
               (model, attention, mode, "fits")), key=lambda c: (c["frames"], dates[c["file"]]), default=None)
    config = next(r["config"] for n, r in results if n in files)
    ours = [f"measured on one H200, most frames per (model, attention, mode) that fit: {fitting} ({src})"]
    if top:
        ours.append(f"headline: {model} {attention}, chunked blocks + activation offload, {top['frames']} latent "
                    f"frames of {config['height']}x{config['width']} ({top['tokens']:,} tokens): "
                    f"{top['step_s']:.1f} s/step "
                    f"(n={top['timed_steps']} timed step{'s' if top['timed_steps'] != 1 else ''}), peak "
                    f"{top['measured_peak_GB']:.1f} GB measured vs {top['predicted_peak_GB']:.1f} GB predicted "
                    f"(the newest run of the most frames: {top['file']})")
    reached = max((f for (m, _, _), f in most.items() if m == model), default=0)
    verdict = [f"{TARGET_FRAMES}-frame target ({model} at {TARGET_FRAMES} frames): "
               + (f"met (a measured {model} cell of {reached} frames fits)" if reached >= TARGET_FRAMES else
                  f"not met: no measured cell of {TARGET_FRAMES} frames fits; the most for {model} is {reached} "
                  "frames"),
               f"~{PAPER_PEAK_GB} GB peak HBM at {TARGET_FRAMES} frames: {peak_verdict(cells)}",
               f"dense OOMs at {DENSE_OOM_FRAMES} frames: {length_verdict(cells, 'dense', DENSE_OOM_FRAMES, 'OOM')}",
               f"Swin fits {TARGET_FRAMES} frames: {length_verdict(cells, 'swin', TARGET_FRAMES, 'fits')}",
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
            if unplanned_settings(c):
                return None        # run with an offload setting the plan-only tables did not plan
            r = plan_row(tables, c["model"], c["attention"], c["mode"], c["frames"], c.get("slab_frames", 0))
            return r and r["predicted_peak_GB"]
        current = {n for n, r in results if descends_from(r.get("commit", ""), DSA_HEAD_GROUPS)}
        left_out = sorted({_cell_name(c) for _, c in cells if c["status"] == "fits" and unplanned_settings(c)})
        verdict.append(_error_text(planner_error(cells, replanned), f"today's planner ({names}) on the same cells",
                                   replanned)
                       + (f"; left out, run with offload settings those tables did not plan "
                          f"({', '.join(UNPLANNED)}): {'; '.join(left_out)}" if left_out else ""))
    verdict.append(estimate_text(results_dir))
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
    s = load(results_dir, "attention", LAYER_SWEEP)
    if not s:
        return "attention layer alone not measured"
    sweep = s["tables"]["sweep"]
    big = {r["variant"]: r for r in sweep if r["tokens"] == max(x["tokens"] for x in sweep)}
    target = {r["variant"]: r for r in s["tables"]["target"]}
    d, t = target["dense"], target["dsa_fused"]
    f, w = big["dsa_fused"], big["swin2x4x4"]
    return (f"attention layer alone at {f['tokens'] / 1e6:.2f} M tokens, fwd+bwd peak: DSA fused "
            f"{f['peak_gb']:.1f} GB, Swin {w['peak_gb']:.1f} GB; at {d['tokens'] / 1e3:.0f}K tokens fused DSA peaks "
            f"{'above' if t['peak_gb'] > d['peak_gb'] else 'at or below'} dense flash ({t['peak_gb']:.1f} vs "
            f"{d['peak_gb']:.1f} GB); dense flash not run past {d['tokens'] / 1e3:.0f}K tokens (time, not memory, "
            f"is its wall) ({link(results_dir, 'attention', LAYER_SWEEP)})")

