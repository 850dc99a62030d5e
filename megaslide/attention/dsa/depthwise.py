"""The offset net's depthwise Conv3d on channels-last tokens, with a Triton backend and PyTorch's.

`depthwise_conv3d(x, weight, bias, frames)` is Conv3d(C, C, kernel, padding=kernel // 2, groups=C)
over x (B, T, H, W, C), returning output frames [lo, hi) as (B, hi - lo, H, W, C): zero padding only
at x's own edges, so a slab of frames with a halo of kernel // 2 frames on each side gives the same
output frames as the whole clip.

Why a kernel of its own: the block input is channels-last (tokens, then channels), and cuDNN's
depthwise Conv3d is slow on that layout for bf16 (its weight gradient) and needs a transposed
contiguous copy for NCDHW (experiments/bench_offset_net.py times both; docs/dsa_kernels.md). The Triton
kernels (depthwise_kernels.py) read the tokens in place, read each input tile once for all temporal taps,
accumulate in fp32 and compute the weight and bias gradients in one pass without atomics.

`gelu=True` is the offset net's conv + GELU: the Triton forward applies GELU to its fp32 sum and writes the
pre-activation beside it (kept for the backward, as autograd keeps F.gelu's input), so the net makes no
separate GELU pass; the backward takes GELU's derivative in one elementwise pass before the conv's.

Backends: "torch" (F.conv3d and its autograd, the reference), "cpu" (F.conv3d forward, where oneDNN runs the
channels-last view well, and a backward written out: PyTorch's CPU backward of a depthwise Conv3d takes a
generic slow path, its input gradient many times the forward's time) and "triton" (CUDA, or the CPU
interpreter when asked for by name); "auto" takes triton on CUDA, cpu on the CPU. Under autocast the output
has autocast's dtype, as F.conv3d's would.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megaslide.backends import Backend, device_guard, select_backend, triton_kernels_check

CONV_BLOCK = (8, 64, 4, 16)
"""(BLOCK_X tokens, BLOCK_C channels, warps, frames) of a forward / input-gradient program on the GPU: each
program walks `frames` output frames of one row segment (depthwise_kernels.py), keeping the 27 taps of its
channels in registers; docs/dsa_kernels.md says why this tile, and `python -m experiments.bench_offset_net
sweep=true` times the candidates."""
WGRAD_BLOCK = (8, 64, 4)
"""(BLOCK_X, BLOCK_C, warps) of a weight-gradient program on the GPU: each program holds 27 tap tiles, 3 dy
tiles and a bias tile of 8 x 64 fp32."""
WGRAD_PROGRAMS = 256
"""Column chunks of the weight gradient (at most): each writes its own (taps + 1, C) fp32 partial sum."""


def _kernels():
    from megaslide.attention.dsa import depthwise_kernels
    return depthwise_kernels


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """F.conv3d's output dtype for x: autocast's where it is enabled on x's device, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _conv_blocks(W: int, C: int, frames: int) -> tuple[int, int, int, int]:
    """(BLOCK_X, BLOCK_C, warps, frames per program): the GPU tiles, or in the interpreter (cost per
    operation) whole rows and all frames in one program."""
    import triton
    if _kernels().INTERPRETED:
        return triton.next_power_of_2(W), triton.next_power_of_2(C), 1, frames
    return CONV_BLOCK


def _wgrad_blocks(W: int, C: int) -> tuple[int, int, int]:
    """(BLOCK_X, BLOCK_C, warps) of the weight gradient: the GPU tiles, or whole rows in the interpreter."""
    import triton
    if _kernels().INTERPRETED:
        return triton.next_power_of_2(W), triton.next_power_of_2(C), 1
    return WGRAD_BLOCK


def _conv(x, taps, bias, shift, y, pre, kernel) -> None:
    """Launch `_conv_kernel`: y (B, frames, H, W, C) = conv of x (B, TX, H, W, C) with taps (KT*KH*KW, C) fp32
    read at frame offset `shift`; with `pre` given, pre = that conv and y = gelu(pre)."""
    import triton
    B, TX, H, W, C = x.shape
    frames = y.shape[1]
    bx, bc, warps, per_program = _conv_blocks(W, C, frames)
    grid = (triton.cdiv(frames, per_program) * H * triton.cdiv(W, bx), B, triton.cdiv(C, bc))
    with device_guard(x):
        _kernels()._conv_kernel[grid](x, taps, bias if bias is not None else taps, y, pre if pre is not None else y,
                                      TX, frames, H, W, C, shift, x.stride(0), y.stride(0), per_program,
                                      KT=kernel[0], KH=kernel[1], KW=kernel[2], HAS_BIAS=bias is not None,
                                      GELU=pre is not None, BLOCK_X=bx, BLOCK_C=bc, num_warps=warps)


