"""QK-norm + RoPE benchmark: the fused Triton op (megaslide.nn.qk_rope) against its eager reference, forward
and forward+backward, at the token slices a chunked block runs on 1080p clips, after a correctness check.

Inputs are as training's `SelfAttention.project_qkv` makes them under bf16 autocast: q and k bf16 slices of
one (1, N, 3D) qkv output, fp32 norm weights, fp32 cos / sin rows of a 1080p token grid (frames of 68 x 120
tokens: 1080p latents at patch 2 x 2). Gradients are taken for q, k and both weights.

Tables of results/qk_rope/<name>.json (rendered by experiments/report.py):
- check: the fused op's q, k and every gradient against the eager reference in float64, beside the eager
  reference in the tested dtype (megaslide.testing.check_qk_rope), fp32 and bf16; `passed` is all of them;
- cells: per model width (heads x head_dim) and token count, each backend: forward and forward+backward
  medians (and spread), peak memory (CUDA), and `hbm_ms`, the time of the compulsory traffic of q and k at
  the copy bandwidth re-measured in the same run (forward: read x, write out; backward: read x and dout,
  write dx; tables and weights left out), with `hbm_fraction` = hbm_ms / ms for each;
- summary: per cell the eager / fused ratio of forward+backward; `choice`: what "auto" runs here and why.

    python -m experiments.bench_qk_rope name=h200_qk_rope   # GPU
    python -m experiments.bench_qk_rope smoke=true          # tiny, CPU via TRITON_INTERPRET=1
Configuration: experiments/conf/bench_qk_rope.yaml.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun, check_line, kernel_check_device
from experiments.hydra_config import script_config, script_main, trial_preset
from megaslide.nn.rope import RopeTable
from megaslide.perf.timing import MIN_REPEATS, copy_gbps, measure
from megaslide.testing import check_qk_rope

BACKENDS = ("triton", "reference")
CHECK_CASES = [(2, 9, 3, 128), (1, 33, 4, 72)]   # (B, N, heads, d)
SMOKE_CHECK_CASES = [(1, 5, 3, 10)]
SMOKE = {"widths": [[2, 8]], "tokens": [7], "repeats": 5}


@dataclass(frozen=True)
class BenchQKRopeConfig:
    """The keys of experiments/conf/bench_qk_rope.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    widths: list[list[int]]
    tokens: list[int]
    frame: list[int]
    repeats: int
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        if self.repeats < MIN_REPEATS:
            raise ValueError(f"repeats={self.repeats}: time at least {MIN_REPEATS} calls for a median and a spread")
        if not self.widths or any(len(w) != 2 or min(w) < 1 or w[1] % 2 for w in self.widths):
            raise ValueError(f"widths={self.widths}: give [heads, head_dim] pairs, each >= 1, head_dim even")
        if not self.tokens or min(self.tokens) < 1:
            raise ValueError(f"tokens={self.tokens}: give token counts >= 1")
        if len(self.frame) != 2 or min(self.frame) < 1:
            raise ValueError(f"frame={self.frame}: give the token frame as [H, W], each >= 1")


def make_inputs(B: int, N: int, heads: int, d: int, frame: tuple[int, int], device, dtype, seed: int = 0):
    """q, k (B, N, D) slices of one qkv tensor, weights (D,) fp32, cos / sin (N, d/2) of the first N tokens of
    a (frames, H, W) grid, and output gradients (B, N, heads, d)."""
    g = torch.Generator(device=device).manual_seed(seed)
    D = heads * d
    q, k, _ = torch.randn(B, N, 3 * D, generator=g, device=device, dtype=dtype).chunk(3, dim=-1)   # (B, N, D)
    weights = [1 + 0.1 * torch.randn(D, generator=g, device=device) for _ in range(2)]
    frames = math.ceil(N / math.prod(frame))
    cos, sin = (t[:N] for t in RopeTable(d, frames, *frame).grid((frames, *frame), device=device))
    grads = [torch.randn(B, N, heads, d, generator=g, device=device, dtype=dtype) for _ in range(2)]
    return q, k, weights, cos, sin, grads


def compulsory_bytes(tokens: int, dim: int, elem: int, backward: bool) -> int:
    """q and k: forward reads x and writes out; the backward reads x and dout and writes dx."""
    return 2 * tokens * dim * elem * (5 if backward else 2)


