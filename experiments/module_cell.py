"""The DSA modules' timing cell that bench_attention and bench_offset_net share: one `dsa` or `dsa_zero`
module's attend (offset net + op) fwd+bwd as training runs it."""
from __future__ import annotations

import math

import torch

from megaslide.attention import build_attention

KERNEL = (3, 3, 3)


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
