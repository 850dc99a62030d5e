"""Causal-RoPE SP S1-S4: the sequence-parallel causal generator's optimisation ladder, speedup and first-frame
latency (sp_inference)."""
from __future__ import annotations

import itertools
from pathlib import Path

from experiments.claims.common import link, load, widest


def s1(results_dir: Path) -> tuple[str, str]:
    """S1 is checked by a test, not by a result file."""
    return ("implemented; equal to one process on 2 and 3 gloo ranks (tests/inference/test_sp.py); 8 GPUs not run",
            "implemented, not run at 8")


def _ladder(result: dict) -> list[tuple[str, float]]:
    """The causal optimisation ladder of a result at its own rank count: (rung, total seconds) in order."""
    return [(r["variant"].removeprefix("causal: "), r["total_s"]) for r in result["rows"]
            if r["variant"].startswith("causal") and r["ranks"] == result["ranks"]]


def _slower_rungs(ladder: list[tuple[str, float]]) -> list[str]:
    return [f"{rung} ({before:.2f} -> {after:.2f} s)" for (_, before), (rung, after) in itertools.pairwise(ladder)
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
            return ((f"{where}, wan-1.3b shapes, 21 latent frames: causal {s['total_s']:.2f} s vs full-sequence "
                     f"{s['total_s'] * vs:.2f} s = {vs:.2f}x{scaling} ({src})"),
                    (f"{'supported' if s['speedup_vs_full_meets_1.58x'] else 'not reproduced'} on {where} "
                     f"(paper: 8 GPUs)"))
        if which == "S4":
            one_ms = one["summary"]["ttff_ms"]
            more = f", {s['ttff_ms']:.0f} ms on {where} ({src})" if P > 1 else ""
            return ((f"first chunk final after {one_ms:.0f} ms on 1 H200 "
                     f"({link(results_dir, 'sp_inference', 'wan-1.3b_P1')})"
                     f"{more}; VAE decode excluded"),
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


