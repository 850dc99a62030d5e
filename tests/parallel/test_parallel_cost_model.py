"""Cost model on a case small enough to compute by hand.

2 nodes x 2 GPUs, intra 1e6 B/s, inter 1e5 B/s (0.001 / 0.0001 GB/s), attention at 1e9 FLOP/s.
Workload B=1, N=1000, h=4, d=100, 2-byte: T = 800,000 bytes per full tensor, 1.6e9 FLOPs, so
compute per rank = 1.6e9 / 4 / 1e9 = 0.4 s; per rank q,k,v = 600,000 B, output 200,000 B, and
a K/V block = 400,000 B.
"""
from __future__ import annotations

import pytest

from megaslide.parallel.cost_model import (AttentionWorkload, Plan, all_to_all_time, candidate_plans, predict,
                                           rank_plans, ring_step_time)
from megaslide.parallel.groups import Topology

TOPO = Topology(nodes=2, gpus_per_node=2, intra_bw=0.001, inter_bw=0.0001)
WORK = AttentionWorkload(batch=1, seq_len=1000, heads=4, head_dim=100, dtype_bytes=2)
TFLOPS = 1e-3


def test_workload_sizes():
    assert WORK.tensor_bytes() == 800_000
    assert WORK.flops() == 1.6e9


def test_all_to_all_time_by_hand():
    # members 0..3: each rank has 1 intra peer and 2 inter peers; 150,000 B per peer
    assert all_to_all_time([0, 1, 2, 3], 600_000, TOPO) == pytest.approx(max(150_000 / 1e6, 2 * 150_000 / 1e5))
    assert all_to_all_time([0, 1], 600_000, TOPO) == pytest.approx(300_000 / 1e6)
    assert all_to_all_time([0, 2], 600_000, TOPO) == pytest.approx(300_000 / 1e5)


def test_ring_step_uses_slowest_hop():
    assert ring_step_time([0, 1], 400_000, TOPO) == pytest.approx(0.4)
    assert ring_step_time([0, 1, 2, 3], 400_000, TOPO) == pytest.approx(4.0)
    assert ring_step_time([3], 400_000, TOPO) == 0.0


@pytest.mark.parametrize("plan, compute, a2a, ring_comm, total", [
    (Plan("ulysses", 4, 1), 0.4, 3.0 + 1.0, 0.0, 4.4),
    # c = 0.1 per step, m = 4.0 (inter hop): 0.1 + 3 * 4.0
    (Plan("ring", 1, 4), 0.4, 0.0, 12.0, 12.1),
    # Ulysses {0,1} intra: 300,000/1e6 + 100,000/1e6; ring {0,2} inter: 0.2 + 4.0
    (Plan("hybrid", 2, 2, "ulysses_intra"), 0.4, 0.4, 4.0, 0.3 + 4.2 + 0.1),
    # Ulysses {0,2} inter: 3.0 + 1.0; ring {0,1} intra: 0.2 + max(0.2, 0.4)
    (Plan("hybrid", 2, 2, "ring_intra"), 0.4, 4.0, 0.4, 3.0 + 0.6 + 1.0),
    # torus C=2: max(4.0 + 0.6 / 2, 4.0 / 2 + 0.6)
    (Plan("torus", 2, 2, "ring_intra", chunks=2), 0.4, 4.0, 0.4, 4.3),
    # torus C=2: max(0.4 + 4.2 / 2, 0.4 / 2 + 4.2)
    (Plan("torus", 2, 2, "ulysses_intra", chunks=2), 0.4, 0.4, 4.0, 4.4),
])
def test_predict_by_hand(plan, compute, a2a, ring_comm, total):
    pred = predict(plan, WORK, TOPO, TFLOPS)
    assert pred.compute_s == pytest.approx(compute)
    assert pred.all_to_all_s == pytest.approx(a2a)
    assert pred.ring_comm_s == pytest.approx(ring_comm)
    assert pred.total_s == pytest.approx(total)


def test_torus_with_one_chunk_is_hybrid():
    for placement in ("ulysses_intra", "ring_intra"):
        hybrid = predict(Plan("hybrid", 2, 2, placement), WORK, TOPO, TFLOPS)
        torus = predict(Plan("torus", 2, 2, placement, chunks=1), WORK, TOPO, TFLOPS)
        assert torus.total_s == pytest.approx(hybrid.total_s)


def test_rank_plans_picks_best():
    ranked = rank_plans(WORK, TOPO, TFLOPS)
    assert ranked[0].plan == Plan("torus", 2, 2, "ring_intra", chunks=2)
    assert ranked[0].total_s == pytest.approx(4.3)
    assert [p.total_s for p in ranked] == sorted(p.total_s for p in ranked)
    assert ranked[-1].plan.mode == "ring"


def test_candidate_plans_respect_heads():
    plans = candidate_plans(world=4, heads=2)
    assert all(2 % p.ulysses_degree == 0 for p in plans)
    assert not any(p.mode == "ulysses" for p in plans)  # 2 heads cannot split over 4 ranks
    assert {(p.mode, p.placement) for p in plans if p.mode == "hybrid"} == {("hybrid", "ulysses_intra"),
                                                                           ("hybrid", "ring_intra")}


def test_predict_rejects_bad_plans():
    with pytest.raises(ValueError, match="topology has 4"):
        predict(Plan("hybrid", 2, 1), WORK, TOPO, TFLOPS)
    with pytest.raises(ValueError, match="heads=6"):
        predict(Plan("ulysses", 4, 1), AttentionWorkload(1, 100, 6, 8), TOPO, TFLOPS)
    with pytest.raises(ValueError, match="bandwidths"):
        Topology(nodes=1, gpus_per_node=2, intra_bw=0.0, inter_bw=1.0)
