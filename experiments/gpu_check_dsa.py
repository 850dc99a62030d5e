"""GPU correctness check of the fused 3D-DSA Triton kernels (compiled, not interpreted).

For each case and dtype (fp32, bf16) it draws inputs in float64, rounds them to the dtype
and compares the Triton output and the gradients of q, k, v and offsets with the float64
PyTorch reference run on the same rounded inputs. Op `dsa_zero` checks the zero-offset
kernels (`neighborhood_attention`, zero_kernels.py) the same way at the same shapes (output
and q, k, v gradients against the reference with zero offsets) and that two backward runs
are bit-identical (they use no atomics). Op `dsa_halo` checks the op with `halo_reach` set (the halo
forward, halo.py, then the gather kernels' backward on its lse): offsets uniform in +-reach, a quarter on
the bound, a few moved past it so that tiles inside, on and beyond the halo bound meet in one call; each
row also compares the per-tile paths with the plain rule (`reference.halo_paths_reference`) and asks for
tiles of both paths. Op `dsa_halo_cuda` checks the op with the CUDA C++ halo forward (halo_cuda.py: bf16; the
gathers for the tiles it refuses, and the gather backward on its lse) on the same cases: out, all four
gradients, its paths, the same bits twice. Rows of both halo ops also compare the halo forward's lse with
float64 and name the path of the tile that holds the largest error of out, dq and d(offsets) (a failing
row's error then points at the halo path or at the gathers it falls back to). The rule
(megaslide.testing.within_tolerance):
the kernel's max error may be at most 2x the error of the same-dtype PyTorch reference, plus a
floor of 2 x eps(dtype) x max(1, max|value|). Cases cover d = 32..128 (48, 80
and 96 run padded), odd grids, a single frame, far (clamped) offsets, zero offsets without
an offset gradient, many query blocks and (3, 5, 5) windows; the op's backward takes the key tiles
`launch.key_config` picks for each grid (4 x 4 x 4, 1 x 8 x 8 on one frame), and
every key configuration the sweep times is also checked on one case (rows named `..._keys_...`), and
with `sweep=true` every query block it times, on one case of each op (rows `..._launch_...`).
`sweep=true` also times the kernels' launch configurations (the zero-offset kernels' too), the
backward's key tiles, entries per block (BLOCK_E) and warps, and the backward's kernels one by one
(a profiler's CUDA time per kernel name) at the 262K-token benchmark shape, beside a re-measured HBM
copy ceiling, to pick the default tiles. Configuration:
experiments/conf/gpu_check_dsa.yaml.

    python -m experiments.gpu_check_dsa               # H200: checks -> results/attention/dsa_gpu_check.json
    python -m experiments.gpu_check_dsa sweep=true    # + launch-config timings
    python -m experiments.gpu_check_dsa smoke=true    # tiny, CPU via TRITON_INTERPRET=1, seconds

Exits with status 1 when any comparison fails.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from omegaconf import DictConfig

from experiments.dsa_candidates import key_of, launch_of
from experiments.harness import ExperimentRun, kernel_check_device
from megaslide.perf.timing import copy_gbps, kernel_ms, timed
from experiments.hydra_config import script_config, script_main
from megaslide.attention.dsa import deformable_slide_attention, neighborhood_attention
from megaslide.attention.dsa.op import BACKENDS
from megaslide.backends import select_backend
from megaslide.testing import TOLERANCE_RULE, deterministic_algorithms, rounding_floor, within_tolerance

F64 = torch.float64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOOR_ULPS = 2
GRADS = ("out", "dq", "dk", "dv", "doffsets")
QUERY_SIDE = ("out", "dq", "doffsets")  # indexed by query token: each error lies in one query tile
OPS = ("dsa", "dsa_zero", "dsa_halo", "dsa_halo_cuda")  # the general kernels; the zero-offset kernels (no offsets,
# no offset gradient); the general op with the halo forward; the op with the CUDA C++ halo forward (bf16)


@dataclass(frozen=True)
class GpuCheckConfig:
    """The keys of experiments/conf/gpu_check_dsa.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    sweep: bool
    launch_candidates: list[list[int]]
    key_candidates: list[list[int]]
    dtypes: list[str]
    ops: list[str]
    cases: list[str]
    wandb_dir: str
    wandb_project: str


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, int, int, int, int, int]  # (B, T, H, W, heads, d)
    kernel_size: tuple[int, int, int]
    offset_std: float = 1.5
    far_fraction: float = 0.0  # share of offset coordinates moved far outside the grid
    offsets_grad: bool = True
    fp32_offsets: bool = False  # offsets stay fp32 whatever the dtype, as the DSA module passes them
    halo_reach: int | None = None  # op dsa_halo: offsets uniform in +-halo_reach (far_fraction moved past it)


