"""A float64 reference of the compact CPU AdamW (megaslide/offload/compact.py states the formats), written
independently of the library: numpy, a codebook searched for the nearest code (the first moment) or the two
around a value (the root of the second, rounded stochastically), a uint32 hash, and stochastic rounding from the
exact fraction. `step` returns what one update makes of a state, and for each output the
elements whose value lies so near a rounding or quantisation decision that an fp32 computation may fall on the
other side (`near`: within NEAR times the magnitude of the terms that made the value, which bounds an fp32
computation's error): there the fast paths may take the other neighbour, nowhere else."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BLOCK = 64
MANTISSA = {"signed": 3, "sqrt": 4}
NEAR = 8 * 2.0 ** -24    # an fp32 step's error, relative to the magnitude of the terms that made a value


def codebook(kind: str) -> np.ndarray:
    """The normalised magnitude of every magnitude code, by code: 2^(e-16)(1 + f/2^M), subnormals f 2^(-15-M)."""
    m = MANTISSA[kind]
    values = []
    for code in range(2 ** (4 + m)):
        e, f = code >> m, code & (2 ** m - 1)
        values.append(f * 2.0 ** (-15 - m) if e == 0 else 2.0 ** (e - 16) * (1 + f / 2 ** m))
    return np.array(values)


def nearest_code(y: np.ndarray, kind: str, tol: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest magnitude code of y >= 0 (ties to the even code), and whether y lies within tol of a midpoint."""
    book = codebook(kind)
    mid = (book[1:] + book[:-1]) / 2
    upper = np.searchsorted(mid, y, side="right")           # codes whose lower midpoint is <= y
    tie = (upper > 0) & (mid[np.maximum(upper - 1, 0)] == y)
    code = np.where(tie & (upper % 2 == 1), upper - 1, upper)
    gap = np.minimum(np.abs(y - mid[np.maximum(upper - 1, 0)]), np.abs(y - mid[np.minimum(upper, mid.size - 1)]))
    return code, gap <= tol


def block_scale(absmax: float) -> float:
    """2^k with absmax / 2^k in [1/2, 1); 0 below 2^-126."""
    return 0.0 if absmax < 2.0 ** -126 else 2.0 ** math.frexp(absmax)[1]


def stochastic_code(y: np.ndarray, kind: str, r: np.ndarray, tol: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The code of y >= 0 rounded stochastically with the (23 - M)-bit integers r: the code below y, or the next
    one iff y's fraction of the gap between them, in 2^-(23-M) units, plus r reaches 2^(23-M) (the largest code
    stays); and whether y lies within tol of that threshold."""
    book, units = codebook(kind), 2.0 ** (23 - MANTISSA[kind])
    low = np.searchsorted(book, y, side="right") - 1                        # the largest code <= y
    top = low == book.size - 1
    gap = book[np.minimum(low + 1, book.size - 1)] - book[low]
    fraction = np.where(top, 0.0, (y - book[low]) / np.where(top, 1.0, gap))
    up = ~top & (fraction * units + r >= units)
    return low + up, ~top & (np.abs(fraction * units + r - units) * gap / units <= tol)


def quantize(x: np.ndarray, kind: str, magnitude: np.ndarray,
             r: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Dequantised values of float64 x, block by block, and the NEAR flags (`magnitude`: of the terms that
    made each value); codes to nearest, or with the random integers `r` stochastically."""
    pad = -x.size % BLOCK
    blocks, tol = np.pad(x, (0, pad)).reshape(-1, BLOCK), NEAR * np.pad(magnitude, (0, pad)).reshape(-1, BLOCK)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)                       # (blocks, 1)
    scale = np.array([[block_scale(a)] for a in absmax[:, 0]]).reshape(-1, 1)
    safe = np.where(scale > 0, scale, 1.0)
    y, y_tol = (np.abs(blocks) / safe).ravel(), (tol / safe).ravel()
    code, flagged = (nearest_code(y, kind, y_tol) if r is None
                     else stochastic_code(y, kind, np.pad(r, (0, pad)), y_tol))
    out = np.sign(blocks) * codebook(kind)[code].reshape(blocks.shape) * scale
    power = 2.0 ** np.round(np.log2(np.where(absmax > 0, absmax, 1.0)))
    near = (flagged.reshape(blocks.shape) | (np.abs(absmax - power) <= tol.max(axis=1, keepdims=True))) & (scale > 0)
    return out.ravel()[:x.size], near.ravel()[:x.size]   # near a midpoint, or the scale itself may flip


