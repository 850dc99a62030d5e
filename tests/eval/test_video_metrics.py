import os

import cv2
import numpy as np
import pytest
import torch

from megaslide.data.moving_shapes import MovingShapes, render_video
from megaslide.data.video_io import to_uint8_frames
from megaslide.eval.video import (
    FLOW_METHODS,
    color_histogram_features,
    consistency,
    dynamic_degree,
    flow_scores,
    frame_consistency,
    pixel_features,
    temporal_flickering,
    top_flow_magnitude,
)

os.environ.setdefault("WANDB_MODE", "disabled")


def reference_flickering(frames: np.ndarray, dtype=np.float64) -> float:
    """VBench's loop: per pair, the mean of cv2.absdiff of float32 frames (VBench averages in float32)."""
    maes = [
        np.mean(cv2.absdiff(a.astype(np.float32), b.astype(np.float32)).astype(dtype))
        for a, b in zip(frames[:-1], frames[1:])
    ]
    return (255.0 - float(np.mean(maes))) / 255.0


def reference_consistency(features: np.ndarray) -> float:
    """VBench's loop over frames with per-pair cosine similarities, in float64."""

    def cos(a, b):
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))

    total = 0.0
    for t in range(1, len(features)):
        total += (max(0.0, cos(features[t - 1], features[t])) + max(0.0, cos(features[0], features[t]))) / 2
    return total / (len(features) - 1)


@pytest.mark.parametrize(
    "shape,chunk", [((2, 5, 7, 3), 16), ((18, 9, 11, 3), 16), ((33, 4, 3, 3), 4), ((7, 1, 1, 3), 1)]
)
def test_temporal_flickering_matches_vbench_loop(shape, chunk):
    frames = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    expected = reference_flickering(frames)
    vbench_error = abs(reference_flickering(frames, dtype=np.float32) - expected)
    assert abs(temporal_flickering(frames, chunk=chunk) - expected) <= max(2 * vbench_error, 1e-12)
    assert temporal_flickering(torch.from_numpy(frames), chunk=chunk) == temporal_flickering(frames, chunk=chunk)


def test_temporal_flickering_extremes_and_errors():
    static = np.full((5, 8, 8, 3), 77, np.uint8)
    assert temporal_flickering(static) == 1.0
    strobe = np.zeros((6, 8, 8, 3), np.uint8)
    strobe[::2] = 255
    assert temporal_flickering(strobe) == 0.0
    with pytest.raises(ValueError, match="to_uint8_frames"):
        temporal_flickering(np.zeros((3, 4, 8, 8), np.float32))
    with pytest.raises(ValueError, match="at least 2"):
        temporal_flickering(static[:1])


@pytest.mark.parametrize("num_frames,dim", [(2, 1), (5, 7), (17, 64)])
def test_consistency_matches_vbench_loop(num_frames, dim):
    rng = np.random.default_rng(num_frames * dim)
    features = rng.normal(size=(num_frames, dim))  # negative cosines occur and are clipped
    expected = reference_consistency(features)
    assert consistency(features) == pytest.approx(expected, abs=1e-12)
    assert consistency(torch.from_numpy(features).float()) == pytest.approx(expected, abs=1e-6)


def test_consistency_known_values():
    same = np.tile(np.array([[1.0, 2.0, 3.0]]), (4, 1))
    assert consistency(same) == pytest.approx(1.0)
    # f1 orthogonal to f0; f2 = f0: pairs give (0 + 0) / 2 and (0 + 1) / 2
    assert consistency(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])) == pytest.approx(0.25)
    assert consistency(np.array([[1.0, 0.0], [-1.0, 0.0]])) == 0.0
    assert consistency(np.array([[1.0, 0.0], [0.0, 0.0]])) == 0.0
    with pytest.raises(ValueError, match="features"):
        consistency(np.ones((1, 4)))
    with pytest.raises(ValueError, match="features"):
        consistency(np.ones(4))


@pytest.mark.parametrize("bins", [1, 4, 8])
def test_color_histogram_features_match_histogramdd(bins):
    frames = np.random.default_rng(bins).integers(0, 256, (3, 5, 9, 3), dtype=np.uint8)
    features = color_histogram_features(frames, bins=bins)
    assert features.shape == (3, bins**3)
    for frame, row in zip(frames, features):
        counts, _ = np.histogramdd(frame.reshape(-1, 3).astype(float), bins=bins, range=[(0, 256)] * 3)
        np.testing.assert_allclose(row, np.sqrt(counts.ravel() / counts.sum()), atol=1e-12)
        assert np.sum(row**2) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="bins"):
        color_histogram_features(frames, bins=3)


