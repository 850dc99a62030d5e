"""What bounds each fused 3D-DSA kernel: Nsight Compute (ncu) on one launch of each, at the benchmark shape.

The script re-runs itself under ncu (`child=true`: one forward and one backward of each op in `ops`, in that
order) and profiles the first `launch_count` launches of the named kernels, in launch order: for `dsa` the
forward, the backward's query pass, the binning's capped pass and its two exact passes (no-ops unless a list
overflowed) and the key pass of the first head group (6); for `dsa_zero` its forward, dq and dk / dv kernels
(3); for `dsa_halo_cuda` the CUDA halo forward (1). It parses ncu's text report into one row per launch
(duration, SM and memory throughput, issue slots busy, IPC, the busiest pipe, L1 / L2 throughput and hit rates,
registers, theoretical and achieved occupancy) and writes results/attention/<name>.json. Clocks are left as they
are (`--clock-control none`), so durations are the machine's own; ncu replays each kernel once per pass, so the
script's wall time is many times the kernels'.

    python -m experiments.ncu_dsa name=h200_ncu          # on a GPU machine with ncu
    python -m experiments.ncu_dsa 'ops=[dsa_zero,dsa]' launch_count=9   # both ops' kernels

Configuration: experiments/conf/ncu_dsa.yaml. Exits with status 2 when there is no GPU or no ncu.
"""
from __future__ import annotations

import glob
import math
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun
from experiments.hydra_config import script_config, script_main
from experiments.results_io import REPO_ROOT

KERNELS = {"dsa": ["_dsa_fwd_kernel", "_query_kernel", "_bin_capped_kernel", "_bin_kernel", "_key_kernel"],
           "dsa_zero": ["_na_fwd_kernel", "_na_bwd_dq_kernel", "_na_bwd_dkdv_kernel"],
           "dsa_halo_cuda": ["halo_fwd_kernel"]}
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "LaunchStats", "Occupancy",
            "WarpStateStats"]
METRICS = {  # row key: (ncu's metric name in the text report, its unit there; durations in any time unit)
    "duration_ms": ("Duration", None), "sm_throughput_pct": ("Compute (SM) Throughput", "%"),
    "memory_throughput_pct": ("Memory Throughput", "%"), "dram_GBps": ("Memory Throughput", "Gbyte/s"),
    "dram_throughput_pct": ("DRAM Throughput", "%"), "l1_throughput_pct": ("L1/TEX Cache Throughput", "%"),
    "l2_throughput_pct": ("L2 Cache Throughput", "%"), "issue_slots_busy_pct": ("Issue Slots Busy", "%"),
    "ipc": ("Executed Ipc Active", "inst/cycle"), "l1_hit_pct": ("L1/TEX Hit Rate", "%"),
    "l2_hit_pct": ("L2 Hit Rate", "%"), "registers": ("Registers Per Thread", "register/thread"),
    "theoretical_occupancy_pct": ("Theoretical Occupancy", "%"), "achieved_occupancy_pct": ("Achieved Occupancy", "%"),
    "cycles_per_issue": ("Warp Cycles Per Issued Instruction", "cycle"),
}
TO_MS = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}


@dataclass(frozen=True)
class NcuConfig:
    """The keys of experiments/conf/ncu_dsa.yaml (their meaning is documented there)."""

    name: str
    child: bool
    ops: list[str]
    shape: list[int]
    launch_count: int
    ncu: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        if not self.ops or set(self.ops) - set(KERNELS):
            raise ValueError(f"ops={list(self.ops)}: choose one or more of {list(KERNELS)}")
        if len(self.shape) != 6 or min(self.shape) < 1:
            raise ValueError(f"shape={list(self.shape)}: give six positive sizes (B, T, H, W, heads, d)")
        if self.launch_count < 1:
            raise ValueError(f"launch_count={self.launch_count} must be >= 1")


