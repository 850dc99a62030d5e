"""Host-resident state of the offload engine: every persistent byte of the DiT blocks.

Per transformer block l, each a flat (numel,) buffer laid out by `BlockLayout`:
    weights     param dtype (bf16, or fp32 in the exact mode)  pinned  streamed H2D twice a step
    grads       param dtype                                   pinned  D2H target (gradient staging)
    master      fp32                                                  AdamW master weights
    exp_avg     fp32                                                  AdamW first moment
    exp_avg_sq  fp32                                                  AdamW second moment
In the fp32 mode `weights` IS `master` (the master is streamed directly), so the fused CPU
AdamW writes the next step's weights either way: into `weights` through its bf16 output,
or in place. Bytes per parameter: bf16 mode 2 + 2 + 4 + 4 + 4 = 16; fp32 mode 4 + 4 + 4 + 4 = 16.
The sizes are counted in megaslide/perf/host_memory.py, which the planner shares.

All pinned buffers are carved from ONE arena, allocated once: a pageable allocation that
is first touched (zeroed, in parallel) and then page-locked with `cudaHostRegister`. The
caching host allocator (`pin_memory=True`) would round every request up to a power of two
(a 96 GB arena would ask for 128 GB). The optimizer state lives in a second, pageable arena,
unless `pin_optimizer_state` (the optimizer_device="gpu" ablation streams it), in which case
it joins the pinned arena. On a machine without CUDA nothing is pinned.

With activation offload (offload.activation_offload) the block inputs saved for the
backward's recompute are parked in `InputBuffers`: one more arena, of one block input per
parked block, pinned like the first and regrown only when the input grows.

With data parallelism (`Shard`) each rank holds the same buffers for its 1/P shard of every block.

Non-block parameters (patch embed, timestep MLPs, text encoder, caption projection, final
layer) are not here: they are small and the engine keeps them resident on the device.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from megaslide.checkpoint import flat_layout
from megaslide.perf.host_memory import (
    ARENA_ALIGN,
    PARAM_ALIGN,
    arena_bytes,
    arena_sizes,
    host_bytes_per_param,
    round_up,
    shard_numel,
)

FP32 = torch.float32


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter of a block sits in the block's flat buffers."""

    name: str                # e.g. "attn.qkv.weight"
    shape: tuple[int, ...]
    offset: int              # first element

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


class BlockLayout:
    """The flat layout shared by every block (all blocks of a DiT have the same parameters).

    `numel` includes alignment padding, which stays exactly zero: it gets zero gradients,
    and AdamW maps (0, grad 0, moments 0) to 0."""

    def __init__(self, slots: list[ParamSlot], numel: int):
        self.slots = slots
        self.numel = numel

    @classmethod
    def from_module(cls, block: nn.Module) -> BlockLayout:
        """Layout of `block`'s parameters in `named_parameters()` order (works on meta)."""
        return cls.from_record(flat_layout(((name, p.shape) for name, p in block.named_parameters()), PARAM_ALIGN))

    @classmethod
    def from_record(cls, record: dict) -> BlockLayout:
        """The layout a checkpoint records (`megaslide.checkpoint.flat_layout`)."""
        slots = [ParamSlot(name, tuple(shape), offset)
                 for name, shape, offset in zip(record["names"], record["shapes"], record["offsets"])]
        return cls(slots, record["numel"])

    def record(self) -> dict:
        """This layout as plain Python values, the form a sharded checkpoint records it in."""
        return {"names": [s.name for s in self.slots], "shapes": [list(s.shape) for s in self.slots],
                "offsets": [s.offset for s in self.slots], "numel": self.numel}

    @property
    def param_count(self) -> int:
        """Parameters of one block, padding excluded."""
        return sum(s.numel for s in self.slots)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter of a flat (numel,) buffer, shaped like the parameter."""
        return [flat[s.offset:s.end].view(s.shape) for s in self.slots]

    def flatten(self, block: nn.Module) -> torch.Tensor:
        """The block's parameters as one (numel,) fp32 CPU buffer, padding zero."""
        flat = torch.zeros(self.numel, dtype=FP32)
        for view, (_, p) in zip(self.views(flat), block.named_parameters()):
            view.copy_(p.detach())
        return flat

    def mount(self, block: nn.Module, params: list[nn.Parameter]) -> None:
        """Make `block` compute with `params` (views into a device buffer) from now on."""
        for slot, p in zip(self.slots, params):
            module_path, _, leaf = slot.name.rpartition(".")
            module = block.get_submodule(module_path) if module_path else block
            module._parameters[leaf] = p

    def spans(self, used: list[bool]) -> list[tuple[int, int]]:
        """Element ranges covering the parameters flagged in `used`: each run of consecutive
        used parameters is one range (the padding inside it included)."""
        out: list[tuple[int, int]] = []
        previous_used = False
        for slot, u in zip(self.slots, used):
            if u and previous_used:
                out[-1] = (out[-1][0], slot.end)
            elif u:
                out.append((slot.offset, slot.end))
            previous_used = u
        return out


