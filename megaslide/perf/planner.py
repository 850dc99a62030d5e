"""Will a training run fit, and how fast can it go? Predicted before anything is allocated.

Its command line is experiments/plan.py, which plans the `RunConfig` that train.py's overrides make
(`python -m experiments.plan model=7B model.in_channels=3 offload=engine check=true`); a table of cells
plans each with `grid_run`.

Host RAM (offload engine): the exact bytes of the engine's arenas (per block parameter 16 B with fp32 master
and moments, 6.125 B with offload.master_dtype=bf16 and offload.moments=int8; megaslide/perf/host_memory.py,
by which the engine allocates them), the block inputs that activation
offload parks there (`parked_inputs`), the fp32 model when it is first built on the host (`build_on_host`,
what `Trainer` asks of `OffloadEngine.from_config`), and a reserve for the process.

HBM: the peak of `torch.cuda.max_memory_allocated`, phase by phase (forward, loss, backward,
optimizer), from the shapes. One block's activations come from
megaslide/perf/activation_memory.py (what each op saves, the variant's share from its
`attend_memory`, token chunking); around them the engine holds, at the peak of its backward
(the second block it recomputes: the first one's parameter gradients are still referenced):
- the block shells (weights and flat gradients), the stem (fp32 weights and AdamW moments;
  its gradients exist only after the blocks' backward), the clip tensors and RoPE tables;
- the saved block inputs still on the device (all the streamed ones; with activation offload
  two, plus the stem's output, which the stem's backward keeps; with offload.boundary_stride = k
  `inputs_on_device`'s: a segment's k, and without activation offload the boundaries before it),
  the last block's output, the engine's dL/d(output) and the current one, and a resident tail's
  inputs and outputs;
- the previous block's parameter gradients and the current block's so far.
- with offload.keep_attention, the kept attention outputs and lse on the device (megaslide/perf/kept_attention.py
  places them within the budgets left beside the rest of the step; `plan_offload`'s `budgets`).
Checked against H200 peaks of the offload engine at the 7B width (dim 4096, ffn 16384, 32
heads), bf16, batch 1: DSA 3x3x3, 4 blocks, 65,536 tokens: 34.2 GB predicted, 34.9 measured;
131,072 tokens: 62.6 GB vs 63.4; dense, 20 blocks, 32,768 tokens: 22.6 GB vs 23.2. The fit
check keeps `HBM_MARGIN` of the free memory for the caching allocator's fragmentation.
The resident trainer (`plan_resident`: fp32 weights, gradients and AdamW moments on the device,
bf16 autocast, per-block checkpointing) is planned with the same block model.

Step time, two figures kept apart:
- the lower bound (`OffloadPlan.lower_bound`, `compute_lower_bound_s`), from ceilings only: every executed
  FLOP (attention's counted ones and DSA's offset net included) at the matmul ceiling, the bytes each PCIe
  direction moves at its ceiling, and the GPU optimizer's bytes at the HBM ceiling; no fitted constant, and
  nothing for the CPU AdamW (no ceiling of it is measured). A step cannot run faster at those ceilings;
- the estimate (`OffloadPlan.estimate_s`, `seconds`), below: it uses figures fitted to measured steps
  (`FITTED`), so a measured step may beat it or lag it. Its error on the committed H200 steps it was not
  fitted on is computed by experiments/planner_error.py (results/README.md, claim C3).

Step-time estimate: max(compute, H2D, D2H, CPU AdamW) from executed FLOPs, bytes moved (weights, gradients,
parked block inputs; a boundary stride's re-run blocks count one more forward and weight H2D each) and the
ceilings (defaults: HARDWARE.md, 600 TFLOP/s effective, 50 GB/s PCIe each way, 3.5 Gparam/s CPU AdamW beside
PCIe traffic). Compute (`compute_seconds`) has three terms, run one after the other on one stream:
- attention: every block's `attend` (the variant's token mixing, DSA's offset net included) at the
  variant's own rate (`AttentionRate`), forward and backward apart: DSA's gathers and its backward's
  key-tile binning run far below the matmul ceiling. Its forward runs in the streamed forward and again in
  the recompute, its backward once;
- matmul: all other executed FLOPs at the matmul ceiling: model FLOPs (forward + 2x forward for the
  backward), the recomputed forward, and with chunking the slices' token-wise forward once more (the offload
  engine's streamed blocks, whose gradient is `BlockRunner.block_grad`: only the pre-attention slices' QKV
  projection, and no slab re-run).
- elementwise: norms, RoPE, modulation, activations, residual adds, casts and the slices' copies are
  memory-bound: `FITTED.elementwise_bytes` of HBM traffic per token and width element per block pass (a
  forward, or a third of a backward) at the HBM ceiling, a figure fitted on measured steps (`FITTED`
  names them); a compiled step (train.compile) moves `FITTED.elementwise_bytes_compiled`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from megaslide.config import (
    DataConfig,
    DiTConfig,
    ExecutionConfig,
    OffloadConfig,
    ParallelConfig,
    SLAB_AUTO,
    RunConfig,
    TrainConfig,
)
from megaslide.models.chunking import frame_slabs
from megaslide.models.dit import count_params
from megaslide.perf.activation_memory import ActivationDtypes, BlockMemory, block_memory
from megaslide.perf.flops import DiTFlops, dit_flops, keys_per_query
from megaslide.perf.kept_attention import KeptAttentionPlan, kept_block_bytes, place_kept_attention
from megaslide.perf.host_memory import (
    HOST_RESERVE_BYTES,
    StateFormat,
    block_layout,
    host_bytes,
    host_bytes_per_param,
    shard_numel,
)
from megaslide.perf.memory import hbm_available_bytes, host_available_bytes
from megaslide.perf.slab_choice import choose_slab_frames
from megaslide.perf.stream_schedule import backward_ops, inputs_on_device, parked_inputs, weight_loads

GB = 1e9
HBM_MARGIN = 0.05                  # share of the free HBM left to the caching allocator's fragmentation


@dataclass(frozen=True)
class AttentionRate:
    """How fast a self-attention variant's `attend` runs, in TFLOP/s of its counted FLOPs (QK^T and PV:
    4 x keys x D per query, as megaslide/perf/flops.py counts them; the backward counted as 2x the
    forward), forward and backward apart: time per counted FLOP, whatever `attend` does besides (DSA:
    trilinear gathers, the backward's binning). `includes_own_weights`: the rate was measured on the
    whole `attend`, the variant's own weights (DSA's offset net) included, so the matmul term leaves
    their FLOPs out."""

    forward_tflops: float
    backward_tflops: float
    includes_own_weights: bool = True


@dataclass(frozen=True)
class ResultCell:
    """One cell of a committed result: `file` under results/ and the fields that pick the cell out of its
    table (oom_thresholds: tables.cells; attention: tables.target; mfu_overlap: variants)."""

    file: str
    fields: tuple[tuple[str, object], ...]

    def matches(self, file: str, cell: dict) -> bool:
        return file == self.file and all(cell.get(k) == v for k, v in self.fields)


@dataclass(frozen=True)
class FittedConstants:
    """The figures the step-time estimate takes from measurements, each beside the committed cells it comes
    from (so the estimate's error is reported on the other cells only: experiments/planner_error.py).

    `elementwise_bytes`: HBM bytes the memory-bound work of one block moves per token and width element in
    one pass, fitted as (step - matmul - attention) x HBM ceiling / (tokens x dim x depth x passes) on
    `elementwise_fitted_on`, the matmul and attention terms as its run planned them (4 passes: forward,
    recompute, 2 for the backward); tests/perf/test_planner.py re-derives it from that cell.
    `elementwise_bytes_compiled`: the same figure for a compiled step (train.compile: torch.compile fuses the
    token-wise work, so it moves fewer bytes), fitted so that today's estimate of `elementwise_compiled_fitted_on`
    equals its measured step; tests/experiments/test_planner_error.py checks that.
    `dsa_rate`: the fused DSA op alone (bf16, 3x3x3, 16 heads x 64, 262,144 tokens), counted FLOPs over the
    forward's time and over fwd+bwd less the forward, from `dsa_rate_measured_on`. Its offset net is not in
    it: a rate measured on `attend` (experiments/oom_thresholds.py) is lower."""

    elementwise_bytes: float
    elementwise_fitted_on: tuple[ResultCell, ...]
    elementwise_bytes_compiled: float
    elementwise_compiled_fitted_on: tuple[ResultCell, ...]
    dsa_rate: AttentionRate
    dsa_rate_measured_on: tuple[ResultCell, ...]

    @property
    def step_cells(self) -> tuple[ResultCell, ...]:
        """The measured training steps a figure was fitted on (the DSA rate's cells are kernel timings)."""
        return self.elementwise_fitted_on + self.elementwise_compiled_fitted_on


FITTED = FittedConstants(
    elementwise_bytes=660.0,
    elementwise_fitted_on=(ResultCell("oom_thresholds/h200_headline_256.json", (
        ("model", "1B"), ("attention", "dense"), ("mode", "chunked_offload"), ("frames", 16))),),
    elementwise_bytes_compiled=208.0,
    elementwise_compiled_fitted_on=(ResultCell("oom_thresholds/h200_dsa32_token_slices.json", (
        ("model", "1B"), ("attention", "dsa"), ("mode", "chunked_offload"), ("frames", 32))),),
    dsa_rate=AttentionRate(1.47, 0.93, includes_own_weights=False),
    dsa_rate_measured_on=(ResultCell("attention/h200_kernels_v7.json", (("variant", "dsa_fused_fwd"),)),
                          ResultCell("attention/h200_kernels_v7.json", (("variant", "dsa_fused"),))))

# dsa_zero runs kernels of its own (no offsets): no default, so it is bounded at the matmul ceiling.
DEFAULT_ATTENTION_RATES = {"dsa": FITTED.dsa_rate}


@dataclass(frozen=True)
class Ceilings:
    tflops: float = 600.0           # sustained dense bf16 FLOP/s of a DiT step
    h2d_GBps: float = 50.0          # pinned PCIe, each way, while the other way is busy
    d2h_GBps: float = 50.0
    cpu_adam_gparams: float = 3.5   # fused CPU AdamW while PCIe traffic shares host DRAM
    hbm_TBps: float = 4.3           # device memory (copy, read + write): GPU optimizer, elementwise work
    collective_GBps: float = 150.0  # data parallel: NCCL all-gather / reduce-scatter bus bandwidth per GPU
    attention: AttentionRate | None = None  # the model's `attend`; None: DEFAULT_ATTENTION_RATES, else `tflops`

    def __post_init__(self) -> None:
        for name in ("tflops", "h2d_GBps", "d2h_GBps", "cpu_adam_gparams", "hbm_TBps"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"ceilings.{name}={value} must be a finite number > 0 (a rate the step time is "
                                 f"divided by); leave it null for the planner's default {getattr(Ceilings, name)}")

    def attention_rate(self, name: str) -> AttentionRate:
        """The rate of attention variant `name`: the measured one, its default, or the matmul ceiling."""
        return (self.attention or DEFAULT_ATTENTION_RATES.get(name)
                or AttentionRate(self.tflops, self.tflops, includes_own_weights=False))


def compute_seconds(cfg: DiTConfig, batch: int, grid: tuple[int, int, int], *, recomputed: int,
                    ceilings: Ceilings, backward: bool = True, execution: ExecutionConfig | None = None,
                    block_grads: int = 0, kept: int = 0, compiled: bool = False) -> tuple[float, dict[str, float]]:
    """The estimated compute of one training step of `batch` clips of token grid `grid` in which
    `recomputed` blocks run their forward twice (the offload engine's streamed blocks, the resident
    trainer's checkpointed ones), or without `backward` of one forward pass (no grad: nothing re-runs):
    (executed FLOPs, {"matmul": s, "attention": s, "elementwise": s}); the estimate is their sum (see the
    module docstring).

    Blocks dominate (the stem's forward is counted once per pass). Every block's forward runs once,
    plus once more if recomputed, plus once more with several slabs (`slab_frames`: each slab re-runs
    in the backward); its backward counts 2x its forward. A chunked block (`chunk_tokens` or
    `slab_frames`) re-runs its token-wise slices in the backward: every weight's forward once more.
    Slabs read their halo frames too: the QKV projection and `attend` run over `halo` x the tokens.
    `execution` (default: whole) says how the blocks run. `block_grads` of the recomputed blocks (the offload
    engine's streamed ones) get their gradient from `BlockRunner.block_grad`: chunked, their recompute is its
    slab pass, they have no slab re-run, and of their slices only the pre-attention ones (the QKV projection
    over the slab and its halo) run once more. `kept` of the recomputed blocks keep their attention output and
    lse (offload.keep_attention): their recompute runs no attention forward (its counted FLOPs), the offset net
    still. `compiled` (train.compile) takes the compiled steps' elementwise figure."""
    execution = execution or ExecutionConfig()
    flops = dit_flops(cfg, batch, grid)
    tokens, depth, a, D = batch * math.prod(grid), cfg.depth, cfg.attention, cfg.dim
    reach = a.variant.temporal_reach(a.options) if execution.slab_frames else None
    slabs = frame_slabs(grid[0], execution.slab_frames, reach)
    halo = sum(b - t for t, _, _, b in slabs) / grid[0]          # frames read per frame kept
    chunked = bool(execution.chunk_tokens or execution.slab_frames)
    by_slab = block_grads / depth if chunked else 0.0             # share of blocks whose gradient is block_grad
    forwards = 1 + (recomputed / depth + (len(slabs) > 1) * (1 - by_slab) if backward else 0)  # a block's forwards
    passes = forwards + 2 * backward                              # counting the backward as 2 forwards
    counted = 4.0 * tokens * keys_per_query(a, grid) * D * depth  # attend's forward, counted
    own = 2.0 * tokens * a.variant.extra_macs_per_token(a.options, D, cfg.num_heads) * depth
    qkv = 2.0 * tokens * 3 * D * D * depth
    rerun = (flops.weights + (halo - 1) * qkv) * (1 - by_slab) + halo * qkv * by_slab  # the slices' re-run
    skipped = halo * counted * kept / depth if backward else 0.0  # the kept blocks' attention forwards not re-run
    executed = (flops.forward * passes + rerun * (backward and chunked)
                + (halo - 1) * (qkv + counted + own) * passes) - skipped
    rate = ceilings.attention_rate(a.name)
    in_attend = halo * (counted + (own if rate.includes_own_weights else 0))
    attention = (halo * (counted * forwards / (rate.forward_tflops * 1e12)
                         + 2 * backward * counted / (rate.backward_tflops * 1e12))
                 - skipped / (rate.forward_tflops * 1e12))
    matmul = (executed + skipped - in_attend * passes) / (ceilings.tflops * 1e12)
    elementwise = elementwise_seconds(cfg, tokens, passes, ceilings, compiled=compiled)
    return executed, {"matmul": matmul, "attention": attention, "elementwise": elementwise}


def compute_lower_bound_s(cfg: DiTConfig, batch: int, grid: tuple[int, int, int], *, recomputed: int,
                          ceilings: Ceilings, backward: bool = True, execution: ExecutionConfig | None = None) -> float:
    """A lower bound on the compute of the step `compute_seconds` describes: its executed FLOPs, attention's
    included, at the matmul ceiling (no fitted constant, no variant's own rate)."""
    executed, _ = compute_seconds(cfg, batch, grid, recomputed=recomputed, ceilings=ceilings, backward=backward,
                                  execution=execution)
    return executed / (ceilings.tflops * 1e12)


def elementwise_seconds(cfg: DiTConfig, tokens: int, passes: float, ceilings: Ceilings, *,
                        compiled: bool = False) -> float:
    """The memory-bound work of `passes` passes of every block over `tokens` tokens at the HBM ceiling, eager or
    `compiled` (train.compile)."""
    per_element = FITTED.elementwise_bytes_compiled if compiled else FITTED.elementwise_bytes
    return per_element * tokens * cfg.dim * cfg.depth * passes / (ceilings.hbm_TBps * 1e12)


def phase_over(phases: dict[str, int], budget: int) -> str | None:
    """The first phase, in the order of a step, whose HBM exceeds `budget` bytes (None: all fit)."""
    return next((name for name, need in phases.items() if need > budget), None)


def _clip_and_rope(cfg: DiTConfig, batch: int, grid: tuple[int, int, int], act: int) -> int:
    """Bytes of a step's clip tensors (x0, noise, x_t in fp32, the patch embedding's input in the
    compute dtype) and RoPE tables (cos, sin: fp32, head_dim / 2 per token each)."""
    tokens = math.prod(grid)
    patch_values = cfg.in_channels * math.prod(cfg.patch_size)
    return batch * tokens * patch_values * (3 * 4 + act) + tokens * cfg.head_dim * 4


def _final_layer(cfg: DiTConfig, tokens: int, dtypes: ActivationDtypes, chunk: int) -> int:
    """The final layer at the peak of its backward (the modulation's): LayerNorm's fp32 input copy (of
    a bf16 input) and output, and the fp32 gradients of the modulation's output and input; with
    `chunk` tokens per slice (execution.chunk_tokens), those of one slice, beside a slice's input gradient
    made full size to be summed in."""
    per_token = (4 if dtypes.autocast and dtypes.residual < 4 else 0) + 4 + 8
    if not chunk or tokens <= chunk:
        return tokens * cfg.dim * per_token
    return chunk * cfg.dim * per_token + tokens * cfg.dim * dtypes.residual


def _block_items(memory: BlockMemory, which: str) -> dict[str, int]:
    return {f"block ({memory.moment}): {k}": v for k, v in getattr(memory, which).items()}


class PhasedHBM:
    """What both plans say of a step's HBM: `hbm_phases` (peak bytes of each phase, in the order
    of a step) and `hbm` (bytes by item at the peak), for `batch` clips of token grid `grid`."""

    @property
    def tokens(self) -> int:
        return self.batch * math.prod(self.grid)

    @property
    def hbm_total(self) -> int:
        return max(self.hbm_phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.hbm_phases, key=self.hbm_phases.get)

    def hbm_lines(self) -> list[str]:
        """The HBM part of a plan's table: each phase's peak, and the items at the peak."""
        lines = ["HBM: by phase " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in self.hbm_phases.items()),
                 f"  at the peak ({self.peak_phase}):"]
        lines += [f"  {k:<72} {v / GB:9.2f} GB" for k, v in self.hbm.items()]
        return [*lines, f"  {'total (peak of max_memory_allocated)':<72} {self.hbm_total / GB:9.2f} GB"]


@dataclass
class OffloadPlan(PhasedHBM):
    cfg: DiTConfig
    batch: int
    grid: tuple[int, int, int]
    state_format: StateFormat   # the host buffers' dtypes: streamed weights, master, moments
    optimizer_device: str
    grad_clip: bool
    params: int
    block_params: int           # all blocks, padding excluded
    host: dict[str, int]        # bytes by item
    pinned_bytes: int
    hbm: dict[str, int]         # bytes by item, at the peak phase
    hbm_phases: dict[str, int]  # peak bytes of each phase of a step, in its order
    flops: DiTFlops
    seconds: dict[str, float]   # per step: compute, h2d, d2h, optimizer
    h2d_bytes: int
    d2h_bytes: int
    resident_blocks: int        # last blocks kept on the device through backward (no recompute, no re-stream)
    activation_offload: bool    # saved block inputs parked in pinned host RAM
    executed_flops: float       # model FLOPs plus the recomputed forward of the other blocks
    execution: ExecutionConfig  # how the blocks run
    ceilings: Ceilings = Ceilings()  # the rates both step-time figures assume
    boundary_stride: int = 1    # block inputs kept every k blocks; the backward re-runs the others' forward
    kept: KeptAttentionPlan = KeptAttentionPlan("off")  # where each block's attention output and lse are kept
    ranks: int = 1              # ranks sharing the host state (parallel.dp x parallel.sp): the figures are one rank's
    ranks_per_node: int = 1     # of them on one node, sharing its host RAM
    sp: int = 1                 # sequence-parallel ranks per replica (parallel.sp)

    @property
    def ranks_key(self) -> str:
        return ParallelConfig(dp=self.ranks // self.sp, sp=self.sp).ranks_key

    @property
    def param_dtype(self) -> torch.dtype:
        return self.state_format.param_dtype

    @property
    def host_total(self) -> int:
        """Host bytes of one rank."""
        return sum(self.host.values())

    @property
    def host_bytes_per_param(self) -> float:
        """Persistent host bytes per block parameter (the arenas' buffers, padding aside)."""
        return sum(host_bytes_per_param(self.state_format).values())

    @property
    def node_host_total(self) -> int:
        """Host bytes of one node: its ranks' together."""
        return self.ranks_per_node * self.host_total

    @property
    def lower_bound(self) -> dict[str, float]:
        """Seconds per step no resource can beat at the ceilings (module docstring): executed FLOPs at the
        matmul ceiling, each PCIe direction's bytes, and (GPU optimizer) its HBM traffic."""
        bound = {"compute": self.executed_flops / (self.ceilings.tflops * 1e12), "h2d": self.seconds["h2d"],
                 "d2h": self.seconds["d2h"]}
        return {**bound, "optimizer": self.seconds["optimizer"]} if self.optimizer_device == "gpu" else bound

    @property
    def lower_bound_s(self) -> float:
        return max(self.lower_bound.values())

    @property
    def estimate_s(self) -> float:
        """The step-time estimate (module docstring): the slowest of compute, PCIe each way and the optimizer."""
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
                "activation_offload": self.activation_offload, "chunk_tokens": self.execution.chunk_tokens,
                "slab_frames": self.execution.slab_frames,
                "host_bytes": self.host, "host_total_bytes": self.host_total, "pinned_bytes": self.pinned_bytes,
                "master_dtype": str(self.state_format.master_dtype), "moments": self.state_format.moments,
                "host_bytes_per_block_param": host_bytes_per_param(self.state_format),
                "host_bytes_per_block_param_total": self.host_bytes_per_param,
                "hbm_bytes": self.hbm, "hbm_phase_bytes": self.hbm_phases, "hbm_total_bytes": self.hbm_total,
                "hbm_peak_phase": self.peak_phase,
                "model_flops_per_step": self.flops.train, "executed_flops_per_step": self.executed_flops,
                "resident_blocks": self.resident_blocks, "boundary_stride": self.boundary_stride,
                "seconds": self.seconds, "estimate_s": self.estimate_s, "serial_s": self.serial_s, "bound": self.bound,
                "lower_bound_seconds": self.lower_bound, "lower_bound_s": self.lower_bound_s,
                "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "kept_attention": self.kept.as_dict(),
                "ranks": self.ranks, "ranks_per_node": self.ranks_per_node,
                "node_host_total_bytes": self.node_host_total}

    def table(self) -> str:
        c = self.cfg
        model = (f"model: dim {c.dim}, depth {c.depth}, heads {c.num_heads}, ffn {c.ffn_dim}, attention "
                 f"{c.attention.name}; {self.params / 1e9:.3f} B params ({self.block_params / 1e9:.3f} B in blocks)")
        step = (f"step: batch {self.batch} x grid {self.grid} = {self.tokens} tokens; {self.param_dtype}; "
                f"optimizer on {self.optimizer_device}; clipping {'on' if self.grad_clip else 'off'}; chunk "
                f"{self.execution.chunk_tokens or 'off'}; slabs {self.execution.slab_frames or 'off'}; "
                f"activation offload {'on' if self.activation_offload else 'off'}; "
                f"boundary stride {self.boundary_stride}")
        fmt = self.state_format
        per_param = ", ".join(f"{k} {v:g}" for k, v in host_bytes_per_param(fmt).items())
        ranks = (f"{self.ranks} ranks ({self.ranks_per_node} per node), each a 1/{self.ranks} shard of the block "
                 f"state; batch, clip, host RAM, HBM and step time are one rank's")
        lines = [model, step, self.kept.line(), *([ranks] if self.ranks > 1 else []),
                 f"host RAM{' per rank' if self.ranks > 1 else ''}: {self.host_bytes_per_param:g} bytes per block "
                 f"parameter (master {fmt.master_dtype}, moments {fmt.moments}: {per_param})"]
        lines += [f"  {k:<72} {v / GB:9.2f} GB" for k, v in self.host.items()]
        lines += [f"  {'total':<72} {self.host_total / GB:9.2f} GB   (pinned {self.pinned_bytes / GB:.2f} GB)"]
        if self.ranks > 1:
            lines += [f"  {f'per node ({self.ranks_per_node} ranks)':<72} {self.node_host_total / GB:9.2f} GB"]
        lines += [
                  *self.hbm_lines(), "step time, fitted estimate (s):"]
        lines += [f"  {k:<72} {v:9.3f}" for k, v in self.seconds.items()]
        lines += [f"  {'estimate = max (' + self.bound + ')':<72} {self.estimate_s:9.3f}",
                  f"  {'serial = sum':<72} {self.serial_s:9.3f}",
                  "step time, lower bound from ceilings only (s):"]
        lines += [f"  {k:<72} {v:9.3f}" for k, v in self.lower_bound.items()]
        lines += [f"  {'lower bound = max':<72} {self.lower_bound_s:9.3f}"]
        return "\n".join(lines)


def _offload_hbm(cfg: DiTConfig, batch: int, grid: tuple[int, int, int], dtypes: ActivationDtypes, n: int,
                 resident: int, k: int, activation_offload: bool, optimizer_device: str,
                 execution: ExecutionConfig, stride: int = 1) -> dict[str, dict[str, int]]:
    """Device bytes by item for each phase of an offloaded step (see the module docstring)."""
    tokens = batch * math.prod(grid)
    w, D, depth = dtypes.residual, cfg.dim, cfg.depth
    x = tokens * D * w                                        # one (B, N, D) block input / output / gradient
    memory = block_memory(cfg, tokens, dtypes, grid[0], execution)
    streamed = depth - k
    fixed = {f"block shells ({2 + k}): weights and flat gradients": 2 * (2 + k) * n * w,
             "resident stem: fp32 weights, AdamW moments": 12 * resident,
             "clip tensors, RoPE tables": _clip_and_rope(cfg, batch, grid, dtypes.act)}
    if optimizer_device == "gpu":
        # two slots of master, moments, gradient and weights; the update's fp32 gradient, sqrt and quotient
        # (without clipping an update runs during the backward)
        fixed["GPU optimizer slots (2) + AdamW temporaries"] = 2 * n * (12 + 2 * w) + (12 if w < 4 else 8) * n
    parks = activation_offload and parked_inputs(depth, k, stride) > 0
    # inputs on the device after the forward (`inputs_on_device`: with activation offload the last segment's
    # and the boundary before it; else every kept one, the first being the stem's output), and with activation
    # offload the stem's output (parked as block 0's input, but the stem's backward keeps it)
    after, segment, _ = inputs_on_device(depth, k, stride, parks)
    kept_inputs = after + parks
    saved = {f"saved block inputs on the device ({kept_inputs})": kept_inputs * x}
    tail = {"resident tail: kept graphs, input": k * memory.kept_total + x} if k else {}
    # the peak block's own parameter gradients so far: fc2's in an unchunked MLP backward, none in a
    # recomputed forward, (about) all of them in a chunked block's backward
    own = {"MLP backward": cfg.ffn_dim * D * w, "forward end": 0, "attention forward": 0}.get(memory.moment, n * w)
    block = {"this block's parameter gradients so far": own, **_block_items(memory, "peak")}
    previous = k > 0 or streamed >= 2                        # the peak block has a block before it in backward
    # the peak block: the second in the backward (without a tail it has one input fewer than after the
    # forward), or the first of a segment that was re-run (`segment`: its inputs, beside earlier boundaries)
    peak_inputs = (max(after - (not k), segment) if previous else after) + parks
    outputs = {f"resident tail: input and outputs ({k + 1})": (k + 1) * x} if k else {"last block output": x}
    # the forward's peak: a streamed block's forward, or the end of the tail's (its graphs all kept)
    forward = tail if sum(tail.values()) > memory.forward_total else _block_items(memory, "forward")
    last = {"dL/d(last output)": x} if k else {"last block output and its gradient": 2 * x}
    phases = {"forward": {**fixed, **saved, **forward},
              "loss": {**fixed, **saved, **tail, **last,
                       "final layer and its backward": _final_layer(cfg, tokens, dtypes, execution.chunk_tokens)},
              "backward": {**fixed, f"saved block inputs on the device ({peak_inputs})": peak_inputs * x, **outputs,
                           "dL/d(last output), this block's output gradient": (2 if previous else 1) * x,
                           "previous block's parameter gradients": n * w if previous else 0, **block}}
    if k:
        phases["backward, resident tail"] = {**fixed, **saved, "dL/d(last output)": x,
                                             "resident tail: the other kept graphs, input":
                                                 (k - 1) * memory.kept_total + x, **block}
    phases["optimizer"] = {**fixed, "stem gradients and AdamW temporaries": 8 * resident,
                           "stem output, last block output and their gradients": 4 * x}
    return {name: {item: v for item, v in items.items() if v} for name, items in phases.items()}


def grid_run(model: DiTConfig, grid: tuple[int, int, int], *, batch: int = 1, grad_clip: float = 1.0,
             execution: ExecutionConfig | None = None, offload: OffloadConfig | None = None,
             parallel: ParallelConfig | None = None) -> RunConfig:
    """The `RunConfig` of training steps of `batch` clips (the global batch) of token grid `grid` (T', H', W'), for
    a table of cells planned without a data set: its data is the clip that patchifies to `grid`; `offload`
    defaults to the engine with its defaults, `parallel` to one process."""
    pt, ph, pw = model.patch_size
    data = DataConfig(frames=grid[0] * pt, height=grid[1] * ph, width=grid[2] * pw)
    return RunConfig(model, execution or ExecutionConfig(), data, TrainConfig(batch_size=batch, grad_clip=grad_clip),
                     offload or OffloadConfig(enabled=True), parallel or ParallelConfig())


def rank_grid(run: RunConfig) -> tuple[int, int, int]:
    """The token grid one rank's blocks run over: the clip's, or under sequence parallelism (parallel.sp = S) with
    an attention over nearby frames of bounded reach the largest rank's frames (ceil(T' / S)) with that reach of
    halo on each side. Other attentions plan the whole clip (conservative: only their attention spans it)."""
    T, H, W = run.grid
    a = run.model.attention
    reach = a.variant.temporal_reach(a.options)
    if run.parallel.sp == 1 or a.variant.sp_form != "frames" or reach is None:
        return run.grid
    return min(T, -(-T // run.parallel.sp) + 2 * reach), H, W


@dataclass(frozen=True)
class Budgets:
    """What a step may use: `hbm` free device bytes (before the engine allocates), `host` available host bytes,
    on a device of type `device_type`. The kept attention (offload.keep_attention) is placed within them."""

    hbm: int
    host: int
    device_type: str = "cuda"


def plan_offload(run: RunConfig, *, param_dtype: torch.dtype, ceilings: Ceilings = Ceilings(),
                 pin_optimizer_state: bool | None = None, build_on_host: bool = False,
                 block_grad: bool = True, budgets: Budgets | None = None,
                 ranks_per_node: int | None = None) -> OffloadPlan:
    """Host RAM, HBM and step time (lower bound, estimate) of one training step of `run` on the offload engine
    (allocates nothing): its model, how its blocks run, its offload settings (optimizer_device, resident_blocks,
    activation_offload), train.batch_size clips of its data's token grid, and clipping (train.grad_clip > 0).
    `param_dtype`: the streamed block weights' (the run's precision on its device); `build_on_host`: the
    fp32 model is first built in host RAM; `pin_optimizer_state`: default, pinned for the GPU optimizer;
    `block_grad`: the streamed blocks take their gradient from `BlockRunner.block_grad` (the engine's backward
    since it has one; False plans the engine before it, as steps measured then ran). With offload.keep_attention
    on or auto the plan places the kept attention (`OffloadPlan.kept`, megaslide/perf/kept_attention.py) within
    `budgets` beside the rest of the step, and counts it: its HBM, pinned host RAM, PCIe bytes and the attention
    forwards it saves. With execution.slab_frames=auto it first takes the fewest frame slabs whose step fits
    `budgets.hbm` (megaslide/perf/slab_choice.py: before the kept attention, which takes what is left);
    `OffloadPlan.execution` holds the size chosen.

    Several ranks (run.parallel.dp x run.parallel.sp = P): one rank's step, on its replica's batch share
    (train.batch_size / parallel.dp) and, sequence parallel, its part of each clip (`rank_grid`), its 1/P shard of
    the block state (host bytes, H2D and D2H bytes, CPU AdamW work fall by P), plus the all-gather of every block
    load and the reduce-scatter of every block gradient at `Ceilings.collective_GBps` (each moves (P-1)/P of the
    block): the engine issues them on the H2D and the D2H lane, after and before the shard's copy, so they add
    to those lanes' seconds and overlap compute as the copies do. `ranks_per_node` (default: all P on one node) share a
    node's host RAM (`node_host_total`, what `check_fits` compares with the node). The kept attention is one rank's
    activation state, of its batch share, whatever the sharding of the weights."""
    if run.execution.slab_frames == SLAB_AUTO:
        if budgets is None:
            raise ValueError(f"execution.slab_frames={SLAB_AUTO}: the plan takes the fewest slabs whose step fits the "
                             f"HBM budget; pass budgets= (experiments/plan.py: hbm_budget_GB)")
        again = functools.partial(plan_offload, param_dtype=param_dtype, ceilings=ceilings,
                                  pin_optimizer_state=pin_optimizer_state, build_on_host=build_on_host,
                                  block_grad=block_grad, budgets=budgets, ranks_per_node=ranks_per_node)
        run = choose_slab_frames(run, lambda r: again(r).hbm_total <= usable_hbm(budgets.hbm))
    cfg, execution, offload = run.model, run.execution, run.offload
    ranks = run.parallel.dp * run.parallel.sp
    ranks_per_node = ranks if ranks_per_node is None else ranks_per_node
    if not 1 <= ranks_per_node <= ranks:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be in [1, {run.parallel.ranks_key}]")
    batch, grid, grad_clip = run.train.batch_size // run.parallel.dp, rank_grid(run), run.train.grad_clip > 0
    optimizer_device, resident_blocks, activation_offload = (offload.optimizer_device, offload.resident_blocks,
                                                             offload.activation_offload)
    cfg.validate()
    execution.validate(cfg.attention)
    offload.validate()
    if not 0 <= resident_blocks <= cfg.depth:
        raise ValueError(f"offload.resident_blocks={resident_blocks} must be in [0, {cfg.depth}] (the model's depth)")
    pin_state = optimizer_device == "gpu" if pin_optimizer_state is None else pin_optimizer_state
    fmt = StateFormat.of(param_dtype, offload)
    layout = block_layout(cfg)
    n, depth, w = layout.numel, cfg.depth, torch.finfo(param_dtype).bits // 8
    shard = shard_numel(n, ranks)                  # elements of every block this rank's host holds
    params = count_params(cfg)
    block_params = depth * layout.param_count
    resident = params - block_params
    tokens = batch * math.prod(grid)
    k = resident_blocks
    stride = offload.boundary_stride
    parked = parked_inputs(depth, k, stride) if activation_offload else 0
    input_bytes = tokens * cfg.dim * w
    arenas = host_bytes(shard, depth, fmt, pin_state)
    host = {"block state, pinned arena": arenas["pinned"], "block state, pageable arena": arenas["pageable"]}
    if parked:
        host[f"parked block inputs, pinned ({parked} x {input_bytes / GB:.2f} GB)"] = parked * input_bytes
    if build_on_host:
        host["fp32 model built on the host (transient)"] = params * 4
    host["process reserve"] = HOST_RESERVE_BYTES

    dtypes = ActivationDtypes(act=w, residual=w)   # bf16 shells run under bf16 autocast; fp32 ones without
    phases = _offload_hbm(cfg, batch, grid, dtypes, n, resident, k, activation_offload, optimizer_device, execution,
                          stride)
    kept = _place_kept(run, batch, phases, host, budgets, dtypes.act, ranks_per_node)
    if kept.host:
        host[f"kept attention, pinned ({len(kept.host)} x {kept.block_bytes / GB:.2f} GB)"] = kept.host_bytes
        host["process reserve"] = host.pop("process reserve")
    hbm_phases = {name: sum(items.values()) for name, items in phases.items()}

    flops = dit_flops(cfg, batch, grid)
    weights_bytes = shard * w                      # one block's H2D (this rank's shard of it)
    grads_to_host = grad_clip or optimizer_device == "cpu"
    # forward + backward (`weight_loads`): the backward re-streams neither the kept blocks nor what the shells
    # still hold; with a boundary stride it re-streams the re-run blocks of each segment but the last
    loads = weight_loads(depth, k, stride)
    h2d = weights_bytes * loads + parked * input_bytes + kept.host_bytes
    d2h = (weights_bytes * depth if grads_to_host else 0) + parked * input_bytes + kept.host_bytes
    if optimizer_device == "gpu":
        h2d += depth * n * 12 + (depth * weights_bytes if grad_clip else 0)
        d2h += depth * n * (12 + (w if param_dtype != torch.float32 else 0))
        optimizer_s = depth * n * 28 / (ceilings.hbm_TBps * 1e12)
    else:
        optimizer_s = block_params / ranks / (ceilings.cpu_adam_gparams * 1e9)
    reruns = sum(not grad for _, grad in backward_ops(depth - k, stride))  # forwards re-run without grad
    executed, compute = compute_seconds(cfg, batch, grid, recomputed=depth - k + reruns, ceilings=ceilings,
                                        execution=execution, block_grads=depth - k if block_grad else 0,
                                        kept=len(kept.gpu) + len(kept.host), compiled=run.train.compile)
    seconds = {"compute": sum(compute.values()), "h2d": h2d / (ceilings.h2d_GBps * 1e9),
               "d2h": d2h / (ceilings.d2h_GBps * 1e9), "optimizer": optimizer_s}
    if ranks > 1:   # after each load's H2D its all-gather, before each gradient's D2H its reduce-scatter, on the lane
        block_moved = (ranks - 1) * shard * w        # each moves (P-1)/P of the padded block per rank
        seconds["h2d"] += block_moved * loads / (ceilings.collective_GBps * 1e9)
        seconds["d2h"] += block_moved * depth / (ceilings.collective_GBps * 1e9)
    pinned = arenas["pinned"] + parked * input_bytes + kept.host_bytes
    peak = max(hbm_phases, key=hbm_phases.get)
    return OffloadPlan(cfg, batch, tuple(grid), fmt, optimizer_device, grad_clip, params, block_params,
                       host, pinned, phases[peak], hbm_phases, flops, seconds, h2d, d2h, k, activation_offload,
                       executed, execution, ceilings, stride, kept, ranks, ranks_per_node, run.parallel.sp)


def _place_kept(run: RunConfig, batch: int, phases: dict[str, dict[str, int]], host: dict[str, int],
                budgets: Budgets | None, act: int, ranks_per_node: int) -> KeptAttentionPlan:
    """The kept attention of `run` (offload.keep_attention) for one rank's `batch` clips, placed within what
    `budgets` leave beside the step's peak HBM (`phases`) and this rank's host RAM (`host`; the node's host budget
    is shared by its `ranks_per_node` ranks); its device bytes are added to `phases`: in the forward and the
    backward the most kept blocks on the device at once (`KeptAttentionPlan.device_blocks`), in between all the
    device-kept ones, and with several slabs one slab's replayed output and lse in the backward."""
    cfg, offload, execution = run.model, run.offload, run.execution
    a, streamed, tokens = cfg.attention, cfg.depth - offload.resident_blocks, batch * math.prod(run.grid)
    block_bytes = kept_block_bytes(cfg, tokens, act)
    if offload.keep_attention == "off":
        return place_kept_attention("off", streamed, block_bytes, hbm_free=0, host_free=0)
    if budgets is None:
        raise ValueError(f"offload.keep_attention={offload.keep_attention}: the plan places the kept attention within "
                         f"HBM and host budgets; pass budgets= (experiments/plan.py: hbm_budget_GB, host_budget_GB)")
    base = max(sum(items.values()) for items in phases.values())
    kept = place_kept_attention(offload.keep_attention, streamed, block_bytes,
                                hbm_free=usable_hbm(budgets.hbm) - base,
                                host_free=budgets.host // ranks_per_node - sum(host.values()),
                                unable=a.variant.keep_reason(a.options, budgets.device_type))
    slabs = frame_slabs(run.grid[0], execution.slab_frames,
                        a.variant.temporal_reach(a.options) if execution.slab_frames else None)
    slab = max(b - t for t, _, _, b in slabs) * batch * run.grid[1] * run.grid[2]
    replay = kept_block_bytes(cfg, slab, act) if len(slabs) > 1 and (kept.gpu or kept.host) else 0
    passing = f"kept attention on the device (at most {kept.device_blocks} blocks: output + lse)"
    between = f"kept attention on the device ({len(kept.gpu)} blocks: output + lse)"
    for name, items in phases.items():
        if name in ("forward", "backward"):
            items[passing] = kept.device_blocks * block_bytes
        elif name != "optimizer":
            items[between] = kept.gpu_bytes
        if name == "backward":
            items["kept attention: a slab's replayed output + lse"] = replay
        phases[name] = {item: v for item, v in items.items() if v}
    return kept


@dataclass
class ResidentPlan(PhasedHBM):
    """HBM of the resident trainer's step (megaslide/train/resident.py) with per-block checkpointing."""

    cfg: DiTConfig
    batch: int
    grid: tuple[int, int, int]
    params: int
    hbm: dict[str, int]         # bytes by item, at the peak phase
    hbm_phases: dict[str, int]  # peak bytes of each phase of a step (from the second on), in its order
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)   # how the blocks run (its slabs)

    def as_dict(self) -> dict:
        return {"params": self.params, "tokens": self.tokens, "slab_frames": self.execution.slab_frames,
                "hbm_bytes": self.hbm,
                "hbm_phase_bytes": self.hbm_phases, "hbm_total_bytes": self.hbm_total,
                "hbm_peak_phase": self.peak_phase}

    def table(self) -> str:
        c = self.cfg
        head = (f"resident trainer: dim {c.dim}, depth {c.depth}, heads {c.num_heads}, ffn {c.ffn_dim}, attention "
                f"{c.attention.name}; {self.params / 1e9:.3f} B params; batch {self.batch} x grid {self.grid} = "
                f"{self.tokens} tokens; slabs {self.execution.slab_frames or 'off'}")
        return "\n".join([head, *self.hbm_lines()])


def plan_resident(run: RunConfig, *, autocast: bool = True) -> ResidentPlan:
    """HBM of a steady-state step of the resident trainer on `run` (one data-parallel rank's share of
    train.batch_size clips of its data's token grid) with checkpoint_blocks, its blocks otherwise run as
    run.execution says (allocates nothing).

    fp32 weights, gradients and AdamW moments of every parameter stay on the device. Under bf16
    autocast the forward caches a bf16 copy of every weight until it ends (the recompute casts one
    block's again), the fp32 gates make the residual stream fp32, and the previous step's
    gradients live until `zero_grad`, which comes after the forward. The optimizer step adds
    foreach AdamW's temporary (sqrt of the second moment) for every parameter."""
    cfg, execution, batch, grid = run.model, run.execution, run.train.batch_size // run.parallel.dp, rank_grid(run)
    cfg.validate()
    execution.validate(cfg.attention)
    if execution.slab_frames == SLAB_AUTO:
        raise ValueError(f"execution.slab_frames={SLAB_AUTO}: plan the run from `resident_slabs` (the slab size it "
                         f"chooses within an HBM budget), or give a number of frames")
    params = count_params(cfg)
    block = block_layout(cfg).param_count
    tokens = batch * math.prod(grid)
    dtypes = ActivationDtypes(act=2 if autocast else 4, residual=4)
    memory = block_memory(cfg, tokens, dtypes, grid[0], execution)
    x = tokens * cfg.dim * 4
    cast = 2 if autocast else 0
    state = {"fp32 weights and AdamW moments": 12 * params,
             "clip tensors, RoPE tables": _clip_and_rope(cfg, batch, grid, dtypes.act)}
    inputs = f"checkpointed block inputs ({cfg.depth})"
    last_block = {**state, inputs: cfg.depth * x, "dL/d(output)": x, "recomputed block's bf16 weights": cast * block,
                  **_block_items(memory, "peak")}
    first_block = {**state, "gradients of the later blocks": 4 * (cfg.depth - 1) * block,
                   "block input, dL/d(output), dL/d(input)": 3 * x, "recomputed block's bf16 weights": cast * block,
                   **_block_items(memory, "peak")}
    phases = {"forward": {**state, "previous step's gradients": 4 * params, "bf16 weight cache (autocast)":
                          cast * params, inputs: cfg.depth * x, **_block_items(memory, "forward")},
              "backward": max(last_block, first_block, key=lambda items: sum(items.values())),
              "optimizer": {**state, "gradients": 4 * params, "AdamW temporaries (foreach)": 4 * params}}
    phases = {name: {k: v for k, v in items.items() if v} for name, items in phases.items()}
    totals = {name: sum(items.values()) for name, items in phases.items()}
    return ResidentPlan(cfg, batch, tuple(grid), params, phases[max(totals, key=totals.get)], totals, execution)


def resident_slabs(run: RunConfig, hbm_budget: int, *, autocast: bool) -> RunConfig:
    """`run` with execution.slab_frames=auto resolved for the resident trainer (megaslide/perf/slab_choice.py):
    the fewest slabs whose `plan_resident` peak fits `usable_hbm(hbm_budget)` (free bytes of the device; on the
    CPU, of host RAM); `run` itself for any other value."""
    return choose_slab_frames(run, lambda r: plan_resident(r, autocast=autocast).hbm_total <= usable_hbm(hbm_budget))


def largest_depth(cfg: DiTConfig, *, host_budget: int, state_format: StateFormat, pin_optimizer_state: bool) -> int:
    """The most blocks of `cfg`'s width whose host state (in `state_format`) and reserve fit in `host_budget` bytes
    (0 if none)."""
    layout = block_layout(cfg)
    per_block = host_bytes(layout.numel, 1, state_format, pin_optimizer_state)
    per_block_bytes = per_block["pinned"] + per_block["pageable"]
    return max(0, int((host_budget - HOST_RESERVE_BYTES) // per_block_bytes))


def usable_hbm(available: int) -> int:
    """Free HBM less the `HBM_MARGIN` kept for the caching allocator's fragmentation."""
    return int(available * (1 - HBM_MARGIN))


def check_fits(plan: OffloadPlan | ResidentPlan, *, host_available: int, hbm_available: int | None) -> None:
    """Raise ValueError, with the numbers and a fix, when the plan exceeds host RAM (the offload engine's
    host state) or HBM."""
    if isinstance(plan, OffloadPlan) and plan.node_host_total > host_available:
        items = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in plan.host.items())
        arenas = plan.host["block state, pinned arena"] + plan.host["block state, pageable arena"]
        others = plan.host_total - arenas - HOST_RESERVE_BYTES   # what the host holds besides arenas and reserve
        depth = largest_depth(plan.cfg, host_budget=host_available - others, state_format=plan.state_format,
                              pin_optimizer_state=False)
        fix = (f"Use at most model.depth={depth} at this width, a smaller preset, a shorter clip (parked block "
               f"inputs grow with it), or a machine with more RAM" if depth > 0 else
               f"Not even one block of this width (model.dim={plan.cfg.dim}) fits: use a smaller preset or "
               f"model.dim, a shorter clip (parked block inputs grow with it), or a machine with more RAM")
        if plan.ranks > 1:
            need = (f"{plan.ranks_key} with {plan.ranks_per_node} ranks on a node needs "
                    f"{plan.node_host_total / GB:.1f} GB there, {plan.host_total / GB:.1f} GB per rank ({items})")
            fix = ("Spread parallel.dp over more nodes (fewer ranks per node) or raise it: each rank holds "
                   "1/parallel.dp of the block state; or use a smaller model")
        else:
            need = f"it needs {plan.host_total / GB:.1f} GB ({items}"
            need += f"; {plan.params / 1e9:.2f} B params, {plan.tokens} tokens per step)"
        raise ValueError(f"the model does not fit host RAM: {need} but {host_available / GB:.1f} GB is available "
                         f"(MemAvailable). {fix}")
    if hbm_available is not None and plan.hbm_total > usable_hbm(hbm_available):
        items = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in plan.hbm.items())
        raise ValueError(f"the step does not fit device memory: its {plan.peak_phase} needs "
                         f"{plan.hbm_total / GB:.1f} GB of HBM ({items}) but {hbm_available / GB:.1f} GB is free, "
                         f"{usable_hbm(hbm_available) / GB:.1f} GB usable ({HBM_MARGIN:.0%} kept for the allocator). "
                         f"Use fewer tokens per step (batch, frames, resolution), execution.chunk_tokens, "
                         f"offload.activation_offload, or raise offload.gpu_memory_fraction")


def require_cpu_fit(plan: ResidentPlan) -> None:
    """A resident step on the CPU: its "device" memory is host RAM, where an overshoot ends in the kernel's OOM kill
    without a word, so a step the plan puts past MemAvailable is refused first. The plan assumes per-block
    checkpoints; a run without them holds more than it counts."""
    available = host_available_bytes()
    if plan.hbm_total > available:
        items = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in plan.hbm.items())
        raise ValueError(f"the step does not fit this machine's RAM: on the CPU its {plan.peak_phase} needs at least "
                         f"{plan.hbm_total / GB:.1f} GB ({items}) but {available / GB:.1f} GB is available "
                         f"(MemAvailable). Use fewer tokens per step (train.batch_size, data.frames, data.height, "
                         f"data.width), a smaller model, or train.device=cuda")


def require_fit(plan: OffloadPlan | ResidentPlan, device: torch.device, gpu_memory_fraction: float = 0.0) -> None:
    """`check_fits` against this machine: MemAvailable and the device's free memory (under the cap)."""
    check_fits(plan, host_available=host_available_bytes(),
               hbm_available=hbm_available_bytes(device, gpu_memory_fraction))
