"""Process-group setup for sequence-parallel inference under torchrun (or one plain process).

    torchrun --standalone --nproc_per_node 2 experiments/generate_full.py mode=torus

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), picks NCCL for CUDA and gloo for CPU, binds each rank to GPU LOCAL_RANK, and
turns NVLink multicast (NVLS) off before the first communicator exists: NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (the lent machines do not support it). With a process group it arms
`megaslide.parallel.watchdog` with the group's timeout: sequence-parallel attention that cannot finish, on the
host or on the device, ends the process with an error naming the mode and the rank. A plain `python`
run (no WORLD_SIZE) gets a one-rank context with no process group.

Convention of the inference code (`megaslide.parallel.groups`): an SP `group` of None means
"no group", this process alone with no collectives; pass `ctx.group` (the world group, None in
a plain one-process run) to shard over all ranks.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaslide.device import resolve_device
from megaslide.parallel import watchdog
from megaslide.parallel.mesh import MULTICAST_OFF, leave_process_groups


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None                 # "nccl" | "gloo" | None (one process, no group)
    group: dist.ProcessGroup | None     # the world group, or None without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the torchrun job described by the environment (or return a one-rank context)."""
    os.environ.update(MULTICAST_OFF)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank=local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return DistContext(0, 1, 0, dev, None, None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    watchdog.arm(timeout_s)  # SP attention that cannot finish (host or device) ends with an error, not a hang
    return DistContext(rank, world, local_rank, dev, backend, dist.group.WORLD)


def shutdown(ctx: DistContext) -> None:
    """Leave the job (`megaslide.parallel.mesh.leave_process_groups`)."""
    if ctx.backend is not None:
        watchdog.disarm()
        leave_process_groups()


def barrier(ctx: DistContext) -> None:
    if ctx.backend is not None:
        dist.barrier()
