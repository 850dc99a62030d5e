"""One-sided K/V transport for ring attention through torch symmetric memory (CUDA peers).

Two-sided ring passing needs a matching send and receive per step and relays every block
through R-1 hops. With symmetric memory each rank exposes its own K/V block in a buffer that
all peers of the group map, and at step t simply *gets* block (r - t) mod R straight from its
owner's buffer into a local slot, on a side stream, while the current block is being used:

    own buffer <- my K/V ; barrier          (every block is published)
    for t: slot[t % 2] <- get(peer r - t)   (copy engine / NVLink, overlapped with compute)
    barrier                                 (nobody still reads my buffer when it is reused)

The buffers never change during a call, so no per-step handshake is needed; the two barriers
(signal-pad based, issued from the current stream) are the only synchronisation. Multicast /
NVLS is never used: launchers set NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1
before init, and `can_use_symm_mem` refuses to run without the latter.

Only the forward K/V movement is one-sided; the backward always passes K/V and dK/dV with P2P.
`resolve_transport` picks "symm_mem" or the two-sided "p2p" fallback and says why.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from megaslide.parallel.groups import group_rank, group_size, world_if_none

TRANSPORTS = ("p2p", "symm_mem", "auto")

_PROBED: dict[tuple[int, ...], tuple[bool, str]] = {}
_WORKSPACES: dict[tuple, tuple[torch.Tensor, object]] = {}
_SIDE_STREAMS: dict[torch.device, object] = {}


def _local_checks(group: dist.ProcessGroup | None, device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"tensors are on {device.type}; symmetric memory needs CUDA peers"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not dist.is_initialized():
        return False, "torch.distributed is not initialised"
    backend = dist.get_backend(group)
    if backend != "nccl":
        return False, f"the group's backend is {backend!r}; symmetric memory needs an NCCL group"
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        return False, ("TORCH_SYMM_MEM_DISABLE_MULTICAST is not '1': set it (and NCCL_NVLS_ENABLE=0) "
                       "before init so that NVLink multicast stays off")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return False, f"torch.distributed._symmetric_memory is unavailable: {e}"
    if not all(hasattr(symm_mem, name) for name in ("empty", "rendezvous")):
        return False, "this torch lacks symm_mem.empty / symm_mem.rendezvous"
    return True, "ok"


def can_use_symm_mem(group: dist.ProcessGroup | None = None,
                     device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether one-sided transport works on `group`, and why not.

    Checks the device, backend and environment, then (once per group, cached) allocates a tiny
    symmetric buffer, rendezvouses and reads a peer's value; all ranks agree on the answer via an
    all-reduce. Collective when the local checks pass: call it on every rank of `group`."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    group = world_if_none(group)
    ok, reason = _local_checks(group, device)
    if not ok:
        return ok, reason
    key = tuple(dist.get_process_group_ranks(group))
    if key not in _PROBED:
        _PROBED[key] = _probe(group, device)
    return _PROBED[key]


def symm_mem_backend(device: torch.device) -> str | None:
    """The symmetric-memory allocator torch uses on a CUDA `device` (e.g. "CUDA", "NVSHMEM",
    "NCCL"; they differ in whether freeing a buffer is collective), or None if unknown."""
    if device.type != "cuda":
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        return symm_mem.get_backend(device)
    except (ImportError, AttributeError, RuntimeError):
        return None


def _probe(group, device) -> tuple[bool, str]:
    rank, size = group_rank(group), group_size(group)
    reason = "ok"
    try:
        buf, hdl = _workspace(group, (1,), torch.float32, device)
        buf.fill_(float(rank))
        hdl.barrier(channel=0)
        peer = (rank + 1) % size
        got = hdl.get_buffer(peer, (1,), torch.float32).clone()
        hdl.barrier(channel=0)
        if got.item() != float(peer):
            reason = f"read {got.item()} from peer {peer}, expected {float(peer)}"
    except (RuntimeError, TypeError, AttributeError, ValueError) as e:
        reason = f"symmetric memory probe failed: {type(e).__name__}: {e}"
    flag = torch.tensor([1 if reason == "ok" else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if flag.item() == 0 and reason == "ok":
        reason = "symmetric memory failed on another rank of the group"
    return flag.item() == 1, reason


def _workspace(group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """A cached symmetric buffer and its handle (collective on first use of a shape)."""
    import torch.distributed._symmetric_memory as symm_mem
    g = world_if_none(group)
    key = (g.group_name, tuple(shape), dtype, device)
    if key not in _WORKSPACES:
        if not symm_mem.is_symm_mem_enabled_for_group(g.group_name):
            with warnings.catch_warnings():  # needed before torch ~2.8, a deprecated no-op after
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(g.group_name)
        buf = symm_mem.empty(tuple(shape), dtype=dtype, device=device)
        _WORKSPACES[key] = (buf, symm_mem.rendezvous(buf, g.group_name))
    return _WORKSPACES[key]


def release_symm_mem_workspaces() -> None:
    """Drop the cached K/V buffers (the benchmark calls it between sequence lengths)."""
    _WORKSPACES.clear()


def resolve_transport(transport: str, group: dist.ProcessGroup | None, device: torch.device) -> str:
    """"p2p" -> "p2p"; "symm_mem" -> "symm_mem" or ValueError with the reason; "auto" -> the best that works."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: choose one of {TRANSPORTS}")
    if transport == "p2p":
        return "p2p"
    ok, reason = can_use_symm_mem(group, device)
    if transport == "symm_mem" and not ok:
        raise ValueError(f"transport='symm_mem' is unavailable here ({reason}); use transport='p2p' or 'auto'")
    return "symm_mem" if ok else "p2p"


class SymmMemKVStream:
    """One-sided source of ring blocks: block t is read straight from ring rank (r - t) mod R.

    kv (2, B, h, n, d) is this rank's block; see the module docstring for the protocol."""

    def __init__(self, kv: torch.Tensor, group, rank: int, size: int):
        self.kv, self.rank, self.size = kv, rank, size
        self.buf, self.hdl = _workspace(group, kv.shape, kv.dtype, kv.device)
        self.buf.copy_(kv)
        self.hdl.barrier(channel=0)
        if kv.device not in _SIDE_STREAMS:
            _SIDE_STREAMS[kv.device] = torch.cuda.Stream(device=kv.device)
        self.stream = _SIDE_STREAMS[kv.device]
        self.slots = [torch.empty_like(kv), torch.empty_like(kv)]
        self.ready: dict[int, torch.cuda.Event] = {}

    def prefetch(self, step: int) -> None:
        src = (self.rank - step) % self.size
        slot = self.slots[step % 2]
        self.stream.wait_stream(torch.cuda.current_stream())  # the slot's previous reader is queued before
        with torch.cuda.stream(self.stream):
            slot.copy_(self.hdl.get_buffer(src, tuple(self.kv.shape), self.kv.dtype), non_blocking=True)
            self.ready[step] = torch.cuda.Event()
            self.ready[step].record(self.stream)

    def get(self, step: int) -> torch.Tensor:
        if step == 0:
            return self.kv
        torch.cuda.current_stream().wait_event(self.ready.pop(step))
        return self.slots[step % 2]

    def close(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)
        self.hdl.barrier(channel=0)
