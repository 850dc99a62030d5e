"""Attention benchmark: forward+backward time and peak memory against token count.

Variants: dense SDPA (flash on GPU), Swin windows at a comparable keys-per-query budget,
DSA reference (materialised samples), DSA fused (Triton) and `dsa_zero` fused. Token grids
are 1080p latents (8x VAE, patch 2: 68 x 120 tokens per latent frame) at growing frame
counts, plus the 262K-token target grid (16 x 128 x 128). The same run re-measures the
ceilings (HBM copy bandwidth, bf16 matmul) and works out the fused kernel's roofline.
Configuration: experiments/conf/bench_attention.yaml.

    python -m experiments.bench_attention                  # GPU sweep -> results/attention/
    python -m experiments.bench_attention smoke=true       # tiny, CPU, seconds
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from baselines.swin_attention import SwinAttention
from experiments.harness import ExperimentRun, copy_gbps, matmul_tflops, timed
from experiments.hydra_config import script_config, script_main
from megaslide.attention.dsa import deformable_slide_attention

DATASHEET_FP32_TFLOPS = 67.0   # H100/H200 SXM CUDA-core fp32 (non-tensor) peak, datasheet
SMOKE = {"heads": 2, "head_dim": 16, "repeats": 5}


@dataclass(frozen=True)
class BenchAttentionConfig:
    """The keys of experiments/conf/bench_attention.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    heads: int
    head_dim: int
    frames: list[int]
    repeats: int
    wandb_dir: str
    wandb_project: str


def make_inputs(grid, heads, d, K, dtype, device, max_offset=4.0, zero=False):
    g = torch.Generator(device=device).manual_seed(0)
    shape = (1, *grid, heads, d)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    off = torch.zeros(1, *grid, heads, K, 3, device=device) if zero else \
        max_offset * (2 * torch.rand(1, *grid, heads, K, 3, generator=g, device=device) - 1)
    return q, k, v, off.requires_grad_()


def variant_fns(grid, heads, d, dtype, device, window, kernel):
    """name -> (setup() -> step closure, keys per query)."""
    K = math.prod(kernel)

    def dense():
        q, k, v, _ = make_inputs(grid, heads, d, K, dtype, device)
        qt, kt, vt = (x.view(1, -1, heads, d).transpose(1, 2) for x in (q, k, v))

        def step():
            F.scaled_dot_product_attention(qt, kt, vt).sum().backward()
        return step

    win = (min(window[0], grid[0]), *window[1:])  # a single latent frame gets 2D windows

    def swin():
        q, k, v, _ = make_inputs(grid, heads, d, K, dtype, device)
        attn = SwinAttention(heads * d, heads, window=win, layer_idx=1).to(device)

        def step():
            attn.attend(*(x.view(1, -1, heads, d) for x in (q, k, v)), None, grid).sum().backward()
        return step

    def dsa(backend, zero=False):
        def setup():
            q, k, v, off = make_inputs(grid, heads, d, K, dtype, device, zero=zero)

            def step():
                deformable_slide_attention(q, k, v, off, kernel, backend=backend).sum().backward()
            return step
        return setup

    n = math.prod(grid)
    return {"dense": (dense, n), f"swin{'x'.join(map(str, window))}": (swin, math.prod(win)),
            "dsa_reference": (dsa("reference"), K), "dsa_fused": (dsa("triton"), K),
            "dsa_zero_fused": (dsa("triton", zero=True), K)}


