"""Offset-net benchmark: the `dsa` module's offset net (depthwise Conv3d + GELU, Linear, max_offset * tanh)
fwd+bwd on each backend of its kernels (the module's `net_backend`): `triton` (depthwise.py's channels-last
conv fused with GELU and bounded.py's one-pass bound) and `torch` (F.conv3d, cuDNN on an NCDHW copy on CUDA,
F.gelu and torch.tanh), and the `dsa` module with either net against `dsa_zero`, after correctness checks.

Tables of results/attention/<name>.json (rendered by experiments/report.py):
- checks: the Triton conv's (alone and fused with GELU) output and x / weight / bias gradients against
  F.conv3d in float64 on the same rounded inputs, beside F.conv3d in the tested dtype
  (megaslide.testing.check_conv), at an odd grid and a frame slab with its halo; and the whole offset net
  on the Triton kernels (offsets and the gradients of x, the conv's weight and bias, the Linear's weight and
  bias) against the net written out in float64, beside the module's PyTorch net in the tested dtype
  (megaslide.testing.check_offset_net), on odd grids with channel counts and head dims that are not powers
  of two; fp32 and bf16; `passed` is all of them, and nothing is timed unless they pass;
- conv: the conv alone fwd+bwd at the target grid for each model width (heads x head_dim), each backend,
  beside `hbm_ms`: the HBM time of its compulsory traffic (read x, write y; read dy and x for the input
  and weight gradients, write dx), from the copy ceiling re-measured in the same run;
- offset_net: the whole net fwd+bwd, each backend, as `DSAAttention.offsets` runs it in training (bf16
  autocast over fp32 weights, x in bf16 as bench_attention's module rows give it);
- module: the `dsa` module's attend (offset net + the op on its Triton kernels) fwd+bwd with each offset
  net backend, and the `dsa_zero` module's, as bench_attention's module rows run them (CUDA only); the
  summary gives, per width, dsa / dsa_zero with either net and with the net's own time taken out (what a
  free net would leave), the committed `baseline` run's dsa / dsa_zero and its dsa time over this run's
  (the previous offset net, measured in another run), and the issue targets on the first;
- split: each stage of the `dsa` module's attend alone, fwd+bwd (CUDA only): conv + GELU, the offset
  Linear, the bound, and the op on the offsets that net gives; the summary gives each stage's share of the
  module's time and what the stages leave out;
- tiles (with `sweep=true`): each Triton launch alone (forward, forward + GELU, input gradient, weight
  gradient) at the first width for each candidate tiling, to pick depthwise.CONV_BLOCK, WGRAD_BLOCK and
  WGRAD_PROGRAMS.
Every cell is `repeats` (at least 5) calls after a warm-up: median and min / max / std, and peak memory.
Configuration: experiments/conf/bench_offset_net.yaml.

    python -m experiments.bench_offset_net name=h200_offset_net   # GPU, about 2-3 minutes
    python -m experiments.bench_offset_net smoke=true             # tiny, CPU via TRITON_INTERPRET=1
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun, check_line, kernel_check_device
from experiments.module_cell import STAGES, module_fn, stage_fn
from megaslide.perf.timing import MIN_REPEATS, copy_gbps, measure, timed
from experiments.hydra_config import script_config, script_main, trial_preset
from experiments.results_io import RESULTS_DIR
from megaslide.testing import check_conv, check_offset_net

BACKENDS = ("triton", "torch")
CHECK_CASES = [((2, 5, 9, 13, 96), (1, 4)), ((1, 3, 8, 8, 64), (0, 3))]   # (B, T, H, W, C), output frames
SMOKE_CHECK_CASES = [((1, 3, 2, 5, 6), (1, 3))]
NET_CHECK_CASES = [((3, 5, 7), 96, 2, (0, 3), 1), ((5, 9, 13), 80, 5, (1, 4), 2)]   # grid, C, heads, frames, B
SMOKE_NET_CHECK_CASES = [((3, 3, 5), 6, 2, (1, 3), 1)]
MODULE_CELLS = (("dsa", "triton"), ("dsa", "torch"), ("dsa_zero", None))   # (module, offset net backend)
TARGETS = (2.5, 2.0)   # module dsa / dsa_zero at the largest width: issue 35's bound, then issue 36's
SMOKE = {"heads": 2, "head_dims": [4], "grid": [1, 2, 4], "repeats": 5}


@dataclass(frozen=True)
class BenchOffsetNetConfig:
    """The keys of experiments/conf/bench_offset_net.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    sweep: bool
    heads: int
    head_dims: list[int]
    grid: list[int]
    repeats: int
    baseline: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        if self.repeats < MIN_REPEATS:
            raise ValueError(f"repeats={self.repeats}: time at least {MIN_REPEATS} calls for a median and a spread")
        if len(self.grid) != 3 or min(self.grid) < 1:
            raise ValueError(f"grid={list(self.grid)}: give the token grid as [T, H, W], each >= 1")


