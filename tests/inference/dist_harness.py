"""Run a test body on P local gloo ranks, started the way torchrun starts them.

`run_ranks(body, world, *args)` starts `world` processes with `megaslide.testing.spawn`
(torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port).
Each joins through `megaslide.inference.launch.init_distributed(device="cpu")` and calls
`body(ctx, *args)`. An exception or failed assertion in any rank fails the calling test with that
rank's traceback.
"""
from __future__ import annotations

import os

from megaslide.testing import spawn


def _entry(rank: int, world: int, body, args) -> None:
    from megaslide.inference.launch import init_distributed, shutdown

    os.environ["WANDB_MODE"] = "disabled"
    ctx = init_distributed(device="cpu", timeout_s=120)
    body(ctx, *args)  # on failure the process dies and spawn stops the others
    shutdown(ctx)


def run_ranks(body, world: int, *args, timeout: float = 150.0) -> None:
    spawn(_entry, world, (body, args), backend=None, timeout_s=timeout)