def test_pixel_features_are_block_means():
    frames = np.random.default_rng(1).integers(0, 256, (2, 8, 12, 3), dtype=np.uint8)
    features = pixel_features(frames, size=4)
    blocks = frames.astype(np.float64).reshape(2, 4, 2, 4, 3, 3).mean(axis=(2, 4)) / 255.0  # (T, 4, 4, 3)
    np.testing.assert_allclose(features, blocks.transpose(0, 3, 1, 2).reshape(2, -1), atol=1e-12)


def test_frame_consistency_separates_steady_from_changing_subjects():
    ds = MovingShapes(4, frames=10, height=32, width=32, speed=3.0, shape_size=10, seed=2)
    for index in range(len(ds)):
        item = ds[index]
        steady = to_uint8_frames(item["video"])
        recoloured = [dict(lab, color="green" if lab["color"] != "green" else "red") for lab in item["labels"]]
        other = to_uint8_frames(render_video(32, 32, item["trajectory"], recoloured, 10.0) / 127.5 - 1.0)
        switching = np.concatenate([steady[:5], other[5:]])
        assert frame_consistency(steady) > 0.97  # anti-aliased edges shift a few histogram bins
        assert frame_consistency(steady) - frame_consistency(switching) > 0.015
        static = np.repeat(steady[:1], 10, axis=0)
        assert frame_consistency(static, encoder=pixel_features) == pytest.approx(1.0)
        assert frame_consistency(steady, encoder=pixel_features) < frame_consistency(static, encoder=pixel_features)


def test_frame_consistency_is_blind_to_motion_as_documented():
    """The histogram encoder ignores position: frozen and teleporting clips score like the true one
    (the documented limit; the motion-aware score is metrics.motion's temporal_consistency)."""
    ds = MovingShapes(4, frames=16, height=16, width=16, speed=3.0, shape_size=6, seed=10007)
    for index in range(len(ds)):
        steady = to_uint8_frames(ds[index]["video"])
        frozen = np.repeat(steady[:1], len(steady), axis=0)
        teleport = steady.copy()
        teleport[8:] = np.roll(steady[8:], (5, 5), axis=(1, 2))
        assert frame_consistency(frozen) == pytest.approx(1.0)
        assert frame_consistency(teleport) == pytest.approx(frame_consistency(steady), abs=0.01)


@pytest.mark.parametrize("size,fraction", [((7, 9), 0.05), ((4, 4), 0.05), ((32, 33), 0.2), ((3, 5), 1.0)])
def test_top_flow_magnitude_matches_sorting(size, fraction):
    flow = np.random.default_rng(size[0]).normal(size=(*size, 2)).astype(np.float32)
    magnitude = np.sqrt((flow.astype(np.float64) ** 2).sum(-1)).ravel()
    count = max(1, int(magnitude.size * fraction))
    expected = np.sort(magnitude)[::-1][:count].mean()
    assert top_flow_magnitude(flow, fraction) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("method", list(FLOW_METHODS))
def test_flow_recovers_a_translation(method):
    rng = np.random.default_rng(0)
    texture = cv2.GaussianBlur(rng.uniform(0, 255, (64, 64, 3)).astype(np.float32), (0, 0), 2.0)
    texture = ((texture - texture.min()) / (texture.max() - texture.min()) * 255).astype(np.uint8)
    frames = np.stack([np.roll(texture, (t, 2 * t), axis=(0, 1)) for t in range(3)])  # dy = 1, dx = 2 per frame
    flow = FLOW_METHODS[method](frames[0], frames[1])
    assert flow.shape == (64, 64, 2)
    assert np.median(flow[8:-8, 8:-8, 0]) == pytest.approx(2.0, abs=0.2)  # dx
    assert np.median(flow[8:-8, 8:-8, 1]) == pytest.approx(1.0, abs=0.2)  # dy
    scores = flow_scores(frames, method=method)
    assert scores.shape == (2,) and np.all(scores > 1.8)


@pytest.mark.parametrize("method", list(FLOW_METHODS))
def test_dynamic_degree_static_vs_moving(method):
    moving = MovingShapes(3, frames=8, height=32, width=32, speed=3.0, shape_size=10, seed=4)
    for index in range(len(moving)):
        frames = to_uint8_frames(moving[index]["video"])
        assert dynamic_degree(frames, method=method)
        assert not dynamic_degree(np.repeat(frames[:1], 8, axis=0), method=method)
        assert not dynamic_degree(frames, threshold=50.0, method=method)
        assert not dynamic_degree(frames, min_moving_pairs=8, method=method)  # only 7 pairs exist


def test_dynamic_degree_bad_arguments():
    frames = np.zeros((4, 16, 16, 3), np.uint8)
    with pytest.raises(ValueError, match="method"):
        dynamic_degree(frames, method="raft")
    with pytest.raises(ValueError, match="fps"):
        dynamic_degree(frames, fps=0)
    with pytest.raises(ValueError, match="top_fraction"):
        flow_scores(frames, top_fraction=0.0)
