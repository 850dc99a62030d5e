"""Throughput of the fused CPU AdamW (megaslide.offload.cpu_adam) against torch.optim.AdamW.

Every variant runs the same workload on the same threads: one AdamW step over N flat fp32
parameters, with fp32 or bf16 gradients, optionally writing the updated weights as bf16.
torch's optimizers need fp32 gradients and write no bf16 copy, so for those workloads their
timed step includes the cast of the gradient into a preallocated fp32 buffer and the copy of
the weights into the bf16 buffer, as the offload engine would have to do.

Bytes per parameter (the least any implementation must move, counted explicitly):
    read  param 4 + exp_avg 4 + exp_avg_sq 4 + grad (4 fp32 | 2 bf16)
    write param 4 + exp_avg 4 + exp_avg_sq 4 (+ 2 for the bf16 weights)
    -> 28 B (fp32 grad), 26 B (bf16 grad), 28 B (bf16 grad + bf16 out)
Achieved bandwidth = N * bytes / time. The ceiling is re-measured in the same run with two
torch kernels on the same threads: a copy (dst.copy_(src): 8 B/element, read + write, as
HARDWARE.md counts it) and an in-place add (a.add_(b): 12 B/element, two reads and one write
to lines already read, the access pattern of AdamW).

The compact host states (bf16 master, int8 moments, both) are timed beside the fp32 state (`compact_states`),
after a check that the native step gives the same bits as the torch backend on each (`compact_check`).

Order: correctness (C++ vs torch.optim.AdamW on a small buffer) -> ceilings -> timings ->
JSON (results/cpu_adam/<name>.json, or under $MEGASLIDE_RESULTS_DIR) and W&B -> table.
Configuration: experiments/conf/bench_cpu_adam.yaml.

    python -m experiments.bench_cpu_adam                       # 64M and 268M params
    python -m experiments.bench_cpu_adam params=[268435456] threads=16
    python -m experiments.bench_cpu_adam tiny=true             # CI smoke: 1M params
"""
from __future__ import annotations

import gc
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun
from megaslide.perf.timing import copy_gbps, timed
from experiments.hydra_config import script_config, script_main, trial_preset
from megaslide.offload import compact, cpu_adam
from megaslide.offload.compact import SIGNED, SQRT, QuantizedMoment
from megaslide.perf.host_memory import MOMENT_BLOCK

LR, WEIGHT_DECAY = 1e-4, 0.01
TARGET_SPEEDUP = 1.2  # vs torch fused AdamW, the goal set for the offload engine
VARIANTS = ("megaslide", "megaslide-torch-backend", "torch-fused", "torch-foreach", "torch-single")
TINY = {"params": [2 ** 20], "iters": 5, "warmup": 1, "bw_bytes": 16 * 2 ** 20}


