"""Causal-RoPE SP S1-S4: the sequence-parallel causal generator's optimisation ladder, speedup and first-frame
latency (sp_inference)."""
from __future__ import annotations

import itertools
from pathlib import Path

from experiments.claims.common import gpus_text, link, newest_one_gpu, under_previous_rule, widest
from megaslide.testing import within_tolerance

PAPER_GPUS = 8          # S1-S4: the paper's rank count
PAPER_TTFF_S = 1.0      # S4: the paper's first-frame latency bound
SAME_OUTPUT_RULE = ("the P-rank video (causal and full-sequence) lies within 2x the bf16 noise of one GPU's "
                    "(megaslide.testing.within_tolerance, the run's own check)")


def widest_sp(results_dir: Path) -> tuple[str, dict] | None:
    """The sequence-parallel result with the most ranks, as (name, data), if it has more than one."""
    wide = widest(results_dir, "sp_inference", "ranks")
    return wide if wide and wide[1]["ranks"] > 1 else None


def same_output(result: dict) -> tuple[bool, str]:
    """Whether a P-rank result's video equals one GPU's by SAME_OUTPUT_RULE, and the figures that decide it."""
    c = result["tables"]["correctness"][0]
    worst, noise = max(c["causal_max_abs_diff_P_vs_1"], c["full_max_abs_diff_P_vs_1"]), \
        c["bf16_noise_max_abs_diff_vs_fp32_first_2_chunks"]
    return (within_tolerance(worst, noise, floor=0.0),
            f"largest difference from one GPU {worst:.3g} vs bf16 noise {noise:.3g} "
            f"(output up to {c['output_max_abs']:.2f})")


def output_verdict(results_dir: Path) -> str:
    """S1 and S4's rule: supported on P GPUs if the widest SP run's output is the same as one GPU's
    (SAME_OUTPUT_RULE), not supported if not, not assessed without a run on more than one GPU."""
    wide = widest_sp(results_dir)
    if not wide:
        return f"not assessed: no sequence-parallel run on more than one GPU (rule: {SAME_OUTPUT_RULE})"
    name, result = wide
    ok, figures = same_output(result)
    P = result["ranks"]
    at = "" if P >= PAPER_GPUS else f", not run at {PAPER_GPUS}"
    return (f"{'supported' if ok else 'not supported'} on {gpus_text(P, result)}{at} (paper: {PAPER_GPUS} GPUs): "
            f"{figures} "
            f"({link(results_dir, 'sp_inference', name)}; rule: supported if {SAME_OUTPUT_RULE})")


def s1(results_dir: Path) -> tuple[str, str]:
    """S1: each rank's locally computed RoPE positions give one process's output, checked by a test on gloo ranks
    and by the widest measured run."""
    return ("implemented; equal to one process on 2 and 3 gloo ranks (tests/inference/test_sp.py)",
            output_verdict(results_dir) + "; " + under_previous_rule("fixed text, no rule",
                                                                      "implemented, not run at 8"))


def _ladder(result: dict) -> list[tuple[str, float]]:
    """The causal optimisation ladder of a result at its own rank count: (rung, total seconds) in order."""
    return [(r["variant"].removeprefix("causal: "), r["total_s"]) for r in result["rows"]
            if r["variant"].startswith("causal") and r["ranks"] == result["ranks"]]


def _slower_rungs(ladder: list[tuple[str, float]]) -> list[str]:
    return [f"{rung} ({before:.2f} -> {after:.2f} s)" for (_, before), (rung, after) in itertools.pairwise(ladder)
            if after > before]


def s_claim(which):
    def f(results_dir: Path):
        first, wide = newest_one_gpu(results_dir, "sp_inference", "ranks"), widest_sp(results_dir)
        if not first:
            return "not measured", "-"
        one_name, one = first
        name, p = wide or first
        P, s, src = p["ranks"], p["summary"], link(results_dir, "sp_inference", name)
        where = gpus_text(P, p)
        if which == "S3":
            vs = s["speedup_vs_full_sequence_total"]
            scaling = (f"; {s['speedup_vs_1gpu_total']:.2f}x over 1 GPU (target 1.8x)" if P > 1 else
                       "; 2 and 8 GPUs not run")
            return ((f"{where}, wan-1.3b shapes, 21 latent frames: causal {s['total_s']:.2f} s vs full-sequence "
                     f"{s['total_s'] * vs:.2f} s = {vs:.2f}x{scaling} ({src})"),
                    (f"{'supported' if s['speedup_vs_full_meets_1.58x'] else 'not reproduced'} on {where} "
                     f"(paper: 8 GPUs)"))
        if which == "S4":
            one_ms = one["summary"]["ttff_ms"]
            more = f", {s['ttff_ms']:.0f} ms on {where} ({src})" if P > 1 else ""
            below = max(one_ms, s["ttff_ms"]) < 1e3 * PAPER_TTFF_S
            return ((f"first chunk final after {one_ms:.0f} ms on {gpus_text(1, one)} "
                     f"({link(results_dir, 'sp_inference', one_name)})"
                     f"{more}; VAE decode excluded"),
                    (f"first frame < {PAPER_TTFF_S:g} s: {'supported' if below else 'not supported'} (rule: every "
                     f"measured first-chunk time below {PAPER_TTFF_S:g} s); quality unchanged (read as the same "
                     "output: the run's weights are random, and the same video scores the same): "
                     + output_verdict(results_dir)))
        ladders = [(1, one_name, one)] + ([(P, name, p)] if P > 1 else [])
        texts, findings = [], []
        for gpus, file, result in ladders:
            ladder, slower = _ladder(result), _slower_rungs(_ladder(result))
            texts.append(f"{gpus_text(gpus, result)}: {ladder[0][1]:.2f} s -> {ladder[-1][1]:.2f} s "
                         f"({link(results_dir, 'sp_inference', file)})")
            on = f"on {gpus} GPU{'s' if gpus > 1 else ''}"
            findings.append(f"mixed {on}: {len(slower)} of {len(ladder) - 1} rungs got slower, {', '.join(slower)}"
                            if slower else f"supported {on} (every rung faster)")
        return f"optimisation ladder, seconds per 5 s video: {'; '.join(texts)}", "; ".join(findings)
    return f


