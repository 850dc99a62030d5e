"""Baselines: the Swin-DiT self-attention (swin_attention.py). It is registered as `swin` by
the `megaslide.attention` entry point in pyproject.toml, so importing this package has no
side effects; the dense 3D-DiT baseline is megaslide's own `dense` attention."""
