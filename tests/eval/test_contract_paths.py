"""The contract paths of docs/ARCHITECTURE.md stay importable after the evaluation modules moved to megaslide.eval."""
import importlib

import megaslide.eval.motion
import megaslide.eval.video


def test_metrics_paths_name_the_eval_modules():
    assert importlib.import_module("megaslide.metrics.video") is megaslide.eval.video
    assert importlib.import_module("megaslide.metrics.motion") is megaslide.eval.motion
    from megaslide.metrics.motion import score_videos
    from megaslide.metrics.video import consistency, temporal_flickering
    assert score_videos is megaslide.eval.motion.score_videos
    assert (consistency, temporal_flickering) == (megaslide.eval.video.consistency,
                                                  megaslide.eval.video.temporal_flickering)
