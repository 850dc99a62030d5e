"""The training run's (dp, sp) DeviceMesh from torchrun's environment, and the replicas' mean gradient: one
collective, a parameter without a gradient counted as zero and left None only where no replica has one."""
import pytest
import torch

from megaslide.config import ParallelConfig
from megaslide.parallel.data_parallel import DataParallel
from megaslide.parallel.mesh import init_training_mesh, leave_process_groups
from megaslide.testing import spawn


def _mesh_and_mean(rank: int, world: int) -> None:
    mesh = init_training_mesh(ParallelConfig(dp=world), torch.device("cpu"))   # joins the group itself
    assert mesh.mesh_dim_names == ("dp", "sp") and tuple(mesh.shape) == (world, 1)
    dp = DataParallel.of(mesh)
    assert (dp.rank, dp.size, dp.is_main) == (rank, world, rank == 0)
    assert dp.rows(6 * world) == slice(6 * rank, 6 * rank + 6)
    params = [torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(3)]
    params[0].grad = torch.full((2, 3), float(rank + 1))
    if rank == 0:
        params[1].grad = torch.ones(2, 3)                # only rank 0 has it: the mean counts the others as 0
    values = dp.mean_grads_(params, torch.tensor([float(rank), 10.0 * rank]))
    assert torch.equal(values, torch.tensor([sum(range(world)) / world, 10.0 * sum(range(world)) / world]))
    assert torch.equal(params[0].grad, torch.full((2, 3), (world + 1) / 2))
    assert torch.equal(params[1].grad, torch.full((2, 3), 1 / world)) and params[2].grad is None
    assert dp.mean_grads_(params, torch.zeros(0)).numel() == 0
    leave_process_groups()


def test_mesh_and_the_replicas_mean_on_three_ranks():
    spawn(_mesh_and_mean, 3, backend=None, timeout_s=120)


def test_one_plain_process_has_no_mesh_and_a_bad_world_names_the_keys(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_training_mesh(ParallelConfig(), torch.device("cpu")) is None
    assert DataParallel.of(None) == DataParallel.single()
    with pytest.raises(ValueError, match=r"parallel.dp=2 x parallel.sp=2 = 4 must equal the number of processes, "
                                         r"WORLD_SIZE=1: start `torchrun --nproc-per-node=4"):
        init_training_mesh(ParallelConfig(dp=2, sp=2), torch.device("cpu"))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"parallel.dp=2 .* WORLD_SIZE=3"):
        init_training_mesh(ParallelConfig(dp=2), torch.device("cpu"))
