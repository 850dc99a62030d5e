"""Triton kernels of fused QK-norm + RoPE (the op: qk_rope.py) and their launchers.

One tensor x (B, N, D) of the query or key projection, D = heads * d, is handled as B * N rows of D/2
interleaved pairs (x[2i], x[2i+1]), the pairing `apply_rope` rotates. A program holds whole rows in
registers and accumulates in fp32, rounding once at the store.

- forward, one program per row: r = 1 / sqrt(mean(x^2) + eps), n = x * r, y = n * w (the RMSNorm over D,
  as `nn.RMSNorm(D)` computes it), then each pair (a, b) of y with head-local pair index j = i % (d/2)
  becomes (a c - b s, a s + b c), with c, s = cos, sin[token, j].
- backward, each program a run of consecutive rows: the rotation's transpose takes the output gradient
  (g1, g2) of a pair to gy = (g1 c + g2 s, g2 c - g1 s); then dw += gy * n (a per-program fp32 partial,
  summed over programs by the launcher in a fixed order: deterministic), dn = gy * w and
  dx = r * (dn - n * mean(dn * n)). Without a norm (weight None) dx = gy.
cos and sin are constants: they get no gradient.

The input may be a strided view (a slice of the fused qkv projection): unit channel stride, one row
stride. This module imports triton; the op imports it when a kernel first runs, after a test has set
TRITON_INTERPRET.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1)."""
BACKWARD_PROGRAMS_PER_SM = 4
"""Backward programs per streaming multiprocessor: each writes one fp32 partial of dw (D floats)."""
INTERPRETER_PROGRAMS = 3
"""Backward programs under the interpreter, whose cost is per program: few, with several rows each."""


