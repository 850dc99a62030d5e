"""Mesh placement (which SP ranks form which groups) and the padding helpers, without processes."""
from __future__ import annotations

import pytest
import torch

from megaslide.parallel import resolve_degrees
from megaslide.parallel.groups import SPMesh, Topology, rank_grid, ring_groups, ulysses_groups
from megaslide.parallel.local_attn import Segment
from megaslide.parallel.padding import pad_shard, shard_len, shard_sequence, unpad_shard, valid_len


def test_ulysses_intra_grid():
    grid = rank_grid(4, 2, "ulysses_intra")  # 2 nodes x 4 GPUs: Ulysses inside a node
    assert ulysses_groups(grid) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ring_groups(grid) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_ring_intra_grid():
    grid = rank_grid(2, 4, "ring_intra")  # rings of 4 consecutive ranks, Ulysses across nodes
    assert ring_groups(grid) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ulysses_groups(grid) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_ring_layouts_follow_the_gathered_shards():
    grid = rank_grid(2, 2, "ring_intra")
    mesh = SPMesh(2, 2, "ring_intra", grid, None, None, 0, 0)
    # ring member j holds shards j and 2 + j after the Ulysses exchange
    assert mesh.ring_layouts(5) == ((Segment(0, 5), Segment(10, 5)), (Segment(5, 5), Segment(15, 5)))
    mesh = SPMesh(2, 2, "ulysses_intra", rank_grid(2, 2, "ulysses_intra"), None, None, 0, 0)
    assert mesh.ring_layouts(5) == ((Segment(0, 10),), (Segment(10, 10),))


def test_grid_and_topology_validation():
    with pytest.raises(ValueError, match="placement"):
        rank_grid(2, 2, "diagonal")
    with pytest.raises(ValueError, match="gpus_per_node"):
        Topology(nodes=1, gpus_per_node=0, intra_bw=1.0, inter_bw=1.0)
    topo = Topology(nodes=2, gpus_per_node=8, intra_bw=450.0, inter_bw=50.0)
    assert topo.world_size == 16 and topo.node_of(7) == 0 and topo.node_of(8) == 1


def test_resolve_degrees():
    assert resolve_degrees("ulysses", 4, 8, None, None) == (4, 1)
    assert resolve_degrees("ring", 4, 3, None, None) == (1, 4)
    assert resolve_degrees("hybrid", 8, 8, 2, None) == (2, 4)
    assert resolve_degrees("hybrid", 8, 8, None, 2) == (4, 2)
    assert resolve_degrees("torus", 4, 8, None, None) == (4, 1)
    with pytest.raises(ValueError, match="does not divide"):
        resolve_degrees("hybrid", 8, 8, 3, None)
    with pytest.raises(ValueError, match="heads=6 is not divisible by ulysses_degree=4"):
        resolve_degrees("hybrid", 8, 6, 4, 2)
    with pytest.raises(ValueError, match="mode='ring' on 4 ranks"):
        resolve_degrees("ring", 4, 8, 2, None)


def test_padding_lengths():
    assert shard_len(18, 4) == 5
    assert [valid_len(18, 4, r) for r in range(4)] == [5, 5, 5, 3]
    assert [valid_len(9, 4, r) for r in range(4)] == [3, 3, 3, 0]  # the last rank is all padding
    with pytest.raises(ValueError, match="seq_len"):
        shard_len(0, 4)


def test_shard_pad_unpad_roundtrip():
    x = torch.arange(2 * 9 * 3, dtype=torch.float32).view(2, 9, 3)
    shards = [shard_sequence(x, 4, r) for r in range(4)]
    assert all(s.shape == (2, 3, 3) for s in shards)
    assert torch.equal(torch.cat([unpad_shard(s, 9, 4, r) for r, s in enumerate(shards)], dim=1), x)
    assert torch.equal(shards[3], torch.zeros(2, 3, 3))
    assert torch.equal(pad_shard(x[:, 8:], 9, 4), torch.cat([x[:, 8:], torch.zeros(2, 2, 3)], dim=1))
    with pytest.raises(ValueError, match="shard_len=3"):
        pad_shard(x[:, :4], 9, 4)
