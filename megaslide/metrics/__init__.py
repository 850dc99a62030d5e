"""The contract paths `megaslide.metrics.video` and `megaslide.metrics.motion` (docs/ARCHITECTURE.md):
the evaluation modules they name live in megaslide.eval; the performance accounting that also
lived here is megaslide.perf."""
import sys

from megaslide.eval import motion, video

sys.modules[f"{__name__}.motion"] = motion
sys.modules[f"{__name__}.video"] = video
