"""Primitives shared by the model and the attention variants: the lowest layer of megaslide.

RMSNorm, 3D RoPE tables and their rotation, adaLN modulation, and fused QK-norm + RoPE (qk_rope.py, imported
by its own path: its kernels need triton). Nothing here imports
`megaslide.models` or `megaslide.attention`; both import from here.
"""
from megaslide.nn.modulation import modulate
from megaslide.nn.norm import RMSNorm
from megaslide.nn.rope import RopeTable, apply_rope, axis_pairs, grid_positions

__all__ = ["RMSNorm", "RopeTable", "apply_rope", "axis_pairs", "grid_positions", "modulate"]
