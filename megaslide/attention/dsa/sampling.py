"""Triton helpers the 3D-DSA kernels share: the queries a program owns (`_query_block`), where their samples
sit (clamped windows, clamped sample positions, trilinear corners) and one step of the online softmax.

Positions follow the op's definition (op.py): along an axis of size S with kernel k the window of query i
starts at clamp(i - k // 2, 0, S - k); sample j sits at window start + j + offset, clamped to [0, S - 1],
and reads the two neighbouring tokens of each axis with linear weights.
"""
from __future__ import annotations

import triton
import triton.language as tl


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
def _query_tile(T, H, W, TILE_T: tl.constexpr, TILE_Y: tl.constexpr, TILE_X: tl.constexpr):
    """This program's tile of TILE_T x TILE_Y x TILE_X queries (tiles row-major over (t, y, x) tile indices,
    program p of the launch grid's first axis takes tile p), as the halo forwards tile the grid. Returns the
    tile's first query along each axis (t0, y0, x0) and its queries as `_query_block` does: n (BQ,) token
    indices, q_valid (BQ,) and the grid coordinates t, y, x (BQ,), rows past the grid clamped onto its edge."""
    BQ: tl.constexpr = TILE_T * TILE_Y * TILE_X
    p = tl.program_id(0)
    x_tiles = tl.cdiv(W, TILE_X)
    y_tiles = tl.cdiv(H, TILE_Y)
    t0 = p // (x_tiles * y_tiles) * TILE_T
    y0 = p // x_tiles % y_tiles * TILE_Y
    x0 = p % x_tiles * TILE_X
    i = tl.arange(0, BQ)  # (BQ,)
    t = t0 + i // (TILE_Y * TILE_X)  # (BQ,) query coordinates, clamped onto the grid below
    y = y0 + i // TILE_X % TILE_Y
    x = x0 + i % TILE_X
    q_valid = (t < T) & (y < H) & (x < W)
    t, y, x = tl.minimum(t, T - 1), tl.minimum(y, H - 1), tl.minimum(x, W - 1)
    n = (t * H + y) * W + x  # (BQ,) valid tokens
    return t0, y0, x0, n, q_valid, t, y, x


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
