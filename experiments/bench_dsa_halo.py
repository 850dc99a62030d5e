"""DSA halo-forward benchmark: the halo forward (megaslide/attention/dsa/halo.py) against the gather forward
(forward.py, "v2") at the target grid, after a correctness check of the halo forward.

Tables of results/attention/<name>.json (rendered by experiments/report.py):
- check: the halo forward's out and log-sum-exp against the float64 reference beside the same-dtype
  reference (megaslide.testing.check_dsa_halo), fp32 and bf16, on small grids whose tiles lie inside, on and
  beyond the halo bound, and its per-tile paths against the plain rule; `passed` is all of them;
- cells: at `grid` (one batch, `heads` x `head_dim`, bf16, 3 x 3 x 3 window, fp32 offsets uniform in
  +-bound for each of `bounds`): the gather forward and, for each tile of `tiles`, the halo forward with
  reach min(ceil(bound), MAX_HALO_REACH) (past it most tiles take the gathers: the fallback's cost), both
  storing the lse (as a training forward does); median ms and spread, peak memory, the halo cells' tiles on
  each path and `max_err` against the gather forward's output; a halo cell whose
  kernel fails to build (e.g. out of shared memory) is kept with its error; on a GPU, for each tile of 16 or
  32 queries, a `halo_cuda` cell of the CUDA C++ halo forward (halo_cuda.py) likewise;
- summary: per bound, the best halo cell's speedup over the gather forward (and the best halo_cuda cell's).

    python -m experiments.bench_dsa_halo name=h200_dsa_halo   # GPU
    python -m experiments.bench_dsa_halo smoke=true           # tiny, CPU via TRITON_INTERPRET=1
Configuration: experiments/conf/bench_dsa_halo.yaml.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun, check_line, kernel_check_device, progress
from experiments.hydra_config import script_config, script_main, trial_preset
from megaslide.attention.dsa.constants import MAX_HALO_REACH
from megaslide.perf.timing import MIN_REPEATS, measure
from megaslide.testing import check_dsa_halo, dsa_halo_inputs

KERNEL = (3, 3, 3)
CHECK_CASES = [  # (shape, reach, tile, beyond): mixed tiles, clamped edges, odd grids, padded head dims
    ((1, 5, 9, 23, 2, 24), 0, (2, 2, 4), {(2, 4, 9): (0.0, 0.0, -6.5), (4, 8, 22): (-9.0, 9.0, 9.0)}),
    ((2, 7, 13, 17, 1, 64), 1, (1, 4, 4), {(3, 6, 8): (2.5, -4.5, 3.25)}),
]
SMOKE_CHECK_CASES = [((1, 3, 5, 13, 1, 24), 1, (4, 8, 8), {(0, 1, 9): (0.0, 0.0, -8.5)})]
SMOKE = {"grid": [3, 4, 4], "heads": 1, "head_dim": 16, "bounds": [1], "tiles": [[4, 4, 4, 4]], "repeats": 5}


@dataclass(frozen=True)
class BenchDSAHaloConfig:
    """The keys of experiments/conf/bench_dsa_halo.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    grid: list[int]
    heads: int
    head_dim: int
    bounds: list[float]
    tiles: list[list[int]]
    repeats: int
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        if self.repeats < MIN_REPEATS:
            raise ValueError(f"repeats={self.repeats}: time at least {MIN_REPEATS} calls for a median and a spread")
        if len(self.grid) != 3 or min(self.grid) < 3:
            raise ValueError(f"grid={self.grid}: give [T, H, W], each >= 3 (the 3 x 3 x 3 window)")
        if self.heads < 1 or not 1 <= self.head_dim <= 128:
            raise ValueError(f"heads={self.heads}, head_dim={self.head_dim}: heads >= 1, head_dim in [1, 128]")
        if not self.bounds or min(self.bounds) < 0:
            raise ValueError(f"bounds={self.bounds}: give offset bounds >= 0 (tokens)")
        for tile in self.tiles:
            if len(tile) != 4 or any(s < 1 or s & (s - 1) for s in tile) or math.prod(tile[:3]) < 16:
                raise ValueError(f"tiles={self.tiles}: give [t, y, x, warps], powers of two, t * y * x >= 16")


