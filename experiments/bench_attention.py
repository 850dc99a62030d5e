"""Attention benchmark: forward+backward time and peak memory of the attention variants, the DSA
modules, and issue 36's targets.

Tables of results/attention/<name>.json (rendered by experiments/report.py):
- target: each op variant at the 262K-token target grid (16 x 128 x 128), `heads` x `head_dim`:
  dense SDPA (flash on GPU), Swin 2x4x4 windows (32 keys per query), the DSA reference
  (materialised samples), DSA fused (Triton) fwd+bwd and its forward alone (`dsa_fused_fwd`, under
  no_grad), and `dsa_zero_fused`: what the `dsa_zero` module's attend runs (zero offsets, no offset
  gradient); where `variants` names them, the op with the CUDA C++ halo forward (halo_kernel="cuda", halos
  covering the offsets' bound, at most MAX_HALO_REACH) fwd+bwd (`dsa_fused_halo_cuda`) and forward alone
  (`dsa_fused_halo_cuda_fwd`), also in the offsets table, with target lines of their own;
- kernels: one fwd+bwd call of dsa_fused and dsa_fused_deterministic (those of `variants`) at the target grid,
  its device time per kernel (torch.profiler): which kernels the deterministic mode's extra time is spent in;
- rank_blocks (only where `rank_blocks` lists any): dsa_fused_deterministic at the target grid with the
  deterministic binning ranked in blocks of b entries (`launch.KeyConfig.rank_block`) for each b listed, and
  its cost over the target table's dsa_fused (`rank_block_rows`);
- module: the `dsa` and `dsa_zero` modules' attend (offset net + op) fwd+bwd at the target grid, for
  each head dim of `module_head_dims` (`heads` heads), bf16 autocast over fp32 weights as training
  runs them; the offset net keeps PyTorch's default init (not the zero init), so samples fall
  between tokens as in a trained layer;
- offsets: dsa_fused fwd+bwd and forward at the target grid with offsets uniform in +-b for each b of
  `offset_bounds` (the +-1 targets read the b = 1 rows; the target table's +-4 is the widest the module
  allows): the cost's dependence on how far samples spread;
- sweep: `sweep_variants` on 1080p latents (8x VAE, patch 2: 68 x 120 tokens per latent frame) at
  `frames` latent frames, for the log-log slope of time against tokens;
- gather: the gather floor (`experiments.kernels.gather_floor`): a kernel that makes only the fused
  forward's corner-row loads (the same launch, positions and rows; the backward's query pass makes the same
  loads again), timed at the target grid in both row layouts at +-4 and at each of `offset_bounds` at the
  forward's launch, and at +-4 and the smallest bound at each of `gather_launches`, after a check against
  the reference on a small grid (`gather_check`);
- tiles: the fused kernels' launch configuration per head dim at the target grid;
- summary / targets: each of issue 36's targets beside its figure measured in the tables above; `met` is
  computed from the data (`target_row`).
Every cell is timed `repeats` (at least 5) times after one warm-up: median and min / max / std in
ms, and its peak memory. The same run measures the ceilings (HBM copy, L2-resident copy, bf16
matmul) for two modelled bounds on the fused kernel, the idealised roofline and the gather bound; the gather
floor is a third, measured one.
Configuration: experiments/conf/bench_attention.yaml.

    python -m experiments.bench_attention                  # GPU sweep -> results/attention/sweep.json
    python -m experiments.bench_attention quick=true name=h200_quick   # target grid + short slope sweep
    python -m experiments.bench_attention smoke=true       # tiny, CPU, seconds
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from baselines.swin_attention import SwinAttention
from experiments import gpu_check_dsa
from experiments.dsa_candidates import launch_of
from experiments.harness import ExperimentRun
from experiments.module_cell import KERNEL, module_fn
from megaslide.perf.timing import MIN_REPEATS, copy_gbps, kernel_ms, matmul_tflops, measure, timed
from experiments.hydra_config import require_ranges, require_sizes, script_config, script_main, trial_preset
from experiments.results_io import RESULTS_DIR
from megaslide.attention import build_attention
from megaslide.attention.dsa import deformable_slide_attention
from megaslide.attention.dsa.constants import ENTRY_FLOATS, MAX_HALO_REACH
from megaslide.attention.dsa.op import check_kernel_size
from megaslide.testing import within_tolerance
from megaslide.train.determinism import deterministic_mode, fix_cublas_workspace

DATASHEET_FP32_TFLOPS = 67.0   # H100/H200 SXM CUDA-core fp32 (non-tensor) peak, datasheet
WINDOW = (2, 4, 4)
SWIN = "swin" + "x".join(map(str, WINDOW))
VARIANTS = ("dense", SWIN, "dsa_reference", "dsa_fused", "dsa_fused_fwd", "dsa_fused_deterministic", "dsa_zero_fused",
            "dsa_fused_halo_cuda", "dsa_fused_halo_cuda_fwd")
FUSED = ("dsa_fused", "dsa_fused_fwd")   # the fused op fwd+bwd / fwd
HALO_CUDA = ("dsa_fused_halo_cuda", "dsa_fused_halo_cuda_fwd")   # the op with the CUDA halo forward, fwd+bwd / fwd
MODULES = ("dsa", "dsa_zero")
SLOPE_TOKENS = (65_000, 1_100_000)  # the slope target's "65K to 1M tokens": 8 to 128 frames of 68 x 120
SMOKE = {"heads": 2, "head_dim": 16, "module_head_dims": [16], "repeats": 5}
QUICK = {"frames": [2, 8, 32, 128], "variants": ["dense", SWIN, "dsa_fused", "dsa_fused_fwd", "dsa_fused_deterministic",
                                                 "dsa_zero_fused"],
         "sweep_variants": ["dsa_fused"]}


@dataclass(frozen=True)
class BenchAttentionConfig:
    """The keys of experiments/conf/bench_attention.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    quick: bool
    heads: int
    head_dim: int
    module_head_dims: list[int]
    offset_bounds: list[float]
    rank_blocks: list[int]
    gather_launches: list[list[int]]
    frames: list[int]
    variants: list[str]
    sweep_variants: list[str]
    repeats: int
    baseline: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        for key in ("variants", "sweep_variants"):
            unknown = [v for v in getattr(self, key) if v not in VARIANTS]
            if unknown:
                raise ValueError(f"{key}={unknown} unknown; choose from {list(VARIANTS)}")
        if any(not b > 0 for b in self.offset_bounds):
            raise ValueError(f"offset_bounds={list(self.offset_bounds)}: each bound must be > 0 "
                             "(offsets uniform in +-b)")
        if self.rank_blocks:  # launch.py imports triton, which a CPU-only install may lack
            from megaslide.attention.dsa.launch import RANK_BLOCKS
            if not set(self.rank_blocks) <= set(RANK_BLOCKS):
                raise ValueError(f"rank_blocks={list(self.rank_blocks)}: each must be one of {list(RANK_BLOCKS)}, "
                                 "entries per block of the deterministic binning (launch.KeyConfig.rank_block)")
        if self.repeats < MIN_REPEATS:
            raise ValueError(f"repeats={self.repeats}: time at least {MIN_REPEATS} calls for a median and a spread")
        require_sizes("frames", list(self.frames))
        require_sizes("module_head_dims", list(self.module_head_dims))
        require_ranges(self, positive=("heads", "head_dim"))