def conv_hbm_bytes(tokens: int, channels: int, x_elem: int, y_elem: int) -> int:
    """Compulsory traffic of the conv fwd+bwd: forward reads x, writes y; backward reads dy twice (input
    and weight gradients) and x once, writes dx (the weights are negligible)."""
    return tokens * channels * (x_elem + y_elem + 2 * y_elem + x_elem + x_elem)


def timed_cell(step, repeats: int, device) -> dict:
    return measure(lambda: step, repeats, device)


def offset_net_cells(grid, heads: int, d: int, device, repeats: int, ceiling_gbps: float) -> tuple[list, list]:
    """(conv rows, offset_net rows) at one width, each backend."""
    from megaslide.attention import build_attention
    from megaslide.attention.dsa.depthwise import depthwise_conv3d
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    n, dim = math.prod(grid), heads * d
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, n, dim, generator=g, device=device, dtype=dtype).requires_grad_()   # (1, N, D)
    attn = build_attention("dsa", dim, heads).to(device)
    base = {"grid": list(grid), "tokens": n, "heads": heads, "head_dim": d, "channels": dim}
    hbm_ms = conv_hbm_bytes(n, dim, x.element_size(), 2 if cuda else 4) / (ceiling_gbps * 1e9) * 1e3
    conv_rows, net_rows = [], []
    for backend in BACKENDS:
        attn.net_backend = backend

        def conv_step(backend=backend):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                y = depthwise_conv3d(x.view(1, *grid, dim), attn.offset_conv.weight, attn.offset_conv.bias,
                                     backend=backend)
            y.float().sum().backward()

        def net_step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                o = attn.offsets(x, grid)   # (1, T, H, W, heads, K, 3)
            o.sum().backward()

        conv = {**base, "backend": backend, **timed_cell(conv_step, repeats, device), "hbm_ms": hbm_ms}
        if "ms" in conv:
            conv["hbm_fraction"] = hbm_ms / conv["ms"]
        conv_rows.append(conv)
        net_rows.append({**base, "backend": backend, **timed_cell(net_step, repeats, device)})
        for kind, row in (("conv", conv), ("offset_net", net_rows[-1])):
            print(f"  {kind:10s} d={d:4d} {backend:6s} {row.get('ms', float('nan')):9.2f} ms "
                  f"[{row.get('ms_min', float('nan')):.2f}, {row.get('ms_max', float('nan')):.2f}]", flush=True)
    return conv_rows, net_rows


def module_cells(grid, heads: int, d: int, device, repeats: int) -> list[dict]:
    """The `dsa` module's attend with each offset net backend and the `dsa_zero` module's, fwd+bwd at one
    width (the op on its Triton kernels: CUDA only, else skipped rows)."""
    rows = []
    for name, net in MODULE_CELLS:
        row = {"variant": name, "net_backend": net or "none", "grid": list(grid), "tokens": math.prod(grid),
               "heads": heads, "head_dim": d}
        if device.type != "cuda":
            row["status"] = "skipped: the op's Triton kernels need CUDA"
        else:
            row.update(measure(module_fn(name, grid, heads, d, device, "triton", net), repeats, device))
        rows.append(row)
        print(f"  module     d={d:4d} {name:8s} net {row['net_backend']:6s} {row.get('ms', float('nan')):9.2f} ms "
              f"[{row.get('ms_min', float('nan')):.2f}, {row.get('ms_max', float('nan')):.2f}]", flush=True)
    return rows


