"""Contract path of the MovingShapes scores (docs/ARCHITECTURE.md); the code is megaslide.eval.motion."""
from megaslide.eval.motion import SCORER_VERSION, score_video, score_videos

__all__ = ["SCORER_VERSION", "score_video", "score_videos"]
