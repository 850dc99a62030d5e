"""Run a test body on P local gloo ranks, started the way torchrun starts them.

`run_ranks(body, world, *args)` spawns `world` processes (forkserver with torch preloaded, so
each costs a fork rather than a torch import). Each sets torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), joins through
`megaslide.inference.launch.init_distributed(device="cpu")` and calls `body(ctx, *args)`. An
exception or failed assertion in any rank fails the calling test with that rank's traceback.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
import time

import torch
import torch.multiprocessing as tmp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, body, args) -> None:
    from megaslide.inference.launch import init_distributed, shutdown

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), WANDB_MODE="disabled")
    torch.set_num_threads(1)
    ctx = init_distributed(device="cpu", timeout_s=120)
    body(ctx, *args)  # on failure the process dies and run_ranks stops the others
    shutdown(ctx)


def run_ranks(body, world: int, *args, timeout: float = 150.0) -> None:
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
    ctx = tmp.start_processes(_entry, args=(world, free_port(), body, args), nprocs=world, join=False,
                              start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):  # returns when all exit, raises when one fails
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"ranks ran past {timeout} s")