@dataclass(frozen=True)
class BenchCpuAdamConfig:
    """The keys of experiments/conf/bench_cpu_adam.yaml (their meaning is documented there)."""

    name: str
    tiny: bool
    params: list[int]
    threads: int
    iters: int
    warmup: int
    bw_bytes: int
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        for key in ("threads", "iters", "warmup", "bw_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if min(self.params) < 1:
            raise ValueError(f"params={self.params}: every count must be >= 1")


@dataclass(frozen=True)
class Workload:
    name: str
    grad_dtype: torch.dtype
    bf16_out: bool

    @property
    def bytes_per_param(self) -> int:
        grad_bytes = torch.finfo(self.grad_dtype).bits // 8
        read = 4 + 4 + 4 + grad_bytes  # param, exp_avg, exp_avg_sq, grad
        write = 4 + 4 + 4 + (2 if self.bf16_out else 0)  # param, exp_avg, exp_avg_sq, bf16 weights
        return read + write


WORKLOADS = (
    Workload("fp32 grad", torch.float32, False),
    Workload("bf16 grad", torch.bfloat16, False),
    Workload("bf16 grad + bf16 out", torch.bfloat16, True),
)


@dataclass
class Buffers:
    """One parameter group's flat host state: (N,) each."""
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: torch.Tensor | None

    @classmethod
    def create(cls, init_param: torch.Tensor, init_grad: torch.Tensor, w: Workload) -> Buffers:
        n = init_param.numel()
        out = torch.empty(n, dtype=torch.bfloat16) if w.bf16_out else None
        return cls(init_param.clone(), init_grad.to(w.grad_dtype), torch.zeros(n), torch.zeros(n), out)


def check_correctness(workload: Workload, n: int = 100_003, steps: int = 3) -> dict:
    """adamw_step_ vs torch.optim.AdamW(foreach=False) and a float64 AdamW on fresh random data.

    Moments must match torch bit for bit; the weights' error against float64 may be at most
    twice torch's (floor: 1 ulp of the largest weight), since torch's sqrt is not correctly
    rounded the bits may differ; the bf16 output must equal weights.to(bfloat16)."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    b = Buffers(p0.clone(), torch.empty(0), torch.zeros(n), torch.zeros(n),
                torch.empty(n, dtype=torch.bfloat16) if workload.bf16_out else None)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=LR, weight_decay=WEIGHT_DECAY, foreach=False, fused=False)
    p64, m64, v64 = p0.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    exact = True
    for step in range(1, steps + 1):
        grad = (torch.randn(n, generator=gen) * 1e-2).to(workload.grad_dtype)
        cpu_adam.adamw_step_(b.param, grad, b.exp_avg, b.exp_avg_sq, step=step, lr=LR,
                             weight_decay=WEIGHT_DECAY, param_bf16=b.out)
        ref.grad = grad.float()
        opt.step()
        g64 = grad.double()
        p64.mul_(1 - LR * WEIGHT_DECAY)
        m64.mul_(0.9).add_(0.1 * g64)
        v64.mul_(0.999).add_(0.001 * g64 * g64)
        p64.sub_(LR / (1 - 0.9**step) * m64 / (v64.sqrt() / (1 - 0.999**step) ** 0.5 + 1e-8))
        state = opt.state[ref]
        exact &= torch.equal(b.exp_avg, state["exp_avg"]) and torch.equal(b.exp_avg_sq, state["exp_avg_sq"])
        if b.out is not None:
            exact &= torch.equal(b.out.view(torch.int16), b.param.to(torch.bfloat16).view(torch.int16))
    err_ours = (b.param.double() - p64).abs().max().item()
    err_torch = (ref.detach().double() - p64).abs().max().item()
    one_ulp = torch.finfo(torch.float32).eps * p64.abs().max().item()
    return {"workload": workload.name, "moments_and_bf16_exact": bool(exact),
            "param_err_vs_fp64": err_ours, "torch_param_err_vs_fp64": err_torch,
            "param_bits_differ_from_torch": (b.param != ref.detach()).float().mean().item(),
            "passed": bool(exact) and err_ours <= 2 * max(err_torch, one_ulp)}


def host_bandwidth(nbytes: int, iters: int) -> dict:
    """Host memory bandwidth in GB/s with torch kernels on the current torch threads."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros(nbytes // 4)
    add_s = timed(lambda: dst.add_(src), "cpu", iters).median  # the warm-up touches the pages
    return {"bytes": nbytes, "copy_GBps": copy_gbps("cpu", nbytes, iters),
            "inplace_add_GBps": 3 * nbytes / add_s / 1e9}


def make_step(variant: str, b: Buffers, threads: int) -> Callable[[int], None]:
    """A function running AdamW step `step` of `variant` on the buffers `b`."""
    if variant in ("megaslide", "megaslide-torch-backend"):
        fn = cpu_adam.adamw_step_ if variant == "megaslide" else cpu_adam.adamw_step_torch_
        kw = {"num_threads": threads} if variant == "megaslide" else {}

        def step_ours(step: int) -> None:
            fn(b.param, b.grad, b.exp_avg, b.exp_avg_sq, step=step, lr=LR,
               weight_decay=WEIGHT_DECAY, param_bf16=b.out, **kw)
        return step_ours

    flags = {"torch-fused": {"fused": True}, "torch-foreach": {"foreach": True},
             "torch-single": {"foreach": False}}[variant]
    param = torch.nn.Parameter(b.param)  # shares b.param's storage
    grad32 = b.grad if b.grad.dtype == torch.float32 else torch.empty_like(b.param)
    param.grad = grad32
    opt = torch.optim.AdamW([param], lr=LR, weight_decay=WEIGHT_DECAY, **flags)

    def step_torch(step: int) -> None:
        if grad32 is not b.grad:
            grad32.copy_(b.grad)
        opt.step()
        if b.out is not None:
            b.out.copy_(param.detach())
    return step_torch


def time_variant(variant: str, b: Buffers, threads: int, warmup: int, iters: int) -> dict:
    try:
        step_fn = make_step(variant, b, threads)
        for s in range(1, warmup + 1):
            step_fn(s)  # also allocates torch's optimizer state
    except RuntimeError as err:  # e.g. fused AdamW not supported on this CPU build
        return {"variant": variant, "error": str(err).splitlines()[0]}
    counter = iter(range(warmup + 1, warmup + iters + 1))
    t = timed(lambda: step_fn(next(counter)), "cpu", iters, warmup=0)
    return {"variant": variant, "median_s": t.median, "best_s": t.min, "worst_s": t.max, "std_s": t.std}


# The host states of offload.master_dtype x offload.moments (docs/offload_engine.md, "Compact optimizer state"),
# each with bf16 gradients and, for an fp32 master, the bf16 weights written: (name, master dtype, int8 moments)
STATES = (("fp32 state", torch.float32, False), ("bf16 master", torch.bfloat16, False),
          ("int8 moments", torch.float32, True), ("bf16 master + int8 moments", torch.bfloat16, True))


def state_buffers(init_param: torch.Tensor, master: torch.dtype, int8: bool) -> tuple:
    """(param, exp_avg, exp_avg_sq, bf16 out or None) of one host state over init_param's N elements."""
    n = init_param.numel()
    moments = ((QuantizedMoment.zeros(n, SIGNED), QuantizedMoment.zeros(n, SQRT)) if int8
               else (torch.zeros(n), torch.zeros(n)))
    out = torch.empty(n, dtype=torch.bfloat16) if master == torch.float32 else None
    return init_param.to(master), *moments, out


def state_bytes(master: torch.dtype, int8: bool) -> float:
    """Bytes per parameter a step must move: param (read + write), the bf16 gradient, both moments (read +
    write, int8 codes with one fp32 scale per MOMENT_BLOCK), and the bf16 weights an fp32 master writes."""
    param = 2 * master.itemsize
    moments = 2 * 2 * ((1 + 4 / MOMENT_BLOCK) if int8 else 4)
    return param + 2 + moments + (2 if master == torch.float32 else 0)


def check_states(n: int = 100_003, steps: int = 3) -> dict:
    """Every compact host state, native vs the torch backend (the tested reference of the formats) over `steps`
    steps of fresh random gradients: the weights and the moments must be the same bits."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 1e-2).bfloat16() for _ in range(steps)]
    same = {}
    for name, master, int8 in STATES[1:]:
        runs = []
        for fn in (cpu_adam.adamw_step_, cpu_adam.adamw_step_torch_):
            param, m, v, out = state_buffers(p0, master, int8)
            for step, grad in enumerate(grads, 1):
                fn(param, grad, m, v, step=step, lr=LR, weight_decay=WEIGHT_DECAY, param_bf16=out,
                   rounding_key=compact.rounding_key(0, 3, step))
            runs.append([param, *((m.codes, m.scales, v.codes, v.scales) if int8 else (m, v))])
        same[name] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*runs))
    return {"n": n, "steps": steps, "native_equals_reference": same, "passed": all(same.values())}


def state_rows(n: int, threads: int, warmup: int, iters: int) -> list[dict]:
    """The native AdamW step over each host state of N parameters: throughput, bytes moved, and the time
    against the fp32 state's (`vs_fp32_state`)."""
    gen = torch.Generator().manual_seed(n)
    init_param, grad = torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 1e-3).bfloat16()
    rows = []
    for name, master, int8 in STATES:
        param, m, v, out = state_buffers(init_param, master, int8)
        key = compact.rounding_key(0, 0, 1)
        counter = iter(range(1, warmup + iters + 1))

        def step() -> None:
            cpu_adam.adamw_step_(param, grad, m, v, step=next(counter), lr=LR, weight_decay=WEIGHT_DECAY,
                                 param_bf16=out, num_threads=threads, rounding_key=key)
        t = timed(step, "cpu", iters, warmup=warmup)
        bytes_per_param = state_bytes(master, int8)
        rows.append({"params": n, "state": name, "bytes_per_param": bytes_per_param, "median_s": t.median,
                     "best_s": t.min, "worst_s": t.max, "std_s": t.std, "gparams_per_s": n / t.median / 1e9,
                     "GBps": n * bytes_per_param / t.median / 1e9, "vs_fp32_state": t.median / rows[0]["median_s"]
                     if rows else 1.0})
    return rows


