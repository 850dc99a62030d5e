"""Self-attention registry: `build_attention(name, dim, num_heads, **kw)`.

Each variant is one class (see `base.SelfAttention`) that owns its typed options, their
validation against the token grid, `keys_per_query` and its extra parameters. `dense`, `dsa`
and `dsa_zero` register here with `@register_attention`. Other packages add variants through
the `megaslide.attention` entry-point group (pyproject.toml:
`swin = "baselines.swin_attention:SwinAttention"`), loaded the first time their name is asked
for, so the core never imports them.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from megaslide.attention.base import SelfAttention

ENTRY_POINT_GROUP = "megaslide.attention"

_REGISTRY: dict[str, type[SelfAttention]] = {}


def register_attention(cls: type[SelfAttention]) -> type[SelfAttention]:
    """Class decorator: make `cls` available as `cls.name`."""
    _REGISTRY[cls.name] = cls
    return cls


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_attention() -> list[str]:
    """Every variant name: registered ones and those an installed package declares."""
    return sorted(set(_REGISTRY) | set(_entry_points()))


def attention_class(name: str) -> type[SelfAttention]:
    """The variant class called `name`, loaded from its entry point the first time."""
    if name not in _REGISTRY:
        ep = _entry_points().get(name)
        if ep is None:
            raise ValueError(f"attention.name={name!r} is unknown; known: {known_attention()}")
        cls = ep.load()
        if cls.name != name:
            raise ValueError(f"entry point {name!r} of group {ENTRY_POINT_GROUP!r} loads {ep.value}, "
                             f"whose name is {cls.name!r}; make the two agree")
        register_attention(cls)
    return _REGISTRY[name]


def build_attention(name: str, dim: int, num_heads: int, **kw) -> SelfAttention:
    """Build a self-attention module. kw: qk_norm, layer_idx and the variant's own options
    (swin: window; dsa and dsa_zero: kernel_size, max_offset, backend). An option the variant
    does not take raises a ValueError listing the ones it does."""
    return attention_class(name)(dim, num_heads, **kw)


from megaslide.attention import dense  # noqa: E402,F401  (registers 'dense')
from megaslide.attention.dsa import module as _dsa_module  # noqa: E402,F401  (registers 'dsa', 'dsa_zero')
