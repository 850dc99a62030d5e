"""Contract path of the VBench formulas (docs/ARCHITECTURE.md); the code is megaslide.eval.video."""
from megaslide.eval.video import consistency, dynamic_degree, frame_consistency, temporal_flickering

__all__ = ["consistency", "dynamic_degree", "frame_consistency", "temporal_flickering"]