def bench(sizes: list[int], threads: int, warmup: int, iters: int, bw_bytes: int) -> dict:
    torch.set_num_threads(threads)
    correctness = [check_correctness(w) for w in WORKLOADS]
    if not all(c["passed"] for c in correctness):
        sys.exit(f"correctness check failed, not timing: {correctness}")
    bandwidth = host_bandwidth(bw_bytes, iters)
    ceiling = max(bandwidth["copy_GBps"], bandwidth["inplace_add_GBps"])
    rows = []
    for n in sizes:
        gen = torch.Generator().manual_seed(n)
        init_param = torch.randn(n, generator=gen)
        init_grad = torch.randn(n, generator=gen) * 1e-3
        for w in WORKLOADS:
            timings = []
            for variant in VARIANTS:
                b = Buffers.create(init_param, init_grad, w)
                timings.append(time_variant(variant, b, threads, warmup, iters))
                del b
                gc.collect()
            fused = next((t for t in timings if t["variant"] == "torch-fused" and "median_s" in t), None)
            for t in timings:
                row = {"params": n, "workload": w.name, "bytes_per_param": w.bytes_per_param, **t}
                if "median_s" in t:
                    row["gparams_per_s"] = n / t["median_s"] / 1e9
                    row["GBps"] = n * w.bytes_per_param / t["median_s"] / 1e9
                    row["frac_of_bandwidth"] = row["GBps"] / ceiling
                    row["speedup_vs_torch_fused"] = fused["median_s"] / t["median_s"] if fused else None
                rows.append(row)
        del init_param, init_grad
    states = check_states()
    if not states["passed"]:
        sys.exit(f"compact state check failed, not timing: {states}")
    return {"backend": cpu_adam.backend(), "isa": cpu_adam.native_isa(), "threads": threads,
            "warmup": warmup, "iters": iters, "lr": LR, "weight_decay": WEIGHT_DECAY,
            "target_speedup_vs_torch_fused": TARGET_SPEEDUP, "correctness": correctness,
            "bandwidth": bandwidth, "bandwidth_ceiling_GBps": ceiling, "results": rows,
            "compact_check": [states], "compact_states": [r for n in sizes
                                                         for r in state_rows(n, threads, warmup, iters)]}


