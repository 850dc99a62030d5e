"""Host-resident state of the offload engine: every persistent byte of the DiT blocks.

Per transformer block l, each a flat (numel,) buffer laid out by `BlockLayout`, in the dtypes of a
`StateFormat` (offload.master_dtype, offload.moments):
    weights     param dtype (bf16, or fp32 in the exact mode)  pinned  streamed H2D twice a step
    grads       param dtype                                   pinned  D2H target (gradient staging)
    master      fp32 (or bf16)                                        AdamW master weights
    exp_avg     fp32 (or 8-bit: QuantizedMoment)                      AdamW first moment
    exp_avg_sq  fp32 (or 8-bit, its square root)                      AdamW second moment
When the master has the weights' dtype (fp32 mode; or bf16 master with bf16 weights) `weights` IS
`master` (the master is streamed directly), so the fused CPU AdamW writes the next step's weights
either way: into `weights` through its bf16 output, or in place (a bf16 master with fp32 weights, the
CPU exact mode, is copied into them after the update). Bytes per parameter: bf16 mode 2 + 2 + 4 + 4 + 4
= 16; fp32 mode 4 + 4 + 4 + 4 = 16; the compact formats down to 2 + 2 + 2 x (1 + 4 / 64) = 6.125. The
sizes are counted in megaslide/perf/host_memory.py, which the planner shares, and carved in its order.

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
from megaslide.offload.compact import SIGNED, SQRT, QuantizedMoment
from megaslide.perf.host_memory import (
    ARENA_ALIGN,
    MOMENT_BLOCK,
    PARAM_ALIGN,
    StateFormat,
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

    def take_state(self, value: torch.Tensor | dict) -> torch.Tensor | dict:
        """This rank's part of a whole block's checkpointed buffer (`read_block`): a flat tensor, or an 8-bit
        moment's {"codes", "scales"} (the scales of this shard's whole quantisation blocks)."""
        if not isinstance(value, dict):
            return self.take(value)
        scales = Shard(self.rank, self.ranks, self.numel // MOMENT_BLOCK)
        return {"codes": self.take(value["codes"]), "scales": scales.take(value["scales"])}

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
    """The host buffers of one block, each (numel,); `master` may be `weights` itself."""

    weights: torch.Tensor
    grads: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor | QuantizedMoment
    exp_avg_sq: torch.Tensor | QuantizedMoment

    @classmethod
    def of(cls, buffers: dict[str, torch.Tensor]) -> HostBlock:
        """A block from its buffers by `StateFormat` name (weights, grads, [master], moments or their
        codes and scales)."""
        def moment(name: str, kind: str):
            if name in buffers:
                return buffers[name]
            return QuantizedMoment(buffers[f"{name}.codes"], buffers[f"{name}.scales"], kind)
        return cls(buffers["weights"], buffers["grads"], buffers.get("master", buffers["weights"]),
                   moment("exp_avg", SIGNED), moment("exp_avg_sq", SQRT))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every distinct buffer by `StateFormat` name (the master only when it is not the weights)."""
        out = {"weights": self.weights, "grads": self.grads}
        if self.master is not self.weights:
            out["master"] = self.master
        for name in ("exp_avg", "exp_avg_sq"):
            moment = getattr(self, name)
            if isinstance(moment, QuantizedMoment):
                out.update({f"{name}.codes": moment.codes, f"{name}.scales": moment.scales})
            else:
                out[name] = moment
        return out


