"""Compact optimizer state of the CPU AdamW: 8-bit block-quantised moments and stochastic rounding to bf16.

**8-bit moments** (`QuantizedMoment`). A flat moment buffer of N elements is cut into blocks of
`MOMENT_BLOCK` (64) elements; each block keeps one fp32 scale and N one-byte codes:
- the scale is a power of two, 2^k with k = floor(log2(absmax)) + 1, so every value of the block divided
  by it lies in (-1, 1) and the division is exact (a shared exponent, as the OCP MX formats use). A block
  whose absmax is below 2^-126 (fp32's smallest normal) is stored as zeros with scale 0;
- a code is a tiny float of that normalised value, rounded to nearest (ties to even), saturating at its
  largest magnitude: 4 exponent bits with subnormals, the top binade [1/2, 1); value(e, f) =
  2^(e - 16) (1 + f / 2^M) for e >= 1 and f 2^(-15 - M) for e = 0. The first moment (`SIGNED`) has a sign
  bit and M = 3 (E4M3: 6.25% relative step, zero below 2^-19 of the block's absmax); the second moment
  is kept as its square root (`SQRT`: the update divides by sqrt(v) anyway, and the root halves the
  dynamic range the code must span), unsigned with M = 4 (E4M4).
An update dequantises a block (exactly), updates it in fp32 and requantises it with a fresh scale.
The first moment's codes round to nearest; the root's round stochastically (`encode_magnitude` with random
bits: up with probability equal to the distance from the code below, in units of the gap). Why: with beta2 =
0.999 a step moves the root by about 0.05%, far less than half a code step (1.6-3.1%), so round to nearest
returns the old code and the stored second moment stops following the gradients (it can neither decay nor grow
by small steps). Stochastic codes follow it in expectation. The first moment needs none: beta1 = 0.9 moves it by
a tenth of its distance to the gradient each step, so a rounding error decays instead of accumulating.
Every parameter of a block's flat buffer starts on a multiple of `MOMENT_BLOCK` (it divides PARAM_ALIGN),
so an update of a run of parameters covers whole quantisation blocks, its last one possibly cut short by
padding (which stays zero and so never changes a scale).

**Stochastic rounding** to bf16 (`round_stochastic_bf16`): an fp32 value moves up to the next bf16 (away
from zero) with probability equal to its distance from the one below in units of their gap, by adding 16
random bits to its low half and truncating. The bits are a counter-based hash (`random_bits`): of the
element's index in its block's flat buffer and a key made of the run's seed, the block and the AdamW step
(`rounding_key`), so they do not depend on threads or on how a buffer is split into calls, and a resumed
run draws exactly the bits the uninterrupted run would have: the seed and the step are all the state. The
root's codes draw theirs the same way from a key of their own (`root_key`), so the two roundings are
independent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaslide.perf.host_memory import MOMENT_BLOCK

SIGNED, SQRT = "signed", "sqrt"            # QuantizedMoment kinds: the first moment; the root of the second
MANTISSA_BITS = {SIGNED: 3, SQRT: 4}
MAX_CODE = {SIGNED: 127, SQRT: 255}          # largest magnitude code (the sign is bit 7 of a SIGNED code)
_SUBNORMAL_BELOW = 2.0 ** -15                # normalised values below this are subnormal codes (e = 0)
_MASK32 = 0xFFFFFFFF
ROOT_RANDOM_BITS = 23 - MANTISSA_BITS[SQRT]  # random bits a root code rounds with: the fp32 mantissa bits it drops
_ROOT_SALT = 0x9E3779B9                      # makes root_key(key) independent of the master's key


@dataclass
class QuantizedMoment:
    """One flat AdamW moment of N elements in 8 bits (see the module docstring).

    codes: (N,) uint8; scales: (ceil(N / MOMENT_BLOCK),) fp32 powers of two (0 for an all-zero block);
    kind: SIGNED (exp_avg) or SQRT (exp_avg_sq, kept as its square root)."""

    codes: torch.Tensor
    scales: torch.Tensor
    kind: str

    @classmethod
    def zeros(cls, numel: int, kind: str) -> QuantizedMoment:
        return cls(torch.zeros(numel, dtype=torch.uint8), torch.zeros(cls.num_scales(numel)), kind)

    @staticmethod
    def num_scales(numel: int) -> int:
        """Scales of a moment of `numel` elements: one per MOMENT_BLOCK, the last block possibly cut short."""
        return math.ceil(numel / MOMENT_BLOCK)

    def numel(self) -> int:
        return self.codes.numel()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def __getitem__(self, span: slice) -> QuantizedMoment:
        """Elements [lo, hi) as a view; lo must start a quantisation block."""
        lo, hi, stride = span.indices(self.numel())
        if stride != 1 or lo % MOMENT_BLOCK:
            raise ValueError(f"a QuantizedMoment is cut at multiples of MOMENT_BLOCK={MOMENT_BLOCK} elements, "
                             f"got [{lo}:{hi}]; cut at a parameter's offset (they are aligned)")
        hi = max(lo, hi)
        return QuantizedMoment(self.codes[lo:hi], self.scales[lo // MOMENT_BLOCK:math.ceil(hi / MOMENT_BLOCK)],
                               self.kind)

    def values(self) -> torch.Tensor:
        """(N,) fp32: the stored quantity, exactly (the first moment, or the root of the second)."""
        return dequantize(self.codes, self.scales, self.kind)

    def store_(self, values: torch.Tensor, random: torch.Tensor | None = None) -> None:
        """Quantise (N,) fp32 `values` (the first moment, or the root of the second) into this buffer; `random`:
        the (N,) int64 random bits of a stochastic rounding (`quantize`)."""
        codes, scales = quantize(values, self.kind, random)
        self.codes.copy_(codes)
        self.scales.copy_(scales)

    def zero_(self) -> None:
        self.codes.zero_()
        self.scales.zero_()

    def clone(self) -> QuantizedMoment:
        return QuantizedMoment(self.codes.clone(), self.scales.clone(), self.kind)

    def state(self) -> dict[str, torch.Tensor]:
        """Copies of codes and scales, as a checkpoint keeps them."""
        return {"codes": self.codes.clone(), "scales": self.scales.clone()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for key in ("codes", "scales"):
            mine, theirs = getattr(self, key), state[key]
            if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                raise ValueError(f"the checkpoint's 8-bit moment {key} are {theirs.dtype} {tuple(theirs.shape)}, "
                                 f"this run's {mine.dtype} {tuple(mine.shape)}; resume with the model config "
                                 f"it was saved with")
            mine.copy_(theirs)


def _float_of_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(N,) -> (ceil(N / MOMENT_BLOCK), MOMENT_BLOCK), the last block padded with zeros."""
    pad = -x.numel() % MOMENT_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, MOMENT_BLOCK)


