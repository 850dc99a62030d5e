"""Host RAM of the offload engine, byte for byte: the one accounting that the engine allocates by
(megaslide/offload/host_state.py carves its arenas with `arena_sizes`) and the planner plans with.

Per block parameter the host holds (`host_bytes_per_param`, by `StateFormat`) weights and gradients in the
streamed dtype, master weights (the weights themselves when the master has their dtype) and the two AdamW
moments: 16 bytes with the default fp32 master and moments (bf16 weights and gradients 2 + 2, master 4,
moments 4 + 4; or fp32 weights = master 4, gradients 4, moments 4 + 4). The compact options
(offload.master_dtype=bf16: the bf16 weights are the master, updated with stochastic rounding;
offload.moments=int8: one byte per moment plus an fp32 scale per `MOMENT_BLOCK` elements) bring bf16 weights
to 2 + 2 + 4 + 4 = 12 (bf16 master), 2 + 2 + 4 + 2 x 1.0625 = 10.125 (int8 moments) or 6.125 (both).
Each block's buffers are flat, every parameter starting on a `PARAM_ALIGN`-element boundary
(`block_layout` gives the length); each buffer of an arena starts on a page (`ARENA_ALIGN`).
Activation offload parks `stream_schedule.parked_inputs` block inputs beside them, and `HOST_RESERVE_BYTES`
is kept for the rest of the process.

Sharded over P data-parallel ranks (ZeRO-3 style), each rank's arenas hold `shard_numel` elements of every block
(the flat block padded to P equal shards), so host bytes per rank fall by P; the ranks on one node
(`ranks_per_node`, torchrun's local world size) share its RAM, each with its own reserve.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaslide.checkpoint import flat_layout
from megaslide.config import DiTConfig, OffloadConfig
from megaslide.device import PRECISIONS
from megaslide.models.dit import DiTBlock

GB = 1e9
PARAM_ALIGN = 64                   # elements: each parameter starts on a 64-element boundary of its block buffer
ARENA_ALIGN = 4096                 # bytes: each buffer of an arena starts on a page
HOST_RESERVE_BYTES = 4 * 2 ** 30   # torch + CUDA runtime + data + Python beside the host state
MOMENT_BLOCK = 64                  # elements per scale of an int8 moment; divides PARAM_ALIGN (see below)
assert PARAM_ALIGN % MOMENT_BLOCK == 0  # every parameter starts a quantisation block: updates cover whole ones


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class BlockSize:
    """The size of one block's flat buffers: `numel` elements (alignment padding included) holding
    `param_count` parameters."""

    numel: int
    param_count: int


def block_layout(cfg: DiTConfig) -> BlockSize:
    """The flat size of one block of `cfg`, as the engine lays it out (built on the meta device, allocates
    nothing)."""
    with torch.device("meta"):
        block = DiTBlock(cfg, 0)
    record = flat_layout(((name, p.shape) for name, p in block.named_parameters()), PARAM_ALIGN)
    return BlockSize(record["numel"], sum(math.prod(shape) for shape in record["shapes"]))


@dataclass(frozen=True)
class Buffer:
    """One flat host buffer of a block: `numel` elements of `dtype`."""

    name: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def shard_numel(numel: int, ranks: int) -> int:
    """Elements of a block's flat buffer that each of `ranks` ranks holds: an equal share, rounded up to
    `PARAM_ALIGN` (the flat block is padded with zeros to `ranks` such shards; one rank: `numel` itself). A
    multiple of `MOMENT_BLOCK` too (it divides PARAM_ALIGN), so every shard holds whole quantisation blocks of an
    int8 moment and the ranks' parts join into the one process's buffer exactly."""
    return round_up(-(-numel // ranks), PARAM_ALIGN)


@dataclass(frozen=True)
class StateFormat:
    """How the engine stores a block's state: weights and gradients in `param_dtype` (streamed), master weights
    in `master_dtype` (the weights are the master when the dtypes agree), AdamW moments as `moments` (fp32, or
    int8: codes plus one fp32 scale per MOMENT_BLOCK elements)."""

    param_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32
    moments: str = "fp32"

    @classmethod
    def of(cls, param_dtype: torch.dtype, offload: OffloadConfig) -> StateFormat:
        """The format offload.master_dtype and offload.moments ask for, with weights in `param_dtype`."""
        return cls(param_dtype, PRECISIONS[offload.master_dtype], offload.moments)

    @property
    def aliased(self) -> bool:
        """Whether the streamed weights are the master weights (one buffer)."""
        return self.param_dtype == self.master_dtype

    @property
    def compact(self) -> bool:
        return self.master_dtype != torch.float32 or self.moments != "fp32"

    def pinned_buffers(self, numel: int) -> list[Buffer]:
        """A block's page-locked buffers, in carving order: what streams H2D and D2H."""
        return [Buffer("weights", numel, self.param_dtype), Buffer("grads", numel, self.param_dtype)]

    def state_buffers(self, numel: int) -> list[Buffer]:
        """A block's optimizer state, in carving order: the master (unless it is the weights) and the moments."""
        master = [] if self.aliased else [Buffer("master", numel, self.master_dtype)]
        if self.moments == "fp32":
            return [*master, Buffer("exp_avg", numel, torch.float32), Buffer("exp_avg_sq", numel, torch.float32)]
        blocks = math.ceil(numel / MOMENT_BLOCK)
        return [*master, *(b for moment in ("exp_avg", "exp_avg_sq")
                           for b in (Buffer(f"{moment}.codes", numel, torch.uint8),
                                     Buffer(f"{moment}.scales", blocks, torch.float32)))]