# The launches are custom ops so that torch.compile (train.compile) treats them as opaque calls, as
# dsa/op.py's; the fake functions give compile the output shapes.
@torch.library.custom_op("megaslide::depthwise_conv", mutates_args=())
def _launch_conv(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, shift: int, frames: int,
                 kernel: list[int], dtype: torch.dtype) -> torch.Tensor:
    """`frames` output frames (B, frames, H, W, C) in `dtype` of the conv of x (B, TX, H, W, C) with taps
    (KT*KH*KW, C) fp32 read at frame offset `shift` (depthwise_kernels._conv_kernel)."""
    B, _, H, W, C = x.shape
    y = torch.empty((B, frames, H, W, C), dtype=dtype, device=x.device)
    _conv(x, taps, bias, shift, y, None, kernel)
    return y


@_launch_conv.register_fake
def _(x, taps, bias, shift, frames, kernel, dtype):
    B, _, H, W, C = x.shape
    return x.new_empty((B, frames, H, W, C), dtype=dtype)


@torch.library.custom_op("megaslide::depthwise_conv_gelu", mutates_args=())
def _launch_conv_gelu(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, shift: int, frames: int,
                      kernel: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu(pre), pre) of `_launch_conv`'s output pre, one pass."""
    B, _, H, W, C = x.shape
    y, pre = (torch.empty((B, frames, H, W, C), dtype=dtype, device=x.device) for _ in range(2))
    _conv(x, taps, bias, shift, y, pre, kernel)
    return y, pre


@_launch_conv_gelu.register_fake
def _(x, taps, bias, shift, frames, kernel, dtype):
    B, _, H, W, C = x.shape
    return tuple(x.new_empty((B, frames, H, W, C), dtype=dtype) for _ in range(2))


@torch.library.custom_op("megaslide::depthwise_wgrad", mutates_args=())
def _launch_wgrad(x: torch.Tensor, dy: torch.Tensor, shift: int, kernel: list[int]) -> torch.Tensor:
    """The weight and bias gradients (KT*KH*KW + 1, C) fp32 (the bias last) of y = conv(x) + bias at frame
    offset `shift` given dy."""
    import triton
    B, TX, H, W, C = x.shape
    TY = dy.shape[1]
    bx, bc, warps = _wgrad_blocks(W, C)
    taps = math.prod(kernel)
    cols = B * H * triton.cdiv(W, bx)
    per_program = triton.cdiv(cols, WGRAD_PROGRAMS)
    programs = triton.cdiv(cols, per_program)
    part = torch.empty((programs, taps + 1, C), dtype=torch.float32, device=x.device)
    with device_guard(x):
        _kernels()._wgrad_kernel[(programs, triton.cdiv(C, bc))](
            x, dy, part, B, TX, TY, H, W, C, shift, x.stride(0), dy.stride(0), per_program,
            KT=kernel[0], KH=kernel[1], KW=kernel[2], BLOCK_X=bx, BLOCK_C=bc, num_warps=warps)
    return part.sum(0)  # (taps + 1, C)


@_launch_wgrad.register_fake
def _(x, dy, shift, kernel):
    return x.new_empty((math.prod(kernel) + 1, x.shape[-1]), dtype=torch.float32)


