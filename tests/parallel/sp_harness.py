"""Spawn gloo process groups on localhost for the sequence-parallel tests.

`run_spawned(worker, world, *args)` starts `world` processes (forkserver with torch preloaded,
so each costs one fork rather than one torch import), each calling `worker(rank, world, port,
*args)`; it fails the calling test with the workers' output if any process fails or runs past
`timeout` seconds. Workers call `init_gloo` / `dist.destroy_process_group` themselves.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    os.environ["WANDB_MODE"] = "disabled"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def run_spawned(worker, world: int, *args, timeout: float = 150.0) -> None:
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
    ctx = tmp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, join=False,
                              start_method="forkserver")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    while not ctx.join(timeout=1.0):
        if datetime.datetime.now() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"spawned workers ran past {timeout} s")
