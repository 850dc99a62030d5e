"""Building blocks of the video DiT: embeddings, MLP, cross-attention, final layer, and `default_init`."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megaslide.nn import RMSNorm, modulate


def default_init(module: nn.Module) -> None:
    """Define every parameter of `module`'s tree as the constructors do, drawing from the random stream in the
    order they draw: a module with `reset_parameters` (torch's layers and ours that own parameters) resets its
    whole tree; `nn.MultiheadAttention` resets after its `out_proj`, as its constructor does; any other module
    after its children, in registration order. A module that owns parameters and has no `reset_parameters` is
    an error: it would leave them undefined on a meta-device build."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
        return
    for child in module.children():
        default_init(child)
    if isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()
    elif next(module.parameters(recurse=False), None) is not None:
        raise TypeError(f"{type(module).__name__} owns parameters but has no reset_parameters(): give it one that "
                        f"defines them, in the order its constructor does")


class PatchEmbed3D(nn.Module):
    """(B, C, T, H, W) latents -> (B, N, D) tokens by a strided Conv3d over (pt, ph, pw) patches."""

    def __init__(self, in_channels: int, dim: int, patch_size: tuple[int, int, int]):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)                     # (B, D, T', H', W')
        return x.flatten(2).transpose(1, 2)  # (B, N, D)


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features (B, dim) of timesteps t (B,) in [0, 1000]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]                      # (B, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, dim)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_features(t, self.freq_dim))  # (B, D)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


QUERY_GROUP_MAX = 8192   # most queries a cross-attention group holds (see `query_groups`)


def query_groups(n: int) -> int:
    """How many equal groups cross-attention splits n queries into: the fewest groups of at most QUERY_GROUP_MAX
    queries whose count divides n, or 1 (whole) when none of up to 4x that fewest count divides n.

    Why: a caption has few keys (512), and with a whole slice's queries over it as one batch entry, cuDNN's SDPA
    backward ran markedly slower on an H200 than with the queries in groups, batch entries that share the
    caption (experiments/bench_cross_attention.py measured the effect, results/cross_attention/ holds it; the
    cause inside cuDNN is not measured). Groups of about 8,000 queries were at or near the fastest at both
    model widths."""
    fewest = math.ceil(n / QUERY_GROUP_MAX)
    return next((g for g in range(fewest, 4 * fewest + 1) if n % g == 0), 1) if fewest > 1 else 1


def grouped_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            groups: int) -> torch.Tensor:
    """SDPA of q (B, h, N, d) over k, v (B, h, L, d) with `mask` (B, 1, 1, L) or None -> (B, N, h, d), the N
    queries run as `groups` equal groups (N % groups == 0), each a batch entry with the same keys.

    The same math as one SDPA: a query's softmax runs over the same keys, and each key's gradient is the sum of
    its groups' (autograd sums it through the expand)."""
    B, h, N, d = q.shape
    L, n = k.shape[2], N // groups
    qg = q.reshape(B, h, groups, n, d).transpose(1, 2).reshape(B * groups, h, n, d)    # (B*g, h, n, d), a view
    kg, vg = (t[:, None].expand(B, groups, h, L, d).reshape(B * groups, h, L, d) for t in (k, v))  # (B*g, h, L, d)
    mg = None if mask is None else mask[:, None].expand(B, groups, 1, 1, L).reshape(B * groups, 1, 1, L)
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mg)                        # (B*g, h, n, d)
    return o.transpose(1, 2).reshape(B, N, h, d)


class CrossAttention(nn.Module):
    """Queries from video tokens, keys/values from caption tokens (masked where padded); the queries run in
    groups (`query_groups`)."""

    def __init__(self, dim: int, num_heads: int, context_dim: int, qk_norm: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(context_dim, 2 * dim)
        self.out = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(dim, eps=1e-6) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor | None) -> torch.Tensor:
        B, N, D = x.shape
        h = self.num_heads
        q = self.q_norm(self.q(x)).view(B, N, h, -1).transpose(1, 2)  # (B, h, N, d)
        k, v = self.kv(ctx).chunk(2, dim=-1)                          # (B, L, D) each
        k = self.k_norm(k).view(B, -1, h, D // h).transpose(1, 2)     # (B, h, L, d)
        v = v.view(B, -1, h, D // h).transpose(1, 2)                  # (B, h, L, d)
        mask = None if ctx_mask is None else ctx_mask[:, None, None, :]  # (B, 1, 1, L)
        o = grouped_cross_attention(q, k, v, mask, query_groups(N))    # (B, N, h, d)
        return self.out(o.reshape(B, N, D))                           # (B, N, D)


class FinalLayer(nn.Module):
    """adaLN-modulated norm and a linear map from tokens back to latent patches."""

    def __init__(self, dim: int, patch_volume: int, out_channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.modulation = nn.Parameter(torch.zeros(2, dim))  # per-layer (shift, scale) offsets
        self.linear = nn.Linear(dim, patch_volume * out_channels)

    def reset_parameters(self) -> None:
        """As the constructor defines them: zero modulation offsets, the linear's default init."""
        nn.init.zeros_(self.modulation)
        self.linear.reset_parameters()

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation[None] + t_emb[:, None]).unbind(1)  # (B, D) each
        return self.linear(modulate(self.norm(x), shift, scale))         # (B, N, p*C)