def block_scales(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: the scale 2^k, k = floor(log2 absmax) + 1, and its inverse, both fp32 and exact; (0, 0) for a
    block below 2^-126. Exponents are capped so that 1 / scale stays a normal float (absmax < 2^126)."""
    exponent = ((absmax.view(torch.int32) >> 23) & 0xFF).clamp(max=252)       # biased exponent of absmax
    zero = exponent == 0
    scale = torch.where(zero, 0.0, _float_of_bits((exponent + 1) << 23))
    inverse = torch.where(zero, 0.0, _float_of_bits((253 - exponent) << 23))
    return scale, inverse


def encode_magnitude(y: torch.Tensor, kind: str, random: torch.Tensor | None = None) -> torch.Tensor:
    """Codes (int32) of normalised magnitudes y in [0, 1), saturating: round to nearest even, or with `random`
    (int64, 23 - M random bits per element) stochastically: the dropped fp32 bits plus the random bits carry
    into the code with probability equal to y's distance from the code below, in units of the gap."""
    m = MANTISSA_BITS[kind]
    bits = y.view(torch.int32)
    if random is None:
        rounded = (bits + ((1 << (22 - m)) - 1) + ((bits >> (23 - m)) & 1)) >> (23 - m)   # fp32 -> M mantissa bits
        subnormal = torch.round(y * 2.0 ** (15 + m)).to(torch.int32)                     # exact product; half to even
    else:
        rounded = (bits.to(torch.int64) + random) >> (23 - m)
        subnormal = ((y * 2.0 ** 38).to(torch.int64) + random) >> (23 - m)              # y 2^38 < 2^23, truncated
    normal = rounded - (111 << m)
    return torch.where(y < _SUBNORMAL_BELOW, subnormal, normal).clamp(max=MAX_CODE[kind]).to(torch.int32)


def decode_magnitude(code: torch.Tensor, kind: str) -> torch.Tensor:
    """The normalised magnitude (fp32) of int32 magnitude codes."""
    m = MANTISSA_BITS[kind]
    e, f = code >> m, code & ((1 << m) - 1)
    normal = _float_of_bits(((e + 111) << 23) | (f << (23 - m)))
    return torch.where(e == 0, f.float() * 2.0 ** (-15 - m), normal)


def quantize(values: torch.Tensor, kind: str, random: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) fp32 -> codes (N,) uint8 and scales (ceil(N / MOMENT_BLOCK),) fp32; `random` (N,) int64: round the
    codes stochastically with these bits (`encode_magnitude`), else to nearest."""
    n = values.numel()
    x = _blocks(values.float())                                                  # (blocks, B)
    scale, inverse = block_scales(x.abs().amax(dim=1))                           # (blocks,) each
    random = None if random is None else _blocks(random)                         # (blocks, B)
    code = encode_magnitude(x.abs() * inverse[:, None], kind, random)            # (blocks, B)
    if kind == SIGNED:
        code = code | (torch.signbit(x).to(torch.int32) << 7)
    return code.flatten()[:n].to(torch.uint8), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """codes (N,) uint8, scales (blocks,) -> (N,) fp32, exactly the values the codes stand for."""
    n = codes.numel()
    code = _blocks(codes.to(torch.int32))                                        # (blocks, B)
    magnitude = code & MAX_CODE[kind]
    value = decode_magnitude(magnitude, kind) * scales[:, None]
    if kind == SIGNED:
        value = torch.where(code >= 128, -value, value)
    return value.flatten()[:n]


# ---- stochastic rounding -----------------------------------------------------------------------------
def _lowbias32(x):
    """A 32-bit integer hash (the 'lowbias32' mixer: xor-shift, multiply, twice) of a Python int or an int64
    tensor holding uint32 values."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32       # the int64 product wraps; its low 32 bits are the uint32 product
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_key(seed: int, block: int, step: int) -> int:
    """The 32-bit key of the random bits of `block`'s update at AdamW step `step` (1-based) of a run seeded `seed`."""
    key = 0
    for part in (seed & _MASK32, seed >> 32 & _MASK32, block, step):
        key = _lowbias32(key ^ part)
    return key


def root_key(key: int) -> int:
    """The key of the random bits of the root codes' stochastic rounding in the update keyed `key`."""
    return _lowbias32(key ^ _ROOT_SALT)


def random_bits(key: int, first_index: int, n: int, device: torch.device | str = "cpu",
                bits: int = 16) -> torch.Tensor:
    """(n,) int64 of `bits` random bits each, for elements first_index .. first_index + n - 1 of a flat buffer:
    the top `bits` bits of lowbias32(index + key) (mod 2^32)."""
    index = torch.arange(first_index, first_index + n, dtype=torch.int64, device=device)
    return _lowbias32(index + key) >> (32 - bits)


def round_stochastic_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 (N,) -> bf16 (N,): x's magnitude rounded up with probability (its low 16 bits) / 2^16, using the
    16-bit integers `bits` (N,); NaN stays NaN."""
    raw = x.view(torch.int32).to(torch.int64) & _MASK32
    out = ((raw + bits) >> 16).to(torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(x), torch.nan, out)
