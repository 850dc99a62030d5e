"""The video DiT (dit.py), how its blocks run (chunking.py), and diffusers-format Wan checkpoints (pretrained.py)."""
from megaslide.models.pretrained import load_pretrained

__all__ = ["load_pretrained"]