@dataclass(frozen=True)
class Shard:
    """The part of every block's flat buffer that data-parallel rank `rank` of `ranks` holds (ZeRO-3 style):
    elements [start, start + numel) of the block padded with zeros to `padded` = ranks x numel elements
    (`shard_numel`). One rank holds the whole block (`Shard.whole`)."""

    rank: int
    ranks: int
    numel: int

    @classmethod
    def of(cls, block_numel: int, rank: int, ranks: int) -> Shard:
        return cls(rank, ranks, shard_numel(block_numel, ranks))

    @classmethod
    def whole(cls, block_numel: int) -> Shard:
        return cls(0, 1, block_numel)

    @property
    def start(self) -> int:
        return self.rank * self.numel

    @property
    def padded(self) -> int:
        return self.ranks * self.numel

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's (numel,) part of a block's flat (n,) buffer, n <= padded (the padding reads as zero)."""
        part = flat[self.start:self.start + self.numel]
        return torch.cat([part, part.new_zeros(self.numel - len(part))]) if len(part) < self.numel else part

    def spans(self, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Element ranges of the whole block (`BlockLayout.spans`) as ranges of this shard, those that meet it."""
        out = [(max(lo, self.start) - self.start, min(hi, self.start + self.numel) - self.start) for lo, hi in spans]
        return [(lo, hi) for lo, hi in out if lo < hi]


class HostArena:
    """One host allocation, carved into aligned buffers; page-locked when `pin`.

    `sizes` are the byte sizes of the buffers, handed out in order by `take`."""

    def __init__(self, sizes: list[int], pin: bool):
        self.offsets = self.offsets_of(sizes)
        self.nbytes = total = arena_bytes(sizes)
        self.buffer = torch.empty(total, dtype=torch.uint8)  # (nbytes,)
        self.buffer.zero_()  # first touch in parallel: pages are mapped here, not inside cudaHostRegister
        self.pinned = pin and total > 0
        if self.pinned:
            _register(self.buffer)
            self._finalizer = weakref.finalize(self, _unregister, self.buffer)
        self._next = 0

    @staticmethod
    def offsets_of(sizes: list[int]) -> list[int]:
        """Byte offset of each buffer: page aligned, in order."""
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end = round_up(end + size, ARENA_ALIGN)
        return offsets

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = self.offsets[self._next]
        self._next += 1
        size = numel * dtype.itemsize
        return self.buffer[start:start + size].view(dtype)  # (numel,)

    def close(self) -> None:
        """Unpin now (otherwise when the arena is garbage collected)."""
        if self.pinned:
            self._finalizer()
            self.pinned = False


