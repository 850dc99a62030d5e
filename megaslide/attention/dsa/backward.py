"""The fused 3D-DSA backward without float atomics: a query pass, key-tile binning and a key pass.

Why this shape. Each query's softmax is over its own K samples, so a query pass
recomputes the probabilities p_j = exp(s_j - lse) from the saved log-sum-exp and finishes dq
and d(offsets) for its queries without any communication (dq = sum_j scale * ds_j * K_j, with
ds_j = p_j (<dO, V_j> - <dO, out>); like flash-attention, <dO, out> uses the stored out, rounded
to the input dtype). The offset gradient is the derivative of the trilinear weights:
d(weight of corner c)/d(position_t) = +-w_y w_x (sign + for the upper neighbour), times 1 where
the raw position lies inside [0, S - 1] and 0 where the clamp is active (torch.clamp's gradient,
boundaries inclusive). Only dK and dV cross programs: sample j of query n adds
w_c * scale * ds_j * q_n to dK and w_c * p_j * dO_n to dV at each of its 8 corner tokens. The
query pass stores ds_j, p_j and the sample's clamped position; the (query, sample) entries are
binned by the key tiles their corners touch; a key pass per key tile sums its entries'
contributions with tensor-core dots and writes dk / dv once: no float atomics.

Layout as forward.py: q, k, v, out, dout and their gradients contiguous (B, T, H, W, heads, d),
offsets and d(offsets) contiguous (B, T, H, W, heads, K, 3). Every launch sees one head group
(`dsa_backward`): its q-like pointers start at the group's first head and keep the full
tensors' token strides, HEADS is the group's size. An entry is one (query n, sample j) of one
(batch, head), numbered e = j * N + n (int32, < K * N).

1. Query pass (`_query_kernel`, one program per BLOCK_Q queries of a (batch, head), their head vectors and
   the gathered corners held as split rows: rows.py): recomputes
   p_j = exp(s_j - lse) and finishes dq and d(offsets) of its queries (no other program writes
   them), and stores each entry into the scratch `dsp` (B, HEADS, K, N, ENTRY_FLOATS): fp32
   ds = p (<dO, V_j> - <dO, out>) * scale, p and the sample's clamped (t, y, x) position, padded to
   one aligned 32-byte sector, so that the later passes read an entry with one load and never
   recompute its position from the offsets (whose 3 words per entry lie a token row apart).
2. Binning (`bin_entries`, reading the entries' positions): the key grid is cut into tiles of
   TT x TY x TX tokens (a box of the (T, H, W) grid, the last ones partial). A sample's corners with
   nonzero weight lie in the tiles of its lower corner and, along each axis where the fraction is
   nonzero and the upper neighbour lies in the next tile, that tile too: 1 to 8 tiles. One pass
   (`_bin_capped_kernel`) takes a slot per (entry, tile) from the list's int32 cursor (atomic) and writes
   e there, each list in a fixed room of `capacity` records (by default the records buffer split evenly,
   about 4x a mean list). Offsets that pile samples onto a few tiles (far, clamped ones, say) can overflow
   a room; the pass then sets a flag on the device, and two more passes (`_bin_kernel`, which return at
   once when the flag is clear: no host sync) build exact lists: the first counts the entries per
   (batch, head, tile), `torch.cumsum` makes the exclusive starts, the second takes slots from cursors
   at the starts. The order inside a list is the order in which programs took slots, so
   it varies from run to run on a GPU, and with it the fp32 summation order of dK / dV
   (rounding-level differences; the interpreter runs programs in order and is deterministic). Under
   `torch.use_deterministic_algorithms(True)` only the exact lists are built, in stripes: the entries are cut
   into runs of blocks of `KeyConfig.rank_block` entries, one per fill program (`launch.bin_stripes`,
   `launch.stripe_entries`), and each list into one segment per stripe (a count and a cursor per list and
   stripe). The count takes one program per entry block, which adds its records to its stripe's counts
   (integer atomics: the same counts in any order); the counts' prefix sum places the segments one after the
   other, and each fill program walks its stripe, giving each record the slot of its rank in entry order
   (`_ranked_slots`: no atomics). So every list holds its entries in the same order every run, and dK / dV
   are the same bits. No sort: the stripes' counts and cursors take at most a quarter of the records
   buffer's bytes (outside the scratch bound).
3. Key pass (`_key_kernel`, one program per (batch, head, key tile)): holds the tile's dK and dV
   (KEYS x d, fp32) in registers and walks its list BLOCK_E entries at a time: reads each entry,
   takes its corners and 1D weights from the stored position (sampling._axis_corners, as the forward),
   builds the coefficients C[key, e] = w_t(key_t, e) w_y(key_y, e) w_x(key_x, e), the entry's
   trilinear weight at that key (0 off its corners), as outer products of the per-axis weights (a tile
   is a box, so each axis needs only its own extent's weights), gathers the entries' query rows q_n
   and dO_n (BLOCK_E x d, input dtype) and accumulates dK += (C * ds) @ Q, dV += (C * p) @ dO on tensor
   cores; the next block's list slots are loaded before this block's dots. fp16 / bf16 rows are exact
   in their dtype; the fp32 coefficients C * ds and C * p are rounded to that dtype for the dot (fp32
   accumulation), as flash-attention's backward rounds P and dS for its dK / dV dots: each product is
   then good to the input dtype's precision, as dk / dv themselves are; fp32 inputs use an IEEE fp32
   dot. It writes dk / dv once, in the input dtype: no zero fill, no fp32 dK / dV buffer.

Head groups. The backward's scratch (a 32-byte entry per (query, sample), the key tiles' entry
lists: `constants.backward_scratch_bytes` per token and head) of all heads could exceed memory, so the
backward runs over groups of heads: one set of launches per group, reusing one scratch of at
most `constants.SCRATCH_BYTES` (never less than one head). A launch sees only its group: the q-like
pointers (q, k, v, out, dout, dq, dk, dv, offsets, d(offsets)) start at the group's first head
and keep the full tensors' token strides, HEADS is the group's size and the lse is the group's
(B, group, N). A program does exactly the work it did in one launch over all heads.

Scratch per head group (bounded by `constants.SCRATCH_BYTES` through the group size,
`constants.backward_scratch_bytes`): dsp 32 bytes per entry, records 4 bytes per (entry, tile) with room
for 8 tiles per entry (the worst case; about 1.95 on average for 4 x 4 x 4 tiles, 2.8 for 2 x 2 x 4), the
capped lists' cursors, the exact lists' starts and their cursors 4 bytes per tile each.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from megaslide.attention.dsa.constants import (ENTRY_FLOATS, LOG2E, MAX_TILES_PER_ENTRY, SCRATCH_BYTES,
                                               backward_scratch_bytes)
from megaslide.attention.dsa.launch import (BIN_BLOCK, INTERPRETED, RANKED_BIN_BLOCK, KeyConfig, LaunchConfig,
                                            bin_stripes, exact_programs, query_launch_config, query_programs,
                                            stripe_entries)
from megaslide.attention.dsa.launch import key_config as default_key_config
from megaslide.attention.dsa.rows import (_load_rows, _load_split, _split_axpy, _split_dot, _split_zeros, _store_split,
                                          _token_rows, row_flags)
from megaslide.attention.dsa.sampling import _axis_corners, _corner_axes, _query_block, _sample_axes, _window_start
from megaslide.backends import device_guard


def padded_x(tile: tuple[int, int, int]) -> int:
    """The key pass's x extent of a key tile: TX, padded so that a tile has at least the 16 key rows
    that a tensor-core dot needs (the padding keys are computed and never stored)."""
    return max(tile[2], triton.cdiv(16, tile[0] * tile[1]))


def tiles_per_axis(grid: tuple[int, int, int], tile: tuple[int, int, int]) -> tuple[int, int, int]:
    """Key tiles along t, y, x (the last ones partial)."""
    return tuple(triton.cdiv(s, t) for s, t in zip(grid, tile))


@triton.jit
def _query_kernel(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, dout_ptr, lse_ptr, dq_ptr, doff_ptr, dsp_ptr,
                  T, H, W, HEADS, D, stride_tok, stride_off_tok, scale, qk_scale,
                  KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, OFFSET_GRAD: tl.constexpr, ENTRY: tl.constexpr,
                  WIDE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_Y: tl.constexpr):
    b, h, N, n, q_valid, t, y, x = _query_block(T, H, W, HEADS, BLOCK_Q, BLOCK_Y)
    head_off = b * N * stride_tok + h * D
    k_bh = k_ptr + head_off
    v_bh = v_ptr + head_off
    q = _load_split(q_ptr + head_off, n, stride_tok, D, BLOCK_D, WIDE, EVEN_D)  # split rows (rows.py)
    do = _load_split(dout_ptr + head_off, n, stride_tok, D, BLOCK_D, WIDE, EVEN_D)
    delta = _split_dot(do, _load_split(out_ptr + head_off, n, stride_tok, D, BLOCK_D, WIDE, EVEN_D))  # (BQ,) <dO, out>
    lse = tl.load(lse_ptr + (b * HEADS + h) * N + n)  # (BQ,) log2 units
    off_row = b * N * stride_off_tok + h * (KT * KH * KW * 3) + n.to(tl.int64) * stride_off_tok  # (BQ,)
    off_q = off_ptr + off_row
    doff_q = doff_ptr + off_row
    fields = tl.arange(0, ENTRY)  # (F,) an entry's words
    dsp_q = (dsp_ptr + (b * HEADS + h) * (KT * KH * KW) * N * ENTRY
             + n.to(tl.int64)[:, None] * ENTRY + fields[None, :])  # (BQ, F) entry (n, j = 0) of dsp

    t_start = _window_start(t, KT, T)  # (BQ,)
    y_start = _window_start(y, KH, H)
    x_start = _window_start(x, KW, W)

    dq = _split_zeros(BLOCK_Q, BLOCK_D)
    for it in range(KT):
        for iy in range(KH):
            for ix in range(KW):
                j = (it * KH + iy) * KW + ix
                st, sy, sx = _sample_axes(off_q, j, (t_start, y_start, x_start), (it, iy, ix), (T, H, W))
                t_idx, y_idx, x_idx, t_w, y_w, x_w = _corner_axes(st, sy, sx)
                in_t, pos_t, in_y, pos_y, in_x, pos_x = st[3], st[4], sy[3], sy[4], sx[3], sx[4]

                # sampled key, <dO, sampled value> and, for the offset gradient, the position
                # derivatives of <q, sampled key> and <dO, sampled value>
                k_sample = _split_zeros(BLOCK_Q, BLOCK_D)
                dov = tl.zeros([BLOCK_Q], tl.float32)
                gk_t = tl.zeros([BLOCK_Q], tl.float32)
                gk_y = tl.zeros([BLOCK_Q], tl.float32)
                gk_x = tl.zeros([BLOCK_Q], tl.float32)
                gv_t = tl.zeros([BLOCK_Q], tl.float32)
                gv_y = tl.zeros([BLOCK_Q], tl.float32)
                gv_x = tl.zeros([BLOCK_Q], tl.float32)
                for ct in tl.static_range(2):
                    for cy in tl.static_range(2):
                        for cx in tl.static_range(2):
                            tok = (t_idx[ct] * H + y_idx[cy]) * W + x_idx[cx]  # (BQ,)
                            w = t_w[ct] * y_w[cy] * x_w[cx]  # (BQ,)
                            dw_t = (2 * ct - 1) * y_w[cy] * x_w[cx]  # (BQ,) d w / d pos_t
                            dw_y = (2 * cy - 1) * t_w[ct] * x_w[cx]
                            dw_x = (2 * cx - 1) * t_w[ct] * y_w[cy]
                            k_c = _load_split(k_bh, tok, stride_tok, D, BLOCK_D, WIDE, EVEN_D)
                            v_c = _load_split(v_bh, tok, stride_tok, D, BLOCK_D, WIDE, EVEN_D)
                            k_sample = _split_axpy(k_sample, w, k_c)
                            dov_c = _split_dot(do, v_c)  # (BQ,)
                            dov += w * dov_c
                            if OFFSET_GRAD:
                                qk_c = _split_dot(q, k_c)  # (BQ,)
                                gk_t += dw_t * qk_c
                                gk_y += dw_y * qk_c
                                gk_x += dw_x * qk_c
                                gv_t += dw_t * dov_c
                                gv_y += dw_y * dov_c
                                gv_x += dw_x * dov_c

                s = _split_dot(q, k_sample) * qk_scale  # (BQ,) log2 units
                p = tl.exp2(s - lse)  # (BQ,) softmax probability of sample j
                ds = p * (dov - delta) * scale  # (BQ,) d loss / d <q, sampled key>
                dq = _split_axpy(dq, ds, k_sample)
                entry = tl.where(fields == 0, ds[:, None], tl.where(fields == 1, p[:, None], tl.where(
                    fields == 2, pos_t[:, None], tl.where(fields == 3, pos_y[:, None], tl.where(
                        fields == 4, pos_x[:, None], 0.0)))))  # (BQ, F) what binning and the key pass read
                tl.store(dsp_q + j * N * ENTRY, entry, mask=q_valid[:, None])
                if OFFSET_GRAD:
                    g_t = tl.where(in_t, ds * gk_t + p * gv_t, 0.0)  # (BQ,)
                    g_y = tl.where(in_y, ds * gk_y + p * gv_y, 0.0)
                    g_x = tl.where(in_x, ds * gk_x + p * gv_x, 0.0)
                    doff_ty = doff_ptr.dtype.element_ty
                    tl.store(doff_q + 3 * j, g_t.to(doff_ty), mask=q_valid)
                    tl.store(doff_q + 3 * j + 1, g_y.to(doff_ty), mask=q_valid)
                    tl.store(doff_q + 3 * j + 2, g_x.to(doff_ty), mask=q_valid)

    _store_split(dq_ptr + head_off, n, stride_tok, D, dq, q_valid, BLOCK_D, WIDE)


@triton.jit
def _entry_field(entries, fields, i: tl.constexpr):
    """Word i (E,) of entries (E, F) whose columns are fields (F,)."""
    return tl.sum(tl.where(fields[None, :] == i, entries, 0.0), axis=1)


@triton.jit
def _entries(dsp_bh, e, valid, T, H, W, ENTRY: tl.constexpr):
    """The scratch entries e (E,) int32 of one (batch, head), dsp_bh pointing at its first: one aligned
    (E, ENTRY) load. Returns ds, p (E,) (0 where not valid) and per axis (lower, upper, frac) (E,) of
    the clamped position the query pass stored (`_axis_corners`: the forward's corners)."""
    fields = tl.arange(0, ENTRY)  # (F,)
    entries = tl.load(dsp_bh + e.to(tl.int64)[:, None] * ENTRY + fields[None, :], mask=valid[:, None],
                      other=0.0)  # (E, F)
    t0, t1, ft = _axis_corners(_entry_field(entries, fields, 2), T)
    y0, y1, fy = _axis_corners(_entry_field(entries, fields, 3), H)
    x0, x1, fx = _axis_corners(_entry_field(entries, fields, 4), W)
    return _entry_field(entries, fields, 0), _entry_field(entries, fields, 1), t0, t1, ft, y0, y1, fy, x0, x1, fx


@triton.jit
def _touched_tiles(dsp_bh, block, T, H, W, K: tl.constexpr, TT: tl.constexpr, TY: tl.constexpr, TX: tl.constexpr,
                   BLOCK: tl.constexpr, ENTRY: tl.constexpr):
    """Entries e (E,) of entry block `block` of one (batch, head) (dsp_bh: its first entry) and, per axis,
    the key tiles (lower, upper) (E,) of their corners and whether each is used (lower, upper) (E,): the
    lower corner's tile always, the next where the upper corner has weight and lies past it."""
    e = block * BLOCK + tl.arange(0, BLOCK)  # (E,)
    valid = e < T * H * W * K
    _, _, t0, t1, ft, y0, y1, fy, x0, x1, fx = _entries(dsp_bh, e, valid, T, H, W, ENTRY)
    t_tile, y_tile, x_tile = (t0 // TT, t1 // TT), (y0 // TY, y1 // TY), (x0 // TX, x1 // TX)
    t_used = (valid, valid & (ft != 0.0) & (t_tile[1] != t_tile[0]))
    y_used = (valid, valid & (fy != 0.0) & (y_tile[1] != y_tile[0]))
    x_used = (valid, valid & (fx != 0.0) & (x_tile[1] != x_tile[0]))
    return e, (t_tile, y_tile, x_tile), (t_used, y_used, x_used)


@triton.jit
def _corner_tile(tiles, used, ct: tl.constexpr, cy: tl.constexpr, cx: tl.constexpr, TILES_Y, TILES_X):
    """Whether corner (ct, cy, cx) of each entry touches a tile of its own (E,), and that tile's index (E,)."""
    touched = used[0][ct] & used[1][cy] & used[2][cx]
    return touched, (tiles[0][ct] * TILES_Y + tiles[1][cy]) * TILES_X + tiles[2][cx]


@triton.jit
def _bin_capped_kernel(dsp_ptr, cursor_ptr, records_ptr, flag_ptr, T, H, W, TILES_Y, TILES_X, TILES, CAP,
                       K: tl.constexpr, TT: tl.constexpr, TY: tl.constexpr, TX: tl.constexpr, BLOCK: tl.constexpr,
                       ENTRY: tl.constexpr):
    """Per (entry, touched tile): take a slot from the list's cursor (cursor_ptr: (B * HEADS, TILES) int32,
    zeroed) and, while the list has room (slot < CAP), write e at records[list * CAP + slot]. A slot past
    the room sets flag_ptr[0] to 1: the lists overflowed, and `bin_entries` builds the exact ones."""
    bh = tl.program_id(1)
    e, tiles, used = _touched_tiles(dsp_ptr + bh.to(tl.int64) * K * T * H * W * ENTRY, tl.program_id(0),
                                    T, H, W, K, TT, TY, TX, BLOCK, ENTRY)
    for ct in tl.static_range(2):
        for cy in tl.static_range(2):
            for cx in tl.static_range(2):
                touched, tile = _corner_tile(tiles, used, ct, cy, cx, TILES_Y, TILES_X)
                lst = bh * TILES + tile  # (E,)
                slot = tl.atomic_add(cursor_ptr + lst, 1, mask=touched, sem="relaxed")  # (E,) the old cursor
                tl.store(records_ptr + lst * CAP + slot, e, mask=touched & (slot < CAP))
                tl.atomic_max(flag_ptr + tl.zeros_like(slot), 1, mask=touched & (slot >= CAP), sem="relaxed")


@triton.jit
def _ranked_slots(slot_at, touched, tile, BLOCK: tl.constexpr):
    """Deterministic slots for one corner's records (E,) of a block: each record's slot is its list segment's
    cursor (slot_at (E,) pointers, read by this program alone) plus the count of earlier records of the block in
    the same list, and each cursor then moves past them all. The barriers order every thread's read of the
    cursors before any update, and the updates before the next corner's reads."""
    idx = tl.arange(0, BLOCK)
    same = (tile[:, None] == tile[None, :]) & touched[None, :]  # (E, E) record j lies in record i's list
    rank = tl.sum((same & (idx[None, :] < idx[:, None])).to(tl.int32), axis=1)  # (E,) same-list records before it
    total = tl.sum(same.to(tl.int32), axis=1)  # (E,) the block's records in its list
    base = tl.load(slot_at, mask=touched, other=0, volatile=True)
    tl.debug_barrier()
    tl.store(slot_at, base + total, mask=touched)  # the same value from every record of one list
    tl.debug_barrier()
    return base + rank


@triton.jit
def _bin_kernel(dsp_ptr, slot_ptr, records_ptr, flag_ptr, T, H, W, TILES_Y, TILES_X, TILES, BLOCKS, STRIPES,
                STRIPE_ENTRIES, K: tl.constexpr, TT: tl.constexpr, TY: tl.constexpr, TX: tl.constexpr,
                BLOCK: tl.constexpr, FILL: tl.constexpr, RANKED: tl.constexpr, ENTRY: tl.constexpr):
    """The exact lists, built only where flag_ptr[0] is set: per (entry, touched tile) count (slot_ptr: counts
    (B * HEADS, TILES, STRIPES) int32, zeroed) or, with FILL, take a slot from the cursor (slot_ptr: cursors,
    the segments' starts) and write e there. Each list has STRIPES segments; entry e's records go to segment
    e // STRIPE_ENTRIES. Each program walks its own run of the BLOCKS entry blocks: a few programs, so that a
    launch with nothing to do costs little, or one program per block (the deterministic count: integer atomics
    give the same counts in any order). STRIPES = 1: one segment per list, slots taken with atomics (their order
    varies from run to run). RANKED fill: one program per stripe, whose run is the stripe's entries, so it alone
    owns that segment of every list and ranks its records there in entry order (`_ranked_slots`)."""
    bh = tl.program_id(1)
    if tl.load(flag_ptr) != 0:
        dsp_bh = dsp_ptr + bh.to(tl.int64) * K * T * H * W * ENTRY
        per_program = tl.cdiv(BLOCKS, tl.num_programs(0))
        block = tl.program_id(0) * per_program
        stop = tl.minimum(block + per_program, BLOCKS)
        while block < stop:
            e, tiles, used = _touched_tiles(dsp_bh, block, T, H, W, K, TT, TY, TX, BLOCK, ENTRY)
            segment = e // STRIPE_ENTRIES  # (E,) each entry's segment of its lists (0 with one stripe)
            for ct in tl.static_range(2):
                for cy in tl.static_range(2):
                    for cx in tl.static_range(2):
                        touched, tile = _corner_tile(tiles, used, ct, cy, cx, TILES_Y, TILES_X)
                        slot_at = slot_ptr + (bh * TILES + tile) * STRIPES + segment  # (E,)
                        if RANKED:
                            tl.store(records_ptr + _ranked_slots(slot_at, touched, tile, BLOCK), e, mask=touched)
                        else:
                            slot = tl.atomic_add(slot_at, 1, mask=touched, sem="relaxed")
                            if FILL:
                                tl.store(records_ptr + slot, e, mask=touched)
            block += 1


@triton.jit
def _key_weights(key_pos, lower, upper, frac):
    """(KEYS, E) 1D trilinear weight of keys at positions key_pos (KEYS,) for entries with
    corners lower, upper (E,) and fraction frac (E,): 1 - frac at lower, frac at upper (summed
    where they coincide), 0 elsewhere."""
    at_lower = tl.where(key_pos[:, None] == lower[None, :], 1.0 - frac[None, :], 0.0)
    return at_lower + tl.where(key_pos[:, None] == upper[None, :], frac[None, :], 0.0)


@triton.jit
def _dot_acc(acc, coef, rows, UPCAST: tl.constexpr):
    """acc (KEYS, BD) fp32 += coef (KEYS, E) fp32 @ rows (E, BD): fp16 / bf16 rows as one dot with the
    coefficients rounded to their dtype (fp32 accumulation), as flash-attention's backward rounds P and dS
    before its dK / dV dots; fp32 rows as one IEEE fp32 dot. UPCAST (the interpreter, whose bf16 tl.dot
    multiplies raw bits: numpy has no bf16) runs the dot on the rounded coefficients and rows cast to
    fp32, which gives the same products (exact in fp32)."""
    if rows.dtype == tl.float32:
        return tl.dot(coef, rows, acc, input_precision="ieee")
    rounded = coef.to(rows.dtype)
    if UPCAST:
        return tl.dot(rounded.to(tl.float32), rows.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(rounded, rows, acc)


@triton.jit
def _key_kernel(q_ptr, dout_ptr, dsp_ptr, cursor_ptr, starts_ptr, flag_ptr, records_ptr, dk_ptr, dv_ptr,
                T, H, W, HEADS, D, stride_tok, TILES_Y, TILES_X, TILES, CAP, STRIPES, K: tl.constexpr,
                TT: tl.constexpr, TY: tl.constexpr, TX: tl.constexpr, PX: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, ENTRY: tl.constexpr,
                WIDE: tl.constexpr, EVEN_D: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HEADS).to(tl.int64)
    h = bh % HEADS
    N = T * H * W
    cols = tl.arange(0, BLOCK_D)  # (BD,)
    col_ok = (cols < D)[None, :]  # (1, BD)

    # this tile's keys, row-major over (TT, TY, PX): PX >= TX pads the x extent so that the dots have at
    # least 16 rows; the padding keys (and those past the grid) are computed and never stored
    KEYS: tl.constexpr = TT * TY * PX
    t_first, y_first, x_first = tile // (TILES_Y * TILES_X) * TT, (tile // TILES_X) % TILES_Y * TY, tile % TILES_X * TX
    t_pos = t_first + tl.arange(0, TT)  # (TT,) the tile's key coordinates per axis
    y_pos = y_first + tl.arange(0, TY)  # (TY,)
    x_pos = x_first + tl.arange(0, PX)  # (PX,)

    head_off = b * N * stride_tok + h * D
    q_bh = q_ptr + head_off
    do_bh = dout_ptr + head_off
    dsp_bh = dsp_ptr + bh.to(tl.int64) * K * N * ENTRY
    lst = bh * TILES + tile  # this tile's list: the capped one, or the exact one where the capped lists overflowed
    exact = tl.load(flag_ptr) != 0  # (an exact list is STRIPES segments, one after the other)
    start = tl.where(exact, tl.load(starts_ptr + lst * STRIPES), lst * CAP)
    end = tl.where(exact, tl.load(starts_ptr + (lst + 1) * STRIPES),
                   lst * CAP + tl.minimum(tl.load(cursor_ptr + lst), CAP))

    dk = tl.zeros([KEYS, BLOCK_D], tl.float32)
    dv = tl.zeros([KEYS, BLOCK_D], tl.float32)
    first = start
    slot = first + tl.arange(0, BLOCK_E)  # (E,)
    e = tl.load(records_ptr + slot, mask=slot < end, other=0)  # (E,) this block's entries
    while first < end:  # not `range`: the interpreter cannot take a loaded bound as a range
        valid = slot < end
        ds, p, t0, t1, ft, y0, y1, fy, x0, x1, fx = _entries(dsp_bh, e, valid, T, H, W, ENTRY)  # 0 past the list
        # the entries' queries (E, BD), input dtype; past the list e = 0, a valid row, and ds = p = 0
        rows = _token_rows(e % N, stride_tok, cols, WIDE)
        q = _load_rows(q_bh + rows, col_ok, EVEN_D)
        do = _load_rows(do_bh + rows, col_ok, EVEN_D)
        first += BLOCK_E
        slot = first + tl.arange(0, BLOCK_E)
        e = tl.load(records_ptr + slot, mask=slot < end, other=0)  # the next block's, in flight during the dots
        # each entry's trilinear weight at each key of the tile, separable over the axes:
        # (TT * TY, E) from the t and y weights, times the x weights scaled by ds (dK) or p (dV)
        w_ty = tl.reshape(_key_weights(t_pos, t0, t1, ft)[:, None, :] * _key_weights(y_pos, y0, y1, fy)[None, :, :],
                          (TT * TY, BLOCK_E))
        w_x = _key_weights(x_pos, x0, x1, fx)  # (PX, E)
        coef_ds = tl.reshape(w_ty[:, None, :] * (w_x * ds[None, :])[None, :, :], (KEYS, BLOCK_E))
        coef_p = tl.reshape(w_ty[:, None, :] * (w_x * p[None, :])[None, :, :], (KEYS, BLOCK_E))
        dk = _dot_acc(dk, coef_ds, q, UPCAST)
        dv = _dot_acc(dv, coef_p, do, UPCAST)

    key = tl.arange(0, KEYS)  # (KEYS,) as the coefficients' rows
    key_t = t_first + key // (TY * PX)
    key_y = y_first + (key // PX) % TY
    key_x = x_first + key % PX
    key_ok = (key % PX < TX) & (key_t < T) & (key_y < H) & (key_x < W)  # (KEYS,) keys of this tile
    key_rows = _token_rows((key_t * H + key_y) * W + key_x, stride_tok, cols, WIDE)  # (KEYS, BD)
    out_mask = key_ok[:, None] & col_ok
    tl.store(dk_ptr + head_off + key_rows, dk.to(dk_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dv_ptr + head_off + key_rows, dv.to(dv_ptr.dtype.element_ty), mask=out_mask)


def query_pass(q, k, v, offsets, out, dout, lse, dq, doff, dsp, kernel_size: Sequence[int], scale: float,
               qk_scale: float, offsets_grad: bool, config: LaunchConfig) -> None:
    """Launch the query pass over one head group: q-like tensors (B, T, H, W, g, ...) views of the
    full ones, lse (B, g, N) contiguous; writes dq, doff (when offsets_grad) and dsp (B, g, K, N, ENTRY_FLOATS)."""
    B, T, H, W, g, d = q.shape
    kt, kh, kw = kernel_size
    _query_kernel[(query_programs((T, H, W), config), B * g)](
        q, k, v, offsets, out, dout, lse, dq, doff, dsp,
        T, H, W, g, d, q.stride(3), offsets.stride(3), scale, qk_scale,
        KT=kt, KH=kh, KW=kw, BLOCK_Q=config.block_q, BLOCK_D=config.block_d, BLOCK_Y=config.block_y,
        OFFSET_GRAD=offsets_grad, ENTRY=ENTRY_FLOATS, num_warps=config.num_warps, maxnreg=config.maxnreg,
        **row_flags(T * H * W, q.stride(3), d, config.block_d),
    )


def list_capacity(n_tokens: int, num_samples: int, tiles: int) -> int:
    """Records per capped list when the records buffer (MAX_TILES_PER_ENTRY per entry) is split evenly over a
    (batch, head)'s key tiles: K x 8 x the keys of a tile on average, about 4x the mean list on 4 x 4 x 4 tiles."""
    return n_tokens * num_samples * MAX_TILES_PER_ENTRY // tiles


def bin_entries(dsp, shape, K: int, tile, capacity: int, cursors, starts, records, flag,
                stripes: int | None = None, rank_block: int = RANKED_BIN_BLOCK) -> None:
    """Build the per-(batch, head, key tile) entry lists of one head group of shape (B, T, H, W, g) from
    the query pass's entries dsp (B, g, K, N, ENTRY_FLOATS) of K samples per query, without a host sync.
    First the capped lists, one pass: list i is records[i * capacity:][:min(cursors[i], capacity)]
    (cursors (B * g * tiles,) int32, overwritten; records at least B * g * tiles * capacity int32). If a
    list overflows, flag (1,) int32 is set on the device, and two more passes, which do nothing otherwise,
    build the exact lists: list i is records[starts[i]:starts[i + 1]] (starts (2 * B * g * tiles + 1,)
    int32: the starts, then the fill's cursors). `stripes` (deterministic): the exact lists only, in the same
    order every run: each list in `stripes` segments, one per stripe of the entries (`launch.stripe_entries`),
    each filled in entry order (starts (2 * B * g * tiles * stripes + 1,): list i is records[starts[i * stripes]:
    starts[(i + 1) * stripes]]), ranked in blocks of `rank_block` entries (`KeyConfig.rank_block`; `stripes` from
    `launch.bin_stripes` at the same block). The key pass reads flag to know which lists it has."""
    B, T, H, W, g = shape
    tiles_t, tiles_y, tiles_x = tiles_per_axis((T, H, W), tile)
    tiles = tiles_t * tiles_y * tiles_x
    geometry = (T, H, W, tiles_y, tiles_x, tiles)
    constexprs = {"K": K, "TT": tile[0], "TY": tile[1], "TX": tile[2], "ENTRY": ENTRY_FLOATS, "num_warps": 4}
    entries = T * H * W * K
    if stripes is None:
        flag.zero_()
        cursors.zero_()
        blocks = triton.cdiv(entries, BIN_BLOCK)
        _bin_capped_kernel[(blocks, B * g)](dsp, cursors, records, flag, *geometry, capacity, BLOCK=BIN_BLOCK,
                                            **constexprs)
        count_launch = fill_launch = (exact_programs(dsp.device, blocks, B * g), BIN_BLOCK)  # (programs, block)
        segments, segment_entries = 1, entries
    else:
        flag.fill_(1)
        count_launch = (triton.cdiv(entries, BIN_BLOCK), BIN_BLOCK)  # a program per block
        fill_launch = (stripes, rank_block)  # a program per stripe
        segments, segment_entries = stripes, stripe_entries(entries, stripes, rank_block)
    lists = B * g * tiles * segments  # list segments

    def exact_pass(slots, launch: tuple[int, int], fill: bool):
        programs, block = launch
        _bin_kernel[(programs, B * g)](dsp, slots, records, flag, *geometry, triton.cdiv(entries, block), segments,
                                       segment_entries, BLOCK=block, FILL=fill, RANKED=fill and stripes is not None,
                                       **constexprs)

    counts, cursors_at = starts[1:lists + 1], starts[lists + 1:]
    starts[:lists + 1].zero_()
    exact_pass(counts, count_launch, fill=False)
    torch.cumsum(counts, 0, out=cursors_at)
    counts.copy_(cursors_at)  # starts[i + 1]: the end of segment i
    cursors_at.copy_(starts[:lists])  # each segment's fill cursor at its start
    exact_pass(cursors_at, fill_launch, fill=True)


def key_pass(q, dout, dsp, capacity: int, cursors, starts, flag, records, dk, dv, K: int, head_dim_block: int,
             config: KeyConfig, stripes: int | None = None) -> None:
    """Launch the key pass over one head group (tensors as `query_pass`, K samples per query, lists from
    `bin_entries` with the same `stripes`): writes dk, dv (B, T, H, W, g, d) views in the input dtype."""
    B, T, H, W, g, d = q.shape
    tiles_t, tiles_y, tiles_x = tiles_per_axis((T, H, W), config.tile)
    tiles = tiles_t * tiles_y * tiles_x
    tt, ty, tx = config.tile
    _key_kernel[(tiles, B * g)](
        q, dout, dsp, cursors, starts, flag, records, dk, dv,
        T, H, W, g, d, q.stride(3), tiles_y, tiles_x, tiles, capacity, stripes or 1, K=K,
        TT=tt, TY=ty, TX=tx, PX=padded_x(config.tile), BLOCK_E=config.block_e, BLOCK_D=head_dim_block,
        UPCAST=INTERPRETED, ENTRY=ENTRY_FLOATS, num_warps=config.num_warps, maxnreg=config.maxnreg,
        **row_flags(T * H * W, q.stride(3), d, head_dim_block),
    )


def heads_per_group(batch: int, n_tokens: int, heads: int, num_samples: int,
                    scratch_bytes: int = SCRATCH_BYTES) -> int:
    """Heads per backward group: as many as keep the scratch (`backward_scratch_bytes(K)` per token
    and head) within `scratch_bytes`, at least one."""
    per_head = batch * n_tokens * backward_scratch_bytes(num_samples)
    return max(1, min(heads, scratch_bytes // per_head))


def dsa_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 kernel_size: Sequence[int], scale: float, offsets_grad: bool,
                 config: LaunchConfig | None = None, scratch_bytes: int = SCRATCH_BYTES,
                 key_config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The fused backward (module docstring). Inputs as `dsa_forward` (contiguous) plus its out and lse and the
    output gradient dout (B, T, H, W, heads, d). Returns dq, dk, dv in the dtype and shape of q, k, v
    and d(offsets) (B, T, H, W, heads, K, 3) in offsets' dtype, or None when `offsets_grad` is False.
    `config` overrides the query pass's tiles and `key_config` (a `launch.KeyConfig`) the key tiles and the
    deterministic binning's block (for tuning); `scratch_bytes` bounds the scratch (`heads_per_group`). Under
    `torch.use_deterministic_algorithms(True)` the key tiles' entry lists are built in stripes, in the
    same order every run (`bin_entries`), so dk / dv are the same bits from run to run."""
    B, T, H, W, heads, d = q.shape
    N = T * H * W
    K = math.prod(kernel_size)
    dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # (B, T, H, W, heads, d)
    doff = torch.empty_like(offsets) if offsets_grad else offsets  # (B, T, H, W, heads, K, 3); unused if no grad
    cfg = config or query_launch_config(N, d)
    key_cfg = key_config or default_key_config((T, H, W), d)
    group = heads_per_group(B, N, heads, K, scratch_bytes)
    tiles = math.prod(tiles_per_axis((T, H, W), key_cfg.tile))
    records_bound = B * group * N * K * MAX_TILES_PER_ENTRY
    if records_bound >= 2 ** 31:  # one head (the group never exceeds the scratch cap otherwise): the clip is too long
        raise ValueError(f"DSA's backward indexes its key tiles' entry lists with int32: batch {B} x {N} tokens x "
                         f"K={K} samples x {MAX_TILES_PER_ENTRY} tiles = {records_bound} >= 2**31 per head; "
                         f"attend over fewer tokens per call: a smaller batch, or frame slabs (execution.slab_frames)")
    dsp = torch.empty(B * group * K * N * ENTRY_FLOATS, dtype=torch.float32, device=q.device)  # a group's entries
    capacity = list_capacity(N, K, tiles) if key_cfg.capacity is None else key_cfg.capacity
    room = records_bound // (B * group * tiles)
    if not 1 <= capacity <= room:
        raise ValueError(f"key_config.capacity={capacity}: a capped list holds 1 to {room} records here (the "
                         f"records buffer split over {B * group * tiles} key tiles); use None for that default")
    records = torch.empty(records_bound, dtype=torch.int32, device=q.device)  # the key tiles' entry lists
    cursors = torch.empty(B * group * tiles, dtype=torch.int32, device=q.device)  # the capped lists' lengths
    stripes = (bin_stripes(q.device, N * K, tiles, B * group, key_cfg.rank_block)
               if torch.are_deterministic_algorithms_enabled() else None)
    starts = torch.empty(2 * B * group * tiles * (stripes or 1) + 1, dtype=torch.int32,
                         device=q.device)  # the exact lists'
    flag = torch.empty(1, dtype=torch.int32, device=q.device)  # set where the capped lists overflowed
    with device_guard(q):
        for h0 in range(0, heads, group):
            g = min(group, heads - h0)
            heads_of = (slice(None),) * 4 + (slice(h0, h0 + g),)  # (B, T, H, W, this group's heads, ...)
            q_g, dout_g, offsets_g = q[heads_of], dout[heads_of], offsets[heads_of]
            dsp_g = dsp[:B * g * K * N * ENTRY_FLOATS]  # (B, g, K, N, ENTRY_FLOATS)
            query_pass(q_g, k[heads_of], v[heads_of], offsets_g, out[heads_of], dout_g,
                       lse[:, h0:h0 + g].contiguous(), dq[heads_of], doff[heads_of], dsp_g,
                       kernel_size, scale, scale * LOG2E, offsets_grad, cfg)
            cursors_g, starts_g = cursors[:B * g * tiles], starts[:2 * B * g * tiles * (stripes or 1) + 1]
            bin_entries(dsp_g, (B, T, H, W, g), K, key_cfg.tile, capacity, cursors_g, starts_g, records, flag,
                        stripes, key_cfg.rank_block)
            key_pass(q_g, dout_g, dsp_g, capacity, cursors_g, starts_g, flag, records, dk[heads_of],
                     dv[heads_of], K, cfg.block_d, key_cfg, stripes)
    return dq, dk, dv, doff if offsets_grad else None