def cells(heads: int, d: int, tokens: int, frame, device, repeats: int, ceiling_gbps: float) -> list[dict]:
    """One row per backend at one width and token count: forward and forward+backward."""
    from megaslide.nn.qk_rope import qk_norm_rope
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, (qw, kw), cos, sin, grads = make_inputs(1, tokens, heads, d, tuple(frame), device, dtype)
    leaves = [q.requires_grad_(), k.requires_grad_(), qw.requires_grad_(), kw.requires_grad_()]
    base = {"heads": heads, "head_dim": d, "dim": heads * d, "tokens": tokens, "dtype": str(dtype)[6:]}
    rows = []
    for backend in BACKENDS:
        def forward(backend=backend):
            with torch.no_grad():
                qk_norm_rope(q, k, qw, kw, cos, sin, heads=heads, backend=backend)

        def forward_backward(backend=backend):
            out = qk_norm_rope(q, k, qw, kw, cos, sin, heads=heads, backend=backend)
            torch.autograd.grad(out, leaves, grads)

        row = {**base, "backend": backend}
        for key, step, backward in (("fwd", forward, False), ("fwdbwd", forward_backward, True)):
            cell = measure(lambda step=step: step, repeats, device)
            row.update({f"{key}_{name}": value for name, value in cell.items()})
            hbm_ms = compulsory_bytes(tokens, heads * d, q.element_size(), backward) / (ceiling_gbps * 1e9) * 1e3
            row[f"{key}_hbm_ms"] = hbm_ms
            if "ms" in cell:
                row[f"{key}_hbm_fraction"] = hbm_ms / cell["ms"]
        rows.append(row)
        print(f"  {heads:3d} x {d:3d} N={tokens:8d} {backend:9s} fwd {row.get('fwd_ms', float('nan')):8.3f} ms  "
              f"fwd+bwd {row.get('fwdbwd_ms', float('nan')):8.3f} ms  "
              f"of HBM bound {row.get('fwdbwd_hbm_fraction', float('nan')):.2f}", flush=True)
    return rows


def bench(cfg: BenchQKRopeConfig) -> int:
    device = kernel_check_device(cfg.smoke, "bench_qk_rope")
    if device is None:
        return 2
    from megaslide.nn.qk_rope import choose_backend
    name = cfg.name or ("qk_rope_smoke" if cfg.smoke else "qk_rope")
    run = ExperimentRun("qk_rope", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project, trial=cfg.smoke)
    ceiling = {"hbm_gbps": copy_gbps(device, 2 ** 20 if cfg.smoke else 2 ** 30)}
    checks = []
    for B, N, heads, d in SMOKE_CHECK_CASES if cfg.smoke else CHECK_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, weights, cos, sin, grads = make_inputs(B, N, heads, d, tuple(cfg.frame), device, torch.float64)
            checks.append(check_qk_rope(q, k, *weights, cos, sin, grads, heads, dtype))
    passed = all(c["passed"] for c in checks)
    probe = torch.empty(1, 1, cfg.widths[0][0] * cfg.widths[0][1], device=device,
                        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    chosen, reasons = choose_backend("auto", probe)
    payload = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
               "ceilings": ceiling, "passed": passed, "checks": checks,
               "choice": {"auto": chosen.name, "not_taken": reasons}, "tables": {}}
    rows = run.timed_cells(payload, passed, [(h, d, n) for h, d in cfg.widths for n in cfg.tokens],
                           lambda heads, d, tokens: cells(heads, d, tokens, cfg.frame, device, cfg.repeats,
                                                          ceiling["hbm_gbps"]))
    summary = {}
    for heads, d in cfg.widths:
        for tokens in cfg.tokens:
            by = {r["backend"]: r.get("fwdbwd_ms") for r in rows if (r["heads"], r["head_dim"], r["tokens"])
                  == (heads, d, tokens)}
            if by.get("triton") and by.get("reference"):
                summary[f"speedup_{heads}x{d}_n{tokens}"] = by["reference"] / by["triton"]
    payload["summary"] = summary
    path = run.finish(payload, {"passed": passed, **summary})
    for c in checks:
        print(check_line(c, f"{c['shape']} heads {c['heads']}"))
    print(f"{'PASS' if passed else 'FAIL'}; auto runs {chosen.name}; {summary}; wrote {path}")
    return 0 if passed else 1


@script_main("bench_qk_rope")
def main(hydra_cfg: DictConfig) -> None:
    """Exit status 0: the check passed and the cells ran; 1: the check failed (nothing timed); 2: no GPU."""
    sys.exit(bench(script_config(BenchQKRopeConfig, hydra_cfg, trial_preset(hydra_cfg, smoke=SMOKE))))


if __name__ == "__main__":
    main()