def cells(cfg: BenchDSAHaloConfig, device, bound: float) -> list[dict]:
    """The gather forward and each halo tile at one offset bound, bf16 (fp32 in the interpreter)."""
    from megaslide.attention.dsa.forward import dsa_forward
    from megaslide.attention.dsa.halo import dsa_halo_forward, path_counts
    from megaslide.attention.dsa.launch import HaloConfig
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    shape = (1, *cfg.grid, cfg.heads, cfg.head_dim)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(3))
    offsets = bound * (2 * torch.rand(*shape[:5], 27, 3, generator=g, device=device) - 1)  # fp32, as the module's
    scale, reach = cfg.head_dim ** -0.5, min(math.ceil(bound), MAX_HALO_REACH)
    base = {"bound": bound, "reach": reach, "grid": cfg.grid, "heads": cfg.heads, "head_dim": cfg.head_dim,
            "dtype": str(dtype).removeprefix("torch.")}
    with torch.no_grad():
        want = dsa_forward(q, k, v, offsets, KERNEL, scale)[0].float()
        rows = [{**base, "kernel": "gather",
                 **measure(lambda: lambda: dsa_forward(q, k, v, offsets, KERNEL, scale), cfg.repeats, device)}]
        for t, y, x, warps in cfg.tiles:
            config = HaloConfig((t, y, x), warps)
            if device.type == "cuda" and t * y * x in (16, 32):  # the CUDA C++ halo forward (halo_cuda.py), bf16
                rows.append(cuda_cell(q, k, v, offsets, scale, reach, (t, y, x), want, cfg.repeats, device, base))
            row = {**base, "kernel": "halo", "tile": [t, y, x], "num_warps": warps}
            progress(f"+-{bound:g} halo {[t, y, x]} {warps} warps: first call (builds the kernel)")
            try:
                out, _, path = dsa_halo_forward(q, k, v, offsets, KERNEL, scale, reach, config=config)
            except Exception as err:  # a tile the compiler cannot build here (registers, shared memory)
                rows.append({**row, "status": "error", "error": f"{type(err).__name__}: {err}"[:400]})
                continue
            row.update(paths=path_counts(path), max_err=(out.float() - want).abs().max().item())
            row.update(measure(lambda: lambda: dsa_halo_forward(q, k, v, offsets, KERNEL, scale, reach,
                                                                config=config), cfg.repeats, device))
            rows.append(row)
    for row in rows:
        progress(f"+-{bound:g} {row['kernel']:6s} {row.get('tile', '')} {row.get('status')} "
                 f"{row.get('ms', float('nan')):8.3f} ms paths {row.get('paths', '')} err {row.get('max_err', '')}")
    return rows


def cuda_cell(q, k, v, offsets, scale, reach, tile, want, repeats, device, base) -> dict:
    """One cell of the CUDA C++ halo forward (halo_cuda.py; 4 warps, forward only) at `tile`, as a halo cell."""
    from megaslide.attention.dsa.halo import path_counts
    from megaslide.attention.dsa.halo_cuda import dsa_halo_forward_cuda
    row = {**base, "kernel": "halo_cuda", "tile": list(tile), "num_warps": 4}
    progress(f"+-{base['bound']:g} halo_cuda {list(tile)}: first call (builds the kernel with nvcc)")
    try:
        out, _, path = dsa_halo_forward_cuda(q, k, v, offsets, KERNEL, scale, reach, tile=tile)
    except Exception as err:  # no nvcc, a failed build or launch, a tile over the shared memory
        return {**row, "status": "error", "error": f"{type(err).__name__}: {err}"[:400]}
    row.update(paths=path_counts(path), max_err=(out.float() - want).abs().max().item())
    row.update(measure(lambda: lambda: dsa_halo_forward_cuda(q, k, v, offsets, KERNEL, scale, reach, tile=tile),
                       repeats, device))
    return row


def bench(cfg: BenchDSAHaloConfig) -> int:
    device = kernel_check_device(cfg.smoke, "bench_dsa_halo")
    if device is None:
        return 2
    name = cfg.name or ("dsa_halo_smoke" if cfg.smoke else "dsa_halo")
    run = ExperimentRun("attention", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project, trial=cfg.smoke)
    checks = []
    for shape, reach, tile, beyond in SMOKE_CHECK_CASES if cfg.smoke else CHECK_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            progress(f"check {str(dtype).removeprefix('torch.'):8s} {shape} reach {reach} tile {tile}: starting "
                     "(its first call builds the kernel)")
            checks.append(check_dsa_halo(*dsa_halo_inputs(shape, reach, dtype, beyond, device), reach, tile))
            progress(check_line(checks[-1], f"{shape} reach {reach} tile {tile} paths {checks[-1]['paths']}"))
    passed = all(c["passed"] for c in checks)
    payload = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
               "passed": passed, "checks": checks, "tables": {}}
    rows = run.timed_cells(payload, passed, [(bound,) for bound in cfg.bounds],
                           lambda bound: cells(cfg, device, bound))
    summary = {}
    for bound in cfg.bounds:
        gather = [r["ms"] for r in rows if r["bound"] == bound and r["kernel"] == "gather" and "ms" in r]
        halo = [r["ms"] for r in rows if r["bound"] == bound and r["kernel"] == "halo" and "ms" in r]
        if gather and halo:
            summary[f"halo_speedup_pm{bound:g}"] = gather[0] / min(halo)
        cuda = [r["ms"] for r in rows if r["bound"] == bound and r["kernel"] == "halo_cuda" and "ms" in r]
        if gather and cuda:
            summary[f"halo_cuda_speedup_pm{bound:g}"] = gather[0] / min(cuda)
    payload["summary"] = summary
    path = run.finish(payload, {"passed": passed, **summary})
    print(f"{'PASS' if passed else 'FAIL'}; {summary}; wrote {path}")
    return 0 if passed else 1


@script_main("bench_dsa_halo")
def main(hydra_cfg: DictConfig) -> None:
    """Exit status 0: the check passed and the cells ran; 1: the check failed (nothing timed); 2: no GPU."""
    sys.exit(bench(script_config(BenchDSAHaloConfig, hydra_cfg, trial_preset(hydra_cfg, smoke=SMOKE))))


if __name__ == "__main__":
    main()