def lowbias32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def random_bits(key: int, first_index: int, n: int, bits: int = 16) -> np.ndarray:
    """The top `bits` bits of lowbias32(index + key), as float64 integers."""
    index = (np.arange(first_index, first_index + n, dtype=np.uint64) + np.uint64(key)) % np.uint64(2 ** 32)
    return (lowbias32(index) >> np.uint32(32 - bits)).astype(np.float64)


def root_key(key: int) -> int:
    """The root codes' key: lowbias32 of the update's key xor the salt 0x9E3779B9."""
    return int(lowbias32(np.array([key ^ 0x9E3779B9]))[0])


def round_stochastic_bf16(x: np.ndarray, r: np.ndarray, magnitude: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to bf16: up (in magnitude) iff its fraction between the two neighbours, in 2^-16 units, plus
    r reaches 2^16; and whether x is NEAR that threshold (`magnitude`: of the terms that made x)."""
    a = np.abs(x)
    exponent = np.frexp(a)[1] - 1                           # floor(log2 a), exactly
    ulp = 2.0 ** (np.maximum(exponent, -126) - 7)
    low = np.floor(a / ulp) * ulp
    units = (a - low) / ulp * 2 ** 16                       # in [0, 2^16)
    up = units + r >= 2 ** 16
    near = np.abs(units + r - 2 ** 16) * ulp / 2 ** 16 <= NEAR * magnitude
    return np.sign(x) * (low + up * ulp), near


@dataclass
class Step:
    """One step's outputs in float64: each value, the absolute error an fp32 step may make computing it (`*_tol`:
    NEAR times the magnitude of its terms), and (`*_near`) whether a rounding or quantisation decision lies
    within that error."""

    param: np.ndarray            # fp32 master: the value; bf16 master: the stochastically rounded bf16 value
    param_tol: np.ndarray
    param_near: np.ndarray
    exp_avg: np.ndarray          # the value, or its dequantised 8-bit value
    exp_avg_tol: np.ndarray
    exp_avg_near: np.ndarray
    second: np.ndarray           # fp32 moments: exp_avg_sq; int8: the dequantised 8-bit sqrt(exp_avg_sq)
    second_tol: np.ndarray
    second_near: np.ndarray


def step(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
         weight_decay: float, bf16_master: bool, int8: bool, key: int = 0, first_index: int = 0) -> Step:
    """One AdamW step in float64 from a state given exactly (float64 arrays of the stored values)."""
    decayed = param * (1 - lr * weight_decay)
    m = beta1 * exp_avg + (1 - beta1) * grad
    v = beta2 * exp_avg_sq + (1 - beta2) * grad ** 2
    root = np.sqrt(v)
    update = lr / (1 - beta1 ** step) * m / (root / math.sqrt(1 - beta2 ** step) + eps)
    p = decayed - update
    p_terms, m_terms = np.abs(decayed) + np.abs(update), np.abs(beta1 * exp_avg) + np.abs((1 - beta1) * grad)
    none = np.zeros(p.shape, dtype=bool)
    p, p_near = (round_stochastic_bf16(p, random_bits(key, first_index, p.size), p_terms) if bf16_master
                 else (p, none))
    if int8:
        r = random_bits(root_key(key), first_index, root.size, 23 - MANTISSA["sqrt"])
        (m, m_near), (second, second_near) = quantize(m, "signed", m_terms), quantize(root, "sqrt", root, r)
        second_tol = NEAR * root
    else:
        m_near, second, second_near, second_tol = none, v, none, NEAR * v
    return Step(p, NEAR * p_terms, p_near, m, NEAR * m_terms, m_near, second, second_tol, second_near)
