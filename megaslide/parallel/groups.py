"""Topology description and the 2D (ring x Ulysses) mesh of process groups.

Token order is fixed by the caller: the rank at position r of the sequence-parallel group
(the "SP rank") holds tokens [r * N_local, (r + 1) * N_local). A placement only decides which
SP ranks form which Ulysses and ring groups, i.e. which physical links each kind of traffic uses:

- "ulysses_intra" (the usual USP choice): SP rank = j * U + u. Ulysses groups are runs of U
  consecutive ranks (one node when U divides gpus_per_node); rings stride across nodes.
- "ring_intra" (SwiftFusion's choice): SP rank = u * R + j. Rings are runs of R consecutive
  ranks (fast intra-node links); Ulysses all-to-alls go across nodes.

Here j is the ring index (0..R-1) and u the Ulysses index (0..U-1). After the Ulysses
all-to-all, the rank at (j, u) holds heads chunk u of the tokens of SP ranks grid[j][0..U-1].

A process group of None means "no group: this process alone" (`group_size` 1, `group_rank` 0),
for the helpers here, the samplers of `megaslide.inference` and `parallel.apply.parallelize_dit`.
The collective ops of this package (`sequence_parallel_attention`, `seq_to_head`, `ring_attention`,
`build_mesh`, ...) keep torch.distributed's default argument instead, `group=None` for the world,
and turn it into the world group with `world_if_none` on entry, so no None reaches `group_size`
meaning anything else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megaslide.parallel.local_attn import Layout, layout_from_shards

PLACEMENTS = ("ulysses_intra", "ring_intra")


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; None (no group) is this process alone: 1."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside `group`; 0 for None (no group)."""
    return 0 if group is None else dist.get_rank(group)


def world_if_none(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The group a collective op runs over when its caller passed `group` (None: the world, the
    default argument of torch.distributed and of this package's collective ops)."""
    return dist.group.WORLD if group is None else group


@dataclass(frozen=True)
class Topology:
    """A cluster of `nodes` x `gpus_per_node` GPUs. Bandwidths are per GPU and per direction, GB/s:
    `intra_bw` to a GPU of the same node (NVLink), `inter_bw` to a GPU of another node (network)."""

    nodes: int
    gpus_per_node: int
    intra_bw: float
    inter_bw: float

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Topology needs nodes >= 1 and gpus_per_node >= 1, got {self.nodes}, "
                             f"{self.gpus_per_node}")
        if self.intra_bw <= 0 or self.inter_bw <= 0:
            raise ValueError(f"Topology bandwidths must be > 0 GB/s, got intra_bw={self.intra_bw}, "
                             f"inter_bw={self.inter_bw}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node


def rank_grid(ulysses_degree: int, ring_degree: int, placement: str) -> tuple[tuple[int, ...], ...]:
    """grid[j][u]: the SP rank at ring index j and Ulysses index u (see the module docstring)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: choose one of {PLACEMENTS}")
    if ulysses_degree < 1 or ring_degree < 1:
        raise ValueError(f"ulysses_degree and ring_degree must be >= 1, got {ulysses_degree}, {ring_degree}")
    u_deg, r_deg = ulysses_degree, ring_degree
    if placement == "ulysses_intra":
        return tuple(tuple(j * u_deg + u for u in range(u_deg)) for j in range(r_deg))
    return tuple(tuple(u * r_deg + j for u in range(u_deg)) for j in range(r_deg))


def ulysses_groups(grid) -> list[list[int]]:
    """SP ranks of each Ulysses group (one per ring index), in Ulysses order."""
    return [list(row) for row in grid]


def ring_groups(grid) -> list[list[int]]:
    """SP ranks of each ring (one per Ulysses index), in ring order."""
    return [[row[u] for row in grid] for u in range(len(grid[0]))]


@dataclass(frozen=True)
class SPMesh:
    """This rank's view of a ring x Ulysses mesh. A group is None when its degree is 1 (no group).

    `parent` is the group the mesh divides (`build_mesh` sets it; None for a mesh made by hand)."""

    ulysses_degree: int
    ring_degree: int
    placement: str
    grid: tuple[tuple[int, ...], ...]
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    ulysses_rank: int
    ring_rank: int
    parent: dist.ProcessGroup | None = None

    def ring_layouts(self, shard_len: int) -> tuple[Layout, ...]:
        """Global token positions held by each ring member after the Ulysses all-to-all."""
        return tuple(layout_from_shards(row, shard_len) for row in self.grid)


_MESH_CACHE: dict[tuple, SPMesh] = {}


def build_mesh(ulysses_degree: int, ring_degree: int, placement: str = "ulysses_intra", *,
               group: dist.ProcessGroup | None = None, topology: Topology | None = None) -> SPMesh:
    """Create (or reuse) the process groups of a ring x Ulysses mesh over `group` (default: world).

    Collective: every rank of `group` must call it with the same arguments; new groups are
    created in the same order on every rank, as torch.distributed requires. A degree equal to
    the group size reuses `group` itself; a degree of 1 makes no group."""
    group = world_if_none(group)
    world = dist.get_world_size(group)
    if ulysses_degree * ring_degree != world:
        raise ValueError(f"ulysses_degree ({ulysses_degree}) x ring_degree ({ring_degree}) must equal the "
                         f"sequence-parallel group size ({world})")
    if topology is not None and topology.world_size != world:
        raise ValueError(f"topology has {topology.world_size} GPUs ({topology.nodes} nodes x "
                         f"{topology.gpus_per_node}) but the group has {world} ranks")
    global_ranks = tuple(dist.get_process_group_ranks(group))
    key = (global_ranks, ulysses_degree, ring_degree, placement)
    if key not in _MESH_CACHE:
        _MESH_CACHE[key] = _create_mesh(ulysses_degree, ring_degree, placement, group, global_ranks)
    return _MESH_CACHE[key]


def release_meshes() -> None:
    """Forget the cached meshes, and with them this module's references to their process groups.

    Call after `dist.destroy_process_group()`: a gloo group's worker threads end only when its last
    reference goes, and threads still alive while the interpreter exits can abort the process
    (SIGABRT, "terminate called without an active exception")."""
    _MESH_CACHE.clear()


def _create_mesh(u_deg: int, r_deg: int, placement: str, parent: dist.ProcessGroup, global_ranks) -> SPMesh:
    grid = rank_grid(u_deg, r_deg, placement)
    me = dist.get_rank(parent)
    ring_idx, u_idx = next((j, u) for j, row in enumerate(grid) for u, r in enumerate(row) if r == me)

    def make(members_per_group: list[list[int]], degree: int, mine: int):
        if degree == 1:
            return None
        if degree == len(global_ranks):
            return parent
        created = [dist.new_group([global_ranks[r] for r in members]) for members in members_per_group]
        return created[mine]

    u_group = make(ulysses_groups(grid), u_deg, ring_idx)
    r_group = make(ring_groups(grid), r_deg, u_idx)
    return SPMesh(u_deg, r_deg, placement, grid, u_group, r_group, u_idx, ring_idx, parent)