def print_table(payload: dict) -> None:
    bw = payload["bandwidth"]
    print(f"\nCPU AdamW  backend={payload['backend']} isa={payload['isa']} "
          f"threads={payload['threads']}  host bandwidth: copy {bw['copy_GBps']:.1f} GB/s, "
          f"in-place add {bw['inplace_add_GBps']:.1f} GB/s")
    print(f"{'params':>11} {'workload':<21} {'variant':<24} {'Gparam/s':>9} {'GB/s':>7} "
          f"{'of bw':>6} {'vs fused':>9}")
    for r in payload["results"]:
        if "error" in r:
            print(f"{r['params']:>11} {r['workload']:<21} {r['variant']:<24} unsupported: {r['error']}")
            continue
        ratio = "-" if r["speedup_vs_torch_fused"] is None else f"{r['speedup_vs_torch_fused']:.2f}x"
        print(f"{r['params']:>11} {r['workload']:<21} {r['variant']:<24} {r['gparams_per_s']:>9.2f} "
              f"{r['GBps']:>7.1f} {r['frac_of_bandwidth']:>6.0%} {ratio:>9}")


    print(f"\n{'params':>11} {'host state':<27} {'Gparam/s':>9} {'GB/s':>7} {'time vs fp32 state':>19}")
    for r in payload["compact_states"]:
        print(f"{r['params']:>11} {r['state']:<27} {r['gparams_per_s']:>9.2f} {r['GBps']:>7.1f} "
              f"{r['vs_fp32_state']:>18.2f}x")


@script_main("bench_cpu_adam")
def main(hydra_cfg: DictConfig) -> None:
    threads = hydra_cfg.threads or torch.get_num_threads()
    tiny = trial_preset(hydra_cfg, tiny=TINY) or {}
    cfg = script_config(BenchCpuAdamConfig, hydra_cfg, {"threads": threads, **tiny})
    name = cfg.name or ("tiny" if cfg.tiny else "n" + "-".join(str(n) for n in cfg.params) + f"_t{cfg.threads}")
    run = ExperimentRun("cpu_adam", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project, trial=cfg.tiny)
    payload = bench(cfg.params, cfg.threads, cfg.warmup, cfg.iters, cfg.bw_bytes)
    ours = {f"{r['workload']} {r['params']}": r["speedup_vs_torch_fused"] for r in payload["results"]
            if r["variant"] == "megaslide" and r.get("speedup_vs_torch_fused") is not None}
    path = run.finish(payload, {"bandwidth_ceiling_GBps": payload["bandwidth_ceiling_GBps"],
                                "speedup_vs_torch_fused": ours})
    print(f"wrote {path}")
    print_table(payload)


if __name__ == "__main__":
    main()
