"""Predict one attention layer's time for each SP mode, placement and degree; pick the best.

Bandwidth-only model (no per-message latency), forward pass, non-causal attention (full-
sequence DiT inference). Inputs: bytes and FLOPs of the workload, the topology's per-GPU link
bandwidths, and an attention throughput (TFLOP/s, ideally measured in the same run).

With T = bytes of one full-sequence tensor (B * N * h * d * dtype_bytes), P = U * R ranks:
- compute per rank: 4 B h N^2 d / P / throughput.
- Ulysses all-to-all over a group of U: every rank holds 3T/P of q, k, v (T/P of the output on
  the way back) and sends 1/U of it to each peer; a rank's time is the larger of its intra-node
  and inter-node traffic over the matching bandwidth; the slowest rank sets the pace.
- Ring over R ranks: R steps of compute c = compute / R; each of the R-1 transfers moves this
  rank's K/V block (2T/P) over the slowest hop of the ring (m seconds), double-buffered:
  ring = c + (R-1) max(c, m).
- hybrid (USP): a2a_in + ring + a2a_out (the all-to-alls are not overlapped).
- torus with C head chunks: a pipeline whose first and last stages share the all-to-all link:
  max(a2a_in + a2a_out + ring / C, (a2a_in + a2a_out) / C + ring).
Not modelled: contention between ring and all-to-all traffic on one link tier, NIC sharing
(one NIC per GPU assumed), kernel efficiency changes with chunk size, causal load imbalance.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaslide.parallel.groups import PLACEMENTS, Topology, rank_grid, ring_groups, ulysses_groups

GB = 1e9
MODES = ("ulysses", "ring", "hybrid", "torus")


@dataclass(frozen=True)
class AttentionWorkload:
    """One attention layer over the full sequence: batch x seq_len tokens, heads x head_dim."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    dtype_bytes: int = 2

    def flops(self) -> float:
        """Forward FLOPs of softmax(QK^T)V: two matmuls of 2 B h N^2 d each."""
        return 4.0 * self.batch * self.heads * self.seq_len ** 2 * self.head_dim

    def tensor_bytes(self) -> float:
        """Bytes of one of q, k, v or the output over the full sequence."""
        return float(self.batch * self.seq_len * self.heads * self.head_dim * self.dtype_bytes)


@dataclass(frozen=True)
class Plan:
    mode: str
    ulysses_degree: int
    ring_degree: int
    placement: str = "ulysses_intra"
    chunks: int = 1  # torus head chunks per rank


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    compute_s: float  # attention compute per rank
    all_to_all_s: float  # input + output all-to-all, unoverlapped
    ring_comm_s: float  # the R-1 K/V transfers, unoverlapped
    total_s: float  # the layer, with the mode's overlap


def all_to_all_time(members: list[int], bytes_per_rank: float, topology: Topology) -> float:
    """Seconds for an all-to-all among `members` (ranks) where each sends bytes_per_rank in total,
    1/len(members) of it to every member (its own share stays local)."""
    chunk = bytes_per_rank / len(members)
    worst = 0.0
    for me in members:
        intra = sum(1 for r in members if r != me and topology.node_of(r) == topology.node_of(me))
        inter = sum(1 for r in members if topology.node_of(r) != topology.node_of(me))
        worst = max(worst, intra * chunk / (topology.intra_bw * GB), inter * chunk / (topology.inter_bw * GB))
    return worst


def ring_step_time(members: list[int], block_bytes: float, topology: Topology) -> float:
    """Seconds for one ring step: every member sends block_bytes to the next; the slowest hop sets it."""
    if len(members) == 1:
        return 0.0
    hops = zip(members, members[1:] + members[:1])
    crosses = any(topology.node_of(a) != topology.node_of(b) for a, b in hops)
    return block_bytes / ((topology.inter_bw if crosses else topology.intra_bw) * GB)


def predict(plan: Plan, workload: AttentionWorkload, topology: Topology, attn_tflops: float) -> Prediction:
    """Predicted time of one attention layer under `plan` (see the module docstring)."""
    u_deg, r_deg = plan.ulysses_degree, plan.ring_degree
    world = u_deg * r_deg
    if world != topology.world_size:
        raise ValueError(f"plan uses {world} ranks but the topology has {topology.world_size}")
    if workload.heads % u_deg:
        raise ValueError(f"heads={workload.heads} is not divisible by ulysses_degree={u_deg}")
    if attn_tflops <= 0:
        raise ValueError(f"attn_tflops must be > 0, got {attn_tflops}")
    grid = rank_grid(u_deg, r_deg, plan.placement)
    per_rank = workload.tensor_bytes() / world
    compute = workload.flops() / world / (attn_tflops * 1e12)
    a2a_in = max(all_to_all_time(g, 3 * per_rank, topology) for g in ulysses_groups(grid)) if u_deg > 1 else 0.0
    a2a_out = max(all_to_all_time(g, per_rank, topology) for g in ulysses_groups(grid)) if u_deg > 1 else 0.0
    step = max(ring_step_time(g, 2 * per_rank, topology) for g in ring_groups(grid))
    c = compute / r_deg
    ring = c + (r_deg - 1) * max(c, step)
    a2a = a2a_in + a2a_out
    total = max(a2a + ring / plan.chunks, a2a / plan.chunks + ring) if plan.mode == "torus" else a2a + ring
    return Prediction(plan, compute, a2a, (r_deg - 1) * step, total)


def candidate_plans(world: int, heads: int, modes: tuple[str, ...] = MODES, torus_chunks: int = 4) -> list[Plan]:
    """Every valid plan on `world` ranks: degrees with U | heads, both placements where they differ."""
    plans = []
    for u_deg in (d for d in range(1, world + 1) if world % d == 0 and heads % d == 0):
        r_deg = world // u_deg
        placements = PLACEMENTS if 1 < u_deg < world else PLACEMENTS[:1]
        for placement in placements:
            if u_deg == world and "ulysses" in modes:
                plans.append(Plan("ulysses", u_deg, r_deg, placement))
            if r_deg == world and "ring" in modes:
                plans.append(Plan("ring", u_deg, r_deg, placement))
            if 1 < u_deg < world and "hybrid" in modes:
                plans.append(Plan("hybrid", u_deg, r_deg, placement))
            if u_deg > 1 and "torus" in modes:
                plans.append(Plan("torus", u_deg, r_deg, placement, min(heads // u_deg, torus_chunks)))
    return plans


def rank_plans(workload: AttentionWorkload, topology: Topology, attn_tflops: float,
               modes: tuple[str, ...] = MODES, torus_chunks: int = 4) -> list[Prediction]:
    """Predictions for every candidate plan, fastest first."""
    plans = candidate_plans(topology.world_size, workload.heads, modes, torus_chunks)
    if not plans:
        raise ValueError(f"no plan for modes={modes} on {topology.world_size} ranks with {workload.heads} heads")
    return sorted((predict(p, workload, topology, attn_tflops) for p in plans), key=lambda pr: pr.total_s)