# ----------------------------------------------------------------------------- cells
def make_inputs(grid, heads, d, K, dtype, device, max_offset=4.0):
    """q, k, v (1, T, H, W, heads, d) leaves requiring grad; offsets (1, T, H, W, heads, K, 3) uniform in
    +-max_offset, requiring grad."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = (1, *grid, heads, d)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    off = max_offset * (2 * torch.rand(1, *grid, heads, K, 3, generator=g, device=device) - 1)
    return q, k, v, off.requires_grad_()


def variant_fns(grid, heads, d, dtype, device, max_offset=4.0):
    """name -> (setup() -> step closure, keys per query) for every op variant at one grid (the DSA
    variants' offsets uniform in +-max_offset)."""
    K = math.prod(KERNEL)
    n = math.prod(grid)

    def dense():
        q, k, v, _ = make_inputs(grid, heads, d, K, dtype, device)
        qt, kt, vt = (x.view(1, -1, heads, d).transpose(1, 2) for x in (q, k, v))

        def step():
            F.scaled_dot_product_attention(qt, kt, vt).sum().backward()
        return step

    def attend(build):
        """setup of a module's attend on q, k, v (Swin and dsa_zero read no block input)."""
        def setup():
            q, k, v, _ = make_inputs(grid, heads, d, K, dtype, device)
            attn = build().to(device)

            def step():
                attn.attend(*(x.view(1, -1, heads, d) for x in (q, k, v)), None, grid).sum().backward()
            return step
        return setup

    win = (min(WINDOW[0], grid[0]), *WINDOW[1:])  # a single latent frame gets 2D windows
    swin = attend(lambda: SwinAttention(heads * d, heads, window=win, layer_idx=1))
    dsa_zero = attend(lambda: build_attention("dsa_zero", heads * d, heads, kernel_size=KERNEL, backend="triton"))

    def dsa(backend, backward=True, deterministic=False, halo_kernel=None):
        """halo_kernel: the op's halo forward on that kernel, with halos covering the offsets' bound (at most
        MAX_HALO_REACH tokens); None: the gather forward."""
        halo = {} if halo_kernel is None else {"halo_reach": min(math.ceil(max_offset), MAX_HALO_REACH),
                                               "halo_kernel": halo_kernel}

        def setup():
            q, k, v, off = make_inputs(grid, heads, d, K, dtype, device, max_offset)

            def step():
                if backward:
                    with deterministic_mode(device) if deterministic else contextlib.nullcontext():
                        deformable_slide_attention(q, k, v, off, KERNEL, backend=backend, **halo).sum().backward()
                else:
                    with torch.no_grad():
                        deformable_slide_attention(q, k, v, off, KERNEL, backend=backend, **halo)
            return step
        return setup

    return {"dense": (dense, n), SWIN: (swin, math.prod(win)), "dsa_reference": (dsa("reference"), K),
            "dsa_fused": (dsa("triton"), K), "dsa_fused_fwd": (dsa("triton", backward=False), K),
            "dsa_fused_deterministic": (dsa("triton", deterministic=True), K), "dsa_zero_fused": (dsa_zero, K),
            HALO_CUDA[0]: (dsa("triton", halo_kernel="cuda"), K),
            HALO_CUDA[1]: (dsa("triton", backward=False, halo_kernel="cuda"), K)}


def _print_row(row: dict) -> None:
    print(f"  {row['variant']:16s} N={row['tokens']:>8d} {row.get('status')} {row.get('ms', float('nan')):9.2f} ms "
          f"[{row.get('ms_min', float('nan')):.2f}, {row.get('ms_max', float('nan')):.2f}] "
          f"{row.get('peak_gb', float('nan')):7.2f} GB", flush=True)


def kernel_refusal(grid) -> str | None:
    """Why the DSA variants cannot run KERNEL on `grid` (the op's own check), or None when they can."""
    try:
        check_kernel_size(KERNEL, grid)
    except ValueError as error:
        return str(error)
    return None


def sweep(grids, variants, heads, d, dtype, device, repeats, dense_limit, ref_limit, on_row=lambda rows: None):
    """Time `variants` on every grid; `on_row(rows)` runs after each row (partial saves)."""
    rows = []
    for grid in grids:
        n = math.prod(grid)
        for name, (setup, keys) in variant_fns(grid, heads, d, dtype, device).items():
            if name not in variants:
                continue
            row = {"variant": name, "grid": list(grid), "tokens": n, "keys_per_query": keys}
            if name == "dense" and n > dense_limit:
                row["status"] = f"skipped: N > {dense_limit} (quadratic time)"
            elif name == "dsa_reference" and n > ref_limit:
                row["status"] = f"skipped: N > {ref_limit} (OOM at a smaller N)"
            elif name.startswith("dsa") and (refusal := kernel_refusal(grid)):
                row["status"] = f"skipped: {refusal}"
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
            _print_row(row)
    return rows


SPLIT = ("dsa_fused", "dsa_fused_deterministic")   # target-grid variants whose time is split per kernel


def kernel_split(grid, variants, heads, d, dtype, device) -> list[dict]:
    """One fwd+bwd call of each SPLIT variant in `variants` at `grid`, its device time per kernel (ms; CUDA
    only, [] on CPU): where the deterministic mode's extra time goes."""
    if device.type != "cuda":
        return []
    fns = variant_fns(grid, heads, d, dtype, device)
    return [{"variant": name, "kernel": kernel, "ms": ms} for name in SPLIT if name in variants
            for kernel, ms in kernel_ms(fns[name][0](), device).items()]


def rank_block_rows(grid, heads, d, dtype, device, repeats, rank_blocks, target, on_row=lambda rows: None):
    """dsa_fused_deterministic fwd+bwd at `grid` with the deterministic binning ranked in blocks of b entries
    (`launch.KeyConfig.rank_block`, the default key config otherwise) for each b of `rank_blocks`, on the target
    rows' inputs. A key config reaches the kernels only outside autograd, so they are called as gpu_check_dsa's
    `run` calls them: the forward, then the backward on dout = ones, without the autograd rows' gradient
    accumulation (list the default block, launch.RANKED_BIN_BLOCK, too for a row on the same calls).
    `deterministic_cost`: ms over the `target` table's dsa_fused ms, where that ran."""
    from megaslide.attention.dsa import launch
    n, K = math.prod(grid), math.prod(KERNEL)
    fused = _ok(target, variant="dsa_fused")
    case = gpu_check_dsa.Case("rank_block", (1, *grid, heads, d), KERNEL, fp32_offsets=True)
    rows = []
    for block in rank_blocks:
        row = {"variant": "dsa_fused_deterministic", "rank_block": block, "grid": list(grid), "tokens": n}
        if refusal := kernel_refusal(grid):
            row["status"] = f"skipped: {refusal}"
        elif device.type != "cuda":
            row["status"] = "skipped: Triton kernels need CUDA"
        else:
            keys = replace(launch.key_config(tuple(grid), d), rank_block=block)

            def setup(keys=keys):
                q, k, v, off = (x.detach() for x in make_inputs(grid, heads, d, K, dtype, device))
                inputs = [q, k, v, off, torch.ones_like(q)]  # dout: out.sum()'s gradient

                def step():
                    with deterministic_mode(device):
                        gpu_check_dsa.run("triton", inputs, case, dtype, "dsa", key_config=keys)
                return step
            row.update(measure(setup, repeats, device))
            if fused and row["status"] == "ok":
                row["deterministic_cost"] = row["ms"] / fused["ms"]
        rows.append(row)
        on_row(rows)
        _print_row(row)
    return rows


def module_rows(grid, heads, head_dims, device, repeats, on_row=lambda rows: None):
    """Time each DSA module's attend at `grid` for each head dim (Triton on CUDA, "auto" on CPU)."""
    backend = "triton" if device.type == "cuda" else "auto"
    rows = []
    for d in head_dims:
        for name in MODULES:
            row = {"variant": name, "grid": list(grid), "tokens": math.prod(grid), "heads": heads, "head_dim": d,
                   "backend": backend}
            row.update(measure(module_fn(name, grid, heads, d, device, backend), repeats, device))
            rows.append(row)
            on_row(rows)
            _print_row(row)
    return rows


def offset_rows(grid, heads, d, dtype, device, repeats, bounds, on_row=lambda rows: None,
                names=FUSED):
    """dsa_fused fwd+bwd and its forward alone (or the variants `names`) at `grid` with offsets uniform in +-b
    for each b of `bounds`: how the kernels' cost depends on how far samples spread (the targets' +-4 is the
    widest the module allows, whose tanh bound is 4 by default). Skipped on CPU, as the other fused rows."""
    rows = []
    for bound in bounds:
        fns = variant_fns(grid, heads, d, dtype, device, max_offset=bound)
        for name in names:
            row = {"variant": name, "max_offset": bound, "grid": list(grid), "tokens": math.prod(grid)}
            if device.type != "cuda":
                row["status"] = "skipped: Triton kernels need CUDA"
            else:
                row.update(measure(fns[name][0], repeats, device))
            rows.append(row)
            on_row(rows)
            _print_row(row)
    return rows


def gather_check(device) -> dict:
    """The gather-floor kernel against its reference (the op with q = 0, float64) on a small odd grid, fp32,
    both layouts: max abs error and pass / fail (1e-4, fp32 accumulation of 432 rows). CUDA only."""
    from experiments.kernels import gather_floor
    g = torch.Generator(device=device).manual_seed(1)
    shape, K = (1, 5, 9, 11, 2, 64), math.prod(KERNEL)
    k, v = (torch.randn(shape, generator=g, device=device) for _ in range(2))
    off = 4 * (2 * torch.rand(*shape[:5], K, 3, generator=g, device=device) - 1)
    want = gather_floor.gathered_sum_reference(k, v, off, KERNEL)
    errors = {layout: (gather_floor.gathered_sum(k, v, off, KERNEL, layout).double() - want).abs().max().item()
              for layout in gather_floor.LAYOUTS}
    return {"shape": list(shape), "max_abs_error": errors, "passed": all(e <= 1e-4 for e in errors.values())}


def gather_rows(grid, heads, d, dtype, device, repeats, bounds, launches, on_row=lambda rows: None):
    """The gather floor at `grid` (CUDA; on CPU one skipped row): `gathered_sum` in each row layout with offsets
    uniform in +-b for b = 4 (the targets') and each of `bounds`, at the forward's default launch; then at +-4
    and at the smallest bound at each of `launches` (launch.LaunchConfig). Each row records its launch."""
    n = math.prod(grid)
    if device.type != "cuda":
        rows = [{"variant": "gather", "grid": list(grid), "tokens": n, "status": "skipped: Triton kernels need CUDA"}]
        on_row(rows)
        return rows
    from experiments.kernels.gather_floor import LAYOUTS, gathered_sum
    from megaslide.attention.dsa.launch import forward_launch_config
    default = forward_launch_config(n, d)
    swept = [(b, default) for b in dict.fromkeys([4.0, *bounds])]
    swept += [(b, launch) for b in dict.fromkeys([4.0, min([4.0, *bounds])])
              for launch in dict.fromkeys(launches) if launch != default]
    rows = []
    for bound, launch in swept:
        for layout in LAYOUTS:
            def setup(bound=bound, layout=layout, launch=launch):
                _, k, v, off = (x.detach() for x in make_inputs(grid, heads, d, math.prod(KERNEL), dtype, device,
                                                                bound))
                return lambda: gathered_sum(k, v, off, KERNEL, layout, launch)
            row = {"variant": f"gather_{layout}", "max_offset": bound, "launch": asdict(launch),
                   "default_launch": launch == default, "grid": list(grid), "tokens": n}
            row.update(measure(setup, repeats, device))
            rows.append(row)
            on_row(rows)
            _print_row(row)
    return rows


def key_tile(grid, head_dim: int) -> tuple[int, int, int]:
    """The fused backward's default key tile on a (T, H, W) grid (`launch.key_config`)."""
    from megaslide.attention.dsa import launch
    return launch.key_config(tuple(grid), head_dim).tile


def tile_rows(grid, heads: int, head_dims) -> list[dict]:
    """The fused DSA kernels' default launches on a (T, H, W) grid per head dim: the forward
    (`launch.forward_launch_config`), the backward's query pass (`launch.query_launch_config`), its key
    tiles (`launch.key_config`), heads per backward launch (`backward.heads_per_group`, batch 1) and the
    zero-offset kernels (`launch.launch_config`)."""
    from megaslide.attention.dsa import backward, launch
    n_tokens = math.prod(grid)
    return [{"head_dim": d, "forward": asdict(launch.forward_launch_config(n_tokens, d)),
             "query_pass": asdict(launch.query_launch_config(n_tokens, d)),
             "key_pass": asdict(launch.key_config(tuple(grid), d)),
             "zero_offset": asdict(launch.launch_config(n_tokens, d)),
             "bwd_heads_per_launch": backward.heads_per_group(1, n_tokens, heads, math.prod(KERNEL))}
            for d in sorted(set(head_dims))]


# ----------------------------------------------------------------------------- ceilings and bounds
def l2_copy_gbps(device, nbytes: int = 2 ** 24, calls: int = 50, repeats: int = MIN_REPEATS) -> float:
    """Read + write GB/s of `calls` back-to-back copies of an `nbytes` buffer: source and destination
    (32 MiB) stay resident in an H100/H200's 50 MB L2, so this is an L2 rate (launch gaps included,
    so it errs low)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copies():
        for _ in range(calls):
            dst.copy_(src)
    return 2 * nbytes * calls / timed(copies, device, repeats).median / 1e9


def ceilings(device) -> dict:
    """HBM copy bandwidth, L2-resident copy bandwidth and bf16 matmul peak, measured now."""
    if device.type != "cuda":
        return {}
    return {"hbm_gbps": copy_gbps(device), "l2_gbps": l2_copy_gbps(device), "matmul_tflops": matmul_tflops(device)}


def dsa_roofline(n_tokens: int, heads: int, d: int, K: int, elem: int, ceil: dict) -> dict:
    """The idealised roofline of fused DSA fwd+bwd: compulsory HBM traffic and CUDA-core FLOPs only.

    Bytes: forward reads q, k, v (elem B each) and fp32 offsets, writes out and an fp32 lse; backward
    reads q, k, v, out, dout, offsets, lse, writes dq, dk, dv, doffsets (the corner gathers are assumed
    to be free: `gather_bound` counts them).
    FLOPs (CUDA cores, fp32; per query, head and sample): interpolate K and V from 8 corners
    (2 x 8 x 2d), score and PV (2 x 2d); backward recomputes both interpolations (2 x 16d), dP and
    dq (2 x 2d), scatters dK and dV to 8 corners (2 x 8 x 2d) and the offset gradient (3 x 8 x 2d).
    Time `ms`: the slower of the bytes at the measured HBM rate and the FLOPs at the datasheet peak."""
    qh = n_tokens * heads
    fwd_bytes = qh * (3 * d * elem + K * 3 * 4 + d * elem + 4)
    bwd_bytes = qh * (5 * d * elem + K * 3 * 4 + 4 + 3 * d * elem + K * 3 * 4)
    flops_fwd = qh * K * (32 * d + 4 * d)
    flops_bwd = qh * K * (32 * d + 4 * d + 32 * d + 48 * d)
    out = {"hbm_bytes": fwd_bytes + bwd_bytes, "flops_cuda_core": flops_fwd + flops_bwd}
    if ceil:
        out["t_hbm_ms"] = out["hbm_bytes"] / (ceil["hbm_gbps"] * 1e9) * 1e3
        out["t_flops_ms"] = out["flops_cuda_core"] / (DATASHEET_FP32_TFLOPS * 1e12) * 1e3
        out["ms"] = max(out["t_hbm_ms"], out["t_flops_ms"])
    return out


def tiles_touched(tile: tuple[int, int, int]) -> float:
    """Mean key tiles a sample's 2 x 2 x 2 corners touch for key tiles of `tile` tokens, with the
    sample's lower corner uniform over a tile: per axis the upper corner leaves the tile with
    probability 1 / size (backward.py lists an entry once per touched tile)."""
    return math.prod(1 + 1 / s for s in tile)


def gather_bound(n_tokens: int, heads: int, d: int, K: int, elem: int, ceil: dict,
                 tile: tuple[int, int, int] = (4, 4, 4)) -> dict:
    """A bound on fused DSA fwd+bwd as the kernels are built (forward.py, backward.py),
    for key tiles of `tile` tokens, with r = `tiles_touched(tile)` entry records per (query, sample):
    - gathers: every sample reads its 8 corner rows of K and V (elem B each) from L2, in the forward
      and again in the backward's query pass;
    - key rows: the key pass reads the query row q_n and dO_n of each record (2 d elem B);
    - scratch: each entry (ds, p, position: one 32-byte sector, `constants.ENTRY_FLOATS`) written once, read by
      the binning pass (the capped lists; the exact passes, for overflowing lists, are not counted) and per
      record by the key pass; int32 records written, read, and a slot taken with an atomic (4 B each).
    Time `ms`: the slowest of the idealised roofline's HBM bytes at the HBM rate, all L2 traffic at the
    measured L2 copy rate, and the CUDA-core FLOPs at the datasheet peak. Bytes only: the atomic
    units' throughput, the key pass's tensor-core work and L1 hits between neighbouring queries'
    corners are not modelled."""
    ideal = dsa_roofline(n_tokens, heads, d, K, elem, ceil)
    entries, r = n_tokens * heads * K, tiles_touched(tile)
    gathers = entries * 2 * 8 * 2 * d * elem            # forward and query pass, K and V corner rows
    key_rows = round(entries * r * 2 * d * elem)        # key pass: q and dO rows per record
    entry = 4 * ENTRY_FLOATS
    scratch = round(entries * ((2 + r) * entry + r * 3 * 4))
    out = {"hbm_bytes": ideal["hbm_bytes"], "l2_bytes": ideal["hbm_bytes"] + gathers + key_rows + scratch,
           "gather_bytes": gathers, "key_row_bytes": key_rows, "scratch_bytes": scratch,
           "records_per_sample": r, "flops_cuda_core": ideal["flops_cuda_core"]}
    if ceil:
        out["t_hbm_ms"], out["t_flops_ms"] = ideal["t_hbm_ms"], ideal["t_flops_ms"]
        out["t_l2_ms"] = out["l2_bytes"] / (ceil["l2_gbps"] * 1e9) * 1e3
        out["ms"] = max(out["t_hbm_ms"], out["t_l2_ms"], out["t_flops_ms"])
    return out


# ----------------------------------------------------------------------------- summary
def loglog_slope(rows, variant, tokens=(0, math.inf)) -> float | None:
    """Least-squares slope of log(ms) against log(tokens) over `variant`'s rows within `tokens` (3 at least)."""
    pts = [(r["tokens"], r["ms"]) for r in rows
           if r["variant"] == variant and r.get("status") == "ok" and tokens[0] <= r["tokens"] <= tokens[1]]
    if len(pts) < 3:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def target_row(target: str, measured: float | None, bound: float | None) -> dict:
    """One target line. `met` by the project's one rule, `megaslide.testing.within_tolerance`, with the bound as
    its floor and no reference error: measured finite and <= bound. None: not measured (or no bound)."""
    met = None if measured is None or bound is None else within_tolerance(measured, 0.0, bound)
    return {"target": target, "bound": bound, "measured": measured, "met": met}


def _ok(rows, **match) -> dict | None:
    return next((r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())), None)


