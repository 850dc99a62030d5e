"""The DSA modules' timing cells: one `dsa` or `dsa_zero` module's attend (offset net + op) fwd+bwd as
training runs it (`module_fn`, shared by bench_attention and bench_offset_net), and each stage of the `dsa`
module's attend alone (`stage_fn`)."""
from __future__ import annotations

import math

import torch

from megaslide.attention import build_attention
from megaslide.attention.dsa import deformable_slide_attention
from megaslide.attention.dsa.bounded import bounded_offsets
from megaslide.attention.dsa.depthwise import depthwise_conv3d

KERNEL = (3, 3, 3)
STAGES = ("conv_gelu", "linear", "bound", "op")


def module_fn(name, grid, heads, d, device, backend, net_backend: str | None = None):
    """setup() -> step closure: the `name` module's attend (offset net + op) fwd+bwd on bf16 q, k, v and
    block input x under bf16 autocast over fp32 weights on CUDA; fp32 without autocast on CPU. The offset
    net keeps PyTorch's default init (not the zero init), so samples fall between tokens as in a trained
    layer. `net_backend` replaces the offset net's kernels ("triton" or "torch"; None: the module's own
    choice, which follows `backend`)."""
    def setup():
        cuda = device.type == "cuda"
        dtype = torch.bfloat16 if cuda else torch.float32
        g = torch.Generator(device=device).manual_seed(0)
        n, dim = math.prod(grid), heads * d
        q, k, v = (torch.randn(1, n, heads, d, generator=g, device=device, dtype=dtype).requires_grad_()
                   for _ in range(3))
        x = torch.randn(1, n, dim, generator=g, device=device, dtype=dtype).requires_grad_()  # (1, N, D)
        attn = build_attention(name, dim, heads, kernel_size=KERNEL, backend=backend).to(device)
        if net_backend is not None:
            attn.net_backend = net_backend

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                o = attn.attend(q, k, v, x, grid)  # (1, N, heads, d)
            o.float().sum().backward()
        return step
    return setup


def stage_fn(stage, grid, heads, d, device):
    """setup() -> step closure: one stage of the `dsa` module's attend alone, fwd + bwd with a fixed random
    output gradient, under bf16 autocast on CUDA as `module_fn` runs it, on the kernels the module takes
    there: `conv_gelu` (depthwise conv + GELU of the block input x), `linear` (the offset Linear of the GELU
    output), `bound` (max_offset * tanh of the Linear's output) or `op` (deformable_slide_attention on bf16
    q, k, v with the offsets that net gives, detached). Inputs come from one no-grad pass of the net with
    PyTorch's default init, as in `module_fn`."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: choose one of {STAGES}")

    def setup():
        g = torch.Generator(device=device).manual_seed(0)
        dim = heads * d
        attn = build_attention("dsa", dim, heads, kernel_size=KERNEL, backend="triton").to(device)
        conv, proj, bound = attn.offset_conv, attn.offset_proj, attn.options.max_offset
        x = torch.randn(1, *grid, dim, generator=g, device=device, dtype=torch.bfloat16)   # (1, T, H, W, D)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            h = depthwise_conv3d(x, conv.weight, conv.bias, gelu=True)                    # (1, T, H, W, D)
            o = proj(h)                                                                    # (1, T, H, W, F)
            offsets = bounded_offsets(o, bound).view(1, *grid, heads, math.prod(KERNEL), 3)
        q, k, v = (torch.randn(1, *grid, heads, d, generator=g, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        leaf = {"conv_gelu": [x], "linear": [h], "bound": [o], "op": [q, k, v, offsets]}[stage]
        leaf = [t.detach().requires_grad_() for t in leaf]
        fn = {"conv_gelu": lambda: depthwise_conv3d(leaf[0], conv.weight, conv.bias, gelu=True),
              "linear": lambda: proj(leaf[0]),
              "bound": lambda: bounded_offsets(leaf[0], bound),
              "op": lambda: deformable_slide_attention(*leaf, KERNEL)}[stage]
        like = {"conv_gelu": h, "linear": o, "bound": offsets.view(o.shape), "op": q}[stage]
        grad = torch.randn(like.shape, generator=g, device=device, dtype=torch.float32).to(like.dtype)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = fn()
            out.backward(grad)
        return step
    return setup
