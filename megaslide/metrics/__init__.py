"""The contract paths `megaslide.metrics.video` and `megaslide.metrics.motion` (docs/ARCHITECTURE.md): plain
re-exports of the quality scores, whose code lives in megaslide.eval."""