def deterministic_cost(target) -> float | None:
    """dsa_fused_deterministic's time over dsa_fused's at the target grid: the cost of the backward's striped,
    fixed-order key-tile lists. None unless both ran."""
    fused, det = _ok(target, variant="dsa_fused"), _ok(target, variant="dsa_fused_deterministic")
    return fused and det and det["ms"] / fused["ms"]


def targets(target, modules, rows, baseline: dict | None, spread=()) -> list[dict]:
    """Issue 36's targets (H200, the target grid, fwd+bwd unless said) against this run's figures: the
    +-1 lines read the `spread` rows (`offset_rows`) at max_offset 1, the +-4 line and the deterministic
    cost the `target` rows (offsets +-4). The issue names the modules' ratio at d = 128; each measured head
    dim gets a line. `baseline` is the earlier result whose target-grid peak memory the fused variants must
    not exceed."""
    def ms(table, variant, **match):
        r = _ok(table, variant=variant, **match)
        return r and r["ms"]

    near = ms(spread, "dsa_fused", max_offset=1.0)
    lines = [target_row("dsa_fused fwd+bwd ms, offsets +-1 <= 25", near, 25.0),
             target_row("dsa_fused fwd+bwd ms, offsets +-1 <= 15 (moonshot)", near, 15.0),
             target_row("dsa_fused fwd+bwd ms, offsets +-4 <= 40", ms(target, "dsa_fused"), 40.0),
             target_row("dsa_fused forward ms, offsets +-1 <= 6", ms(spread, "dsa_fused_fwd", max_offset=1.0), 6.0)]
    if _ok(target, variant=HALO_CUDA[0]):   # the op with the CUDA halo forward, where this run measured it
        lines += [target_row(f"{HALO_CUDA[0]} fwd+bwd ms, offsets +-1 <= 25", ms(spread, HALO_CUDA[0], max_offset=1.0),
                             25.0),
                  target_row(f"{HALO_CUDA[0]} fwd+bwd ms, offsets +-4 <= 40", ms(target, HALO_CUDA[0]), 40.0),
                  target_row(f"{HALO_CUDA[1]} forward ms, offsets +-1 <= 6", ms(spread, HALO_CUDA[1], max_offset=1.0),
                             6.0)]
    for d in dict.fromkeys(r["head_dim"] for r in modules):
        dsa, zero = _ok(modules, variant="dsa", head_dim=d), _ok(modules, variant="dsa_zero", head_dim=d)
        lines.append(target_row(f"module dsa / dsa_zero at d={d} <= 2 (issue: d=128)",
                                dsa and zero and dsa["ms"] / zero["ms"], 2.0))
    lo, hi = SLOPE_TOKENS
    lines.append(target_row(f"dsa_fused log-log slope of ms over {lo:,}-{hi:,} tokens <= 1.05",
                            loglog_slope(rows, "dsa_fused", SLOPE_TOKENS), 1.05))
    lines.append(target_row("deterministic mode: dsa_fused_deterministic / dsa_fused ms <= 1.3",
                            deterministic_cost(target), 1.3))
    before = baseline["tables"]["target"] if baseline else []
    for variant in ("dsa_fused", "dsa_zero_fused"):
        now, then = _ok(target, variant=variant), _ok(before, variant=variant)
        lines.append(target_row(f"{variant} peak GB <= baseline's", now and now.get("peak_gb"),
                                then and then.get("peak_gb")))
    return lines