GPU_CASES = [
    Case("d64_odd_grid_two_batches", (2, 5, 9, 11, 4, 64), (3, 3, 3), far_fraction=0.1),
    Case("d128_far_offsets", (1, 7, 13, 10, 2, 128), (3, 3, 3), offset_std=3.0, far_fraction=0.3),
    Case("d48_window_3x5x5", (1, 4, 16, 16, 3, 48), (3, 5, 5)),
    Case("d80_single_frame", (1, 1, 17, 23, 2, 80), (1, 3, 3), far_fraction=0.2),
    Case("d96_zero_offsets_no_offset_grad", (1, 6, 12, 12, 2, 96), (3, 3, 3), offset_std=0.0,
         offsets_grad=False),
    Case("d32_many_blocks_8_heads", (2, 9, 20, 20, 8, 32), (3, 3, 3), offset_std=2.0, far_fraction=0.05),
    Case("d64_8k_tokens", (1, 8, 32, 32, 4, 64), (3, 3, 3), offset_std=4.0),
    Case("d64_fp32_offsets", (1, 5, 8, 9, 2, 64), (3, 3, 3), offset_std=2.0, fp32_offsets=True),
    Case("d64_two_frames", (2, 2, 19, 21, 3, 64), (1, 3, 3), offset_std=3.0, far_fraction=0.1, fp32_offsets=True),
]
KEY_CASE = GPU_CASES[0]  # the case every swept key configuration is checked on
SMOKE_KEY_CANDIDATES = [[1, 2, 4, 16, 1], [2, 2, 2, 32, 1, 128]]
OVERFLOW_CAPACITY = 8
"""Records per capped key-tile list in one more check of each dtype: far fewer than a list holds, so the
backward falls back to its exact lists (backward.py), as it does where offsets pile samples onto a tile."""
SMOKE_LAUNCHES = [(16, 1), (16, 1, 4, 128)]  # rows of queries; 4 x 4 query patches, registers capped
SMOKE_CASES = [Case("smoke_d16", (1, 2, 3, 5, 1, 16), (1, 3, 3), far_fraction=0.2, fp32_offsets=True)]
HALO_CASES = [  # op dsa_halo (3 x 3 x 3 windows): the op's default tiles, 2 x 4 x 4 up to reach 1, 1 x 4 x 4 beyond;
    # each halo's K rows fit 227 KB of shared memory in fp32 (test_dsa_halo.py builds them for sm_90)
    Case("d64_halo_reach1_odd_grid", (2, 6, 13, 11, 2, 64), (3, 3, 3), far_fraction=3e-4, fp32_offsets=True,
         halo_reach=1),
    Case("d48_halo_reach1_padded", (1, 5, 10, 12, 3, 48), (3, 3, 3), far_fraction=3e-4, halo_reach=1),
    Case("d32_halo_reach2", (1, 5, 10, 12, 3, 32), (3, 3, 3), far_fraction=5e-4, halo_reach=2),
    Case("d128_halo_reach0_edges", (1, 3, 7, 13, 2, 128), (3, 3, 3), far_fraction=5e-4, halo_reach=0),
]
SMOKE_HALO_CASES = [Case("smoke_halo_d16", (1, 3, 4, 8, 1, 16), (3, 3, 3), far_fraction=5e-3, fp32_offsets=True,
                         halo_reach=0)]  # tiles of both paths; small halos: the interpreter is slow


