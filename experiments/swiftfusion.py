"""SwiftFusion benchmark: forward time of one attention layer against sequence length, per SP mode.

Variants (P ranks; U x R degrees of the hybrids from `usp_ulysses`):
  sdpa_1gpu          F.scaled_dot_product_attention over all N tokens on one device (no SP)
  ulysses            all-to-all, heads sharded over P
  ring               K/V ring, isend/irecv
  ring_onesided      K/V ring, one-sided gets from symmetric memory (CUDA + NCCL only)
  usp                hybrid, Ulysses inside / ring across ("ulysses_intra"), no overlap: the baseline
  hybrid_ring_intra  hybrid with SwiftFusion's placement (ring inside, Ulysses across)
  torus              Ulysses with the all-to-all chunked by heads and overlapped with attention
  swiftfusion        torus + ring_intra placement + one-sided ring where available
Order of a run: ceilings (single-device SDPA TFLOP/s; all-to-all bus bandwidth if P >= 2) ->
correctness (every variant vs single-device SDPA and an fp32/fp64 reference, output and grads,
full and causal) -> timings with the cost model's prediction beside each -> end-to-end
denoising-step latency of a DiT per mode (experiments/swiftfusion_step.py) -> tables. A SIMULATED
table (cost model only) for 2-8 nodes of 8 GPUs is computed first. Rank 0 rewrites the JSON
after every length, so a run that is cut short keeps what it measured, and logs the run to W&B
(offline by default). Configuration: experiments/conf/swiftfusion.yaml.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc_per_node 2 -m experiments.swiftfusion          # GPUs
    python -m experiments.swiftfusion                                   # one GPU (or CPU) in-process
    python -m experiments.swiftfusion smoke=true                        # CI: 2 gloo processes, tiny

With one rank every distributed mode degenerates to local attention (no communication); the run
still times them, re-measures SDPA and prints the simulation.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig

from experiments.harness import ExperimentRun
from megaslide.perf.timing import timed
from experiments.hydra_config import require_ranges, require_sizes, script_config, script_main, trial_preset
from experiments.swiftfusion_step import StepTableConfig, measure_denoising_steps
from megaslide.config import DiTConfig, ParallelConfig
from megaslide.inference.launch import init_distributed, shutdown
from megaslide.parallel import resolve_degrees, sequence_parallel_attention
from megaslide.parallel.cost_model import AttentionWorkload, Plan, predict, rank_plans
from megaslide.parallel.groups import Topology
from megaslide.parallel.local_attn import select_backend
from megaslide.parallel.onesided import can_use_symm_mem, release_symm_mem_workspaces, symm_mem_backend
from megaslide.testing import free_port, rounding_floor, spawn, within_tolerance

SMOKE = {"world_size": 2, "heads": 4, "head_dim": 8, "seq_lens": [16, 32], "check_seq_len": 16,
         "ceiling_seq_len": 64, "a2a_bytes": 2 ** 16, "model": {"preset": "tiny"},
         "step": {"frames": [2, 3], "height": 4, "width": 8, "max_seconds": 5.0}}


@dataclass(frozen=True)
class SimConfig:
    nodes: list[int]       # node counts of the simulated table
    gpus_per_node: int
    seq_lens: list[int]

    def validate(self) -> None:
        require_sizes("sim.nodes", self.nodes)
        require_sizes("sim.seq_lens", self.seq_lens)
        require_ranges(self, positive=("gpus_per_node",), prefix="sim.")


@dataclass(frozen=True)
class SwiftFusionConfig:
    """The keys of experiments/conf/swiftfusion.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    world_size: int
    heads: int
    head_dim: int
    seq_lens: list[int]
    check_seq_len: int
    ceiling_seq_len: int
    a2a_bytes: int
    usp_ulysses: int | None
    variants: list[str] | None
    symm_mem_backend: str | None
    chunks: int
    repeats: int
    max_seconds: float
    intra_bw: float
    inter_bw: float
    timeout_s: float
    sim: SimConfig
    step: StepTableConfig
    model: DiTConfig       # the DiT of the denoising-step table (random weights)
    model_preset: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        require_ranges(self, positive=("world_size", "heads", "head_dim", "check_seq_len", "ceiling_seq_len",
                                       "a2a_bytes", "chunks", "repeats"),
                       finite=("max_seconds", "intra_bw", "inter_bw", "timeout_s"))
        require_sizes("seq_lens", self.seq_lens)
        if self.usp_ulysses is not None and self.usp_ulysses < 1:
            raise ValueError(f"usp_ulysses={self.usp_ulysses} must be >= 1, or null for the default degree")
        if self.variants == []:
            raise ValueError("variants=[] times nothing: name some, e.g. variants=[usp,torus], or variants=null "
                             "for all")
        if min(self.seq_lens) < self.world_size:
            raise ValueError(f"seq_lens={self.seq_lens}: each length must be >= world_size={self.world_size} (a "
                             f"length is rounded down to a multiple of the ranks)")
        if self.check_seq_len % self.world_size:
            raise ValueError(f"check_seq_len={self.check_seq_len} must be a multiple of world_size="
                             f"{self.world_size} (each rank checks an equal shard)")
        self.sim.validate()
        self.step.validate()
        for frames in self.step.frames:   # every step-table latent patchifies
            self.model.token_grid(frames, self.step.height, self.step.width,
                                  keys=("step.frames", "step.height", "step.width"))