def baseline_modules(name: str) -> list[dict]:
    """The module rows of the repository's results/attention/<name>.json (a bench_attention run: `dsa` and
    `dsa_zero` on the Triton kernels), each with net_backend "triton"; [] when unnamed or absent."""
    path = RESULTS_DIR / "attention" / f"{name}.json"
    if not name or not path.exists():
        return []
    return [{**r, "net_backend": "triton" if r["variant"] == "dsa" else "none"}
            for r in json.loads(path.read_text())["tables"].get("module", [])]


def split_cells(grid, heads: int, d: int, device, repeats: int) -> list[dict]:
    """Each stage of the `dsa` module's attend alone at one width (module_cell.stage_fn; the op on its Triton
    kernels: CUDA only, else skipped rows)."""
    rows = []
    for stage in STAGES:
        row = {"stage": stage, "grid": list(grid), "tokens": math.prod(grid), "heads": heads, "head_dim": d}
        if device.type != "cuda":
            row["status"] = "skipped: the op's Triton kernels need CUDA"
        else:
            row.update(measure(stage_fn(stage, grid, heads, d, device), repeats, device))
        rows.append(row)
        print(f"  stage      d={d:4d} {stage:9s} {row.get('ms', float('nan')):9.2f} ms "
              f"[{row.get('ms_min', float('nan')):.2f}, {row.get('ms_max', float('nan')):.2f}]", flush=True)
    return rows


def split_summary(split_rows: list[dict], module_rows: list[dict], head_dims) -> dict:
    """Per width: each stage's share of the `dsa` module's time (Triton net), and what the stages leave out
    (autocast casts, views, the output's own backward): the module minus their sum."""
    out: dict = {}
    for d in head_dims:
        module = next((r["ms"] for r in module_rows if r.get("status") == "ok" and r["variant"] == "dsa"
                       and r["net_backend"] == "triton" and r["head_dim"] == d), None)
        stages = {r["stage"]: r["ms"] for r in split_rows if r.get("status") == "ok" and r["head_dim"] == d}
        if module and len(stages) == len(STAGES):
            out.update({f"{stage}_share_of_module_d{d}": ms / module for stage, ms in stages.items()})
            out[f"module_minus_stages_ms_d{d}"] = module - sum(stages.values())
    return out


def module_summary(module_rows: list[dict], net_rows: list[dict], head_dims, baseline: list[dict]) -> dict:
    """Per width: module dsa / dsa_zero with the Triton and the torch offset net, with the Triton net's own
    time (the offset_net row) taken out, and in the `baseline` rows (another run) with its dsa time over
    this run's; then TARGETS at the largest width (`met`: ratio <= bound)."""
    def ms(rows, **match):
        row = next((r for r in rows if r.get("status") == "ok" and all(r[k] == v for k, v in match.items())), None)
        return row and row["ms"]

    out: dict = {}
    for d in head_dims:
        zero, net = ms(module_rows, variant="dsa_zero", head_dim=d), ms(net_rows, backend="triton", head_dim=d)
        for backend in BACKENDS:
            dsa = ms(module_rows, variant="dsa", net_backend=backend, head_dim=d)
            out[f"module_dsa_{backend}_net_over_zero_d{d}"] = dsa / zero if dsa and zero else None
        dsa = ms(module_rows, variant="dsa", net_backend="triton", head_dim=d)
        out[f"module_dsa_without_net_over_zero_d{d}"] = (dsa - net) / zero if dsa and zero and net else None
        then, then_zero = (ms(baseline, variant=v, head_dim=d) for v in ("dsa", "dsa_zero"))
        out[f"baseline_module_dsa_over_zero_d{d}"] = then / then_zero if then and then_zero else None
        out[f"module_dsa_speedup_vs_baseline_d{d}"] = then / dsa if then and dsa else None
    ratio = out.get(f"module_dsa_triton_net_over_zero_d{max(head_dims)}")
    out["targets"] = [{"target": f"module dsa / dsa_zero at d={max(head_dims)} <= {bound}", "bound": bound,
                       "measured": ratio, "met": None if ratio is None else ratio <= bound} for bound in TARGETS]
    return out