def run_kernels(cfg: NcuConfig) -> None:
    """The child: one forward and one backward of each op, in the order of `ops`, on bf16 inputs (offsets
    U(-4, 4)); for dsa_halo_cuda the CUDA halo forward alone, at reach 1 with offsets U(-1, 1), so that every
    tile takes its halo path. ncu profiles the first `launch_count` launches in that order."""
    from megaslide.attention.dsa import backward, forward, halo_cuda, zero_kernels

    B, T, H, W, heads, d = cfg.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(cfg.shape, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    window, scale = (3, 3, 3), d ** -0.5
    for op in cfg.ops:
        if op == "dsa":
            offsets = (8 * torch.rand((B, T, H, W, heads, 27, 3), generator=g, device="cuda") - 4).to(torch.bfloat16)
            out, lse = forward.dsa_forward(q, k, v, offsets, window, scale)
            backward.dsa_backward(q, k, v, offsets, out, lse, dout, window, scale, offsets_grad=True)
        elif op == "dsa_halo_cuda":
            offsets = (2 * torch.rand((B, T, H, W, heads, 27, 3), generator=g, device="cuda") - 1).to(torch.bfloat16)
            halo_cuda.dsa_halo_forward_cuda(q, k, v, offsets, window, scale, reach=1)
        else:
            out, lse = zero_kernels.na_forward(q, k, v, window, scale)
            zero_kernels.na_backward(q, k, v, out, lse, dout, window, scale)
    torch.cuda.synchronize()


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_report(text: str) -> list[dict]:
    """ncu's text report -> one row per profiled launch: kernel, grid, block, each METRICS value (durations
    in ms) found, and the busiest pipe with its utilisation from ncu's pipeline hint. A metric table's
    columns are cut at the dashed rule above its header, so names and units with spaces parse."""
    rows, row, spans = [], None, None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        launch = re.match(r"^  (.+?) \(([\d, ]+)\)x\(([\d, ]+)\), Context", line)
        if launch:   # a C++ kernel's name has spaces: "void halo_fwd_kernel<32, 64>(Geometry, ...)" -> its template
            row = {"kernel": launch.group(1).removeprefix("void ").split("(")[0],
                   "grid": [int(x) for x in launch.group(2).split(",")],
                   "block": [int(x) for x in launch.group(3).split(",")]}
            rows.append(row)
            continue
        if row is None:
            continue
        if re.match(r"^ {4}-+( -+)+\s*$", line):
            if i + 1 < len(lines) and "Metric Name" in lines[i + 1]:
                spans = [m.span() for m in re.finditer(r"-+", line)]
            continue
        pipe = re.search(r"(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", line)
        if pipe and "busiest_pipe" not in row:
            row["busiest_pipe"], row["busiest_pipe_pct"] = pipe.group(1), float(pipe.group(2))
        if spans and len(spans) == 3 and len(line) >= spans[2][0]:
            name, unit = line[:spans[1][0]].strip(), line[spans[1][0]:spans[2][0]].strip()
            value = line[spans[2][0]:].strip()
            key = next((k for k, (m, u) in METRICS.items() if m == name and u in (unit, None)), None)
            if key and re.fullmatch(r"[\d,]+(\.\d+)?", value):
                row[key] = _number(value) * TO_MS[unit] if key == "duration_ms" else _number(value)
    return rows


def find_ncu(configured: str) -> str | None:
    """`configured`, else ncu on PATH, else the newest /opt/nvidia/nsight-compute/*/ncu."""
    if configured:
        return configured
    return shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)),
                                       None)


def profile(cfg: NcuConfig) -> int:
    if not torch.cuda.is_available():
        print("ncu_dsa needs a CUDA GPU", file=sys.stderr)
        return 2
    ncu = find_ncu(cfg.ncu)
    if ncu is None:
        print("ncu_dsa: no ncu found; set ncu=/path/to/ncu", file=sys.stderr)
        return 2
    names = [k for op in cfg.ops for k in KERNELS[op]]
    command = [ncu, "--clock-control", "none", "-k", f"regex:{'|'.join(names)}", "-c", str(cfg.launch_count),
               *[a for s in SECTIONS for a in ("--section", s)], sys.executable, "-m", "experiments.ncu_dsa",
               "child=true", f"ops=[{','.join(cfg.ops)}]", f"shape=[{','.join(map(str, cfg.shape))}]"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    rows = parse_report(done.stdout)
    if done.returncode != 0 or not rows:
        print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
        return 1
    run = ExperimentRun("attention", cfg.name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project)
    payload = {"device": torch.cuda.get_device_name(), "ncu": ncu, "tokens": math.prod(cfg.shape[1:4]),
               "sections": SECTIONS, "launches": rows}
    path = run.finish(payload, {"launches": len(rows)})
    print(f"{'kernel':18s} {'ms':>8s} {'SM %':>6s} {'issue %':>8s} {'L1 %':>6s} {'L2 %':>6s} {'L1 hit':>7s} "
          f"{'regs':>5s} {'occ %':>6s}  busiest pipe")
    for r in rows:
        cells = [f"{r.get(k, float('nan')):{w}.1f}" for k, w in
                 [("sm_throughput_pct", 6), ("issue_slots_busy_pct", 8), ("l1_throughput_pct", 6),
                  ("l2_throughput_pct", 6), ("l1_hit_pct", 7), ("registers", 5), ("achieved_occupancy_pct", 6)]]
        print(f"{r['kernel']:18s} {r.get('duration_ms', float('nan')):8.2f} {' '.join(cells)}  "
              f"{r.get('busiest_pipe', '-')} {r.get('busiest_pipe_pct', '')}")
    print(f"wrote {path}")
    return 0


@script_main("ncu_dsa")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(NcuConfig, hydra_cfg)
    if cfg.child:
        run_kernels(cfg)
        return
    sys.exit(profile(cfg))


if __name__ == "__main__":
    main()
