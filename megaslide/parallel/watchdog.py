"""A watchdog that ends a process whose sequence-parallel attention cannot finish, naming the mode and the rank.

A rank whose peer never reaches its side of a collective (an all-to-all, a ring pass, a one-sided barrier) waits
forever: on the host inside a gloo call, or on the device (NCCL kernels, a symmetric-memory barrier spinning on
its signal pad), where the wait shows only at the next host synchronisation (`torch.cuda.synchronize`, `.item()`),
which nothing interrupts. `arm(timeout_s)` starts a thread that watches every `guard(label)`: the guarded block on
the host and, on CUDA, the device work it queued (an event recorded at its end). If either is not done `timeout_s`
after the block began, the thread calls `on_timeout` with

    rank R: sequence-parallel attention (mode='ring' transport='symm_mem') did not finish within T s ...

whose default writes `error: <that>` to stderr and ends the process with exit status 1, so that torchrun stops
the other ranks: an error that names the mode and the rank instead of a hang. Unarmed (the default), `guard` does
nothing. `megaslide.inference.launch.init_distributed` arms it with the process group's timeout.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _Watched:
    label: str
    deadline: float
    event: torch.cuda.Event | None = None  # set when the host part is done and device work may be pending
    host_done: bool = False


def _exit_with(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class Watchdog:
    """Watches guarded blocks for `timeout_s` seconds each (see the module docstring)."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None] = _exit_with):
        if timeout_s <= 0:
            raise ValueError(f"the watchdog's timeout_s={timeout_s} must be > 0")
        self.timeout_s, self.on_timeout = timeout_s, on_timeout
        self._watched: list[_Watched] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sp-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, label: str):
        entry = _Watched(label, time.monotonic() + self.timeout_s)
        with self._lock:
            self._watched.append(entry)
        try:
            yield
        finally:
            if torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():  # a graph runs later
                entry.event = torch.cuda.Event()
                entry.event.record()
            entry.host_done = True

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(period):
            with self._lock:
                self._watched = [w for w in self._watched if not (w.host_done and (w.event is None or w.event.query()))]
                late = [w for w in self._watched if time.monotonic() > w.deadline]
            if late:
                rank = dist.get_rank() if dist.is_initialized() else 0
                where = "on the device" if late[0].host_done else "on the host"
                self.on_timeout(f"rank {rank}: sequence-parallel attention ({late[0].label}) did not finish within "
                                 f"{self.timeout_s:g} s (waiting {where}): a peer never reached its side of a "
                                 f"collective or barrier")
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_ARMED: list[Watchdog] = []


def arm(timeout_s: float, on_timeout: Callable[[str], None] = _exit_with) -> Watchdog:
    """Watch every later `guard` for `timeout_s` seconds (replacing a watchdog armed before)."""
    disarm()
    _ARMED.append(Watchdog(timeout_s, on_timeout))
    return _ARMED[0]


def disarm() -> None:
    """Stop watching (no-op when unarmed)."""
    while _ARMED:
        _ARMED.pop().stop()


def guard(label: str) -> contextlib.AbstractContextManager:
    """The armed watchdog's guard of a block labelled `label` (e.g. the SP mode), or nothing when unarmed."""
    return _ARMED[0].guard(label) if _ARMED else contextlib.nullcontext()