CONV_CANDIDATES = [(8, 64, 4, 16), (8, 64, 4, 8), (16, 64, 8, 16), (4, 128, 4, 16), (8, 32, 2, 16),
                   (8, 128, 4, 16), (16, 128, 4, 16)]   # (BLOCK_X, BLOCK_C, warps, frames per program)
WGRAD_CANDIDATES = [(8, 64, 4, 256), (8, 64, 8, 256), (4, 64, 4, 256), (8, 32, 2, 256), (16, 64, 8, 256),
                    (8, 64, 4, 512), (4, 128, 4, 256)]   # (BLOCK_X, BLOCK_C, warps, WGRAD_PROGRAMS)
SMOKE_CANDIDATES = ([(4, 8, 1, 2)], [(4, 8, 1, 4)])


def sweep_tiles(grid, channels: int, device, repeats: int, smoke: bool) -> list[dict]:
    """Each Triton launch alone per candidate tiling: forward, forward + GELU and input gradient (CONV_BLOCK),
    weight and bias gradient (WGRAD_BLOCK, WGRAD_PROGRAMS), bf16 activations on the GPU."""
    from megaslide.attention.dsa import depthwise as dw
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    x, dy = (torch.randn(1, *grid, channels, generator=g, device=device, dtype=dtype) for _ in range(2))
    taps = torch.randn(27, channels, generator=g, device=device)
    bias = torch.randn(channels, generator=g, device=device)
    conv_candidates, wgrad_candidates = SMOKE_CANDIDATES if smoke else (CONV_CANDIDATES, WGRAD_CANDIDATES)
    saved = dw.CONV_BLOCK, dw.WGRAD_BLOCK, dw.WGRAD_PROGRAMS
    rows = []
    try:
        for block in conv_candidates:
            dw.CONV_BLOCK = block
            kernel = [3, 3, 3]
            for launch, fn in (("forward", lambda: dw._launch_conv(x, taps, bias, 0, grid[0], kernel, dtype)),
                               ("forward_gelu", lambda: dw._launch_conv_gelu(x, taps, bias, 0, grid[0], kernel, dtype)),
                               ("input_grad", lambda: dw._launch_conv(dy, taps, None, 0, grid[0], kernel, dtype))):
                rows.append({"launch": launch, "block_x": block[0], "block_c": block[1], "num_warps": block[2],
                             "frames": block[3], **timed(fn, device, repeats).ms(), "default": block == saved[0]})
        for *block, programs in wgrad_candidates:
            dw.WGRAD_BLOCK, dw.WGRAD_PROGRAMS = tuple(block), programs
            rows.append({"launch": "weight_grad", "block_x": block[0], "block_c": block[1], "num_warps": block[2],
                         "programs": programs, **timed(lambda: dw._launch_wgrad(x, dy, 0, [3, 3, 3]), device,
                                                       repeats).ms(),
                         "default": (tuple(block), programs) == saved[1:]})
    finally:
        dw.CONV_BLOCK, dw.WGRAD_BLOCK, dw.WGRAD_PROGRAMS = saved
    for r in rows:
        print(f"  tiles {r['launch']:12s} {r['block_x']:3d} x {r['block_c']:3d} w{r['num_warps']} "
              f"f{r.get('frames', '-')!s:3s} {r.get('programs', '')!s:5s} {r['ms']:7.2f} ms"
              f"{' (default)' if r['default'] else ''}", flush=True)
    return rows


