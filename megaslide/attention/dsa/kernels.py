"""Fused Triton kernels of 3D Deformable Slide Attention (forward and backward).

Layout. q, k, v, out and their gradients are contiguous (B, T, H, W, heads, d): one
token's head vector is d contiguous elements and token rows are heads * d apart. offsets
and their gradient are contiguous (B, T, H, W, heads, K, 3). The log-sum-exp saved for
backward is fp32 (B, heads, N) with N = T * H * W, in log2 units.

Work split. One program owns BLOCK_Q consecutive query tokens (row-major over (t, y, x),
so neighbouring queries sample overlapping tokens and share cache lines) of one
(batch, head); the launch grid is (cdiv(N, BLOCK_Q), B * heads), and programs take the
blocks in an order that keeps the running programs' K / V rows in L2 (`_query_block`). It loops over the K
samples of the window. For each sample it computes every query's clamped position, the 8
surrounding tokens and their trilinear weights, gathers those 8 rows of K (a
split row of BLOCK_Q tokens each: rows.py; a corner of weight 0 is loaded too: a per-element mask
to skip it skips nothing on non-integer offsets) and combines them into the sampled key; the same
corners give the sampled value. Every gathered row is a valid token (clamped positions,
clamped query rows: `_query_block`), so the gathers need no mask unless the head dim is
padded, and their offsets are int32 while a (batch, head)'s span fits (`rows.row_flags`). The forward runs an
online softmax over the K samples, so the N x K x d sampled keys and values never exist
in memory; it writes only out and the log-sum-exp (O(N x heads)). Every dot product,
interpolation and softmax runs in fp32 whatever the input dtype (fp32, fp16, bf16).
Head dims are padded to the next power of two (at least 16) with masked columns.

Backward (binned.py). Each query's softmax is over its own K samples, so a query pass
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
contributions with tensor-core dots and writes dk / dv once: no float atomics (binned.py says how
and what it costs).

Head groups. The backward's scratch (a 32-byte entry per (query, sample), the key tiles' entry
lists: `op.backward_scratch_bytes` per token and head) of all heads could exceed memory, so the
backward runs over groups of heads: one set of launches per group, reusing one scratch of at
most `SCRATCH_BYTES` (never less than one head). A launch sees only its group: the q-like
pointers (q, k, v, out, dout, dq, dk, dv, offsets, d(offsets)) start at the group's first head
and keep the full tensors' token strides, HEADS is the group's size and the lse is the group's
(B, group, N). A program does exactly the work it did in one launch over all heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton import knobs

from megaslide.attention.dsa.op import ENTRY_FLOATS, MAX_TILES_PER_ENTRY, SCRATCH_BYTES, backward_scratch_bytes
from megaslide.attention.dsa.rows import _load_split, _split_axpy, _split_dot, _split_scale, _split_zeros, _store_split, row_flags
from megaslide.backends import device_guard

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""True when this module's kernels were built for the CPU interpreter (TRITON_INTERPRET=1)."""

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch: BLOCK_Q queries per program, d padded to block_d. block_y > 1 makes a
    program's queries a block_y x (block_q / block_y) patch of one frame (rows y, columns x) instead of
    block_q consecutive tokens, so that more of their windows' corner rows coincide (a candidate of the
    sweep, `experiments/gpu_check_dsa.py`; the forward's default, `forward_launch_config`). maxnreg caps the
    registers per thread (ptxas spills past it; None: the compiler's choice), trading spills for occupancy."""

    block_q: int
    block_d: int
    num_warps: int
    block_y: int = 1
    maxnreg: int | None = None

    def __post_init__(self):
        if self.block_y < 1 or self.block_q % self.block_y or self.block_y & (self.block_y - 1):
            raise ValueError(f"LaunchConfig: block_y={self.block_y} must be a power of two dividing "
                             f"block_q={self.block_q}")


def query_programs(grid: tuple[int, int, int], config: LaunchConfig) -> int:
    """Programs per (batch, head) of a launch over the queries (or keys) of a (T, H, W) grid, as
    `_query_block` numbers them."""
    T, H, W = grid
    if config.block_y == 1:
        return triton.cdiv(T * H * W, config.block_q)
    return T * triton.cdiv(H, config.block_y) * triton.cdiv(W, config.block_q // config.block_y)


LAUNCH_ELEMENTS = 1024
"""BLOCK_Q x block_d of the zero-offset kernels' programs (`launch_config`)."""
SPLIT_WARP_ELEMENTS = 512
"""BLOCK_Q x block_d per warp of the kernels on split rows (rows.py): 16 elements of one token per thread."""


def head_dim_block(head_dim: int) -> int:
    """block_d of a head dim: the next power of two, at least 16 (padded columns are masked)."""
    return max(16, triton.next_power_of_2(head_dim))


def launch_config(n_tokens: int, head_dim: int, elements: int = LAUNCH_ELEMENTS, num_warps: int = 4) -> LaunchConfig:
    """Default tiles for N tokens and head dim d: BLOCK_Q * block_d = `elements` (BLOCK_Q in
    [8, elements / 32]) with `num_warps` warps. The per-query index and weight arithmetic is repeated by every
    thread that holds a piece of the query's row, so a thread should hold several 16-byte pieces of a
    row; more pieces cost registers and occupancy. The H200 sweep at the benchmark shape
    (`python -m experiments.gpu_check_dsa sweep=true`, results/attention/h200_split_v6.json) puts 1024
    first for the zero-offset kernels, whose (BQ, block_d) tiles put 8 threads on a row of 64.
    The interpreter's cost is per operation, not per element, so there one program takes all of a
    (batch, head)'s tokens (up to 1024)."""
    block_d = head_dim_block(head_dim)
    if INTERPRETED:
        block_q = min(1024, max(16, triton.next_power_of_2(n_tokens)))
        return LaunchConfig(block_q=block_q, block_d=block_d, num_warps=1)
    return LaunchConfig(block_q=min(elements // 32, max(8, elements // block_d)), block_d=block_d,
                        num_warps=num_warps)


def split_launch_config(n_tokens: int, head_dim: int, num_warps: int = 2) -> LaunchConfig:
    """Default tiles of the kernels on split rows: `launch_config` at SPLIT_WARP_ELEMENTS per warp, so that
    each thread holds 16 elements of one query (4 threads on a row of 64). The query pass takes 2 warps, the
    fastest of the H200 sweep at the benchmark shape (results/attention/h200_check_v10.json)."""
    return launch_config(n_tokens, head_dim, SPLIT_WARP_ELEMENTS * num_warps, num_warps)


QUERY_MAXNREG = 128
"""Registers per thread of the backward query pass's default launch (`query_launch_config`). Uncapped it
takes about 168 (ncu, results/attention/h200_ncu_v8.json), which leaves 6 programs of 2 warps on an SM; at
128 ptxas spills a few words and 8 fit. The H200 sweep (results/attention/h200_regs_v1.json) timed the
capped pass faster; 96 spills enough to be slower."""
MAXNREG_HEAD_DIM = 64
"""The widest block_d whose default launches cap registers (QUERY_MAXNREG, binned.KEY_MAXNREG): the caps were
timed at 64; at 128 the key pass's dK / dV tiles alone take 128 registers a thread, and the capped module
ran far slower (results/attention/h200_kernels_v14.json)."""


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
    rows' windows share corner rows that a run of consecutive tokens does not: the H200 sweep at the
    benchmark shape (results/attention/h200_check_v10.json) put the 4 x 8 patch of 4 warps first for the
    forward alone, ahead of every row launch, and the query pass on rows. The interpreter keeps its one
    program per (batch, head)."""
    config = split_launch_config(n_tokens, head_dim, num_warps=4)
    if INTERPRETED or config.block_q < FORWARD_BLOCK_Y ** 2:
        return config
    return replace(config, block_y=FORWARD_BLOCK_Y)


@triton.jit
def _window_start(i, kernel: tl.constexpr, size):
    """First index of the clamped window of queries at indices i along an axis of `size`:
    clamp(i - kernel // 2, 0, size - kernel)."""
    return tl.minimum(tl.maximum(i - kernel // 2, 0), size - kernel)


@triton.jit
def _axis_corners(pos, size):
    """The two neighbouring int32 indices of clamped positions pos (fp32, in [0, size - 1]) along
    an axis of `size` (upper == lower at the last index) and the fp32 fraction towards upper."""
    lower_f = tl.floor(pos)
    lower = lower_f.to(tl.int32)
    return lower, tl.minimum(lower + 1, size - 1), pos - lower_f


@triton.jit
def _axis_sample(start, j, offset, size):
    """Clamped sample position along one axis for a block of queries.

    start: (BLOCK_Q,) int32 window start; j: window index; offset: (BLOCK_Q,) fp32;
    size: axis length. Returns (lower, upper, frac, inside, pos): the corners and fraction of
    `_axis_corners`, whether the raw position lies inside [0, size - 1] (where the clamp passes
    gradient) and the clamped fp32 position itself.
    """
    last = size * 1.0 - 1.0  # stays valid when Triton specialises size == 1 to a constant
    raw = (start + j).to(tl.float32) + offset
    pos = tl.minimum(tl.maximum(raw, 0.0), last)
    lower, upper, frac = _axis_corners(pos, size)
    inside = (raw >= 0.0) & (raw <= last)
    return lower, upper, frac, inside, pos


@triton.jit
def _sample_axes(off_q, j, starts, window, grid):
    """`_axis_sample` along t, y and x of sample j (window index (it, iy, ix)) of a block of queries whose
    offsets (3 per sample: dt, dy, dx, any float dtype) start at off_q (BQ,); starts: their window starts
    (t, y, x), each (BQ,); grid: (T, H, W)."""
    dt = tl.load(off_q + 3 * j).to(tl.float32)  # (BQ,)
    dy = tl.load(off_q + 3 * j + 1).to(tl.float32)
    dx = tl.load(off_q + 3 * j + 2).to(tl.float32)
    return (_axis_sample(starts[0], window[0], dt, grid[0]), _axis_sample(starts[1], window[1], dy, grid[1]),
            _axis_sample(starts[2], window[2], dx, grid[2]))


@triton.jit
def _corner_axes(st, sy, sx):
    """From the `_axis_sample` results along t, y and x: the (lower, upper) neighbour indices along each axis,
    then their (lower, upper) 1D weights: corner (ct, cy, cx) is token (t_idx[ct], y_idx[cy], x_idx[cx]) with
    weight t_w[ct] * y_w[cy] * x_w[cx]."""
    return ((st[0], st[1]), (sy[0], sy[1]), (sx[0], sx[1]),
            (1.0 - st[2], st[2]), (1.0 - sy[2], sy[2]), (1.0 - sx[2], sx[2]))


@triton.jit
def _softmax_step(m_i, l_i, s):
    """One key of an online softmax: running max m_i and denominator l_i (BQ,) updated with scores s
    (BQ,) in log2 units. Returns the new max and denominator, the factor alpha (BQ,) that rescales the
    running numerator and the key's weight p (BQ,): numerator <- alpha * numerator + p * value."""
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)  # (BQ,)
    return m_new, l_i * alpha + p, alpha, p


@triton.jit
def _query_block(T, H, W, HEADS, BLOCK_Q: tl.constexpr, BLOCK_Y: tl.constexpr):
    """This program's (batch, head) and its BLOCK_Q query tokens: with BLOCK_Y = 1 a run of
    consecutive tokens (row-major over (t, y, x)), else a BLOCK_Y x BX patch (BX = BLOCK_Q // BLOCK_Y)
    of rows y and columns x of one frame.

    Block order. Runs: block i holds tokens [i * BLOCK_Q, (i + 1) * BLOCK_Q); program p of the launch
    grid's first axis takes block p, except when every (t, y) row is whole blocks
    (W % BLOCK_Q == 0) and H > T: then consecutive programs sweep all T frames of one y row
    before the next row (p -> (y, t, x block), y slowest). Programs run roughly in launch order,
    and a query's samples lie within a few tokens of it along each axis, so the K / V rows (and
    the backward's dK / dV scratch) that the running programs share span a slab of a few y rows
    across all frames (T x W tokens per row) instead of a few whole frames (H x W per frame): the
    smaller working set stays in L2. Patches take the same order, a band of BLOCK_Y rows in place of
    a row: p -> (y band, t, x block). Either order is a bijection over the queries.

    Returns b (int64), h, N = T*H*W, n (BQ,) token indices, q_valid (BQ,), and the queries' grid
    coordinates t, y, x (BQ,). Rows past the grid (q_valid False: past the end of the last run, or
    past the bottom or right edge of a patch) repeat a token of the grid's last one or its edge, so
    that every load a kernel derives from them is in bounds and needs no mask; only stores are
    masked with q_valid."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // HEADS).to(tl.int64)
    h = pid_bh % HEADS
    N = T * H * W
    p = tl.program_id(0)
    i = tl.arange(0, BLOCK_Q)  # (BQ,)
    if BLOCK_Y == 1:
        row_blocks = tl.maximum(W // BLOCK_Q, 1)  # blocks per (t, y) row when rows are whole blocks
        swept = ((p // row_blocks) % T * H + p // (row_blocks * T)) * row_blocks + p % row_blocks
        block = tl.where((W % BLOCK_Q == 0) & (H > T), swept, p)
        n = block * BLOCK_Q + i  # (BQ,) query tokens
        q_valid = n < N
        n = tl.minimum(n, N - 1)
        t = n // (H * W)
        y = (n // W) % H
        x = n % W
    else:
        x_blocks = tl.cdiv(W, BLOCK_Q // BLOCK_Y)
        y = p // (x_blocks * T) * BLOCK_Y + i // (BLOCK_Q // BLOCK_Y)  # (BQ,)
        x = p % x_blocks * (BLOCK_Q // BLOCK_Y) + i % (BLOCK_Q // BLOCK_Y)  # (BQ,)
        q_valid = (y < H) & (x < W)
        y = tl.minimum(y, H - 1)
        x = tl.minimum(x, W - 1)
        t = i * 0 + (p // x_blocks) % T  # (BQ,)
        n = (t * H + y) * W + x
    return b, h, N, n, q_valid, t, y, x


@triton.jit
def _dsa_fwd_kernel(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, lse_ptr,
                    T, H, W, HEADS, D, stride_tok, stride_off_tok, qk_scale,
                    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
                    WIDE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_Y: tl.constexpr):
    b, h, N, n, q_valid, t, y, x = _query_block(T, H, W, HEADS, BLOCK_Q, BLOCK_Y)
    head_off = b * N * stride_tok + h * D  # element offset of (b, token 0, h)
    k_bh = k_ptr + head_off
    v_bh = v_ptr + head_off
    q = _load_split(q_ptr + head_off, n, stride_tok, D, BLOCK_D, WIDE, EVEN_D)  # split row of this block's queries
    off_q = off_ptr + b * N * stride_off_tok + h * (KT * KH * KW * 3) + n.to(tl.int64) * stride_off_tok  # (BQ,)

    t_start = _window_start(t, KT, T)  # (BQ,)
    y_start = _window_start(y, KH, H)  # (BQ,)
    x_start = _window_start(x, KW, W)  # (BQ,)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_Q], tl.float32)  # running softmax denominator
    acc = _split_zeros(BLOCK_Q, BLOCK_D)  # running numerator
    for it in range(KT):
        for iy in range(KH):
            for ix in range(KW):
                j = (it * KH + iy) * KW + ix
                st, sy, sx = _sample_axes(off_q, j, (t_start, y_start, x_start), (it, iy, ix), (T, H, W))
                t_idx, y_idx, x_idx, t_w, y_w, x_w = _corner_axes(st, sy, sx)

                k_sample = _split_zeros(BLOCK_Q, BLOCK_D)
                v_sample = _split_zeros(BLOCK_Q, BLOCK_D)
                for ct in tl.static_range(2):
                    for cy in tl.static_range(2):
                        for cx in tl.static_range(2):
                            tok = (t_idx[ct] * H + y_idx[cy]) * W + x_idx[cx]  # (BQ,)
                            w = t_w[ct] * y_w[cy] * x_w[cx]  # (BQ,)
                            k_sample = _split_axpy(k_sample, w, _load_split(k_bh, tok, stride_tok, D, BLOCK_D,
                                                                            WIDE, EVEN_D))
                            v_sample = _split_axpy(v_sample, w, _load_split(v_bh, tok, stride_tok, D, BLOCK_D,
                                                                            WIDE, EVEN_D))
                s = _split_dot(q, k_sample) * qk_scale  # (BQ,) log2 units
                m_i, l_i, alpha, p = _softmax_step(m_i, l_i, s)
                acc = _split_axpy(_split_scale(acc, alpha), p, v_sample)

    _store_split(out_ptr + head_off, n, stride_tok, D, _split_scale(acc, 1.0 / l_i), q_valid, BLOCK_D, WIDE)
    if STORE_LSE:
        tl.store(lse_ptr + (b * HEADS + h) * N + n, m_i + tl.log2(l_i), mask=q_valid)


def dsa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                kernel_size: tuple[int, int, int], scale: float, store_lse: bool = True,
                config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused forward. q, k, v: contiguous (B, T, H, W, heads, d); offsets: contiguous
    (B, T, H, W, heads, K, 3). Returns out (B, T, H, W, heads, d) in q's dtype and, if
    `store_lse`, the fp32 log-sum-exp (B, heads, T*H*W) in log2 units, both for `dsa_backward`
    (else None: the forward-only path allocates and writes none). `config` overrides the default
    tiles (`forward_launch_config`; for tuning)."""
    B, T, H, W, heads, d = q.shape
    N = T * H * W
    kt, kh, kw = kernel_size
    out = torch.empty_like(q)  # (B, T, H, W, heads, d)
    lse = torch.empty((B, heads, N), dtype=torch.float32, device=q.device) if store_lse else None  # (B, heads, N)
    cfg = config or forward_launch_config(N, d)
    grid = (query_programs((T, H, W), cfg), B * heads)
    with device_guard(q):
        _dsa_fwd_kernel[grid](
            q, k, v, offsets, out, lse if store_lse else out,  # never written without STORE_LSE
            T, H, W, heads, d, q.stride(3), offsets.stride(3), scale * LOG2E,
            KT=kt, KH=kh, KW=kw, BLOCK_Q=cfg.block_q, BLOCK_D=cfg.block_d, STORE_LSE=store_lse,
            BLOCK_Y=cfg.block_y, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
            **row_flags(N, q.stride(3), d, cfg.block_d),
        )
    return out, lse


def heads_per_group(batch: int, n_tokens: int, heads: int, num_samples: int,
                    scratch_bytes: int = SCRATCH_BYTES) -> int:
    """Heads per backward group: as many as keep the scratch (`backward_scratch_bytes(K)` per token
    and head) within `scratch_bytes`, at least one."""
    per_head = batch * n_tokens * backward_scratch_bytes(num_samples)
    return max(1, min(heads, scratch_bytes // per_head))


def dsa_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 kernel_size: tuple[int, int, int], scale: float, offsets_grad: bool,
                 config: LaunchConfig | None = None, scratch_bytes: int = SCRATCH_BYTES,
                 key_config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fused backward (binned.py). Inputs as `dsa_forward` (contiguous) plus its out and lse and the
    output gradient dout (B, T, H, W, heads, d). Returns dq, dk, dv in the dtype and shape of q, k, v
    and d(offsets) (B, T, H, W, heads, K, 3) in offsets' dtype, or None when `offsets_grad` is False.
    `config` overrides the query pass's tiles and `key_config` (a `binned.KeyConfig`) the key tiles
    (for tuning); `scratch_bytes` bounds the scratch (`heads_per_group`). Under
    `torch.use_deterministic_algorithms(True)` the key tiles' entry lists are sorted
    (`binned.sort_lists`), so dk / dv are the same bits from run to run."""
    from megaslide.attention.dsa import binned

    B, T, H, W, heads, d = q.shape
    N = T * H * W
    kt, kh, kw = kernel_size
    K = kt * kh * kw
    dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # (B, T, H, W, heads, d)
    doff = torch.empty_like(offsets) if offsets_grad else offsets  # (B, T, H, W, heads, K, 3); unused if no grad
    cfg = config or query_launch_config(N, d)
    key_cfg = key_config or binned.key_config((T, H, W), d)
    group = heads_per_group(B, N, heads, K, scratch_bytes)
    tiles = math.prod(binned.tiles_per_axis((T, H, W), key_cfg.tile))
    records_bound = B * group * N * K * MAX_TILES_PER_ENTRY
    if records_bound >= 2 ** 31:  # one head (the group never exceeds the 1 GiB cap otherwise): the clip is too long
        raise ValueError(f"DSA's backward indexes its key tiles' entry lists with int32: batch {B} x {N} tokens x "
                         f"K={K} samples x {MAX_TILES_PER_ENTRY} tiles = {records_bound} >= 2**31 per head; attend over "
                         f"fewer tokens per call: a smaller batch, or frame slabs (model.slab_frames)")
    dsp = torch.empty(B * group * K * N * ENTRY_FLOATS, dtype=torch.float32, device=q.device)  # a group's entries
    capacity = binned.list_capacity(N, K, tiles) if key_cfg.capacity is None else key_cfg.capacity
    room = records_bound // (B * group * tiles)
    if not 1 <= capacity <= room:
        raise ValueError(f"key_config.capacity={capacity}: a capped list holds 1 to {room} records here (the "
                         f"records buffer split over {B * group * tiles} key tiles); use None for that default")
    records = torch.empty(records_bound, dtype=torch.int32, device=q.device)  # the key tiles' entry lists
    cursors = torch.empty(B * group * tiles, dtype=torch.int32, device=q.device)  # the capped lists' lengths
    starts = torch.empty(2 * B * group * tiles + 1, dtype=torch.int32, device=q.device)  # the exact lists'
    flag = torch.empty(1, dtype=torch.int32, device=q.device)  # set where the capped lists overflowed
    with device_guard(q):
        for h0 in range(0, heads, group):
            g = min(group, heads - h0)
            heads_of = (slice(None),) * 4 + (slice(h0, h0 + g),)  # (B, T, H, W, this group's heads, ...)
            q_g, dout_g, offsets_g = q[heads_of], dout[heads_of], offsets[heads_of]
            dsp_g = dsp[:B * g * K * N * ENTRY_FLOATS]  # (B, g, K, N, ENTRY_FLOATS)
            binned.query_pass(q_g, k[heads_of], v[heads_of], offsets_g, out[heads_of], dout_g,
                              lse[:, h0:h0 + g].contiguous(), dq[heads_of], doff[heads_of], dsp_g,
                              kernel_size, scale, scale * LOG2E, offsets_grad, cfg)
            cursors_g, starts_g = cursors[:B * g * tiles], starts[:2 * B * g * tiles + 1]
            binned.bin_entries(dsp_g, (B, T, H, W, g), kernel_size, key_cfg.tile, capacity, cursors_g, starts_g,
                               records, flag, deterministic=torch.are_deterministic_algorithms_enabled())
            binned.key_pass(q_g, dout_g, dsp_g, capacity, cursors_g, starts_g, flag, records, dk[heads_of],
                            dv[heads_of], kernel_size, cfg.block_d, key_cfg)
    return dq, dk, dv, doff if offsets_grad else None
