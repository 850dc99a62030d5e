"""The contract paths of docs/ARCHITECTURE.md re-export the evaluation code of megaslide.eval."""
import megaslide.eval.motion
import megaslide.eval.video
import megaslide.metrics.motion
import megaslide.metrics.video


def test_metrics_paths_re_export_the_eval_functions():
    from megaslide.metrics.motion import score_videos
    from megaslide.metrics.video import consistency, temporal_flickering
    assert score_videos is megaslide.eval.motion.score_videos
    assert (consistency, temporal_flickering) == (megaslide.eval.video.consistency,
                                                  megaslide.eval.video.temporal_flickering)


def test_every_re_exported_name_is_the_eval_object():
    for alias, source in ((megaslide.metrics.video, megaslide.eval.video),
                          (megaslide.metrics.motion, megaslide.eval.motion)):
        assert alias.__all__
        for name in alias.__all__:
            assert getattr(alias, name) is getattr(source, name), f"{alias.__name__}.{name}"