@dataclass(frozen=True)
class Variant:
    name: str
    kwargs: dict  # for sequence_parallel_attention; empty for sdpa_1gpu
    plan: Plan | None  # cost-model plan; None for sdpa_1gpu

    def parallel(self) -> ParallelConfig:
        """`kwargs` as the sequence-parallel config of a model (`parallelize_dit`, FullConfig.parallel)."""
        return ParallelConfig(**{"sp_mode" if k == "mode" else k: v for k, v in self.kwargs.items()})


def build_variants(world: int, heads: int, usp_u: int, max_chunks: int) -> list[Variant]:
    r = world // usp_u
    c_full = max(1, min(heads // world, max_chunks))
    c_u = max(1, min(heads // usp_u, max_chunks))
    hyb = {"ulysses_degree": usp_u, "ring_degree": r}
    return [
        Variant("sdpa_1gpu", {}, None),
        Variant("ulysses", {"mode": "ulysses"}, Plan("ulysses", world, 1)),
        Variant("ring", {"mode": "ring"}, Plan("ring", 1, world)),
        Variant("ring_onesided", {"mode": "ring", "transport": "symm_mem"}, Plan("ring", 1, world)),
        Variant("usp", {"mode": "hybrid", "placement": "ulysses_intra", **hyb}, Plan("hybrid", usp_u, r)),
        Variant("hybrid_ring_intra", {"mode": "hybrid", "placement": "ring_intra", **hyb},
                Plan("hybrid", usp_u, r, "ring_intra")),
        Variant("torus", {"mode": "torus", "chunks": c_full}, Plan("torus", world, 1, chunks=c_full)),
        Variant("swiftfusion", {"mode": "torus", "placement": "ring_intra", "transport": "auto", "chunks": c_u,
                                **hyb}, Plan("torus", usp_u, r, "ring_intra", c_u)),
    ]


def select_variants(variants: list[Variant], names: list[str] | None) -> list[Variant]:
    """The variants named in `names` (None: all), in benchmark order."""
    known = [v.name for v in variants]
    unknown = sorted(set(names or []) - set(known))
    if unknown:
        raise ValueError(f"variants={unknown}: unknown; choose among {known}")
    return [v for v in variants if names is None or v.name in names]


def unavailable_reason(v: Variant, world: int, heads: int, device: torch.device) -> str | None:
    """Why `v` cannot run here (indivisible heads, no symmetric memory), or None."""
    if not v.kwargs:
        return None
    try:
        resolve_degrees(v.kwargs["mode"], world, heads, v.kwargs.get("ulysses_degree"), v.kwargs.get("ring_degree"))
    except ValueError as e:
        return str(e)
    if v.kwargs.get("transport") == "symm_mem":
        ok, reason = can_use_symm_mem(None, device)
        return None if ok else reason
    return None


def default_usp_ulysses(world: int, heads: int) -> int:
    """USP's Ulysses degree: the largest divisor of P (and of heads) up to P/2 once P >= 4, else P."""
    cap = world // 2 if world >= 4 else world
    return max(d for d in range(1, cap + 1) if world % d == 0 and heads % d == 0)


# ----------------------------------------------------------------------------- measurement
def progress(message: str) -> None:
    """A line on rank 0 before each collective stage, so that a hung stage is named in the log."""
    if dist.get_rank() == 0:
        print(message, flush=True)


def sdpa(q, k, v, causal: bool = False):
    """(B, N, h, d) layout wrapper of F.scaled_dot_product_attention."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def measure_sdpa_tflops(cfg, device, dtype) -> dict:
    n = cfg.ceiling_seq_len
    q, k, v = (torch.randn(1, n, cfg.heads, cfg.head_dim, device=device, dtype=dtype) for _ in range(3))
    with torch.no_grad():
        t = timed(lambda: sdpa(q, k, v), device, cfg.repeats, across_ranks=True)
    flops = AttentionWorkload(1, n, cfg.heads, cfg.head_dim).flops()
    return {"seq_len": n, "time_s": t.median, **t.ms(), "tflops": flops / t.median / 1e12}


def measure_all_to_all(cfg, device, dtype, world: int) -> dict | None:
    if world < 2:
        return None
    numel = cfg.a2a_bytes // (torch.finfo(dtype).bits // 8) // world * world
    send = torch.randn(numel, device=device, dtype=dtype)
    recv = torch.empty_like(send)
    t = timed(lambda: dist.all_to_all_single(recv, send), device, cfg.repeats, across_ranks=True).median
    nbytes = numel * send.element_size()
    return {"bytes_per_rank": nbytes, "time_s": t, "algbw_GBps": nbytes / t / 1e9,
            "busbw_GBps": nbytes / t / 1e9 * (world - 1) / world}


# ----------------------------------------------------------------------------- correctness
def run_variant(v: Variant, q, k, v_, causal: bool = False):
    if not v.kwargs:
        return sdpa(q, k, v_, causal)
    return sequence_parallel_attention(q, k, v_, causal=causal, **v.kwargs)


def gather_seq(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def check_variant(v: Variant, cfg, device, dtype, rank: int, world: int, causal: bool) -> dict:
    """Output and grads of `v` vs same-dtype single-device SDPA and a high-precision reference."""
    n = cfg.check_seq_len
    progress(f"checking {v.name} causal={causal} at N={n}")
    gen = torch.Generator(device=device).manual_seed(1234)
    full = [torch.randn(1, n, cfg.heads, cfg.head_dim, device=device, dtype=dtype, generator=gen) for _ in range(4)]
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32

    def with_grads(fn, tensors):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors[:3]]
        out = fn(*leaves)
        out.backward(tensors[3])
        return [out.detach()] + [t.grad for t in leaves]

    ref = with_grads(lambda a, b, c: sdpa(a, b, c, causal), [t.to(ref_dtype) for t in full])
    base = with_grads(lambda a, b, c: sdpa(a, b, c, causal), full)
    shard = n // world
    local = [t[:, rank * shard:(rank + 1) * shard] for t in full]
    ours = with_grads(lambda a, b, c: run_variant(v, a, b, c, causal), local)
    ours = [gather_seq(t, world) for t in ours]
    names = ("out", "dq", "dk", "dv")
    err = {k: (a.to(ref_dtype) - r).abs().max().item() for k, a, r in zip(names, ours, ref)}
    bar = {k: (a.to(ref_dtype) - r).abs().max().item() for k, a, r in zip(names, base, ref)}
    # The floor keeps a sum over P blocks instead of one pass from failing on last-bit rounding.
    floor = {k: rounding_floor(dtype, r) for k, r in zip(names, ref)}
    return {"variant": v.name, "causal": causal, "seq_len": n, "dtype": str(dtype).replace("torch.", ""),
            "max_abs_diff_vs_sdpa": (ours[0].float() - base[0].float()).abs().max().item(),
            "err_vs_ref": err, "sdpa_err_vs_ref": bar, "floor": floor,
            "passed": all(within_tolerance(err[k], bar[k], floor[k]) for k in names)}


# ----------------------------------------------------------------------------- timing
def time_variant(v: Variant, n: int, cfg, device, dtype, world: int, topo: Topology, tflops: float) -> dict:
    row = {"variant": v.name, "seq_len": n}
    progress(f"timing {v.name} at N={n}")
    workload = AttentionWorkload(1, n, cfg.heads, cfg.head_dim, torch.finfo(dtype).bits // 8)
    plan = v.plan or Plan("ulysses", 1, 1)
    one_gpu = Topology(1, 1, topo.intra_bw, topo.inter_bw)
    predicted = predict(plan, workload, one_gpu if v.plan is None else topo, tflops).total_s
    row["predicted_s"] = predicted
    if predicted > cfg.max_seconds:
        return {**row, "status": "skipped", "reason": f"predicted {predicted:.2f} s > max_seconds={cfg.max_seconds}"}
    local = n if v.plan is None else n // world
    q, k, vv = (torch.randn(1, local, cfg.heads, cfg.head_dim, device=device, dtype=dtype) for _ in range(3))
    try:
        with torch.no_grad():
            t = timed(lambda: run_variant(v, q, k, vv), device, cfg.repeats, across_ranks=True)
    except torch.cuda.OutOfMemoryError as e:  # with several ranks, one rank's OOM can stall the others
        return {**row, "status": "oom", "reason": str(e).splitlines()[0]}
    finally:
        q = k = vv = None  # release the inputs before the next size
        release_symm_mem_workspaces()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {**row, "status": "ok", "time_s": t.median, **t.ms(), "measured_over_predicted": t.median / predicted,
            "tflops_per_rank": workload.flops() / (1 if v.plan is None else world) / t.median / 1e12}


# ----------------------------------------------------------------------------- simulation
def simulate(cfg, tflops: float, intra_bw: float, inter_bw: float) -> list[dict]:
    """Cost-model-only table: best USP plan (ulysses_intra, no torus) vs best ring_intra plan."""
    rows = []
    for nodes in cfg.sim.nodes:
        topo = Topology(nodes, cfg.sim.gpus_per_node, intra_bw, inter_bw)
        for n in cfg.sim.seq_lens:
            ranked = rank_plans(AttentionWorkload(1, n, cfg.heads, cfg.head_dim), topo, tflops)
            usp = next((p for p in ranked if p.plan.placement == "ulysses_intra" and p.plan.mode != "torus"), None)
            swift = next((p for p in ranked if p.plan.placement == "ring_intra"), None)
            rows.append({"simulated": True, "nodes": nodes, "gpus": topo.world_size, "seq_len": n,
                         "usp": _pred(usp), "ring_intra": _pred(swift), "best": _pred(ranked[0]),
                         "winner_placement": ranked[0].plan.placement,
                         "speedup_ring_intra_vs_usp": usp.total_s / swift.total_s if usp and swift else None})
    return rows


def _pred(p) -> dict | None:
    return None if p is None else {**asdict(p.plan), "total_s": p.total_s, "compute_s": p.compute_s,
                                   "all_to_all_s": p.all_to_all_s, "ring_comm_s": p.ring_comm_s}


# ----------------------------------------------------------------------------- driver
def _plan_str(p: dict | None) -> str:
    if p is None:
        return "-"
    chunks = f" C{p['chunks']}" if p["mode"] == "torus" else ""
    return f"{p['mode']} U{p['ulysses_degree']}xR{p['ring_degree']}{chunks}"


def _ms(p: dict | None) -> str:
    return "-" if p is None else f"{p['total_s'] * 1e3:.2f}"


def print_tables(payload: dict) -> None:
    print("\nsimulated (cost model only, not measured): best USP plan vs best ring_intra plan")
    print(f"{'nodes':>5} {'gpus':>5} {'N':>9} {'USP plan':>22} {'USP ms':>9} {'ring_intra plan':>24} "
          f"{'ms':>9} {'speedup':>8}")
    for r in payload["simulation"]:
        u, s = r["usp"], r["ring_intra"]
        speedup = f"{r['speedup_ring_intra_vs_usp']:.2f}x" if r["speedup_ring_intra_vs_usp"] else "-"
        print(f"{r['nodes']:>5} {r['gpus']:>5} {r['seq_len']:>9} {_plan_str(u):>22} {_ms(u):>9} "
              f"{_plan_str(s):>24} {_ms(s):>9} {speedup:>8}")
    print(f"\ndenoising step of {payload['denoising_step_model']['preset']} (random weights), end to end")
    print(f"{'variant':>18} {'frames':>6} {'tokens':>8} {'status':>11} {'ms':>10} {'vs USP':>7} {'max|diff|':>10}")
    for r in payload["denoising_step"]:
        ms = f"{r['step_s'] * 1e3:.1f}" if "step_s" in r else "-"
        vs = f"{r['speedup_vs_usp']:.2f}x" if r.get("speedup_vs_usp") else "-"
        diff = f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else "-"
        print(f"{r['variant']:>18} {r['latent_frames']:>6} {r['tokens']:>8} {r['status']:>11} {ms:>10} {vs:>7} "
              f"{diff:>10}")
    print(f"\nmeasured on {payload['world_size']} rank(s), {payload['device']}, {payload['dtype']}, block attention "
          f"{payload['attention_backend']['name']}; one-sided: {payload['symm_mem']['reason']}; "
          f"correctness {'PASSED' if all(c['passed'] for c in payload['correctness']) else 'FAILED'}")
    for c in payload["correctness"]:
        if not c["passed"]:
            print(f"  FAILED {c['variant']} causal={c['causal']}: error {c['err_vs_ref']} "
                  f"vs SDPA's {c['sdpa_err_vs_ref']}")
    print(f"{'variant':>18} {'N':>9} {'status':>11} {'ms':>10} {'pred ms':>10} {'meas/pred':>9} {'vs USP':>7}")
    for r in payload["timings"]:
        ms = f"{r['time_s'] * 1e3:.2f}" if "time_s" in r else "-"
        ratio = f"{r['measured_over_predicted']:.2f}" if "measured_over_predicted" in r else "-"
        vs = f"{r['speedup_vs_usp']:.2f}x" if r.get("speedup_vs_usp") else "-"
        pred = f"{r['predicted_s'] * 1e3:.2f}" if "predicted_s" in r else "-"
        print(f"{r['variant']:>18} {r['seq_len']:>9} {r['status']:>11} {ms:>10} {pred:>10} {ratio:>9} {vs:>7}")


def benchmark(cfg: SwiftFusionConfig, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    usp_u = cfg.usp_ulysses or default_usp_ulysses(world, cfg.heads)
    variants = select_variants(build_variants(world, cfg.heads, usp_u, cfg.chunks), cfg.variants)

    ceiling = measure_sdpa_tflops(cfg, device, dtype)
    a2a = measure_all_to_all(cfg, device, dtype, world)
    run_bw = a2a["busbw_GBps"] if a2a else cfg.intra_bw
    topo = Topology(1, world, run_bw, run_bw)
    if cfg.symm_mem_backend and device.type == "cuda":  # before the first symmetric allocation
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.set_backend(cfg.symm_mem_backend)
    symm_ok, symm_reason = can_use_symm_mem(None, device)
    sample = torch.zeros(1, 1, 8, cfg.head_dim, device=device, dtype=dtype)
    backend, why_not = select_backend(sample, sample, sample)
    backward_backend, _ = select_backend(sample, sample, sample, backward=True)

    unavailable = {v.name: unavailable_reason(v, world, cfg.heads, device) for v in variants}
    runnable = [v for v in variants if unavailable[v.name] is None]
    correctness = [check_variant(v, cfg, device, dtype, rank, world, causal)
                   for v in runnable if v.plan is not None for causal in (False, True)]

    timings: list[dict] = []
    sim_intra = a2a["busbw_GBps"] if a2a and device.type == "cuda" else cfg.intra_bw
    payload = {
        "world_size": world, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "heads": cfg.heads, "head_dim": cfg.head_dim, "usp_degrees": [usp_u, world // usp_u],
        "degenerate": world == 1,
        "note": ("one rank: every distributed mode runs as local attention without communication"
                 if world == 1 else ""),
        "ceilings": {"sdpa": ceiling, "all_to_all": a2a},
        "symm_mem": {"available": symm_ok, "reason": symm_reason, "backend": symm_mem_backend(device)},
        "attention_backend": {"name": backend.name, "why_not_others": why_not,
                              "backward": backward_backend.name},
        "run_topology": asdict(topo), "unavailable": {k: r for k, r in unavailable.items() if r},
        "correctness": correctness, "timings": timings, "denoising_step": [], "denoising_step_model": {
            "preset": cfg.model_preset, "latent_hw": [cfg.step.height, cfg.step.width], "weights": "random"},
        "jobs_done": 0, "jobs_total": len(cfg.seq_lens) + len(cfg.step.frames),
        "simulation_inputs": {
            "simulated": True, "attn_tflops": ceiling["tflops"], "attn_tflops_source": f"measured SDPA on {device}",
            "intra_bw_GBps": sim_intra,
            "intra_bw_source": "measured all-to-all busbw" if sim_intra != cfg.intra_bw else "intra_bw (assumed)",
            "inter_bw_GBps": cfg.inter_bw, "inter_bw_source": "inter_bw (assumed)",
            "gpus_per_node": cfg.sim.gpus_per_node},
        "simulation": simulate(cfg, ceiling["tflops"], sim_intra, cfg.inter_bw),
    }
    name = cfg.name or ("smoke" if cfg.smoke else f"{device.type}_w{world}")
    run = ExperimentRun("swiftfusion", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project,
                        trial=cfg.smoke) if rank == 0 else None
    if run:
        run.save(payload)  # correctness + simulation first

    def save() -> None:                      # after every length: a cut-short run keeps the rows it has
        payload["jobs_done"] += 1
        if run:
            run.save(payload)

    for n in cfg.seq_lens:
        n = n // world * world
        rows = [time_variant(v, n, cfg, device, dtype, world, topo, ceiling["tflops"]) for v in runnable]
        rows += [{"variant": v.name, "seq_len": n, "status": "unavailable", "reason": unavailable[v.name]}
                 for v in variants if unavailable[v.name] is not None]
        usp_t = next((r.get("time_s") for r in rows if r["variant"] == "usp"), None)
        for r in rows:
            if usp_t and "time_s" in r:
                r["speedup_vs_usp"] = usp_t / r["time_s"]
        timings.extend(rows)
        save()

    measure_denoising_steps(payload["denoising_step"], variants, unavailable, cfg.model, cfg.step, cfg.repeats,
                            device, dtype, world, on_length=save)
    if run:
        path = run.finish(payload, headline(payload))
        print_tables(payload)
        print(f"wrote {path}")


def headline(payload: dict) -> dict:
    """The run's scalars: correctness, the ceilings, and each variant's speedup over USP at the longest
    length it was timed at (attention layer and denoising step)."""
    out = {"correctness_passed": all(c["passed"] for c in payload["correctness"]),
           "sdpa_tflops": payload["ceilings"]["sdpa"]["tflops"]}
    if payload["ceilings"]["all_to_all"]:
        out["all_to_all_busbw_GBps"] = payload["ceilings"]["all_to_all"]["busbw_GBps"]
    for table, length in (("timings", "seq_len"), ("denoising_step", "tokens")):
        for r in sorted(payload[table], key=lambda r: r[length]):
            if "speedup_vs_usp" in r:
                out[f"{table}/{r['variant']}/speedup_vs_usp"] = r["speedup_vs_usp"]
    return out


def run_rank(rank: int, world: int, cfg: SwiftFusionConfig) -> None:
    """One rank: join the job that torchrun's environment variables describe, run the benchmark,
    leave. Every collective of the benchmark has been waited on when it returns (each SP mode
    waits on its async handles); `shutdown` then tears down in a fixed order (barrier, destroy
    the groups, drop the cached meshes) so no gloo thread outlives the interpreter. A failing
    rank raises, and its exit code is the run's."""
    ctx = init_distributed("auto", timeout_s=cfg.timeout_s)
    benchmark(cfg, ctx.device)
    shutdown(ctx)


@script_main("swiftfusion")
def main(cfg: DictConfig) -> None:
    config = script_config(SwiftFusionConfig, cfg, trial_preset(cfg, smoke=SMOKE))  # smoke: SMOKE's sizes
    if "RANK" in os.environ:  # torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), config)
    elif config.world_size > 1:
        spawn(run_rank, config.world_size, (config,), backend=None, timeout_s=None)
    else:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        run_rank(0, 1, config)


if __name__ == "__main__":
    main()