def bench(cfg: BenchOffsetNetConfig) -> int:
    device = kernel_check_device(cfg.smoke, "bench_offset_net")
    if device is None:
        return 2
    name = cfg.name or ("offset_net_smoke" if cfg.smoke else "offset_net")
    run = ExperimentRun("attention", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project, trial=cfg.smoke)
    ceiling = {"hbm_gbps": copy_gbps(device, 2 ** 20 if cfg.smoke else 2 ** 30)}
    dtypes = (torch.float32, torch.bfloat16)
    checks = [check_conv(shape, frames, dtype, device, gelu=gelu) for shape, frames in
              (SMOKE_CHECK_CASES if cfg.smoke else CHECK_CASES) for dtype in dtypes for gelu in (False, True)]
    checks += [check_offset_net(grid, dim, heads, frames, dtype, device, batch=batch)
               for grid, dim, heads, frames, batch in (SMOKE_NET_CHECK_CASES if cfg.smoke else NET_CHECK_CASES)
               for dtype in dtypes]
    passed = all(c["passed"] for c in checks)
    payload = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
               "ceilings": ceiling, "passed": passed, "checks": checks, "tables": {}}
    run.save({**payload, "partial": True})
    conv_rows, net_rows, module_rows, split_rows = [], [], [], []
    tables = {"conv": conv_rows, "offset_net": net_rows, "module": module_rows, "split": split_rows}
    if passed:
        for d in cfg.head_dims:
            conv, net = offset_net_cells(tuple(cfg.grid), cfg.heads, d, device, cfg.repeats, ceiling["hbm_gbps"])
            conv_rows += conv
            net_rows += net
            module_rows += module_cells(tuple(cfg.grid), cfg.heads, d, device, cfg.repeats)
            split_rows += split_cells(tuple(cfg.grid), cfg.heads, d, device, cfg.repeats)
            run.save({**payload, "partial": True, "tables": tables})
    payload["tables"] = tables
    if passed and cfg.sweep:
        payload["tables"]["tiles"] = sweep_tiles(tuple(cfg.grid), cfg.heads * cfg.head_dims[0], device, cfg.repeats,
                                                 cfg.smoke)
    speedups = {}
    for d in cfg.head_dims:
        by = {r["backend"]: r.get("ms") for r in net_rows if r["head_dim"] == d}
        if by.get("triton") and by.get("torch"):
            speedups[f"offset_net_speedup_d{d}"] = by["torch"] / by["triton"]
    modules = {**split_summary(split_rows, module_rows, cfg.head_dims),
               **module_summary(module_rows, net_rows, cfg.head_dims, baseline_modules(cfg.baseline))}
    payload["summary"] = {**speedups, **modules}
    ratios = {k: v for k, v in modules.items() if k != "targets"}
    path = run.finish(payload, {"passed": passed, **speedups, **{k: v for k, v in ratios.items() if v is not None}})
    for c in checks:
        where = f"{c['shape']} gelu {c['gelu']}" if "shape" in c else f"net {c['grid']} C={c['dim']} heads {c['heads']}"
        print(check_line(c, f"{where} frames {c['frames']}"))
    for k, v in ratios.items():
        print(f"  {k}: {v if v is None else round(v, 3)}")
    for t in modules["targets"]:
        print(f"  {t['target']}: measured {t['measured']}, met {t['met']}")
    print(f"{'PASS' if passed else 'FAIL'}; {speedups}; wrote {path}")
    return 0 if passed else 1


@script_main("bench_offset_net")
def main(hydra_cfg: DictConfig) -> None:
    """Exit status 0: the check passed and the cells ran; 1: the check failed (nothing timed); 2: no GPU."""
    sys.exit(bench(script_config(BenchOffsetNetConfig, hydra_cfg, trial_preset(hydra_cfg, smoke=SMOKE))))


if __name__ == "__main__":
    main()