def checked_key_configs(smoke: bool, key_candidates: list[list[int]]) -> list:
    """The key configs that are checked: `key_candidates`, or in smoke SMOKE_KEY_CANDIDATES."""
    return [key_of(c) for c in (SMOKE_KEY_CANDIDATES if smoke else key_candidates)]


def swept_key_configs(smoke: bool, key_candidates: list[list[int]]) -> list:
    """The key configs the sweep times: the checked ones, or in smoke only the first (interpreter times
    only test the plumbing)."""
    configs = checked_key_configs(smoke, key_candidates)
    return configs[:1] if smoke else configs


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """q, k, v, grad_out (B, T, H, W, heads, d) and offsets (B, T, H, W, heads, K, 3),
    drawn in float64 and rounded to dtype."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, T, H, W, heads, d = case.shape
    K = math.prod(case.kernel_size)
    q, k, v, grad_out = (torch.randn(case.shape, generator=g, device=device, dtype=F64) for _ in range(4))
    offsets = case.offset_std * torch.randn((B, T, H, W, heads, K, 3), generator=g, device=device, dtype=F64)
    if case.halo_reach is not None:  # uniform in +-reach, a quarter exactly on the bound
        offsets = case.halo_reach * (2 * torch.rand(offsets.shape, generator=g, device=device, dtype=F64) - 1)
        on_bound = torch.rand(offsets.shape, generator=g, device=device, dtype=F64) < 0.25
        offsets = torch.where(on_bound, case.halo_reach * offsets.sign(), offsets)
    far = torch.rand(offsets.shape, generator=g, device=device, dtype=F64) < case.far_fraction
    offsets = torch.where(far, torch.where(offsets < 0, -1.0, 1.0) * (max(T, H, W) + 5 * offsets.abs()), offsets)
    return [x.to(dtype) for x in (q, k, v, offsets, grad_out)]


def run(backend: str, inputs, case: Case, dtype: torch.dtype, op: str, key_config=None, launch=None):
    """Output and gradients of one backend of `op` (dsa: offsets as drawn; dsa_zero: none), inputs cast to
    dtype; `key_config` (a launch.KeyConfig) or `launch` (a launch.LaunchConfig): the fused kernels called
    directly with these key tiles or query blocks."""
    q, k, v, grad_out = (x.to(dtype) for x in (inputs[0], inputs[1], inputs[2], inputs[4]))
    offsets = inputs[3].to(torch.float32 if case.fp32_offsets and dtype != F64 else dtype)
    if key_config is not None or launch is not None:
        from megaslide.attention.dsa import backward, forward, zero_kernels
        scale = case.shape[-1] ** -0.5
        if op == "dsa_zero":
            out, lse = zero_kernels.na_forward(q, k, v, case.kernel_size, scale, config=launch)
            return [out, *zero_kernels.na_backward(q, k, v, out, lse, grad_out, case.kernel_size, scale,
                                                   config=launch)]
        out, lse = forward.dsa_forward(q, k, v, offsets, case.kernel_size, scale, config=launch)
        grads = backward.dsa_backward(q, k, v, offsets, out, lse, grad_out, case.kernel_size, scale,
                                      case.offsets_grad, config=launch, key_config=key_config)
        return [out, *(g for g in grads if g is not None)]
    leaves = [q, k, v] + ([offsets] if case.offsets_grad and op != "dsa_zero" else [])
    for x in leaves:
        x.requires_grad_()
    if op != "dsa_zero":
        fused = backend == "triton"
        reach = case.halo_reach if fused else None  # dsa_halo, dsa_halo_cuda: the halo forward
        kernel = "cuda" if fused and op == "dsa_halo_cuda" else "triton"
        out = deformable_slide_attention(q, k, v, offsets, case.kernel_size, backend=backend, halo_reach=reach,
                                         halo_kernel=kernel)
    else:
        out = neighborhood_attention(q, k, v, case.kernel_size, backend=backend)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def check_case(case: Case, dtype_name: str, device: torch.device, op: str, key_config=None, launch=None) -> dict:
    """One comparison row; with `key_config` (op dsa) the fused backward at those key tiles, with `launch`
    the fused kernels at those query blocks."""
    dtype = DTYPES[dtype_name]
    inputs = make_inputs(case, dtype, device)
    truth = run("reference", inputs, case, F64, op)
    same_dtype = run("reference", inputs, case, dtype, op)
    fused = run("triton", inputs, case, dtype, op, key_config, launch)
    name = case.name
    if key_config is not None:
        name += "_keys_{}x{}x{}_e{}_w{}".format(*key_config.tile, key_config.block_e, key_config.num_warps)
        name += f"_r{key_config.maxnreg}" if key_config.maxnreg is not None else ""
        name += f"_cap{key_config.capacity}" if key_config.capacity is not None else ""
    if launch is not None:
        name += f"_launch_q{launch.block_q}_y{launch.block_y}_w{launch.num_warps}"
        name += f"_r{launch.maxnreg}" if launch.maxnreg is not None else ""
    row = {"case": name, "op": op, "dtype": dtype_name, "shape": list(case.shape),
           "kernel_size": list(case.kernel_size), "passed": True, "errors": {}}
    for name, want, ref, got in zip(GRADS, truth, same_dtype, fused):
        compare(row, name, got, want, ref)
    if op == "dsa_zero" and launch is None:  # no atomics: a second run gives the same bits
        again = run("triton", inputs, case, dtype, op)
        row["deterministic"] = all(torch.equal(a, b) for a, b in zip(fused, again))
        row["passed"] &= row["deterministic"]
        del again
    elif op != "dsa_zero" and key_config is None and launch is None:  # sorted key-tile lists: the same bits twice
        with deterministic_algorithms():
            first, again = (run("triton", inputs, case, dtype, op) for _ in range(2))
        row["deterministic"] = all(torch.equal(a, b) for a, b in zip(first, again))
        row["passed"] &= row["deterministic"]
        del first, again
    if op.startswith("dsa_halo"):  # the tiles of each path, against the plain rule; both must be met
        diffs = {n: (got.to(F64) - want).abs() for n, want, got in zip(GRADS, truth, fused) if n in QUERY_SIDE}
        row.update(halo_paths(inputs, case, dtype, op, row, diffs))
        row["passed"] &= row["paths_match"] and min(row["paths"].values()) > 0
    del truth, same_dtype, fused
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def compare(row: dict, name: str, got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor) -> None:
    """Record in `row` the kernel's error on `name` against the float64 `want` beside the same-dtype reference
    `ref`'s, and fail the row where the rule (module docstring) fails."""
    err_kernel = (got.to(F64) - want).abs().max().item()
    err_ref = (ref.to(F64) - want).abs().max().item()
    floor = rounding_floor(got.dtype, want, FLOOR_ULPS)
    ok = within_tolerance(err_kernel, err_ref, floor)
    row["errors"][name] = {"triton": err_kernel, "reference_same_dtype": err_ref, "floor": floor, "ok": ok}
    row["passed"] &= ok