@triton.jit
def _norm_rope_fwd(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_tokens, x_row_stride, eps,
                   HALF_HEAD: tl.constexpr, HALF_ROW: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr):
    """out[row] = rope(rmsnorm(x[row]) * w) for row = program id; out is contiguous (rows of 2 * HALF_ROW)."""
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)                                  # pair index along the row
    live = i < HALF_ROW
    src = x_ptr + row.to(tl.int64) * x_row_stride
    x1 = tl.load(src + 2 * i, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + 2 * i + 1, mask=live, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF_ROW) + eps)
        x1 = x1 * inv_rms * tl.load(w_ptr + 2 * i, mask=live, other=0.0).to(tl.float32)
        x2 = x2 * inv_rms * tl.load(w_ptr + 2 * i + 1, mask=live, other=0.0).to(tl.float32)
    angle = (row % n_tokens) * HALF_HEAD + i % HALF_HEAD
    c = tl.load(cos_ptr + angle, mask=live, other=0.0)
    s = tl.load(sin_ptr + angle, mask=live, other=0.0)
    dst = out_ptr + row.to(tl.int64) * (2 * HALF_ROW)
    tl.store(dst + 2 * i, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=live)
    tl.store(dst + 2 * i + 1, (x1 * s + x2 * c).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _norm_rope_bwd(x_ptr, w_ptr, cos_ptr, sin_ptr, dout_ptr, dx_ptr, dw_ptr, n_rows, n_tokens, x_row_stride,
                   rows_per_program, eps, HALF_HEAD: tl.constexpr, HALF_ROW: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_NORM: tl.constexpr):
    """dx of rows [p * rows_per_program, (p + 1) * rows_per_program) and this program's partial dw
    (row p of dw, fp32); dout and dx are contiguous."""
    p = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    in_row = i < HALF_ROW
    if HAS_NORM:
        w1 = tl.load(w_ptr + 2 * i, mask=in_row, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + 2 * i + 1, mask=in_row, other=0.0).to(tl.float32)
    dw1 = tl.zeros([BLOCK], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK], dtype=tl.float32)
    r = 0
    while r < rows_per_program:  # a while loop: the interpreter cannot range() over a runtime int
        row = p * rows_per_program + r
        live = in_row & (row < n_rows)
        angle = (row % n_tokens) * HALF_HEAD + i % HALF_HEAD
        c = tl.load(cos_ptr + angle, mask=live, other=0.0)
        s = tl.load(sin_ptr + angle, mask=live, other=0.0)
        grad = dout_ptr + row.to(tl.int64) * (2 * HALF_ROW)
        g1 = tl.load(grad + 2 * i, mask=live, other=0.0).to(tl.float32)
        g2 = tl.load(grad + 2 * i + 1, mask=live, other=0.0).to(tl.float32)
        gy1 = g1 * c + g2 * s                                # gradient of the pair before its rotation
        gy2 = g2 * c - g1 * s
        if HAS_NORM:
            src = x_ptr + row.to(tl.int64) * x_row_stride
            x1 = tl.load(src + 2 * i, mask=live, other=0.0).to(tl.float32)
            x2 = tl.load(src + 2 * i + 1, mask=live, other=0.0).to(tl.float32)
            inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF_ROW) + eps)
            n1, n2 = x1 * inv_rms, x2 * inv_rms
            dw1 += gy1 * n1
            dw2 += gy2 * n2
            dn1, dn2 = gy1 * w1, gy2 * w2
            mean_dn_n = (tl.sum(dn1 * n1, axis=0) + tl.sum(dn2 * n2, axis=0)) / (2 * HALF_ROW)
            gy1 = inv_rms * (dn1 - n1 * mean_dn_n)
            gy2 = inv_rms * (dn2 - n2 * mean_dn_n)
        dst = dx_ptr + row.to(tl.int64) * (2 * HALF_ROW)
        tl.store(dst + 2 * i, gy1.to(dx_ptr.dtype.element_ty), mask=live)
        tl.store(dst + 2 * i + 1, gy2.to(dx_ptr.dtype.element_ty), mask=live)
        r += 1
    if HAS_NORM:
        part = dw_ptr + p.to(tl.int64) * (2 * HALF_ROW)
        tl.store(part + 2 * i, dw1, mask=in_row)
        tl.store(part + 2 * i + 1, dw2, mask=in_row)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x (B, N, D) with unit channel stride and one row stride (a contiguous copy only if it lacks them)."""
    B, N, _ = x.shape
    if x.stride(2) != 1 or (B > 1 and x.stride(0) != N * x.stride(1)):
        return x.contiguous()
    return x


def _block_and_warps(D: int) -> tuple[int, int]:
    """Pairs per program padded to a power of two, and warps enough for about 8 pairs per thread."""
    block = triton.next_power_of_2(max(D // 2, 1))
    return block, min(16, max(1, block // 256))


def norm_rope_forward(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      heads: int, eps: float) -> torch.Tensor:
    """x (B, N, D), weight (D,) or None, cos / sin (N, d/2) fp32 -> normalised and rotated (B, N, D), x's dtype."""
    B, N, D = x.shape
    x = rows_view(x)
    out = torch.empty(B, N, D, dtype=x.dtype, device=x.device)          # (B, N, D)
    block, warps = _block_and_warps(D)
    _norm_rope_fwd[(B * N,)](x, x if weight is None else weight, cos, sin, out, N, x.stride(1), eps,
                             HALF_HEAD=D // heads // 2, HALF_ROW=D // 2, BLOCK=block, HAS_NORM=weight is not None,
                             num_warps=warps)
    return out


def backward_programs(rows: int, device: torch.device) -> int:
    """Programs of a backward launch over `rows` rows: a few per SM (one under the interpreter per few rows)."""
    if INTERPRETED or device.type != "cuda":
        return max(1, min(rows, INTERPRETER_PROGRAMS))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(rows, BACKWARD_PROGRAMS_PER_SM * sms))


def norm_rope_backward(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                       dout: torch.Tensor, heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of `norm_rope_forward` for its output gradient dout (B, N, D): dx (B, N, D) in x's dtype
    (contiguous) and dweight (D,) in weight's dtype (None without a weight)."""
    B, N, D = x.shape
    x, dout = rows_view(x), dout.contiguous()
    dx = torch.empty(B, N, D, dtype=x.dtype, device=x.device)           # (B, N, D)
    programs = backward_programs(B * N, x.device)
    partial = torch.empty(programs if weight is not None else 0, D, dtype=torch.float32, device=x.device)
    block, warps = _block_and_warps(D)
    _norm_rope_bwd[(programs,)](x, x if weight is None else weight, cos, sin, dout, dx, partial, B * N, N,
                                x.stride(1), triton.cdiv(B * N, programs), eps, HALF_HEAD=D // heads // 2,
                                HALF_ROW=D // 2, BLOCK=block, HAS_NORM=weight is not None, num_warps=warps)
    return dx, None if weight is None else partial.sum(0).to(weight.dtype)
