"""3D Deformable Slide Attention: the op (reference and fused Triton backends)."""
from megaslide.attention.dsa.op import (
    BACKENDS,
    can_run_reference,
    can_run_triton,
    deformable_slide_attention,
    neighborhood_attention,
)
from megaslide.attention.dsa.reference import deformable_slide_attention_reference

__all__ = [
    "BACKENDS",
    "can_run_reference",
    "can_run_triton",
    "deformable_slide_attention",
    "deformable_slide_attention_reference",
    "neighborhood_attention",
]
