"""Data parallelism of training: the group of `parallel.dp` replicas, each rank's share of the global batch, and the
mean of the replicas' gradients.

`train.batch_size` is the global batch. Every rank draws the same global batch (the same data indices, timesteps
and noise as one process) and trains on its `rows`, an equal contiguous share. A replica's loss is the mean over its
rows, so the mean of the replicas' losses and gradients is the loss and gradient of the global batch: the reduction
here is a sum over the group divided by the number of replicas. One process (`DataParallel.single()`) has no group
and the same methods do nothing.

The offload engine shards its host state over every rank of the run (`DataParallel.of_run`): under sequence
parallelism (parallel.sp = S) each replica is S consecutive ranks that train its rows of the batch together, each
on its share of every clip, and their losses and gradients are parts that sum. Over such a group (`sp` = S) a sum
over all ranks divided by the replicas (size / S) is again the global batch's mean.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megaslide.config import ParallelConfig
from megaslide.parallel.mesh import ranks_per_node


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the data-parallel replicas."""

    group: dist.ProcessGroup | None   # None: one replica, no collectives
    rank: int
    size: int
    sp: int = 1                       # consecutive ranks of the group that train one replica's rows together

    @classmethod
    def single(cls) -> DataParallel:
        return cls(None, 0, 1)

    @classmethod
    def of(cls, mesh: DeviceMesh | None) -> DataParallel:
        """The "dp" dimension of the run's mesh (`megaslide.parallel.mesh.init_training_mesh`); None: one process."""
        if mesh is None or mesh["dp"].size() == 1:
            return cls.single()
        return cls(mesh["dp"].get_group(), mesh["dp"].get_local_rank(), mesh["dp"].size())

    @classmethod
    def of_run(cls, mesh: DeviceMesh | None) -> DataParallel:
        """Every rank of the run's ("dp", "sp") mesh, which spans the world (rank = dp index * sp + sp index), each
        `sp` consecutive ranks one replica; None or one process: `single()`."""
        if mesh is None or mesh.size() == 1:
            return cls.single()
        return cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), sp=mesh["sp"].size())

    @property
    def replicas(self) -> int:
        """The data-parallel replicas among the group's ranks (parallel.dp)."""
        return self.size // self.sp

    @property
    def key(self) -> str:
        """The config keys that give the group's ranks, as an error message names them."""
        return ParallelConfig(dp=self.replicas, sp=self.sp).ranks_key

    @property
    def is_main(self) -> bool:
        """Whether this replica writes the run's files (its metrics, checkpoints, samples)."""
        return self.rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0)

    @property
    def ranks_per_node(self) -> int:
        """The ranks on this node, which share its host RAM (torchrun's local world size; 1 without a group)."""
        return ranks_per_node() if self.size > 1 else 1

    def barrier(self) -> None:
        """Wait for every rank of the run (all of the world: files are written by rank 0 for all of it)."""
        if dist.is_initialized():
            dist.barrier()

    def rows(self, global_batch: int) -> slice:
        """This rank's rows of a global batch of `global_batch` clips (a multiple of the replicas,
        RunConfig.validate): its replica's share."""
        share, replica = global_batch // self.replicas, self.rank // self.sp
        return slice(replica * share, (replica + 1) * share)

    def sum_(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` replaced in place by its sum over the group's ranks; returned."""
        if self.group is not None:
            dist.all_reduce(flat, group=self.group)
        return flat

    def mean_(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` replaced in place by its mean over the replicas (the ranks' sum / replicas); returned."""
        return self.sum_(flat).div_(self.replicas) if self.group is not None else flat

    def mean_grads_(self, params: Sequence[torch.nn.Parameter], values: torch.Tensor) -> torch.Tensor:
        """Each parameter's .grad replaced by the replicas' mean, and `values` (k,) (e.g. the loss) averaged too, in
        one collective; returns the averaged values. A parameter without a gradient counts as zero, and keeps None
        only where no replica gave it one (as one process on the global batch would)."""
        if self.group is None:
            return values
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=values.device,
                                                                               dtype=values.dtype) for p in params]
        present = torch.tensor([p.grad is not None for p in params], device=values.device, dtype=values.dtype)
        flat = self.mean_(torch.cat([*(g.to(values.dtype) for g in grads), present, values]))
        total = sum(g.numel() for g in grads)
        given = (flat[total:total + len(params)] > 0).tolist()   # some replica gave the parameter a gradient
        offset = 0
        for p, g, any_grad in zip(params, grads, given):
            p.grad = flat[offset:offset + g.numel()].view_as(p).to(p.dtype) if any_grad else None
            offset += g.numel()
        return flat[flat.numel() - len(values):]
