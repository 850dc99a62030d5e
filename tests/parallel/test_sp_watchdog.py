"""No hang: every SwiftFusion mode back to back in one process group, and a wait that cannot finish ends with an
error naming the mode and the rank (gloo, 2 ranks started with torchrun's environment).

The first test runs the eight modes of experiments/swiftfusion.py (Ulysses, ring over p2p and over the transport
`auto` picks, USP and the ring-intra hybrid, Torus, SwiftFusion's Torus) forward and backward, causal and not,
twice in two orders, in the one process group that `init_distributed` joins (which arms the watchdog), each
against float64 attention on the gathered sequence. In the second, rank 1 never joins rank 0's ring: the armed
watchdog reports rank 0's stuck call within its timeout."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaslide.parallel import sequence_parallel_attention, watchdog
from megaslide.testing import spawn

MODES = {
    "ulysses": {"mode": "ulysses"},
    "ring": {"mode": "ring"},
    "ring_auto": {"mode": "ring", "transport": "auto"},
    "usp": {"mode": "hybrid", "placement": "ulysses_intra", "ulysses_degree": 2},
    "hybrid_ring_intra": {"mode": "hybrid", "placement": "ring_intra", "ring_degree": 2},
    "torus": {"mode": "torus", "chunks": 2},
    "torus_ring_intra": {"mode": "torus", "placement": "ring_intra", "chunks": 1},
    "swiftfusion": {"mode": "torus", "placement": "ring_intra", "transport": "auto", "chunks": 2},
}
N, HEADS, D = 12, 4, 8


def _every_mode(rank: int, world: int) -> None:
    from megaslide.inference.launch import init_distributed, shutdown

    ctx = init_distributed(device="cpu", timeout_s=60)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, N, HEADS, D, generator=g, dtype=torch.float64) for _ in range(3))
    rows = slice(rank * N // world, (rank + 1) * N // world)
    for order in (list(MODES), list(reversed(MODES))):
        for name in order:
            for causal in (False, True):
                qs, ks, vs = (t[:, rows].clone().requires_grad_() for t in (q, k, v))
                out = sequence_parallel_attention(qs, ks, vs, causal=causal, **MODES[name])
                out.square().sum().backward()
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full), is_causal=causal)
                ref = ref.transpose(1, 2)
                ref[:, rows].square().sum().backward()  # this rank's part of the loss; peers add theirs
                grads = [t.grad for t in full]
                for t in grads:
                    dist.all_reduce(t)
                for got, want in zip((out, qs.grad, ks.grad, vs.grad), (ref[:, rows], *(t[:, rows] for t in grads))):
                    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=f"{name} causal={causal}")
    shutdown(ctx)


def test_every_sp_mode_back_to_back_in_one_process_group():
    spawn(_every_mode, 2, backend=None)


def _stuck(rank: int, world: int, report: Path) -> None:
    watchdog.arm(1.0, on_timeout=lambda message: (report.write_text(message), __import__("os")._exit(0)))
    if rank == 0:  # rank 1 never joins: the first ring pass waits forever
        q = torch.randn(1, 4, 2, 8)
        sequence_parallel_attention(q, q, q, mode="ring")
        raise AssertionError("the ring finished without its peer")
    deadline = time.monotonic() + 60
    while not report.exists() and time.monotonic() < deadline:  # stay in the group until rank 0 reported
        time.sleep(0.1)
    watchdog.disarm()


def test_a_wait_that_cannot_finish_is_an_error_naming_the_mode_and_rank(tmp_path):
    report = tmp_path / "report.txt"
    spawn(_stuck, 2, (report,), timeout_s=90)
    message = report.read_text()
    assert message.startswith("rank 0: sequence-parallel attention (mode='ring' transport='p2p') did not finish "
                              "within 1 s (waiting on the host)"), message