def worst_tile_paths(path: torch.Tensor, tile: tuple[int, int, int], diffs: dict[str, torch.Tensor]) -> dict:
    """For each query-side tensor of `diffs` (its error against float64: (B, T, H, W, heads, ...)), the path
    ("halo" or "gather") of the tile that holds its largest error, from the halo forward's per-tile paths
    (B * heads, tiles; tiles row-major over (t, y, x) tile indices, as `reference.halo_paths_reference`). So a
    failing halo row says whether the halo path or the gathers it falls back to made the error."""
    worst = {}
    for name, diff in diffs.items():
        per_token = diff.flatten(5).amax(-1)  # (B, T, H, W, heads)
        H, W, heads = per_token.shape[2:]
        b, t, y, x, h = (int(i) for i in torch.unravel_index(per_token.argmax(), per_token.shape))
        tiles_y, tiles_x = -(-H // tile[1]), -(-W // tile[2])
        index = ((t // tile[0]) * tiles_y + y // tile[1]) * tiles_x + x // tile[2]
        worst[name] = "halo" if path[b * heads + h, index] else "gather"
    return worst


def halo_paths(inputs, case: Case, dtype: torch.dtype, op: str, row: dict, diffs: dict[str, torch.Tensor]) -> dict:
    """The halo forward's per-tile paths at the op's default tile (`launch.halo_config`), their counts,
    whether they match `reference.halo_paths_reference`, and the path of the tile holding each query-side
    error of `diffs` (`worst_tile_paths`). It also records in `row` the forward's lse (halo.py's,
    or for op dsa_halo_cuda halo_cuda.py's) against float64 beside the same-dtype reference: the backward reads
    that lse, so a gradient that fails with out passing points at it or not."""
    from megaslide.attention.dsa import halo, halo_cuda, launch
    from megaslide.attention.dsa.reference import halo_paths_reference, log_sum_exp_reference
    q, k, v = (x.to(dtype) for x in inputs[:3])
    offsets = inputs[3].to(torch.float32 if case.fp32_offsets else dtype)
    scale = case.shape[-1] ** -0.5
    forward = halo_cuda.dsa_halo_forward_cuda if op == "dsa_halo_cuda" else halo.dsa_halo_forward
    _, lse, path = forward(q, k, v, offsets, case.kernel_size, scale, case.halo_reach)
    wide = [x.to(F64) for x in (q, k, offsets)]
    compare(row, "lse", lse, log_sum_exp_reference(*wide, case.kernel_size, scale),
            log_sum_exp_reference(q.float(), k.float(), offsets.float(), case.kernel_size, scale))
    tile = launch.halo_config(case.halo_reach).tile
    want = halo_paths_reference(offsets, case.kernel_size, case.halo_reach, tile)
    return {"paths": halo.path_counts(path), "paths_match": torch.equal(path.cpu(), want.cpu()),
            "worst_tile_path": worst_tile_paths(path, tile, diffs)}


def failure_recorded(check: Callable[[], dict], row: dict) -> dict:
    """check()'s row, or `row` failed with the error where check() raises (e.g. no nvcc, or a failed build or
    launch of the CUDA halo forward), so that the other rows go on."""
    try:
        return check()
    except Exception as err:  # recorded in the result, which fails
        return {**row, "passed": False, "errors": {}, "error": f"{type(err).__name__}: {err}"[:500]}


def sweep_launch_configs(device: torch.device, smoke: bool, launch_candidates: list[list[int]],
                         key_candidates: list[list[int]], on_row: Callable[[dict], None] = lambda sweep: None) -> dict:
    """Forward and backward times of candidate tiles ([BLOCK_Q, warps[, block_y[, maxnreg]]], `launch_of`),
    for the general kernels (bf16, offsets U(-4, 4)) and the zero-offset kernels (zero_fwd_ms,
    zero_bwd_ms), then of the backward's key configs (`swept_key_configs`) with each
    kernel's profiled time. `on_row(sweep)` gets the sweep so far after each timed row, so a run cut short
    keeps what it timed."""
    from megaslide.attention.dsa import backward, forward, launch, zero_kernels

    shape = (1, 1, 4, 4, 1, 16) if smoke else (1, 16, 128, 128, 16, 64)  # smoke: one program per query block
    kernel_size = (1, 3, 3) if smoke else (3, 3, 3)
    dtype = torch.float32 if smoke else torch.bfloat16
    candidates = SMOKE_LAUNCHES if smoke else launch_candidates
    B, T, H, W, heads, d = shape
    K = math.prod(kernel_size)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4))
    offsets = (8 * torch.rand((B, T, H, W, heads, K, 3), generator=g, device=device) - 4).to(dtype)
    scale = d ** -0.5
    default = launch.launch_config(T * H * W, d)
    rows, key_rows = [], []
    sweep = {"shape": list(shape), "kernel_size": list(kernel_size), "dtype": str(dtype),
             "default_config": asdict(default),
             "forward_default_config": asdict(launch.forward_launch_config(T * H * W, d)),
             "query_default_config": asdict(launch.query_launch_config(T * H * W, d)),
             "default_key_config": asdict(launch.key_config((T, H, W), d)),
             "hbm_copy_gbps": copy_gbps(device, 1 << 20 if smoke else 1 << 30), "configs": rows,
             "key_configs": key_rows}
    for candidate in candidates:
        cfg = launch_of(candidate, d)
        out, lse = forward.dsa_forward(q, k, v, offsets, kernel_size, scale, config=cfg)
        fwd_s = timed(lambda: forward.dsa_forward(q, k, v, offsets, kernel_size, scale, config=cfg), device).median
        def run_backward():
            return backward.dsa_backward(q, k, v, offsets, out, lse, dout, kernel_size, scale, offsets_grad=True,
                                         config=cfg)
        bwd_s = timed(run_backward, device).median
        bwd_kernels = kernel_ms(run_backward, device)
        out, lse = zero_kernels.na_forward(q, k, v, kernel_size, scale, config=cfg)
        zero_fwd_s = timed(lambda: zero_kernels.na_forward(q, k, v, kernel_size, scale, config=cfg), device).median
        zero_bwd_s = timed(lambda: zero_kernels.na_backward(q, k, v, out, lse, dout, kernel_size, scale, config=cfg),
                           device).median
        rows.append({"block_q": cfg.block_q, "num_warps": cfg.num_warps, "block_y": cfg.block_y,
                     "maxnreg": cfg.maxnreg,
                     "fwd_ms": fwd_s * 1e3, "bwd_ms": bwd_s * 1e3,
                     "fwd_bwd_ms": (fwd_s + bwd_s) * 1e3, "zero_fwd_ms": zero_fwd_s * 1e3,
                     "zero_bwd_ms": zero_bwd_s * 1e3, "query_pass_ms": bwd_kernels.get("_query_kernel")})
        on_row(sweep)
    for keys in swept_key_configs(smoke, key_candidates):
        out, lse = forward.dsa_forward(q, k, v, offsets, kernel_size, scale)

        def run_backward():
            return backward.dsa_backward(q, k, v, offsets, out, lse, dout, kernel_size, scale, offsets_grad=True,
                                         key_config=keys)
        key_rows.append({"tile": list(keys.tile), "block_e": keys.block_e, "num_warps": keys.num_warps,
                         "maxnreg": keys.maxnreg, "bwd_ms": timed(run_backward, device).median * 1e3,
                         "kernel_ms": kernel_ms(run_backward, device)})
        on_row(sweep)
    return sweep


def print_tables(rows: list[dict], sweep: dict | None) -> None:
    header = f"{'case':34s} {'op':8s} {'dtype':5s} " + " ".join(f"{g:>19s}" for g in GRADS) + "  result"
    print(header)
    print(f"{'':34s} {'':8s} {'':5s} " + " ".join(f"{'triton / ref err':>19s}" for _ in GRADS))
    for r in rows:
        errors = [r["errors"].get(g) for g in GRADS]
        cells = " ".join(f"{e['triton']:9.2e}/{e['reference_same_dtype']:9.2e}" if e else f"{'-':>19s}" for e in errors)
        deterministic = {True: ", bit-identical", False: ", NOT bit-identical"}.get(r.get("deterministic"), "")
        verdict = "PASS" if r["passed"] else "FAIL"
        print(f"{r['case']:34s} {r['op']:8s} {r['dtype']:5s} {cells}  {verdict}{deterministic}")
    if sweep:
        print(f"\nlaunch configs at {sweep['shape']} {sweep['dtype']} K={math.prod(sweep['kernel_size'])} "
              f"(zero-offset default {sweep['default_config']}, forward {sweep['forward_default_config']}, "
              f"query pass {sweep['query_default_config']}; "
              f"HBM copy {sweep['hbm_copy_gbps']:.0f} GB/s)")
        print(f"{'block_q':>7s} {'y':>2s} {'warps':>5s} {'regs':>4s} {'fwd ms':>9s} {'bwd ms':>9s} {'query ms':>9s} "
              f"{'fwd+bwd ms':>11s} {'zero fwd ms':>12s} {'zero bwd ms':>12s}")
        for c in sweep["configs"]:
            query = f"{c['query_pass_ms']:9.2f}" if c["query_pass_ms"] is not None else f"{'-':>9s}"
            print(f"{c['block_q']:7d} {c.get('block_y', 1):2d} {c['num_warps']:5d} {c.get('maxnreg') or '-':>4} "
                  f"{c['fwd_ms']:9.2f} "
                  f"{c['bwd_ms']:9.2f} {query} {c['fwd_bwd_ms']:11.2f} {c['zero_fwd_ms']:12.2f} "
                  f"{c['zero_bwd_ms']:12.2f}")
        print(f"\nbackward key tiles (default {sweep['default_key_config']}): bwd ms, then ms per kernel")
        for c in sweep["key_configs"]:
            kernels = ", ".join(f"{name[:24]} {ms:.2f}" for name, ms in list(c["kernel_ms"].items())[:5])
            print(f"tile {'x'.join(map(str, c['tile'])):7s} block_e {c['block_e']:3d} warps {c['num_warps']} "
                  f"regs {c.get('maxnreg') or '-':>3} "
                  f"{c['bwd_ms']:9.2f}  {kernels}")


def check(cfg: GpuCheckConfig) -> int:
    device = kernel_check_device(cfg.smoke, "gpu_check_dsa")
    if device is None:
        return 2
    cases = SMOKE_CASES if cfg.smoke else GPU_CASES
    dtypes = cfg.dtypes
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"dtypes {unknown} unknown; choose from {sorted(DTYPES)}")
    if not cfg.ops or set(cfg.ops) - set(OPS):
        raise ValueError(f"ops={list(cfg.ops)}: choose one or more of {list(OPS)}")
    key_case = cases[0] if cfg.smoke else KEY_CASE
    halo_cases = SMOKE_HALO_CASES if cfg.smoke else HALO_CASES
    key_rows = not cfg.cases or key_case.name in cfg.cases  # the key-tile and query-block rows run on key_case
    if cfg.cases:  # only the named cases (e.g. to re-run one failing row)
        known = {c.name for c in cases + halo_cases}
        if set(cfg.cases) - known:
            raise ValueError(f"cases={list(cfg.cases)}: {sorted(set(cfg.cases) - known)} unknown; choose from "
                             f"{sorted(known)}, or cases=[] for all")
        cases, halo_cases = ([c for c in group if c.name in cfg.cases] for group in (cases, halo_cases))
        if not any(halo_cases if op.startswith("dsa_halo") else cases for op in cfg.ops):
            raise ValueError(f"cases={list(cfg.cases)} has no case of ops={list(cfg.ops)}: the halo ops check "
                             f"{[c.name for c in HALO_CASES]}, the others {[c.name for c in GPU_CASES]}")
    name = cfg.name or ("dsa_gpu_check_smoke" if cfg.smoke else "dsa_gpu_check")
    run = ExperimentRun("attention", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project, trial=cfg.smoke)

    probe = torch.zeros((1, 1, 1, 1, 1, 16), device=device)
    auto_backend = select_backend("auto", BACKENDS, probe, torch.zeros((1, 1, 1, 1, 1, 1, 3), device=device)).name
    jobs = [lambda c=case, d=dtype, o=op: check_case(c, d, device, o) for op in cfg.ops if op != "dsa_halo_cuda"
            for case in (halo_cases if op.startswith("dsa_halo") else cases) for dtype in dtypes]
    if "dsa_halo_cuda" in cfg.ops:  # bf16 only: the kernel's dots are bf16 tensor-core dots
        jobs += [lambda c=case: failure_recorded(lambda: check_case(c, "bf16", device, "dsa_halo_cuda"),
                                                 {"case": c.name, "op": "dsa_halo_cuda", "dtype": "bf16"})
                 for case in halo_cases]
    if "dsa" in cfg.ops and key_rows:
        from megaslide.attention.dsa import launch
        jobs += [lambda k=k, d=dtype: check_case(key_case, d, device, "dsa", k)
                 for k in checked_key_configs(cfg.smoke, cfg.key_candidates) for dtype in dtypes]
        overflow = replace(launch.key_config(key_case.shape[1:4], key_case.shape[-1]), capacity=OVERFLOW_CAPACITY)
        jobs += [lambda d=dtype: check_case(key_case, d, device, "dsa", overflow) for dtype in dtypes]
    candidates = SMOKE_LAUNCHES if cfg.smoke else cfg.launch_candidates
    launches = [launch_of(c, key_case.shape[-1]) for c in candidates]  # a malformed candidate fails here, first
    if cfg.sweep and key_rows:  # every query block the sweep times, checked on one case of each op
        jobs += [lambda c=c, o=op, d=dtype: check_case(key_case, d, device, o, launch=c)
                 for c in launches for op in cfg.ops if op != "dsa_halo" for dtype in dtypes]
    # the rows the sweep will time
    timings = len(candidates) + len(swept_key_configs(cfg.smoke, cfg.key_candidates)) if cfg.sweep else 0
    expected_auto = "triton" if device.type == "cuda" else auto_backend  # on a GPU, auto must pick the kernels
    rows: list[dict] = []

    def payload(sweep: dict | None) -> dict:
        """The result so far: jobs_done of jobs_total (checks, then sweep rows), rewritten after each."""
        done = len(rows) + (len(sweep["configs"]) + len(sweep["key_configs"]) if sweep else 0)
        return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
                "auto_backend": auto_backend,
                "passed": all(r["passed"] for r in rows) and auto_backend == expected_auto,
                "tolerance": f"{TOLERANCE_RULE}, floor {FLOOR_ULPS} eps x max(1, max|value|)", "rows": rows,
                "sweep": sweep, "jobs_done": done, "jobs_total": len(jobs) + timings}
    for job in jobs:
        rows.append(job())
        run.save(payload(None))
    sweep = sweep_launch_configs(device, cfg.smoke, cfg.launch_candidates, cfg.key_candidates,
                                 on_row=lambda partial: run.save(payload(partial))) if cfg.sweep else None
    result = payload(sweep)
    passed = result["passed"]
    path = run.finish(result, {"passed": passed, "checks_passed": sum(r["passed"] for r in rows),
                               "checks": len(rows), "auto_backend": auto_backend})
    print_tables(rows, sweep)
    print(f"\n{'PASS' if passed else 'FAIL'}: {sum(r['passed'] for r in rows)}/{len(rows)} checks; "
          f"auto backend = {auto_backend} (expected {expected_auto}); wrote {path}")
    return 0 if passed else 1


@script_main("gpu_check_dsa")
def main(cfg: DictConfig) -> None:
    """Exit status 0: every check passed; 1: a comparison failed; 2: no GPU (and not smoke)."""
    sys.exit(check(script_config(GpuCheckConfig, cfg)))


if __name__ == "__main__":
    main()
