"""megaslide/perf/timing.py: timing statistics, ceilings on CPU, timing across spawned ranks."""
import os

import pytest
import torch
import torch.distributed as dist

from megaslide.perf import timing
from megaslide.perf.timing import MIN_REPEATS, Timing, copy_gbps, matmul_tflops, pcie_gbps, timed
from megaslide.testing import spawn


def test_timed_counts_warmup_and_repeats():
    calls = []
    t = timed(lambda: calls.append(1), "cpu", repeats=6, warmup=2)
    assert len(calls) == 8 and len(t.times) == 6
    assert t.min <= t.median <= t.max and t.std >= 0


def test_timed_refuses_too_few_repeats():
    with pytest.raises(ValueError, match="at least"):
        timed(lambda: None, "cpu", repeats=MIN_REPEATS - 1)


def test_timing_statistics_in_ms():
    t = Timing((0.001, 0.003, 0.002, 0.010, 0.004))
    assert t.ms() == pytest.approx({"ms": 3.0, "ms_min": 1.0, "ms_max": 10.0, "ms_std": 1e3 * 0.0031622776601683794})
    assert set(t.ms("step_ms")) == {"step_ms", "step_ms_min", "step_ms_max", "step_ms_std"}


class FakeClock:
    """Stands in for the `time` module in megaslide.perf.timing: `perf_counter` reads `now`, then
    moves it on by `tick` (so each timed call of a no-op lasts one tick)."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick = 100.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now - self.tick


def test_timed_statistics_on_a_fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    durations = iter([7.0, 9.0, 0.3, 0.1, 0.2, 0.5, 0.4])  # two warm-up calls, then five timed

    def work():
        clock.now += next(durations)

    t = timed(work, "cpu", repeats=5, warmup=2)
    assert t.times == pytest.approx((0.3, 0.1, 0.2, 0.5, 0.4))
    assert (t.median, t.min, t.max) == pytest.approx((0.3, 0.1, 0.5))


def test_ceilings_count_their_work_on_a_fake_clock(monkeypatch):
    monkeypatch.setattr(timing, "time", FakeClock(tick=2e-3))  # every timed repeat lasts 2 ms
    # 10 back-to-back 64^3 matmuls per repeat, 2 n^3 FLOPs each
    assert matmul_tflops("cpu", n=64, dtype=torch.float32, calls=10) == pytest.approx(10 * 2 * 64 ** 3 / 2e-3 / 1e12)
    # a copy reads and writes nbytes
    assert copy_gbps("cpu", nbytes=4096) == pytest.approx(2 * 4096 / 2e-3 / 1e9)


def _sum_ranks(rank, world, path):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    slowest = timed(lambda: None, "cpu", across_ranks=True)
    if rank == 0:
        with open(path, "w") as f:
            f.write(f"{t.item()} {os.environ['WORLD_SIZE']} {len(slowest.times)}")


def test_spawn_joins_a_gloo_group(tmp_path):
    path = tmp_path / "out.txt"
    spawn(_sum_ranks, 2, (str(path),))
    assert path.read_text() == f"3.0 2 {MIN_REPEATS}"


def test_pcie_needs_a_page_locked_byte_buffer():
    with pytest.raises(ValueError, match="page-locked 1-D uint8.*HostArena"):
        pcie_gbps("cpu", torch.empty(4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match="^host: "):
        pcie_gbps("cpu", torch.empty(1024, dtype=torch.float32))
