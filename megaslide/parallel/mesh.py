"""The training run's process groups: one 2D `DeviceMesh` with dims ("dp", "sp") under torchrun.

    torchrun --nproc-per-node=4 experiments/train.py parallel.dp=2 parallel.sp=2 ...

`init_training_mesh` reads torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), checks that `parallel.dp * parallel.sp` equals the world size, joins the default
process group (NCCL on cuda, gloo on cpu; NVLink multicast off before the first communicator) and
lays the ranks out as a dp x sp grid: rank = dp_index * sp + sp_index, so an SP group is `sp`
consecutive ranks (one node when sp divides the GPUs per node) and a DP group strides across them.
`mesh["dp"].get_group()` / `mesh["sp"].get_group()` are the two groups. A plain one-process run
(world size 1, dp = sp = 1) gets None: no process group and no collectives.
"""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megaslide.config import ParallelConfig
from megaslide.parallel.groups import release_meshes

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def world_size_from_env() -> int:
    """The number of processes torchrun started (WORLD_SIZE; 1 for a plain `python` run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def ranks_per_node() -> int:
    """The processes torchrun started on this node (LOCAL_WORLD_SIZE; 1 for a plain `python` run): they share
    its host RAM."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_world(parallel: ParallelConfig, world: int) -> None:
    """ValueError naming `parallel.dp` / `parallel.sp` and WORLD_SIZE unless dp * sp == world."""
    if parallel.dp * parallel.sp != world:
        raise ValueError(f"parallel.dp={parallel.dp} x parallel.sp={parallel.sp} = {parallel.dp * parallel.sp} "
                         f"must equal the number of processes, WORLD_SIZE={world}: start "
                         f"`torchrun --nproc-per-node={parallel.dp * parallel.sp} ...` (per node, times the "
                         f"nodes) or set parallel.dp x parallel.sp = {world}")


def init_training_mesh(parallel: ParallelConfig, device: torch.device) -> DeviceMesh | None:
    """The run's ("dp", "sp") DeviceMesh, joining the default process group first; None when this is
    one plain process (WORLD_SIZE 1 and dp = sp = 1). `device` is this rank's device (cuda:LOCAL_RANK
    or cpu); it picks the backend. Collective: every rank calls it with the same config."""
    world = world_size_from_env()
    check_world(parallel, world)
    if world == 1 and not dist.is_initialized():
        return None
    os.environ.update(MULTICAST_OFF)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=int(os.environ.get("RANK", "0")), world_size=world, **kwargs)
    return init_device_mesh(device.type, (parallel.dp, parallel.sp), mesh_dim_names=("dp", "sp"))


def leave_process_groups() -> None:
    """Leave the job in a fixed order: a barrier (no rank tears down while a peer still talks to it),
    destroy every process group, drop the cached SP meshes' references to them and collect, so that
    gloo's worker threads end now rather than during interpreter exit (where one of them can abort
    the process after its work is done). No-op without a process group."""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    release_meshes()
    gc.collect()
