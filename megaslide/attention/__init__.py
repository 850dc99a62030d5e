"""Self-attention registry: `build_attention(name, dim, num_heads, **kw)`.

Variants register themselves with `@register_attention(name)`. `dense` and the DSA
variants live in megaslide; `swin` is registered by the `baselines` package, which the
core never imports (import `baselines` first to use it).
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_attention(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        return cls
    return deco


def known_attention() -> list[str]:
    return sorted(_REGISTRY)


def build_attention(name: str, dim: int, num_heads: int, **kw) -> nn.Module:
    """Build a self-attention module. kw: qk_norm, layer_idx, window, kernel_size, max_offset, backend."""
    if name not in _REGISTRY:
        hint = " ('swin' is registered by `import baselines`)" if name == "swin" else ""
        raise ValueError(f"unknown attention {name!r}; known: {known_attention()}{hint}")
    return _REGISTRY[name](dim, num_heads, **kw)


from megaslide.attention import dense  # noqa: E402,F401  (registers 'dense')
from megaslide.attention.dsa import module as _dsa_module  # noqa: E402,F401  (registers 'dsa', 'dsa_zero')
