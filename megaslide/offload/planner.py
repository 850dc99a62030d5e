"""Will an offloaded run fit, and how fast can it go? Predicted before anything is allocated.

Its command line is experiments/plan.py (`python -m experiments.plan model=7B check=true`).

Host RAM: the exact bytes of the engine's two arenas (`HostState.arena_sizes`: per block
parameter 16 B, see host_state.py), plus the fp32 model when it is first built on the host
(`build_on_host`, what `Trainer` asks of `OffloadEngine.from_config` for an initialisation
identical to the resident engine's), plus a reserve for the process (torch, CUDA runtime, data).
HBM: two block shells, their flat gradients and autograd's per-parameter gradients of one
block, the resident stem (fp32 weights, gradients, AdamW moments), every block's saved input,
the activations of one block under recomputation (bytes saved per token for backward,
measured on CPU with saved_tensors_hooks: about 65 D + 4 F in bf16 autocast, 104 D + 8 F in
fp32; x1.5 for activation gradients, an estimate), the update slots of the GPU optimizer
ablation, and a reserve for the CUDA context and workspaces. With `resident_blocks=k` the
last k blocks add a shell, a flat gradient and their saved activations each, and skip their
recompute and backward re-stream. Dense attention is assumed to be
flash (O(N) memory); the samples DSA materialises are not modelled.
Step-time floor: max(compute, H2D, D2H, CPU AdamW) from executed FLOPs (model FLOPs plus the
recomputed forward), bytes moved and the ceilings (defaults: HARDWARE.md, 600 TFLOP/s
effective, 50 GB/s PCIe each way, 3.5 Gparam/s CPU AdamW beside PCIe traffic).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaslide.config import DiTConfig
from megaslide.metrics.flops import DiTFlops, dit_flops
from megaslide.metrics.memory import hbm_available_bytes, host_available_bytes
from megaslide.models.dit import DiTBlock, count_params
from megaslide.offload.host_state import BlockLayout, HostArena, HostState, host_bytes_per_param

GB = 1e9
HOST_RESERVE_BYTES = 4 * 2 ** 30   # torch + CUDA runtime + data + Python beside the host state
HBM_RESERVE_BYTES = 2 * 2 ** 30    # CUDA context, cuBLAS/cuDNN workspaces, fragmentation
ACT_BYTES_PER_TOKEN = {torch.bfloat16: (65, 4), torch.float32: (104, 8)}  # (x D, x F), one block
BACKWARD_TRANSIENT = 1.5


@dataclass(frozen=True)
class Ceilings:
    tflops: float = 600.0           # sustained dense bf16 FLOP/s of a DiT step
    h2d_GBps: float = 50.0          # pinned PCIe, each way, while the other way is busy
    d2h_GBps: float = 50.0
    cpu_adam_gparams: float = 3.5   # fused CPU AdamW while PCIe traffic shares host DRAM
    hbm_TBps: float = 4.3           # device memory, for the GPU optimizer ablation


def block_layout(cfg: DiTConfig) -> BlockLayout:
    """The flat layout of one block of `cfg` (built on the meta device, allocates nothing)."""
    with torch.device("meta"):
        return BlockLayout.from_module(DiTBlock(cfg, 0))


def host_bytes(layout: BlockLayout, depth: int, param_dtype: torch.dtype, pin_optimizer_state: bool) -> dict:
    """Bytes of the engine's host arenas: {"pinned": ..., "pageable": ...}."""
    pinned, pageable = HostState.arena_sizes(layout, depth, param_dtype, pin_optimizer_state)
    return {"pinned": HostArena.total_bytes(pinned), "pageable": HostArena.total_bytes(pageable)}


def require_host_fit(arenas: dict, available: int, what: str) -> None:
    """Raise if the arenas plus the process reserve exceed the available host RAM."""
    need = arenas["pinned"] + arenas["pageable"] + HOST_RESERVE_BYTES
    if need > available:
        raise ValueError(f"{what} needs {need / GB:.1f} GB of host RAM ({arenas['pinned'] / GB:.1f} GB pinned + "
                         f"{arenas['pageable'] / GB:.1f} GB pageable + {HOST_RESERVE_BYTES / GB:.1f} GB reserve) but "
                         f"only {available / GB:.1f} GB is available (MemAvailable); use a smaller model (fewer "
                         f"blocks: python -m experiments.plan check=true names the largest depth) or more RAM")