def host_bytes_per_param(fmt: StateFormat) -> dict[str, float]:
    """Persistent host bytes per block parameter, by buffer (padding aside); scales per MOMENT_BLOCK elements."""
    names = {"weights": f"weights ({fmt.param_dtype})" + (" = master" if fmt.aliased else ""),
             "grads": f"grads ({fmt.param_dtype})", "master": f"master ({fmt.master_dtype})"}
    per_param = {names.get(b.name, b.name): b.nbytes / MOMENT_BLOCK
                 for b in fmt.pinned_buffers(MOMENT_BLOCK) + fmt.state_buffers(MOMENT_BLOCK)}
    return {name: int(v) if float(v).is_integer() else v for name, v in per_param.items()}


def arena_sizes(numel: int, depth: int, fmt: StateFormat, pin_optimizer_state: bool) -> tuple[list[int], list[int]]:
    """Byte sizes of the buffers of the pinned and the pageable arena of `depth` blocks of `numel` elements,
    in carving order: every block's `pinned_buffers`, then every block's `state_buffers` (pageable, or pinned
    too with `pin_optimizer_state`)."""
    pinned = [b.nbytes for b in fmt.pinned_buffers(numel)] * depth
    state = [b.nbytes for b in fmt.state_buffers(numel)] * depth
    return (pinned + state, []) if pin_optimizer_state else (pinned, state)


def arena_bytes(sizes: list[int]) -> int:
    """Bytes of one arena holding buffers of byte sizes `sizes`, each starting on a page."""
    return sum(round_up(size, ARENA_ALIGN) for size in sizes)


def host_bytes(numel: int, depth: int, fmt: StateFormat, pin_optimizer_state: bool) -> dict:
    """Bytes of the engine's host arenas for `depth` blocks of `numel` elements: {"pinned": ..., "pageable": ...}."""
    pinned, pageable = arena_sizes(numel, depth, fmt, pin_optimizer_state)
    return {"pinned": arena_bytes(pinned), "pageable": arena_bytes(pageable)}


def require_host_fit(arenas: dict, available: int, what: str, *, ranks: int = 1,
                     ranks_per_node: int = 1) -> None:
    """Raise if `ranks_per_node` processes' arenas (`host_bytes`, one rank's share of `ranks`) plus their process
    reserves exceed the node's available host RAM."""
    need = ranks_per_node * (arenas["pinned"] + arenas["pageable"] + HOST_RESERVE_BYTES)
    if need > available:
        rank = (f"{arenas['pinned'] / GB:.1f} GB pinned + {arenas['pageable'] / GB:.1f} GB pageable + "
                f"{HOST_RESERVE_BYTES / GB:.1f} GB reserve")
        parts = f"{ranks_per_node} ranks x ({rank})" if ranks_per_node > 1 else rank
        fix = (f"raise parallel.dp (now {ranks}) over more nodes: each rank holds 1/parallel.dp of the state"
               if ranks > 1 else "shard it over the data-parallel ranks of several nodes (parallel.dp)")
        raise ValueError(f"{what} needs {need / GB:.1f} GB of host RAM ({parts}) but only {available / GB:.1f} GB "
                         f"is available (MemAvailable); use a smaller model (fewer blocks: python -m experiments.plan "
                         f"check=true names the largest depth), more RAM, or {fix}")