def gather_floor_bound(gather) -> dict | None:
    """The measured gather floor of fused DSA fwd+bwd: the forward and the backward's query pass each make the
    loads that `gathered_sum` makes, so `ms` is twice the fastest gathered_sum at the targets' offsets (+-4)
    over the timed layouts and launches (binning and the key pass not counted); `layout` and `launch` say
    which. None where none was timed."""
    timed = [r for r in gather if r.get("status") == "ok" and r["max_offset"] == 4.0]
    if not timed:
        return None
    floor = min(timed, key=lambda r: r["ms"])
    return {"bound": "gather floor (measured)", "layout": floor["variant"].removeprefix("gather_"),
            "launch": floor.get("launch"), "forward_ms": floor["ms"], "ms": 2 * floor["ms"]}


def summarise(target, rows, target_grid, heads, d, dtype, ceil, hbm_gb: float | None = None,
              modules=(), baseline: dict | None = None, gather=(), spread=()) -> dict:
    """The headline numbers: the fused kernel at the target grid against the others, its bounds (a
    table: the idealised roofline, the gather bound and, where `gather` rows were timed, the measured
    gather floor, each with the fused time's fraction of it; the floor also with the forward's),
    speed-ups at the largest common N, each variant's log-log slope of time vs N and the target lines
    (a table; `spread`: the offsets table's rows, for the +-1 targets). `hbm_gb` (the device's memory)
    bounds the reference's peak where it ran out of memory."""
    by = {r["variant"]: r for r in target if r.get("status") == "ok"}
    n_t, K, elem = math.prod(target_grid), math.prod(KERNEL), torch.finfo(dtype).bits // 8
    fused = by.get("dsa_fused")
    bounds = [{"bound": "idealised roofline", **dsa_roofline(n_t, heads, d, K, elem, ceil)},
              {"bound": "gather bound", **gather_bound(n_t, heads, d, K, elem, ceil, key_tile(target_grid, d))}]
    floor = gather_floor_bound(gather)
    if floor:
        bounds.append(floor)
        if "dsa_fused_fwd" in by:
            floor["forward_fraction"] = floor["forward_ms"] / by["dsa_fused_fwd"]["ms"]
    for b in bounds:
        if fused and "ms" in b:
            b["fused_fraction"] = b["ms"] / fused["ms"]
    summary = {"target_tokens": n_t, "bounds": bounds}
    if fused:
        for other in ("dsa_reference", "dense", SWIN):
            if other in by:
                summary[f"fused_speedup_vs_{other}"] = by[other]["ms"] / fused["ms"]
        if "dsa_fused_deterministic" in by:
            summary["deterministic_cost"] = deterministic_cost(target)
        if "dsa_reference" in by and "peak_gb" in fused:
            summary["fused_memory_fraction_of_reference"] = fused["peak_gb"] / by["dsa_reference"]["peak_gb"]
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
    summary["swin_loglog_slope"] = loglog_slope(rows, SWIN)
    summary["dense_loglog_slope"] = loglog_slope(rows, "dense")
    summary["targets"] = targets(target, list(modules), rows, baseline, spread)
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


