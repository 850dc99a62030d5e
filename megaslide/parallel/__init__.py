"""Sequence-parallel attention (SwiftFusion): Ulysses, Ring, their hybrid, Torus overlap.

Public entry point: `sequence_parallel_attention`. Building blocks: `seq_to_head` /
`head_to_seq` (Ulysses all-to-all), `build_mesh` / `Topology` (placement of the 2D mesh),
padding helpers for N not divisible by P, `can_use_symm_mem` (one-sided transport) and the
cost model (`cost_model.predict`, `cost_model.rank_plans`). `apply.parallelize_dit` applies a
mode to a built VideoDiT (each block's attention swapped for its SP form); `watchdog` turns a call that cannot
finish into an error naming the mode and rank.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaslide.parallel.groups import PLACEMENTS, SPMesh, Topology, build_mesh, group_rank, group_size, world_if_none
from megaslide.parallel.hybrid import hybrid_attention
from megaslide.parallel.onesided import TRANSPORTS, can_use_symm_mem
from megaslide.parallel.padding import pad_shard, shard_len, shard_sequence, unpad_shard, valid_len
from megaslide.parallel.ring import ring_attention
from megaslide.parallel.torus import torus_attention
from megaslide.parallel import watchdog
from megaslide.parallel.ulysses import head_to_seq, seq_to_head, ulysses_attention

MODES = ("ulysses", "ring", "hybrid", "torus")


@dataclass(frozen=True)
class SPOptions:
    """Everything a mode needs besides q, k, v (see `sequence_parallel_attention`)."""

    group: dist.ProcessGroup
    ulysses_degree: int
    ring_degree: int
    causal: bool
    seq_len: int | None
    placement: str
    transport: str
    chunks: int | None

    def mesh(self) -> SPMesh:
        return build_mesh(self.ulysses_degree, self.ring_degree, self.placement, group=self.group)


_RUNNERS: dict[str, Callable[..., torch.Tensor]] = {
    "ulysses": lambda q, k, v, o: ulysses_attention(q, k, v, o.group, causal=o.causal, seq_len=o.seq_len),
    "ring": lambda q, k, v, o: ring_attention(q, k, v, o.group, causal=o.causal, seq_len=o.seq_len,
                                              transport=o.transport),
    "hybrid": lambda q, k, v, o: hybrid_attention(q, k, v, o.mesh(), causal=o.causal, seq_len=o.seq_len,
                                                  transport=o.transport),
    "torus": lambda q, k, v, o: torus_attention(q, k, v, o.mesh(), causal=o.causal, seq_len=o.seq_len,
                                                chunks=o.chunks, transport=o.transport),
}


def resolve_degrees(mode: str, world: int, heads: int, ulysses_degree: int | None,
                    ring_degree: int | None) -> tuple[int, int]:
    """(ulysses_degree, ring_degree) for `mode` on `world` ranks, checked; ValueError says the fix."""
    fixed = {"ulysses": (world, 1), "ring": (1, world)}
    if mode in fixed:
        u, r = fixed[mode]
        if ulysses_degree not in (None, u) or ring_degree not in (None, r):
            raise ValueError(f"mode={mode!r} on {world} ranks means ulysses_degree={u}, ring_degree={r}; got "
                             f"{ulysses_degree}, {ring_degree}: drop them or use mode='hybrid'")
    elif ulysses_degree is None and ring_degree is None:
        if mode == "hybrid":
            raise ValueError("mode='hybrid' needs ulysses_degree and/or ring_degree (their product = group size "
                             f"{world}); `cost_model.rank_plans` can pick them")
        u, r = world, 1
    else:
        given = ulysses_degree if ulysses_degree is not None else ring_degree
        if given < 1 or world % given:
            raise ValueError(f"degree {given} does not divide the group size {world}")
        u = ulysses_degree if ulysses_degree is not None else world // ring_degree
        r = ring_degree if ring_degree is not None else world // ulysses_degree
        if u * r != world:
            raise ValueError(f"ulysses_degree ({u}) x ring_degree ({r}) must equal the group size ({world})")
    if heads % u:
        raise ValueError(f"heads={heads} is not divisible by ulysses_degree={u}: choose a ulysses_degree "
                         f"that divides the head count (or mode='ring' / 'hybrid' with a smaller one)")
    return u, r


def check_options(mode: str, placement: str, transport: str) -> None:
    """ValueError naming the option and its choices unless mode, placement and transport are known."""
    for name, value, known in (("mode", mode, MODES), ("placement", placement, PLACEMENTS),
                               ("transport", transport, TRANSPORTS)):
        if value not in known:
            raise ValueError(f"{name}={value!r}: choose one of {known}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, world: int,
                  seq_len: int | None, placement: str, transport: str) -> None:
    check_options(mode, placement, transport)
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must all be (B, N_local, heads, d) of one shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype and device; got {q.dtype}/{k.dtype}/{v.dtype} "
                         f"on {q.device}/{k.device}/{v.device}")
    if seq_len is not None and not 1 <= seq_len <= world * q.shape[1]:
        raise ValueError(f"seq_len={seq_len} must be in [1, {world * q.shape[1]}] (group size {world} x "
                         f"N_local {q.shape[1]}); pad shards with megaslide.parallel.pad_shard")


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mode: str,
                                group: dist.ProcessGroup | None = None, ulysses_degree: int | None = None,
                                ring_degree: int | None = None, causal: bool = False, seq_len: int | None = None,
                                placement: str = "ulysses_intra", transport: str = "p2p",
                                chunks: int | None = None) -> torch.Tensor:
    """Full softmax attention (scale d**-0.5) over a sequence sharded across `group`.

    q, k, v: (B, N_local, heads, d), this rank's contiguous shard: SP rank r (its rank in `group`,
    default the world) holds tokens [r * N_local, (r + 1) * N_local). Every rank must pass the
    same N_local; for N not divisible by P use `shard_sequence` / `pad_shard` and pass `seq_len=N`
    so that padded keys get no attention. Returns this rank's output shard (B, N_local, heads, d).
    Differentiable with respect to q, k, v.

    mode: "ulysses" (all-to-all, heads divisible by P), "ring" (K/V passed around the ring),
      "hybrid" (Ulysses x Ring; give ulysses_degree and/or ring_degree, product P), "torus"
      (hybrid with the all-to-all chunked by heads and overlapped with attention; default
      ulysses_degree = P).
    placement: "ulysses_intra" (Ulysses groups are consecutive ranks, i.e. inside a node) or
      "ring_intra" (rings are consecutive ranks); see `groups.py`.
    transport: how ring K/V moves in the forward: "p2p" (isend/irecv), "symm_mem" (one-sided
      gets from symmetric memory; CUDA + NCCL only, else ValueError), "auto" (symm_mem if usable).
    chunks: Torus head chunks per rank (default min(heads / ulysses_degree, 4)).
    Under an armed `watchdog`, a call whose work (host or device) cannot finish ends the process with an
    error naming the mode and the rank.
    """
    group = world_if_none(group)
    world = group_size(group)
    _check_inputs(q, k, v, mode, world, seq_len, placement, transport)
    u, r = resolve_degrees(mode, world, q.shape[2], ulysses_degree, ring_degree)
    opts = SPOptions(group, u, r, causal, seq_len, placement, transport, chunks)
    with watchdog.guard(f"mode={mode!r} transport={transport!r}"):
        return _RUNNERS[mode](q, k, v, opts)


__all__ = [
    "MODES", "PLACEMENTS", "TRANSPORTS", "SPMesh", "SPOptions", "Topology", "build_mesh", "can_use_symm_mem",
    "check_options", "group_rank", "group_size", "head_to_seq", "pad_shard", "resolve_degrees", "seq_to_head",
    "sequence_parallel_attention", "shard_len", "shard_sequence", "unpad_shard", "valid_len",
]