def _register(buffer: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if err != 0:
        gib = buffer.numel() / 2 ** 30
        raise RuntimeError(
            f"could not pin {gib:.1f} GiB of host memory for the offload engine (cudaHostRegister "
            f"error {err}). Usually the locked-memory limit is too low: check `ulimit -l` (set it to "
            f"unlimited, e.g. in /etc/security/limits.conf or docker --ulimit memlock=-1), or use a "
            f"smaller model (the planner, python -m experiments.plan, gives the sizes)")


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class InputBuffers:
    """Host buffers for the block inputs that activation offload parks during a training step
    (offload.activation_offload): `count` buffers of one block input each (batch x tokens x dim
    x dtype), carved from one `HostArena`, page-locked with CUDA like the block state (never the
    caching host allocator). Sized by `reserve` from the first step's input and reallocated
    only when a larger input comes."""

    def __init__(self, count: int, pin: bool):
        self.count, self.pin = count, pin
        self.capacity = 0                       # bytes per buffer
        self.arena = HostArena([], pin)
        self.buffers: list[torch.Tensor] = []   # (capacity,) uint8 each

    def reserve(self, nbytes: int) -> None:
        """Make each buffer hold `nbytes`. Growing replaces the arena (contents are lost; no
        transfer may still use it); a size that fits keeps it."""
        if nbytes <= self.capacity or self.count == 0:
            return
        self.arena.close()
        self.arena = HostArena([nbytes] * self.count, self.pin)
        self.buffers = [self.arena.take(nbytes, torch.uint8) for _ in range(self.count)]
        self.capacity = nbytes

    def view(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Buffer `index` as a tensor of `like`'s shape and dtype."""
        if like.nbytes > self.capacity:
            raise ValueError(f"a block input of {like.nbytes} bytes does not fit the {self.capacity}-byte host "
                             f"buffers; reserve them for the largest input first")
        return self.buffers[index][:like.nbytes].view(like.dtype).view(like.shape)

    @property
    def pinned_bytes(self) -> int:
        return self.arena.nbytes if self.arena.pinned else 0

    def close(self) -> None:
        self.arena.close()


@dataclass
class HostBlock:
    """The host buffers of one block, each (numel,)."""

    weights: torch.Tensor
    grads: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class HostState:
    """Host buffers of all `depth` blocks, or of this rank's `shard` of each (every buffer then holds
    shard.numel elements); see the module docstring for the layout."""

    def __init__(self, layout: BlockLayout, depth: int, param_dtype: torch.dtype, *, pin: bool,
                 pin_optimizer_state: bool = False, input_buffers: int = 0, shard: Shard | None = None):
        if param_dtype not in (torch.bfloat16, FP32):
            raise ValueError(f"param_dtype={param_dtype} is not supported; use torch.bfloat16 or torch.float32")
        self.layout, self.depth, self.param_dtype = layout, depth, param_dtype
        self.shard = shard or Shard.whole(layout.numel)
        n, aliased = self.shard.numel, param_dtype == FP32
        pinned_sizes, pageable_sizes = arena_sizes(n, depth, param_dtype, pin_optimizer_state)
        self.pinned_arena = HostArena(pinned_sizes, pin)
        self.pageable_arena = HostArena(pageable_sizes, False)
        pinned = self.pinned_arena
        state = pinned if pin_optimizer_state else self.pageable_arena
        self.blocks: list[HostBlock] = []
        for _ in range(depth):
            weights, grads = pinned.take(n, param_dtype), pinned.take(n, param_dtype)
            master = weights if aliased else None
            self.blocks.append(HostBlock(weights, grads, master, None, None))
        for block in self.blocks:
            if block.master is None:
                block.master = state.take(n, FP32)
            block.exp_avg, block.exp_avg_sq = state.take(n, FP32), state.take(n, FP32)
        self.loaded = [False] * depth
        self.inputs = InputBuffers(input_buffers, pin)

    # ---- contents ----------------------------------------------------------------------------
    def load_block_(self, index: int, master: torch.Tensor) -> None:
        """Set block `index`'s weights from a (layout.numel,) fp32 flat of the whole block (see
        `BlockLayout.flatten`; this rank's shard of it is kept); moments are reset to zero."""
        b = self.blocks[index]
        b.master.copy_(self.shard.take(master))
        if b.weights is not b.master:
            b.weights.copy_(b.master)  # round to nearest even, as the fused AdamW writes it
        b.exp_avg.zero_()
        b.exp_avg_sq.zero_()
        b.grads.zero_()
        self.loaded[index] = True

    def block_state(self, index: int) -> dict[str, torch.Tensor]:
        """Copies of block `index`'s master weights and moments, this rank's shard (what a checkpoint needs)."""
        b = self.blocks[index]
        return {"master": b.master.clone(), "exp_avg": b.exp_avg.clone(), "exp_avg_sq": b.exp_avg_sq.clone()}

    def load_block_state(self, index: int, state: dict[str, torch.Tensor]) -> None:
        b = self.blocks[index]
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if state[key].shape != (self.shard.numel,):
                raise ValueError(f"checkpoint block {index} {key} has shape {tuple(state[key].shape)}, but this "
                                 f"rank's shards of the model's blocks have {self.shard.numel} elements; load a "
                                 f"checkpoint of the same model config")
        b.master.copy_(state["master"])
        if b.weights is not b.master:
            b.weights.copy_(b.master)
        b.exp_avg.copy_(state["exp_avg"])
        b.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.loaded[index] = True

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes: the block state's pinned arena and the parked block inputs."""
        return (self.pinned_arena.nbytes if self.pinned_arena.pinned else 0) + self.inputs.pinned_bytes

    @property
    def total_bytes(self) -> int:
        return self.pinned_arena.nbytes + self.pageable_arena.nbytes

    def bytes_report(self) -> dict:
        """Bytes per parameter by buffer, and the totals actually allocated."""
        per_param = host_bytes_per_param(self.param_dtype)
        params = self.layout.param_count * self.depth / self.shard.ranks   # this rank's share
        return {"block_params": params, "bytes_per_param": per_param,
                "bytes_per_param_total": sum(per_param.values()),
                "bytes_per_param_allocated": self.total_bytes / params,
                "pinned_bytes": self.pinned_bytes, "total_bytes": self.total_bytes}

    def close(self) -> None:
        """Unpin the arenas now (they are also unpinned when the state is garbage collected)."""
        self.pinned_arena.close()
        self.inputs.close()
