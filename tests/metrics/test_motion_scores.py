import functools
import math
import os
from collections import deque

import cv2
import numpy as np
import pytest
import torch

from megaslide.data.moving_shapes import DIRECTIONS, SHAPES, MovingShapes, render_video
from megaslide.data.video_io import to_uint8_frames
from megaslide.metrics.motion import (
    SHAPE_TEMPLATES,
    classify_direction,
    classify_shape,
    fit_motion,
    measure_object,
    score_video,
    score_videos,
    torus_components,
    track_colors,
)

os.environ.setdefault("WANDB_MODE", "disabled")

CONFIGS = {
    "slow": dict(height=32, width=32, speed=(2.0, 4.0), shape_size=8),
    "fast": dict(height=32, width=32, speed=(6.0, 10.0), shape_size=8),
    "two_shapes": dict(height=32, width=32, speed=(2.0, 4.0), shape_size=8, num_shapes=2),
}


def reference_torus_components(mask: np.ndarray) -> np.ndarray:
    """Breadth-first flood fill with 8-neighbours taken modulo the frame size."""
    height, width = mask.shape
    labels = np.zeros(mask.shape, np.int64)
    next_label = 0
    for start in zip(*np.nonzero(mask)):
        if labels[start]:
            continue
        next_label += 1
        labels[start] = next_label
        queue = deque([start])
        while queue:
            y, x = queue.popleft()
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = (y + dy) % height, (x + dx) % width
                    if mask[ny, nx] and not labels[ny, nx]:
                        labels[ny, nx] = next_label
                        queue.append((ny, nx))
    return labels


@functools.lru_cache(maxsize=None)
def dataset_videos(name, num_videos=12, frames=12, seed=5):
    ds = MovingShapes(num_videos, frames=frames, seed=seed, **CONFIGS[name])
    items = [ds[i] for i in range(num_videos)]
    return ds, items, [to_uint8_frames(it["video"]) for it in items], [it["labels"] for it in items]


@pytest.mark.parametrize("shape", [(1, 5), (2, 3), (5, 9), (16, 16), (13, 7)])
def test_torus_components_match_flood_fill(shape):
    rng = np.random.default_rng(shape[0] * 31 + shape[1])
    for density in (0.15, 0.35, 0.6):
        mask = rng.random(shape) < density
        fast, count = torus_components(mask)
        slow = reference_torus_components(mask)
        assert count == slow.max()
        pairs = set(zip(fast[mask].tolist(), slow[mask].tolist()))
        assert len(pairs) == count  # a bijection between the two labellings
        assert np.all((fast == 0) == ~mask)


def test_measure_object_on_a_wrapped_shape():
    height, width, size = 24, 30, 9.0
    for center in ([0.4, 29.1], [12.3, 15.8], [23.6, 0.2]):
        video = render_video(height, width, torch.tensor([[center]]), [{"color": "white", "shape": "square"}], size)
        mask = video[0, 0].numpy() > 127.5
        area, centroid, kurtosis, offset = measure_object(mask)
        extent = np.array([height, width])
        error = (centroid - np.array(center) + extent / 2) % extent - extent / 2
        assert np.all(np.abs(error) < 0.5)
        assert area == pytest.approx(size * size, rel=0.25)
        assert kurtosis == pytest.approx(1.8, abs=0.1) and offset == pytest.approx(0.0, abs=0.06)


def test_classifiers_on_templates_and_unit_vectors():
    for name, (kurtosis, offset) in SHAPE_TEMPLATES.items():
        assert classify_shape(kurtosis, offset) == name
    for name, unit in DIRECTIONS.items():
        assert classify_direction(3.0 * np.array(unit)) == name
        assert classify_direction(3.0 * np.array(unit) + 0.3) == name
    assert classify_direction(np.array([0.1, 0.0])) == "static"
    assert classify_direction(np.array([np.nan, np.nan])) == "static"


def test_fit_motion_unwraps_and_handles_gaps():
    height, width = 20, 30
    times = np.arange(10)
    # leaves the frame repeatedly; even across a gap of two frames each step is shorter than half the frame
    truth = np.array([3.0, 7.0]) + times[:, None] * np.array([-4.0, 6.0])
    wrapped = truth % np.array([height, width])
    present = np.ones(10, bool)
    present[[2, 5]] = False
    wrapped[~present] = np.nan
    fit = fit_motion(wrapped, present, height, width)
    np.testing.assert_allclose(fit.velocity, [-4.0, 6.0], atol=1e-9)
    assert fit.speed == pytest.approx(math.hypot(4.0, 6.0))
    assert fit.residual == pytest.approx(0.0, abs=1e-9)
    assert fit_motion(wrapped, np.eye(10, dtype=bool)[0], height, width) is None


def test_detected_tracks_follow_the_true_trajectory():
    ds, items, videos, labels = dataset_videos("fast")
    extent = np.array([ds.height, ds.width])
    for item, video in zip(items, videos):
        (track,) = track_colors(video, [item["labels"][0]["color"]])
        assert track.present.all()
        error = (track.centroid - item["trajectory"][0].numpy() + extent / 2) % extent - extent / 2
        assert np.abs(error).mean() < 0.3


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ground_truth_scores_near_one(name):
    _, _, videos, labels = dataset_videos(name)
    scores = score_videos(videos, labels)
    assert scores["text_alignment"] >= 0.9
    assert scores["temporal_consistency"] >= 0.9
    assert scores["motion_error"] <= 0.05
    assert scores["num_videos"] == 12


