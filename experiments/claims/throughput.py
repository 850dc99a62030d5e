"""MegaSlide-DiT C4, C5, C9: the offload engine's MFU with and without overlap and with the optimizer on
the GPU (mfu_overlap), the floor of the paper's 105B step at our measured PCIe and CPU AdamW rates, and
the streamed forward's speedup over model sizes (scaling)."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

from experiments.claims.common import link, load, read_results, tokens_text, under_previous_rule
from experiments.results_io import REFERENCE_GPU, ran_on
from megaslide.config import DiTConfig, from_dict
from megaslide.models.dit import count_params
from megaslide.perf.timing import MIN_REPEATS

PAPER_MFU, PAPER_MFU_SERIAL, PAPER_MFU_GPU_OPT = 0.61, 0.28, 0.15   # C4, C5 as the paper states them
MIN_TIMED_STEPS = MIN_REPEATS   # fewer timed steps give no median and spread

CPU_ADAM = "h200_n268M_t16"   # C1/C4: the CPU AdamW rate of the H200 machine's 16 cores, at a clean commit


PAPER_STEP_S, PAPER_PARAMS = 3.1, 105e9   # C4 as the paper states it: 3.1 s per step of its 105B model
HOST_CORES = 16                             # the CPU the CPU AdamW floor is scaled to


def pcie_rates(results_dir: Path) -> list[tuple[str, float, float]]:
    """(file, H2D GB/s, D2H GB/s) of every result of the claims' GPU that measured PCIe (`ceilings.pcie`)."""
    found = []
    for f in sorted(results_dir.glob("*/*.json")):
        result = json.loads(f.read_text())
        pcie = (result.get("ceilings") or {}).get("pcie")
        if pcie and ran_on(result, REFERENCE_GPU):
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
    rates, adam = pcie_rates(results_dir), load(results_dir, "cpu_adam", CPU_ADAM)
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
            f"{scaled}; {link(results_dir, 'cpu_adam', CPU_ADAM)}) needs >= {f['adam_s']:.1f} s")
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
    spread = step_range(o) is not None
    timing = (f"; {timed} timed steps, {o['step_s_min']:.2f}-{o['step_s_max']:.2f} s" if spread else
              f"; the JSON holds {timed} timed steps and no spread: one measurement, not a median over "
              f">= {MIN_TIMED_STEPS}")
    return ((f"{m['attention']} attention, {m['model_cfg']['dim']}-wide, {m['depth']} blocks ({params / 1e9:.2f} B "
             f"params), {tokens_text(tokens)} tokens/step, one H200: {o['step_s']:.2f} s/step with overlap, MFU "
             f"{100 * peak:.1f}% of the measured matmul peak ({100 * sheet:.1f}% of the "
             f"{m['ceilings']['datasheet_TFLOPs']:.0f} TFLOP/s datasheet); serial "
             f"{100 * s['mfu_vs_measured_peak']:.1f}% "
             f"({100 * s['mfu_vs_datasheet']:.1f}%){timing} "
             f"({link(results_dir, 'mfu_overlap', MFU_RESULT)})"),
            f"{word}: MFU {100 * peak:.1f}% (measured peak) / {100 * sheet:.1f}% (datasheet) vs "
            f"{100 * PAPER_MFU:.0f}%; overlap gain {gain:.2f}x vs {PAPER_MFU / PAPER_MFU_SERIAL:.2f}x"
            + ("" if spread else f" (from {timed} timed steps, no spread)"))


SCALING_COMMAND = "python -m experiments.scaling"


CLAIMED_SPEEDUP = 2.11   # C9: the streamed forward's overlapped-vs-serial speedup the paper reports ...
CLAIMED_AT_B = 28.4      # ... at this many billion parameters


