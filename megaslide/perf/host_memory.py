"""Host RAM of the offload engine, byte for byte: the one accounting that the engine allocates by
(megaslide/offload/host_state.py carves its arenas with `arena_sizes`) and the planner plans with.

Per block parameter the host holds 16 bytes (`host_bytes_per_param`): bf16 weights and gradients
plus fp32 master and AdamW moments, or in the fp32 mode weights (= master), gradients and moments.
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
from megaslide.config import DiTConfig
from megaslide.models.dit import DiTBlock

GB = 1e9
PARAM_ALIGN = 64                   # elements: each parameter starts on a 64-element boundary of its block buffer
ARENA_ALIGN = 4096                 # bytes: each buffer of an arena starts on a page
HOST_RESERVE_BYTES = 4 * 2 ** 30   # torch + CUDA runtime + data + Python beside the host state


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


def shard_numel(numel: int, ranks: int) -> int:
    """Elements of a block's flat buffer that each of `ranks` ranks holds: an equal share, rounded up to
    `PARAM_ALIGN` (the flat block is padded with zeros to `ranks` such shards; one rank: `numel` itself)."""
    return round_up(-(-numel // ranks), PARAM_ALIGN)


def host_bytes_per_param(param_dtype: torch.dtype) -> dict[str, int]:
    """Persistent host bytes per block parameter, by buffer (padding aside)."""
    w = torch.finfo(param_dtype).bits // 8
    if param_dtype == torch.float32:
        return {"weights = master (fp32)": 4, "grads (fp32)": 4, "exp_avg": 4, "exp_avg_sq": 4}
    return {f"weights ({param_dtype})": w, f"grads ({param_dtype})": w, "master (fp32)": 4,
            "exp_avg": 4, "exp_avg_sq": 4}


def arena_sizes(numel: int, depth: int, param_dtype: torch.dtype,
                pin_optimizer_state: bool) -> tuple[list[int], list[int]]:
    """Byte sizes of the buffers of the pinned and the pageable arena of `depth` blocks of `numel` elements,
    in carving order: weights (= master in fp32) and grads pinned; [master], exp_avg, exp_avg_sq pageable,
    or pinned too with `pin_optimizer_state`."""
    w = torch.finfo(param_dtype).bits // 8
    pinned = [numel * w, numel * w] * depth
    state = [numel * 4] * ((2 if param_dtype == torch.float32 else 3) * depth)
    return (pinned + state, []) if pin_optimizer_state else (pinned, state)


def arena_bytes(sizes: list[int]) -> int:
    """Bytes of one arena holding buffers of byte sizes `sizes`, each starting on a page."""
    return sum(round_up(size, ARENA_ALIGN) for size in sizes)


def host_bytes(numel: int, depth: int, param_dtype: torch.dtype, pin_optimizer_state: bool) -> dict:
    """Bytes of the engine's host arenas for `depth` blocks of `numel` elements: {"pinned": ..., "pageable": ...}."""
    pinned, pageable = arena_sizes(numel, depth, param_dtype, pin_optimizer_state)
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