@dataclass
class OffloadPlan:
    cfg: DiTConfig
    batch: int
    grid: tuple[int, int, int]
    param_dtype: torch.dtype
    optimizer_device: str
    grad_clip: bool
    params: int
    block_params: int           # all blocks, padding excluded
    host: dict[str, int]        # bytes by item
    pinned_bytes: int
    hbm: dict[str, int]         # bytes by item
    flops: DiTFlops
    seconds: dict[str, float]   # per step: compute, h2d, d2h, optimizer
    h2d_bytes: int
    d2h_bytes: int
    resident_blocks: int        # last blocks kept on the device through backward (no recompute, no re-stream)
    executed_flops: float       # model FLOPs plus the recomputed forward of the other blocks

    @property
    def tokens(self) -> int:
        return self.batch * math.prod(self.grid)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def hbm_total(self) -> int:
        return sum(self.hbm.values())

    @property
    def floor_s(self) -> float:
        return max(self.seconds.values())

    @property
    def serial_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def bound(self) -> str:
        return max(self.seconds, key=self.seconds.get)

    def as_dict(self) -> dict:
        return {"params": self.params, "block_params": self.block_params, "tokens": self.tokens,
                "param_dtype": str(self.param_dtype), "optimizer_device": self.optimizer_device,
                "host_bytes": self.host, "host_total_bytes": self.host_total, "pinned_bytes": self.pinned_bytes,
                "host_bytes_per_block_param": host_bytes_per_param(self.param_dtype),
                "hbm_bytes": self.hbm, "hbm_total_bytes": self.hbm_total,
                "model_flops_per_step": self.flops.train, "executed_flops_per_step": self.executed_flops,
                "resident_blocks": self.resident_blocks,
                "seconds": self.seconds, "floor_s": self.floor_s, "serial_s": self.serial_s, "bound": self.bound,
                "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes}

    def table(self) -> str:
        c = self.cfg
        lines = [f"model: dim {c.dim}, depth {c.depth}, heads {c.num_heads}, ffn {c.ffn_dim}, attention "
                 f"{c.attention.name}; {self.params / 1e9:.3f} B params ({self.block_params / 1e9:.3f} B in blocks)",
                 f"step: batch {self.batch} x grid {self.grid} = {self.tokens} tokens; {self.param_dtype}; "
                 f"optimizer on {self.optimizer_device}; clipping {'on' if self.grad_clip else 'off'}",
                 "host RAM:"]
        lines += [f"  {k:<44} {v / GB:9.2f} GB" for k, v in self.host.items()]
        lines += [f"  {'total':<44} {self.host_total / GB:9.2f} GB   (pinned {self.pinned_bytes / GB:.2f} GB)", "HBM:"]
        lines += [f"  {k:<44} {v / GB:9.2f} GB" for k, v in self.hbm.items()]
        lines += [f"  {'total':<44} {self.hbm_total / GB:9.2f} GB", "step time (s):"]
        lines += [f"  {k:<44} {v:9.3f}" for k, v in self.seconds.items()]
        lines += [f"  {'floor = max (' + self.bound + ')':<44} {self.floor_s:9.3f}",
                  f"  {'serial = sum':<44} {self.serial_s:9.3f}"]
        return "\n".join(lines)


def plan_offload(cfg: DiTConfig, *, batch: int, grid: tuple[int, int, int], param_dtype: torch.dtype,
                 optimizer_device: str = "cpu", grad_clip: bool = True, pin_optimizer_state: bool | None = None,
                 build_on_host: bool = False, resident_blocks: int = 0,
                 ceilings: Ceilings = Ceilings()) -> OffloadPlan:
    """Host RAM, HBM and step-time floor of one offloaded training step (allocates nothing)."""
    cfg.validate()
    if not 0 <= resident_blocks <= cfg.depth:
        raise ValueError(f"offload.resident_blocks={resident_blocks} must be in [0, {cfg.depth}] (the model's depth)")
    if optimizer_device not in ("cpu", "gpu"):
        raise ValueError(f"optimizer_device={optimizer_device!r}: choose cpu or gpu")
    pin_state = optimizer_device == "gpu" if pin_optimizer_state is None else pin_optimizer_state
    layout = block_layout(cfg)
    n, depth, w = layout.numel, cfg.depth, torch.finfo(param_dtype).bits // 8
    params = count_params(cfg)
    block_params = depth * layout.param_count
    resident = params - block_params
    arenas = host_bytes(layout, depth, param_dtype, pin_state)
    host = {"block state, pinned arena": arenas["pinned"], "block state, pageable arena": arenas["pageable"]}
    if build_on_host:
        host["fp32 model built on the host (transient)"] = params * 4
    host["process reserve"] = HOST_RESERVE_BYTES

    tokens = batch * math.prod(grid)
    per_d, per_f = ACT_BYTES_PER_TOKEN[param_dtype]
    k = resident_blocks
    block_acts = tokens * (per_d * cfg.dim + per_f * cfg.ffn_dim)  # one block's saved activations
    hbm = {f"block shells ({2 + k} x weights)": (2 + k) * n * w,
           f"block gradients ({2 + k} flat + 1 autograd)": (3 + k) * n * w,
           "resident stem (weights, grads, AdamW)": resident * 16,
           "saved block inputs": (depth - k + 1) * tokens * cfg.dim * w,
           "one block's activations (backward)": int(BACKWARD_TRANSIENT * block_acts)}
    if k:
        hbm[f"kept activations of the last {k} blocks"] = k * block_acts
    if optimizer_device == "gpu":
        hbm["GPU optimizer slots (2) + AdamW temporaries"] = 2 * n * (12 + 2 * w) + 8 * n
    hbm["CUDA context and workspaces"] = HBM_RESERVE_BYTES

    flops = dit_flops(cfg, batch, grid)
    weights_bytes = n * w
    grads_to_host = grad_clip or optimizer_device == "cpu"
    # forward + backward; the backward re-streams neither the kept blocks nor the two last streamed ones
    h2d = weights_bytes * (depth + max(0, depth - k - 2))
    d2h = weights_bytes * depth if grads_to_host else 0
    if optimizer_device == "gpu":
        h2d += depth * n * 12 + (depth * weights_bytes if grad_clip else 0)
        d2h += depth * n * (12 + (w if param_dtype != torch.float32 else 0))
        optimizer_s = depth * n * 28 / (ceilings.hbm_TBps * 1e12)
    else:
        optimizer_s = block_params / (ceilings.cpu_adam_gparams * 1e9)
    executed = flops.train + flops.forward * (depth - k) / depth  # blocks dominate the forward; stem ignored
    seconds = {"compute": executed / (ceilings.tflops * 1e12), "h2d": h2d / (ceilings.h2d_GBps * 1e9),
               "d2h": d2h / (ceilings.d2h_GBps * 1e9), "optimizer": optimizer_s}
    pinned = arenas["pinned"]
    return OffloadPlan(cfg, batch, tuple(grid), param_dtype, optimizer_device, grad_clip, params, block_params,
                       host, pinned, hbm, flops, seconds, h2d, d2h, k, executed)


def largest_depth(cfg: DiTConfig, *, host_budget: int, param_dtype: torch.dtype, pin_optimizer_state: bool) -> int:
    """The most blocks of `cfg`'s width whose host state and reserve fit in `host_budget` bytes (0 if none)."""
    layout = block_layout(cfg)
    per_block = host_bytes(layout, 1, param_dtype, pin_optimizer_state)
    per_block_bytes = per_block["pinned"] + per_block["pageable"]
    return max(0, int((host_budget - HOST_RESERVE_BYTES) // per_block_bytes))


def check_fits(plan: OffloadPlan, *, host_available: int, hbm_available: int | None) -> None:
    """Raise ValueError, with the numbers and a fix, when the plan exceeds host RAM or HBM."""
    if plan.host_total > host_available:
        items = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in plan.host.items())
        arenas = plan.host["block state, pinned arena"] + plan.host["block state, pageable arena"]
        others = plan.host_total - arenas - HOST_RESERVE_BYTES   # what the host holds besides arenas and reserve
        depth = largest_depth(plan.cfg, host_budget=host_available - others, param_dtype=plan.param_dtype,
                              pin_optimizer_state=False)
        raise ValueError(f"the model does not fit host RAM: it needs {plan.host_total / GB:.1f} GB ({items}; "
                         f"{plan.params / 1e9:.2f} B params) but {host_available / GB:.1f} GB is available "
                         f"(MemAvailable). Use at most model.depth={depth} at this width, a smaller preset, or a "
                         f"machine with more RAM")
    if hbm_available is not None and plan.hbm_total > hbm_available:
        items = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in plan.hbm.items())
        raise ValueError(f"the step does not fit device memory: it needs {plan.hbm_total / GB:.1f} GB of HBM "
                         f"({items}) but {hbm_available / GB:.1f} GB is available. Use fewer tokens per step "
                         f"(batch, frames, resolution), or raise offload.gpu_memory_fraction")


def require_fit(plan: OffloadPlan, device: torch.device, gpu_memory_fraction: float = 0.0) -> None:
    """`check_fits` against this machine: MemAvailable and the device's free memory (under the cap)."""
    check_fits(plan, host_available=host_available_bytes(),
               hbm_available=hbm_available_bytes(device, gpu_memory_fraction))