def c9(results_dir: Path):
    """C9 from the latest GPU scaling run; without one, from the planner-only result (predicted, never measured)."""
    results = read_results(results_dir, "scaling")
    runs = [(n, r) for n, r in results if not r.get("plan_only") and ran_on(r, REFERENCE_GPU)]
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
           f"forward overlapped vs serial {r['full_forward_speedup']:.2f}x "
           f"(planner {r['predicted_forward_speedup']:.2f}x)"
           for r in ran]
    per += [f"{r['preset']} ({r['params_B']:.1f} B): predicted only (needs {r['predicted_host_GB']:.0f} GB host RAM), "
            f"fits the cap {'yes' if r['predicted_fits_cap'] else 'no'}, forward {r['predicted_forward_speedup']:.2f}x"
            for r in rows if r["measured"] != "run"]
    fits_cap = [r for r in ran if r["cap_status"] == "fits"]
    speedups = [r["full_forward_speedup"] for r in ran]
    grows = len(speedups) > 1 and all(a < b for a, b in itertools.pairwise(speedups))
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
    return ((f"planner only, nothing run ({link(results_dir, 'scaling', name)}; "
             f"{c['frames']}x{c['height']}x{c['width']} latents, "
             f"{c['attention']}; budgets {c['hbm_budget_GB']} GB HBM, {c['host_budget_GB']:.0f} GB host, "
             f"{c['cap_GB']:.0f} GB cap; forward speedup at the planner's default ceilings): {per}"),
            f"predicted, not measured: the largest preset that fits the {c['cap_GB']:.0f} GB cap and "
            f"{c['host_budget_GB']:.0f} GB host RAM is "
            + (f"{largest['preset']} ({largest['params_B']:.1f} B)" if largest else "none")
            + f"; GPU run: `{SCALING_COMMAND}`")


def step_range(variant: dict) -> tuple[float, float] | None:
    """(fastest, slowest) timed step of an mfu_overlap variant; None below MIN_TIMED_STEPS or without a spread."""
    if variant.get("timed_steps", 0) < MIN_TIMED_STEPS or "step_s_min" not in variant:
        return None
    return variant["step_s_min"], variant["step_s_max"]


def c5(results_dir: Path):
    m = load(results_dir, "mfu_overlap", MFU_RESULT)
    if not m:
        return "not measured", "-"
    v = {r["variant"]: r for r in m["variants"]}
    g, o = v["gpu_optimizer"], v["overlap"]
    peak, sheet = g["mfu_vs_measured_peak"], g["mfu_vs_datasheet"]
    ranges = step_range(g), step_range(o)
    if None in ranges:
        drop = None
        spans = "no timing spread to compare"
    else:
        drop = ranges[0][0] > ranges[1][1]
        spans = (f"timed steps {ranges[0][0]:.2f}-{ranges[0][1]:.2f} s vs {ranges[1][0]:.2f}-{ranges[1][1]:.2f} s "
                 f"with the optimizer on the CPU")
    reached = [x <= PAPER_MFU_GPU_OPT for x in (peak, sheet)]
    word = (f"not assessed (fewer than {MIN_TIMED_STEPS} timed steps or no spread)" if drop is None else
            "not supported" if not drop else "supported" if all(reached) else
            "reproduced against the datasheet only" if any(reached) else "not reproduced")
    previous = ("supported" if peak <= PAPER_MFU_GPU_OPT else
                f"drop measured, smaller than the paper's: {100 * peak:.1f}% vs {100 * PAPER_MFU_GPU_OPT:.0f}%")
    return ((f"GPU optimizer (master + moments streamed): MFU {100 * peak:.1f}% of the measured peak "
             f"({100 * sheet:.1f}% of the datasheet) vs {100 * o['mfu_vs_measured_peak']:.1f}% "
             f"({100 * o['mfu_vs_datasheet']:.1f}%) with the optimizer on the CPU, overlapped "
             f"({link(results_dir, 'mfu_overlap', MFU_RESULT)})"),
            (f"{word}: MFU {100 * o['mfu_vs_measured_peak']:.1f}% -> {100 * peak:.1f}% (measured peak), "
             f"{100 * o['mfu_vs_datasheet']:.1f}% -> {100 * sheet:.1f}% (datasheet) vs the paper's "
             f"{100 * PAPER_MFU:.0f}% -> {100 * PAPER_MFU_GPU_OPT:.0f}%; {spans} (rule: a drop counts when the GPU "
             f"optimizer's fastest timed step is slower than the CPU optimizer's slowest; supported if a drop counts "
             f"and the GPU optimizer's MFU is at or below the paper's {100 * PAPER_MFU_GPU_OPT:.0f}% against both "
             f"peaks, not reproduced if the drop counts but is smaller, not supported if no drop counts); "
             + under_previous_rule(f"supported if the GPU optimizer's MFU is at or below "
                                   f"{100 * PAPER_MFU_GPU_OPT:.0f}%, else a drop called measured without comparing "
                                   "it with the CPU optimizer's", previous)))