def test_model_layout_batches_and_captions_are_accepted():
    ds, items, videos, labels = dataset_videos("slow", num_videos=4)
    batch = torch.stack([it["video"] for it in items])  # (B, 3, T, H, W)
    from_labels = score_videos(batch, labels)
    from_captions = score_videos(videos, [it["caption"] for it in items])
    assert from_labels == score_videos(videos, labels)
    assert from_captions["text_alignment"] == from_labels["text_alignment"]
    assert math.isnan(from_captions["motion_error"])  # captions carry no speed
    assert score_video(videos[0], items[0]["caption"])["text_alignment"] == 1.0


def test_shuffled_frames_break_motion():
    _, _, videos, labels = dataset_videos("fast")
    rng = np.random.default_rng(0)
    clean = score_videos(videos, labels)
    shuffled = score_videos([v[rng.permutation(len(v))] for v in videos], labels)
    assert shuffled["text_alignment"] <= clean["text_alignment"] - 0.3
    assert shuffled["temporal_consistency"] <= clean["temporal_consistency"] - 0.15
    assert shuffled["smoothness"] < 0.3
    assert shuffled["motion_error"] >= 0.3


def test_colour_swaps_break_alignment_and_identity():
    ds, items, videos, labels = dataset_videos("slow")
    swapped = []
    for item in items:
        wrong = [dict(lab, color="green" if lab["color"] != "green" else "red") for lab in item["labels"]]
        video = render_video(ds.height, ds.width, item["trajectory"], wrong, ds.shape_size)  # (3, T, H, W) in [0, 255]
        swapped.append(to_uint8_frames(video / 127.5 - 1))
    clean = score_videos(videos, labels)
    whole = score_videos(swapped, labels)
    assert whole["text_alignment"] == 0.0 and whole["temporal_consistency"] == 0.0
    half = score_videos([np.concatenate([v[:6], s[6:]]) for v, s in zip(videos, swapped)], labels)
    assert half["identity"] == pytest.approx(0.5)
    assert half["temporal_consistency"] <= clean["temporal_consistency"] - 0.1


def test_positional_jitter_breaks_smoothness_not_alignment():
    ds, items, videos, labels = dataset_videos("slow")
    rng = np.random.default_rng(1)
    jittered = []
    for item in items:
        noise = torch.from_numpy(rng.uniform(-2.0, 2.0, item["trajectory"].shape)).float()
        video = render_video(ds.height, ds.width, item["trajectory"] + noise, item["labels"], ds.shape_size)
        jittered.append(to_uint8_frames(video / 127.5 - 1))
    clean = score_videos(videos, labels)
    shaky = score_videos(jittered, labels)
    assert shaky["smoothness"] <= clean["smoothness"] - 0.3
    assert shaky["temporal_consistency"] <= clean["temporal_consistency"] - 0.08
    assert shaky["text_alignment"] >= 0.9  # the motion is still the captioned one


def test_frame_skipping_breaks_speed_only():
    _, _, videos, labels = dataset_videos("slow")
    skipped = score_videos([v[::2] for v in videos], labels)
    assert skipped["motion_error"] == pytest.approx(1.0, abs=0.1)  # twice the labelled speed
    assert skipped["text_alignment"] >= 0.9


def test_blur_and_noise_break_shape_and_consistency():
    _, _, videos, labels = dataset_videos("slow")
    rng = np.random.default_rng(2)
    clean = score_videos(videos, labels)
    blurred = [np.stack([cv2.GaussianBlur(f, (0, 0), rng.uniform(0.5, 2.0)) for f in v]) for v in videos]
    blur = score_videos(blurred, labels)
    assert blur["text_alignment"] <= clean["text_alignment"] - 0.3
    assert blur["temporal_consistency"] <= clean["temporal_consistency"] - 0.08
    noisy = [np.clip(v + rng.normal(0.0, 100.0, v.shape), 0, 255).astype(np.uint8) for v in videos]
    noise = score_videos(noisy, labels)
    assert noise["text_alignment"] <= clean["text_alignment"] - 0.15  # moments average the noise out a little
    assert noise["shape_stability"] <= clean["shape_stability"] - 0.1
    assert noise["temporal_consistency"] <= clean["temporal_consistency"] - 0.08


def test_an_empty_video_scores_zero():
    labels = [{"color": "red", "shape": "circle", "direction": "left", "speed": 2.0}]
    scores = score_video(np.zeros((6, 16, 16, 3), np.uint8), labels)
    assert scores["text_alignment"] == 0.0 and scores["temporal_consistency"] == 0.0
    assert scores["motion_error"] == 1.0


def test_bad_inputs():
    video = np.zeros((6, 16, 16, 3), np.uint8)
    with pytest.raises(ValueError, match="labels"):
        score_videos([video, video], [[{"color": "red", "shape": "circle", "direction": "up"}]])
    with pytest.raises(ValueError, match="labels"):
        score_video(video, [])
    with pytest.raises(ValueError, match="videos"):
        score_videos([], [])
    with pytest.raises(ValueError, match="at least 2"):
        score_video(video[:1], "a red circle moving up")
    assert set(SHAPE_TEMPLATES) == set(SHAPES)


def test_near_colour_pixels_with_zero_coverage_are_not_an_object():
    """Pixels within the colour radius but on the far side of the background get zero
    coverage; such a component must count as absent, not crash the tracker."""
    import numpy as np

    from megaslide.metrics.motion import measure_object
    mask = np.zeros((8, 8), bool)
    mask[2:4, 2:4] = True
    area, centroid, kurtosis, _ = measure_object(mask, np.zeros((8, 8)))
    assert area == 0.0 and np.isnan(centroid).all() and kurtosis == 0.0
