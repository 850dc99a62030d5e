"""Launch choices of the fused 3D-DSA kernels: tile sizes, warps and register caps, and their defaults.

The defaults were picked by timing candidates on a GPU (`python -m experiments.gpu_check_dsa sweep=true`);
docs/dsa_kernels.md records those measurements and the result files they come from.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1)."""


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch: BLOCK_Q queries per program, d padded to block_d. block_y > 1 makes a
    program's queries a block_y x (block_q / block_y) patch of one frame (rows y, columns x) instead of
    block_q consecutive tokens, so that more of their windows' corner rows coincide (the forward's default,
    `forward_launch_config`). maxnreg caps the registers per thread (ptxas spills past it; None: the
    compiler's choice), trading spills for occupancy."""

    block_q: int
    block_d: int
    num_warps: int
    block_y: int = 1
    maxnreg: int | None = None

    def __post_init__(self):
        if self.block_y < 1 or self.block_q % self.block_y or self.block_y & (self.block_y - 1):
            raise ValueError(f"LaunchConfig: block_y={self.block_y} must be a power of two dividing "
                             f"block_q={self.block_q}")


RANKED_BIN_BLOCK = 32
"""Entries per block of the deterministic binning (`backward.bin_entries` with stripes) by default
(`KeyConfig.rank_block`): its fill ranks a block's records among themselves with a BLOCK x BLOCK comparison
(8 values per thread of 4 warps at 32); chosen by timing 16, 32 and 64 (docs/dsa_kernels.md)."""
RANK_BLOCKS = (16, 32, 64, 128)
"""The values `KeyConfig.rank_block` takes: powers of two (a Triton block) from 16, where the fill's serial steps
per program are 2x the default's, to 128, whose BLOCK x BLOCK comparison is 128 values per thread of 4 warps."""


@dataclass(frozen=True)
class KeyConfig:
    """Tiles of the backward's binning and key pass: key tiles of tile = (t, y, x) tokens (powers of two),
    BLOCK_E entries per dot, num_warps per key program; `capacity` records per capped list (None:
    `backward.list_capacity`, the records buffer split evenly; a small one forces the exact lists, for tests);
    maxnreg caps the key program's registers per thread (as `LaunchConfig.maxnreg`). rank_block: entries per
    block of the deterministic binning's ranked fill (one of RANK_BLOCKS): a smaller block makes fewer
    comparisons per entry (rank_block each) in more serial steps per fill program. Its lists hold their entries
    in (block, corner, entry) order, so another rank_block gives other bits, as fixed from run to run."""

    tile: tuple[int, int, int]
    block_e: int
    num_warps: int
    capacity: int | None = None
    maxnreg: int | None = None
    rank_block: int = RANKED_BIN_BLOCK

    def __post_init__(self):
        if self.rank_block not in RANK_BLOCKS:
            raise ValueError(f"KeyConfig.rank_block={self.rank_block}: entries per block of the deterministic "
                             f"binning must be one of {RANK_BLOCKS} (a power of two from 16 to 128)")


def query_programs(grid: tuple[int, int, int], config: LaunchConfig) -> int:
    """Programs per (batch, head) of a launch over the queries (or keys) of a (T, H, W) grid, as
    `sampling._query_block` numbers them."""
    T, H, W = grid
    if config.block_y == 1:
        return triton.cdiv(T * H * W, config.block_q)
    return T * triton.cdiv(H, config.block_y) * triton.cdiv(W, config.block_q // config.block_y)


LAUNCH_ELEMENTS = 1024
"""BLOCK_Q x block_d of the zero-offset kernels' programs (`launch_config`): their (BQ, block_d) tiles put
8 threads on a row of 64."""
SPLIT_WARP_ELEMENTS = 512
"""BLOCK_Q x block_d per warp of the kernels on split rows (rows.py): 16 elements of one token per thread."""


def head_dim_block(head_dim: int) -> int:
    """block_d of a head dim: the next power of two, at least 16 (padded columns are masked)."""
    return max(16, triton.next_power_of_2(head_dim))


def launch_config(n_tokens: int, head_dim: int, elements: int = LAUNCH_ELEMENTS, num_warps: int = 4) -> LaunchConfig:
    """Default tiles for N tokens and head dim d: BLOCK_Q * block_d = `elements` (BLOCK_Q in
    [8, elements / 32]) with `num_warps` warps. The per-query index and weight arithmetic is repeated by every
    thread that holds a piece of the query's row, so a thread should hold several 16-byte pieces of a
    row; more pieces cost registers and occupancy. The interpreter's cost is per operation, not per element,
    so there one program takes all of a (batch, head)'s tokens (up to 1024)."""
    block_d = head_dim_block(head_dim)
    if INTERPRETED:
        block_q = min(1024, max(16, triton.next_power_of_2(n_tokens)))
        return LaunchConfig(block_q=block_q, block_d=block_d, num_warps=1)
    return LaunchConfig(block_q=min(elements // 32, max(8, elements // block_d)), block_d=block_d,
                        num_warps=num_warps)


def split_launch_config(n_tokens: int, head_dim: int, num_warps: int = 2) -> LaunchConfig:
    """Default tiles of the kernels on split rows: `launch_config` at SPLIT_WARP_ELEMENTS per warp, so that
    each thread holds 16 elements of one query (4 threads on a row of 64); 2 warps for the query pass."""
    return launch_config(n_tokens, head_dim, SPLIT_WARP_ELEMENTS * num_warps, num_warps)


QUERY_MAXNREG = 128
"""Registers per thread of the backward query pass's default launch (`query_launch_config`): uncapped, the
pass takes more registers than let 8 programs of 2 warps share an SM; at 128 ptxas spills a few words
and 8 fit."""
MAXNREG_HEAD_DIM = 64
"""The widest block_d whose default launches cap registers (QUERY_MAXNREG, KEY_MAXNREG): at 128 the key
pass's dK / dV tiles alone take 128 registers a thread, so a cap there spills far more."""


def capped_registers(head_dim: int, maxnreg: int) -> int | None:
    """maxnreg for a default launch at head dim d: the cap up to MAXNREG_HEAD_DIM, else None (uncapped)."""
    return maxnreg if head_dim_block(head_dim) <= MAXNREG_HEAD_DIM else None


def query_launch_config(n_tokens: int, head_dim: int) -> LaunchConfig:
    """The backward query pass's default tiles: `split_launch_config`'s, registers capped at QUERY_MAXNREG
    where `capped_registers` allows (the interpreter ignores the cap)."""
    return replace(split_launch_config(n_tokens, head_dim), maxnreg=capped_registers(head_dim, QUERY_MAXNREG))


FORWARD_BLOCK_Y = 4
"""Rows of the query patch of the fused forward's default launch (`forward_launch_config`)."""


def forward_launch_config(n_tokens: int, head_dim: int) -> LaunchConfig:
    """The fused forward's default tiles: `split_launch_config`'s at 4 warps, its BLOCK_Q queries taken as a
    patch of FORWARD_BLOCK_Y rows of one frame where that leaves the patch at least as wide. Neighbouring
    rows' windows share corner rows that a run of consecutive tokens does not. The interpreter keeps its one
    program per (batch, head)."""
    config = split_launch_config(n_tokens, head_dim, num_warps=4)
    if INTERPRETED or config.block_q < FORWARD_BLOCK_Y ** 2:
        return config
    return replace(config, block_y=FORWARD_BLOCK_Y)


KEY_TILE_KEYS = 64
"""Keys per default key tile: the M of the key pass's dots. A larger tile builds more coefficient rows per
entry (the pass is bound by its L1 / shared-memory traffic), but each entry is listed in fewer tiles (about
1.95 for 4 x 4 x 4 tiles against 2.8 for 2 x 2 x 4)."""
KEY_MAXNREG = 128
"""Registers per thread of the default key programs: uncapped, the key pass leaves room for 2 programs of
4 warps per SM; at 128, 4 fit, for a few spilled words."""


def key_config(grid: tuple[int, int, int], head_dim: int) -> KeyConfig:
    """Default key tiles for a (T, H, W) grid and head dim d: KEY_TILE_KEYS keys, grown by doubling x, y, t in
    turn while an axis tile stays within the grid's next power of two (4 x 4 x 4 on a large grid,
    1 x 8 x 8 on one frame); 128 entries per block (64 in the interpreter), 4 warps, KEY_MAXNREG registers
    where `capped_registers` allows."""
    tile, limits = [1, 1, 1], [triton.next_power_of_2(s) for s in grid]
    while tile[0] * tile[1] * tile[2] < KEY_TILE_KEYS:
        grown = False
        for axis in (2, 1, 0):
            if tile[0] * tile[1] * tile[2] < KEY_TILE_KEYS and tile[axis] < limits[axis]:
                tile[axis] *= 2
                grown = True
        if not grown:
            break
    return KeyConfig(tile=tuple(tile), block_e=64 if INTERPRETED else 128, num_warps=4,
                     maxnreg=capped_registers(head_dim, KEY_MAXNREG))


BIN_BLOCK = 256
"""Entries per block of the binning's capped pass, its exact passes and the deterministic count: 2 per thread of 4
warps. Its entry loads and its atomics are latency-bound, so it pays to keep many programs resident (a larger
block takes more registers and lowers occupancy)."""
EXACT_PROGRAMS_PER_SM = 16
"""Programs per SM of an exact binning launch (`exact_programs`): 64 warps of 4, as many as an SM holds, so
that a launch with no overflowed list costs one wave of programs that return."""


def exact_programs(device: torch.device, blocks: int, lists_groups: int) -> int:
    """Programs along the entry blocks of an exact binning launch: EXACT_PROGRAMS_PER_SM per SM over all
    (batch, head)s on a GPU (each walks its own run of blocks), 2 in the interpreter (to walk the loop)."""
    if device.type != "cuda":
        return min(blocks, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(blocks, EXACT_PROGRAMS_PER_SM * sms // lists_groups))


def bin_stripes(device: torch.device, entries: int, tiles: int, lists_groups: int, block: int) -> int:
    """Stripes of the deterministic binning of `entries` (query, sample)s per (batch, head) over `tiles` key tiles
    in blocks of `block` entries (`KeyConfig.rank_block`): one program per stripe and (batch, head), as an exact
    launch has (`exact_programs` over the blocks), and at most entries / tiles, so that a stripe's count and cursor
    per list (2 int32 per list and stripe) take at most a quarter of the records buffer (8 int32 per entry)."""
    blocks = triton.cdiv(entries, block)
    return max(1, min(exact_programs(device, blocks, lists_groups), entries // tiles))


def stripe_entries(entries: int, stripes: int, block: int) -> int:
    """Entries per stripe of the deterministic binning of `entries` (query, sample)s in `stripes` stripes: the run
    of cdiv(blocks, stripes) blocks of `block` entries (`KeyConfig.rank_block`) that each of the fill's `stripes`
    programs walks (the last run shorter, or empty). Stripe s holds entries [s * this, (s + 1) * this); its records
    fill segment s of every list, and the count adds them there, whichever program counts them."""
    return block * triton.cdiv(triton.cdiv(entries, block), stripes)


@dataclass(frozen=True)
class HaloConfig:
    """Tile of the halo forward (halo.py): tile = (t, y, x) queries per program (powers of two, at least 16
    queries in all: the M of its score dot), num_warps per program."""

    tile: tuple[int, int, int]
    num_warps: int = 4

    def __post_init__(self):
        if any(s < 1 or s & (s - 1) for s in self.tile) or self.tile[0] * self.tile[1] * self.tile[2] < 16:
            raise ValueError(f"HaloConfig: tile={self.tile} must be powers of two with at least 16 queries in all")


def halo_config(reach: int) -> HaloConfig:
    """The halo forward's default tile for offsets of up to `reach` tokens: 2 x 4 x 4 queries up to reach 1
    (a 6 x 8 x 8 halo at a 3 x 3 x 3 window, 512 padded), 1 x 4 x 4 beyond (see
    constants.MAX_HALO_REACH). Not yet timed: `python -m experiments.bench_dsa_halo` times candidates."""
    return HaloConfig(tile=(2, 4, 4) if reach <= 1 else (1, 4, 4), num_warps=4)