def load_baseline(name: str) -> dict | None:
    """The committed attention result `name`: the repository's results/attention/<name>.json (also when
    MEGASLIDE_RESULTS_DIR sends this run's result elsewhere); None when absent or unnamed."""
    path = RESULTS_DIR / "attention" / f"{name}.json"
    return json.loads(path.read_text()) if name and path.exists() else None


@script_main("bench_attention")
def main(hydra_cfg: DictConfig) -> None:
    preset = trial_preset(hydra_cfg, smoke=SMOKE, quick=QUICK)
    cfg = script_config(BenchAttentionConfig, hydra_cfg, preset)
    if not cfg.smoke and not torch.cuda.is_available():
        raise ValueError("bench_attention times the attention ops at full size (up to 1M tokens): it needs a CUDA "
                         "GPU; smoke=true runs it tiny on the CPU")
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda" and ("dsa_fused_deterministic" in cfg.variants or cfg.rank_blocks):
        fix_cublas_workspace()   # train.deterministic's mode needs it before CUDA starts
    heads, d, repeats = cfg.heads, cfg.head_dim, cfg.repeats
    if cfg.smoke:
        sweep_grids, target_grid = [(4, 4, 8), (8, 4, 8)], (4, 8, 8)
    else:
        sweep_grids, target_grid = [(f, 68, 120) for f in cfg.frames], (16, 128, 128)

    # the gather floor's launches, parsed (and a malformed one refused) before any GPU work
    launches = [launch_of(c, d, "gather_launches") for c in cfg.gather_launches] if device.type == "cuda" else []
    ceil = ceilings(device)
    print(f"device {device}, dtype {dtype}, ceilings {ceil}", flush=True)
    name = cfg.name or ("smoke" if cfg.smoke else "sweep")
    config = {"heads": heads, "head_dim": d, "module_head_dims": cfg.module_head_dims, "dtype": str(dtype),
              "kernel": KERNEL, "window": WINDOW, "device": str(device), "baseline": cfg.baseline}
    run = ExperimentRun("attention", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project, trial=cfg.smoke)
    tables: dict[str, list] = {}
    if device.type == "cuda":
        tables["tiles"] = tile_rows(target_grid, heads, [d, *cfg.module_head_dims])

    def save(key):
        def on_row(rows):
            tables[key] = rows
            run.save({"config": config, "ceilings": ceil, "partial": True, "tables": tables})
        return on_row

    print("target grid", target_grid, flush=True)
    target = sweep([target_grid], cfg.variants, heads, d, dtype, device, repeats,
                   dense_limit=10 ** 9, ref_limit=10 ** 9, on_row=save("target"))
    tables["kernels"] = kernel_split(target_grid, cfg.variants, heads, d, dtype, device)
    if cfg.rank_blocks:
        print("deterministic binning's rank blocks", flush=True)
        tables["rank_blocks"] = rank_block_rows(target_grid, heads, d, dtype, device, repeats, cfg.rank_blocks,
                                                target, on_row=save("rank_blocks"))
    print("modules", flush=True)
    modules = module_rows(target_grid, heads, cfg.module_head_dims, device, repeats, on_row=save("module"))
    print("offset spread", flush=True)
    names = FUSED + (HALO_CUDA if HALO_CUDA[0] in cfg.variants else ())
    spread = offset_rows(target_grid, heads, d, dtype, device, repeats, cfg.offset_bounds, on_row=save("offsets"),
                         names=names)
    print("gather floor", flush=True)
    checks = {"gather_check": gather_check(device)} if device.type == "cuda" else {}
    print(checks, flush=True)
    gather = gather_rows(target_grid, heads, d, dtype, device, repeats, cfg.offset_bounds, launches,
                         on_row=save("gather"))
    print("sweep", flush=True)
    rows = sweep(sweep_grids, cfg.sweep_variants, heads, d, dtype, device, repeats,
                 dense_limit=300_000, ref_limit=140_000, on_row=save("sweep"))
    hbm_gb = torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None
    floor_rows = gather if checks.get("gather_check", {}).get("passed") else ()  # no floor from a failed kernel
    summary = summarise(target, rows, target_grid, heads, d, dtype, ceil, hbm_gb, modules,
                        load_baseline(cfg.baseline), floor_rows, spread)

    payload = {"config": config, "ceilings": ceil, **checks, "summary": summary,
               "tables": {**tables, "target": target, "module": modules, "offsets": spread, "gather": gather,
                          "sweep": rows}}
    images = {}
    if not cfg.smoke:
        images["time and memory vs tokens"] = plot(rows, str(run.result_path.parent / name))
    scalars = {k: v for k, v in summary.items() if k not in ("bounds", "targets")}  # the lists are tables
    path = run.finish(payload, scalars, images)
    print("\nsummary")
    for k, v in scalars.items():
        print(f"  {k}: {v}")
    for key in ("bounds", "targets"):
        print(f"{key}:")
        for line in summary[key]:
            print("  " + ", ".join(f"{k} {v}" for k, v in line.items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