def measure(setup, repeats: int, device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        timing = timed(setup(), device, repeats)
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    out = {"status": "ok", **timing.ms()}
    if device.type == "cuda":
        out["peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
    return out


def ceilings(device) -> dict:
    """HBM copy bandwidth and bf16 matmul peak, measured now."""
    if device.type != "cuda":
        return {}
    return {"hbm_gbps": copy_gbps(device), "matmul_tflops": matmul_tflops(device)}


def dsa_roofline(n_tokens: int, heads: int, d: int, K: int, elem: int, ceil: dict) -> dict:
    """Work the fused DSA fwd+bwd must do at minimum.

    Bytes: compulsory HBM traffic. Forward reads q, k, v (elem B each) and fp32 offsets, writes out
    and an fp32 lse; backward reads q, k, v, out, dout, offsets, lse, writes dq, dk, dv, doffsets
    (corner gathers are assumed to hit cache: neighbouring queries share them).
    FLOPs (CUDA cores, fp32; per query, head and sample): interpolate K and V from 8 corners
    (2 x 8 x 2d), score and PV (2 x 2d); backward recomputes both interpolations (2 x 16d), dP and
    dq (2 x 2d), scatters dK and dV to 8 corners (2 x 8 x 2d) and the offset gradient (3 x 8 x 2d)."""
    qh = n_tokens * heads
    fwd_bytes = qh * (3 * d * elem + K * 3 * 4 + d * elem + 4)
    bwd_bytes = qh * (5 * d * elem + K * 3 * 4 + 4 + 3 * d * elem + K * 3 * 4)
    flops_fwd = qh * K * (32 * d + 4 * d)
    flops_bwd = qh * K * (32 * d + 4 * d + 32 * d + 48 * d)
    bytes_total, flops = fwd_bytes + bwd_bytes, flops_fwd + flops_bwd
    out = {"bytes": bytes_total, "flops_cuda_core": flops}
    if ceil:
        out["t_bytes_ms"] = bytes_total / (ceil["hbm_gbps"] * 1e9) * 1e3
        out["t_flops_ms"] = flops / (DATASHEET_FP32_TFLOPS * 1e12) * 1e3
        out["roofline_ms"] = max(out["t_bytes_ms"], out["t_flops_ms"])
    return out


def sweep(grids, variants, heads, d, dtype, device, window, kernel, repeats, dense_limit, ref_limit,
          on_row=lambda rows: None):
    """Time every variant on every grid; `on_row(rows)` runs after each row (partial saves)."""
    rows = []
    for grid in grids:
        n = math.prod(grid)
        for name, (setup, keys) in variant_fns(grid, heads, d, dtype, device, window, kernel).items():
            if name not in variants:
                continue
            row = {"variant": name, "grid": list(grid), "tokens": n, "keys_per_query": keys}
            if name == "dense" and n > dense_limit:
                row["status"] = f"skipped: N > {dense_limit} (quadratic time)"
            elif name == "dsa_reference" and n > ref_limit:
                row["status"] = f"skipped: N > {ref_limit} (OOM at a smaller N)"
            elif name.startswith("dsa") and any(k > s for k, s in zip(kernel, grid)):
                row["status"] = f"skipped: kernel {kernel} larger than the grid"
            elif "fused" in name and device.type != "cuda":
                row["status"] = "skipped: Triton kernels need CUDA"
            else:
                row.update(measure(setup, repeats, device))
                if name == "dsa_reference" and row["status"] == "OOM":
                    ref_limit = min(ref_limit, n)
                if name == "dense" and row["status"] == "OOM":
                    dense_limit = min(dense_limit, n)
            rows.append(row)
            on_row(rows)
            print(f"  {name:16s} N={n:>8d} {row.get('status')} {row.get('ms', float('nan')):9.2f} ms "
                  f"{row.get('peak_gb', float('nan')):7.2f} GB", flush=True)
    return rows


def loglog_slope(rows, variant) -> float | None:
    pts = [(r["tokens"], r["ms"]) for r in rows if r["variant"] == variant and r.get("status") == "ok"]
    if len(pts) < 3:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def summarise(target, rows, target_grid, heads, d, kernel, dtype, ceil, hbm_gb: float | None = None) -> dict:
    """The headline numbers: the fused kernel at the target grid against the others and its
    roofline, speed-ups at the largest common N, and each variant's log-log slope of time vs N.
    `hbm_gb` (the device's memory) bounds the reference's peak where it ran out of memory."""
    by = {r["variant"]: r for r in target if r.get("status") == "ok"}
    n_t = math.prod(target_grid)
    roof = dsa_roofline(n_t, heads, d, math.prod(kernel), torch.finfo(dtype).bits // 8, ceil)
    summary = {"target_tokens": n_t, "roofline": roof}
    fused = by.get("dsa_fused")
    if fused:
        for other in ("dsa_reference", "dense", "swin2x4x4"):
            if other in by:
                summary[f"fused_speedup_vs_{other}"] = by[other]["ms"] / fused["ms"]
        if "dsa_reference" in by and "peak_gb" in fused:
            summary["fused_memory_fraction_of_reference"] = fused["peak_gb"] / by["dsa_reference"]["peak_gb"]
        if "roofline_ms" in roof:
            summary["fused_fraction_of_roofline"] = roof["roofline_ms"] / fused["ms"]
        ref_t = next((r for r in target if r["variant"] == "dsa_reference"), {})
        if ref_t.get("status") == "OOM" and "peak_gb" in fused and hbm_gb:
            summary["reference_oom_at_target_hbm_gb"] = hbm_gb
            summary["fused_memory_fraction_of_reference_upper_bound"] = fused["peak_gb"] / hbm_gb
    common = [(r["tokens"], r["ms"]) for r in rows if r["variant"] == "dsa_reference" and r.get("status") == "ok"]
    fused_by_n = {r["tokens"]: r["ms"] for r in rows if r["variant"] == "dsa_fused" and r.get("status") == "ok"}
    common = [(n, ms) for n, ms in common if n in fused_by_n]
    if common:
        n, ms = max(common)
        summary["fused_speedup_vs_reference_at_largest_common_n"] = {"tokens": n, "speedup": ms / fused_by_n[n]}
    summary["fused_loglog_slope"] = loglog_slope(rows, "dsa_fused")
    summary["swin_loglog_slope"] = loglog_slope(rows, "swin2x4x4")
    summary["dense_loglog_slope"] = loglog_slope(rows, "dense")
    return summary


def plot(rows, path_prefix) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [r for r in rows if r["variant"] == variant and r.get("status") == "ok"]
        if pts:
            axes[0].loglog([r["tokens"] for r in pts], [r["ms"] for r in pts], "o-", label=variant)
            if "peak_gb" in pts[0]:
                axes[1].loglog([r["tokens"] for r in pts], [max(r["peak_gb"], 1e-3) for r in pts], "o-", label=variant)
    axes[0].set(xlabel="tokens", ylabel="fwd+bwd ms", title="time")
    axes[1].set(xlabel="tokens", ylabel="peak GB", title="peak memory")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{path_prefix}.png", dpi=110)
    return f"{path_prefix}.png"


@script_main("bench_attention")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(BenchAttentionConfig, hydra_cfg, SMOKE if hydra_cfg.smoke else None)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel, window = (3, 3, 3), (2, 4, 4)
    variants = ["dense", "swin2x4x4", "dsa_reference", "dsa_fused", "dsa_zero_fused"]
    heads, d, repeats = cfg.heads, cfg.head_dim, cfg.repeats
    if cfg.smoke:
        sweep_grids, target_grid = [(4, 4, 8), (8, 4, 8)], (4, 8, 8)
    else:
        sweep_grids, target_grid = [(f, 68, 120) for f in cfg.frames], (16, 128, 128)

    ceil = ceilings(device)
    print(f"device {device}, dtype {dtype}, ceilings {ceil}", flush=True)
    name = cfg.name or ("smoke" if cfg.smoke else "sweep")
    config = {"heads": heads, "head_dim": d, "dtype": str(dtype), "kernel": kernel, "window": window,
              "device": str(device)}
    run = ExperimentRun("attention", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project)
    tables: dict[str, list] = {}

    def save(key):
        def on_row(rows):
            tables[key] = rows
            run.save({"config": config, "ceilings": ceil, "partial": True, "tables": tables})
        return on_row

    print("target grid", target_grid, flush=True)
    target = sweep([target_grid], variants, heads, d, dtype, device, window, kernel, repeats,
                   dense_limit=10 ** 9, ref_limit=10 ** 9, on_row=save("target"))
    print("sweep", flush=True)
    rows = sweep(sweep_grids, variants, heads, d, dtype, device, window, kernel, repeats,
                 dense_limit=300_000, ref_limit=140_000, on_row=save("sweep"))
    hbm_gb = torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None
    summary = summarise(target, rows, target_grid, heads, d, kernel, dtype, ceil, hbm_gb)

    payload = {"config": config, "ceilings": ceil, "summary": summary,
               "tables": {"target": target, "sweep": rows}}
    images = {}
    if not cfg.smoke:
        images["time and memory vs tokens"] = plot(rows, str(run.result_path.parent / name))
    path = run.finish(payload, summary, images)
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