class HostState:
    """Host buffers of all `depth` blocks in format `fmt`, or of this rank's `shard` of each (every buffer then
    holds shard.numel elements); see the module docstring for the layout."""

    def __init__(self, layout: BlockLayout, depth: int, fmt: StateFormat, *, pin: bool,
                 pin_optimizer_state: bool = False, input_buffers: int = 0, shard: Shard | None = None):
        if fmt.param_dtype not in (torch.bfloat16, FP32):
            raise ValueError(f"param_dtype={fmt.param_dtype} is not supported; use torch.bfloat16 or torch.float32")
        self.layout, self.depth, self.fmt, self.param_dtype = layout, depth, fmt, fmt.param_dtype
        self.shard = shard or Shard.whole(layout.numel)
        n = self.shard.numel
        pinned_sizes, pageable_sizes = arena_sizes(n, depth, fmt, pin_optimizer_state)
        self.pinned_arena = HostArena(pinned_sizes, pin)
        self.pageable_arena = HostArena(pageable_sizes, False)
        state = self.pinned_arena if pin_optimizer_state else self.pageable_arena
        # carved in arena_sizes' order: every block's pinned buffers, then every block's state
        pinned = [{b.name: self.pinned_arena.take(b.numel, b.dtype) for b in fmt.pinned_buffers(n)}
                  for _ in range(depth)]
        states = [{b.name: state.take(b.numel, b.dtype) for b in fmt.state_buffers(n)} for _ in range(depth)]
        self.blocks = [HostBlock.of({**p, **s}) for p, s in zip(pinned, states)]
        self.loaded = [False] * depth
        self.inputs = InputBuffers(input_buffers, pin)

    # ---- contents ----------------------------------------------------------------------------
    def load_block_(self, index: int, master: torch.Tensor) -> None:
        """Set block `index`'s weights from a (layout.numel,) fp32 flat of the whole block (see
        `BlockLayout.flatten`; this rank's shard of it is kept), rounded to nearest even into a bf16 master;
        moments are reset to zero."""
        b = self.blocks[index]
        b.master.copy_(self.shard.take(master))
        if b.weights is not b.master:
            b.weights.copy_(b.master)  # round to nearest even, as the fused AdamW writes it (or widen exactly)
        b.exp_avg.zero_()
        b.exp_avg_sq.zero_()
        b.grads.zero_()
        self.loaded[index] = True

    def block_state(self, index: int) -> dict:
        """Copies of block `index`'s master weights and moments, this rank's shard (what a checkpoint needs); an
        8-bit moment as {"codes", "scales"}."""
        b = self.blocks[index]
        return {"master": b.master.clone(),
                **{k: m.state() if isinstance(m, QuantizedMoment) else m.clone()
                   for k, m in (("exp_avg", b.exp_avg), ("exp_avg_sq", b.exp_avg_sq))}}

    def load_block_state(self, index: int, state: dict) -> None:
        b = self.blocks[index]
        master = state["master"]
        if master.shape != (self.shard.numel,):
            raise ValueError(f"checkpoint block {index} master has shape {tuple(master.shape)}, but this "
                             f"rank's shards of the model's blocks have {self.shard.numel} elements; load a "
                             f"checkpoint of the same model config")
        if master.dtype != b.master.dtype:
            raise ValueError(f"checkpoint block {index} holds {master.dtype} master weights, but this run keeps "
                             f"{b.master.dtype} ones; resume with offload.master_dtype="
                             f"{'bf16' if master.dtype == torch.bfloat16 else 'fp32'}")
        for key in ("exp_avg", "exp_avg_sq"):
            _load_moment(index, key, getattr(b, key), state[key], self.shard.numel)
        b.master.copy_(master)
        if b.weights is not b.master:
            b.weights.copy_(b.master)
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
        per_param = host_bytes_per_param(self.fmt)
        params = self.layout.param_count * self.depth / self.shard.ranks   # this rank's share
        return {"block_params": params, "bytes_per_param": per_param,
                "bytes_per_param_total": sum(per_param.values()),
                "bytes_per_param_allocated": self.total_bytes / params,
                "pinned_bytes": self.pinned_bytes, "total_bytes": self.total_bytes}

    def close(self) -> None:
        """Unpin the arenas now (they are also unpinned when the state is garbage collected)."""
        self.pinned_arena.close()
        self.inputs.close()


def _load_moment(index: int, key: str, target: torch.Tensor | QuantizedMoment, saved, numel: int) -> None:
    """Copy a checkpoint's moment into `target`, refusing one of the other format or size."""
    quantized = isinstance(target, QuantizedMoment)
    if quantized != isinstance(saved, dict):
        kept, other = ("int8", "fp32") if quantized else ("fp32", "int8")
        raise ValueError(f"checkpoint block {index} holds {other} {key}, but this run keeps {kept} moments; resume "
                         f"with offload.moments={other}")
    if quantized:
        target.load_state(saved)
        return
    if saved.shape != (numel,):
        raise ValueError(f"checkpoint block {index} {key} has shape {tuple(saved.shape)}, but this model's blocks "
                         f"have {numel} elements; load a checkpoint of the same model config")
    target.copy_(saved)
