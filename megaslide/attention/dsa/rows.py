"""Token rows of the 3D-DSA kernels: their element offsets, their loads, and split rows.

Every kernel reads head vectors of (batch, head)'s tokens: `_token_rows` gives their element offsets (int32
while a (batch, head)'s span fits: `row_flags`), `_load_rows` loads a (BQ, BLOCK_D) tile of them (no mask
where every row is a valid token and d fills BLOCK_D). The fused forward and query pass hold their
head vectors as split rows instead.

A split row of BQ tokens is a tuple of 4 fp32 (BQ, BLOCK_D // 4) tiles: the even and the odd columns of
the first half of the head dim, then those of the second half (column of element i of tile 2 h + parity:
h * BLOCK_D / 2 + 2 i + parity). Padded columns are 0. Every row operation the kernels need (a dot product
per token, a weighted sum of rows) is elementwise over the 4 tiles, so the split is never undone in
between; only a store interleaves the tiles back.

Why. The kernels' cost is instruction issue (Nsight Compute: docs/dsa_kernels.md), and much of it is
per token, not per element: the corner indices, the trilinear weights and their derivatives, the
cross-thread reductions. A (BQ, BLOCK_D // 2) tile puts half as many threads on a token's row as a
(BQ, BLOCK_D) tile does at the same 16-byte vectors, so each thread holds 16 elements of one token
instead of 8 of each of two, and does that per-token work once, not twice. The even / odd split lets
bf16 rows load as int32 words that become fp32 with one instruction per element (a shift for the low
half, a mask for the high half) where a bf16 -> fp32 cast of the high half takes two.
The bf16 path needs d = BLOCK_D (no padding: every word holds two columns of the head); other dtypes and
padded head dims load elements and split them (`tl.split`), the same values.
"""
from __future__ import annotations

import triton
import triton.language as tl


def row_flags(n_tokens: int, stride_tok: int, head_dim: int, block_d: int) -> dict:
    """The constexprs of `_token_rows` and `_load_rows` for a launch over N tokens with token stride
    `stride_tok`: WIDE when a (batch, head)'s element offsets can reach 2**31, EVEN_D when the head dim
    needs no padding."""
    return dict(WIDE=n_tokens * stride_tok >= 2 ** 31, EVEN_D=head_dim == block_d)


@triton.jit
def _token_rows(tok, stride_tok, cols, WIDE: tl.constexpr):
    """(BQ, BD) element offsets of the head vectors of tokens tok (BQ,) from their (batch, head)'s first
    token's: int32, so that an address costs one wide multiply-add, unless WIDE (N * stride_tok >= 2**31)."""
    if WIDE:
        tok = tok.to(tl.int64)
    return tok[:, None] * stride_tok + cols[None, :]


@triton.jit
def _load_rows(ptrs, col_ok, EVEN_D: tl.constexpr):
    """The (BQ, BD) tile at ptrs, in its dtype, from rows that are all valid tokens (clamped queries and
    corners): no mask at all when the head dim fills BLOCK_D (EVEN_D), else the padded columns (col_ok
    (1, BD)) read as 0."""
    if EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=col_ok, other=0.0)
    return tile


@triton.jit
def _bf16_pair(words):
    """The fp32 values of the low and the high bf16 of int32 words (exact: a bf16 is an fp32's top half)."""
    return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _split_half(half):
    """(even, odd) columns of a (BQ, 2 * QW) fp32 tile: two (BQ, QW) tiles."""
    return tl.split(tl.reshape(half, (half.shape[0], half.shape[1] // 2, 2)))


@triton.jit
def _load_split(ptr, tok, stride_tok, D, BLOCK_D: tl.constexpr, WIDE: tl.constexpr, EVEN_D: tl.constexpr):
    """The split row of tokens tok (BQ,) (valid tokens: `sampling._query_block`) of the tensor whose
    (batch, head)'s token 0 is at ptr, with token stride stride_tok (elements)."""
    HALF: tl.constexpr = BLOCK_D // 2
    QW: tl.constexpr = BLOCK_D // 4
    if EVEN_D and ptr.dtype.element_ty == tl.bfloat16:
        words = ptr.to(tl.pointer_type(tl.int32)) + _token_rows(tok, stride_tok // 2, tl.arange(0, QW), WIDE)
        first_even, first_odd = _bf16_pair(tl.load(words))  # (BQ, QW) each
        second_even, second_odd = _bf16_pair(tl.load(words + QW))
    else:
        cols = tl.arange(0, HALF)  # (HALF,)
        rows = ptr + _token_rows(tok, stride_tok, cols, WIDE)  # (BQ, HALF)
        first_even, first_odd = _split_half(_load_rows(rows, (cols < D)[None, :], EVEN_D).to(tl.float32))
        second_even, second_odd = _split_half(_load_rows(rows + HALF, (cols + HALF < D)[None, :], EVEN_D)
                                              .to(tl.float32))
    return first_even, first_odd, second_even, second_odd


@triton.jit
def _store_split(ptr, tok, stride_tok, D, row, valid, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    """Store split row `row` of tokens tok (BQ,) where valid (BQ,), in ptr's dtype (ptr, stride_tok as
    `_load_split`)."""
    HALF: tl.constexpr = BLOCK_D // 2
    BQ: tl.constexpr = row[0].shape[0]
    cols = tl.arange(0, HALF)  # (HALF,)
    rows = ptr + _token_rows(tok, stride_tok, cols, WIDE)  # (BQ, HALF)
    first = tl.reshape(tl.join(row[0], row[1]), (BQ, HALF))  # (BQ, HALF) interleaved again
    second = tl.reshape(tl.join(row[2], row[3]), (BQ, HALF))
    tl.store(rows, first.to(ptr.dtype.element_ty), mask=valid[:, None] & (cols < D)[None, :])
    tl.store(rows + HALF, second.to(ptr.dtype.element_ty), mask=valid[:, None] & (cols + HALF < D)[None, :])


@triton.jit
def _split_zeros(BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """A split row of BLOCK_Q zero vectors."""
    zero = tl.zeros([BLOCK_Q, BLOCK_D // 4], tl.float32)
    return zero, zero, zero, zero


@triton.jit
def _split_dot(a, b):
    """(BQ,) <a_n, b_n> of two split rows, one multiply-add chain per thread before the cross-thread sum."""
    acc = a[0] * b[0]
    acc += a[1] * b[1]
    acc += a[2] * b[2]
    acc += a[3] * b[3]
    return tl.sum(acc, axis=1)


@triton.jit
def _split_axpy(acc, w, x):
    """acc_n + w_n x_n of split rows acc, x and weights w (BQ,)."""
    w = w[:, None]
    return acc[0] + w * x[0], acc[1] + w * x[1], acc[2] + w * x[2], acc[3] + w * x[3]


@triton.jit
def _split_scale(row, w):
    """w_n row_n of a split row and weights w (BQ,)."""
    w = w[:, None]
    return row[0] * w, row[1] * w, row[2] * w, row[3] * w