def _tokens_in_place(x: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, W, C) with tokens contiguous within a batch (the kernels' layout), copied if not."""
    B, T, H, W, C = x.shape
    if x.stride()[1:] == (H * W * C, W * C, C, 1):
        return x
    return x.contiguous()


class _DepthwiseConv3dTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lo: int, hi: int, gelu: bool):
        C = x.shape[-1]
        kernel = list(weight.shape[2:])
        x = _tokens_in_place(x)
        taps = weight.detach().reshape(C, -1).t().float().contiguous()  # (taps, C)
        b = bias.detach().float() if bias is not None else None
        if gelu:
            y, pre = _launch_conv_gelu(x, taps, b, lo, hi - lo, kernel, _out_dtype(x))
            ctx.save_for_backward(x, taps, pre)
        else:
            y = _launch_conv(x, taps, b, lo, hi - lo, kernel, _out_dtype(x))
            ctx.save_for_backward(x, taps)
        ctx.meta = (lo, kernel, bias is not None, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, taps, *pre = ctx.saved_tensors
        lo, kernel, has_bias, w_dtype = ctx.meta
        dy = dy.contiguous()
        if pre:  # through the GELU: the gradient of its input, the conv's output
            dy = torch.ops.aten.gelu_backward(dy, pre[0])
        C = x.shape[-1]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # the transposed conv: taps reversed, dy read at frame offset -lo
            dx = _launch_conv(dy, taps.flip(0).contiguous(), None, -lo, x.shape[1], kernel, x.dtype)
        if ctx.needs_input_grad[1] or (has_bias and ctx.needs_input_grad[2]):
            grads = _launch_wgrad(x, dy, lo, kernel)  # (taps + 1, C): the weight's, then the bias's
            dw = grads[:-1].t().reshape(C, 1, *kernel).to(w_dtype)
            db = grads[-1].to(w_dtype) if has_bias else None
        return dx, dw, db, None, None, None


def _conv_torch(x, weight, bias, lo, hi, gelu):
    h = x.permute(0, 4, 1, 2, 3)                                   # (B, C, T, H, W), a channels-last view
    if x.is_cuda:
        # cuDNN's bf16 depthwise weight gradient is far slower on the channels-last view than on NCDHW
        h = h.contiguous()
    pad = tuple(k // 2 for k in weight.shape[2:])
    y = F.conv3d(h, weight, bias, padding=pad, groups=weight.shape[0])[:, :, lo:hi]   # (B, C, hi-lo, H, W)
    y = y.permute(0, 2, 3, 4, 1)                                   # (B, hi-lo, H, W, C)
    return F.gelu(y) if gelu else y


class _DepthwiseConv3dCPU(torch.autograd.Function):
    """F.conv3d over the channels-last view; the backward as two plain passes: the input gradient is the
    conv of dy (zero outside frames [lo, hi)) with the taps flipped, the weight gradient per tap the sum of
    dy times x shifted by that tap (x zero-padded), both accumulated in at least fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, lo: int, hi: int):
        pad = tuple(k // 2 for k in weight.shape[2:])
        y = F.conv3d(x.permute(0, 4, 1, 2, 3), weight, bias, padding=pad, groups=weight.shape[0])  # (B, C, T, H, W)
        ctx.save_for_backward(x, weight)
        ctx.meta = (lo, bias.dtype if bias is not None else None)
        return y[:, :, lo:hi].permute(0, 2, 3, 4, 1)               # (B, hi-lo, H, W, C)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        lo, bias_dtype = ctx.meta
        B, T, H, W, C = x.shape
        kernel = weight.shape[2:]
        pt, ph, pw = (k // 2 for k in kernel)
        frames = dy.shape[1]
        wide = torch.promote_types(dy.dtype, torch.float32)
        dy = dy.to(wide)                                            # (B, frames, H, W, C)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            full = dy.new_zeros((B, T, H, W, C))
            full[:, lo:lo + frames] = dy                            # (B, T, H, W, C)
            dx = F.conv3d(full.permute(0, 4, 1, 2, 3), weight.to(wide).flip(2, 3, 4), None, padding=(pt, ph, pw),
                          groups=C).permute(0, 2, 3, 4, 1).to(x.dtype)  # (B, T, H, W, C)
        if ctx.needs_input_grad[1]:
            xp = F.pad(x.to(wide), (0, 0, pw, pw, ph, ph, pt, pt))  # (B, T+2pt, H+2ph, W+2pw, C)
            taps = [(xp[:, lo + a:lo + a + frames, b:b + H, c:c + W] * dy).sum((0, 1, 2, 3))   # (C,) per tap
                    for a in range(kernel[0]) for b in range(kernel[1]) for c in range(kernel[2])]
            dw = torch.stack(taps, 1).view(weight.shape).to(weight.dtype)  # (C, 1, kt, kh, kw)
        if bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.sum((0, 1, 2, 3)).to(bias_dtype)                # (C,)
        return dx, dw, db, None, None


def _conv_cpu(x, weight, bias, lo, hi, gelu):
    y = _DepthwiseConv3dCPU.apply(x, weight, bias, lo, hi)          # (B, hi-lo, H, W, C)
    return F.gelu(y) if gelu else y


def _conv_triton(x, weight, bias, lo, hi, gelu):
    return _DepthwiseConv3dTriton.apply(x, weight, bias, lo, hi, gelu)


def _can_run_torch(x: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    return True, "F.conv3d"


def _can_run_cpu(x: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    if x.device.type == "cpu" or explicit:
        return True, "F.conv3d, backward written out"
    return False, f"auto takes it on the CPU only (x is on {x.device})"


def _can_run_triton(x: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    return triton_kernels_check("megaslide.attention.dsa.depthwise_kernels", x.device, explicit,
                                "Triton depthwise conv")


BACKENDS: tuple[Backend, ...] = (Backend("triton", _can_run_triton, _conv_triton),
                                 Backend("cpu", _can_run_cpu, _conv_cpu),
                                 Backend("torch", _can_run_torch, _conv_torch))


def depthwise_conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     frames: tuple[int, int] | None = None, backend: str = "auto", gelu: bool = False) -> torch.Tensor:
    """Depthwise Conv3d of x (B, T, H, W, C) with weight (C, 1, kt, kh, kw) (odd sizes) and bias (C,),
    padding kernel // 2; output frames [lo, hi) (default all) as (B, hi - lo, H, W, C); with `gelu`, F.gelu
    (exact) of it, fused into the conv's pass on the Triton path."""
    B, T, H, W, C = x.shape
    lo, hi = frames if frames is not None else (0, T)
    if weight.dim() != 5 or weight.shape[:2] != (C, 1) or any(k % 2 == 0 for k in weight.shape[2:]):
        raise ValueError(f"depthwise_conv3d: weight {tuple(weight.shape)} must be (C={C}, 1, kt, kh, kw) with odd "
                         f"kernel sizes (a depthwise Conv3d over x's last dim)")
    if not 0 <= lo < hi <= T:
        raise ValueError(f"depthwise_conv3d: frames=({lo}, {hi}) must satisfy 0 <= lo < hi <= T={T}")
    return select_backend(backend, BACKENDS, x).run(x, weight, bias, lo, hi, gelu)
