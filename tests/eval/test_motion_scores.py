import functools
import math
import os
from collections import deque

import cv2
import numpy as np
import pytest
import torch

from megaslide.data.moving_shapes import DIRECTIONS, SHAPES, MovingShapes, caption_for, render_video
from megaslide.data.video_io import to_uint8_frames
from megaslide.eval.motion import (
    FILL_RATIO,
    SCORER_VERSION,
    classify_direction,
    classify_shapes,
    fit_motion,
    grow_torus,
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
        coverage = video[0, 0].numpy().astype(np.float64) / 255.0
        region = grow_torus(coverage > 0.5)
        area, centroid = measure_object(region, coverage)
        extent = np.array([height, width])
        error = (centroid - np.array(center) + extent / 2) % extent - extent / 2
        assert np.all(np.abs(error) < 0.05)
        assert area == pytest.approx(size * size, rel=0.02)
        assert classify_shapes(coverage[None], region[None], np.array([area]), centroid[None]) == ["square"]


def _torus_blur(image: np.ndarray, weights) -> np.ndarray:
    """A separable blur of an image (H, W) that wraps at the borders; weights of the taps -r..r."""
    radius = len(weights) // 2
    for axis in (0, 1):
        image = sum(w * np.roll(image, shift, axis=axis) for w, shift in zip(weights, range(-radius, radius + 1)))
    return image


@pytest.mark.parametrize("size", [6.0, 8.0, 11.0])
def test_classify_shapes_names_rendered_shapes_sharp_and_blurred(size):
    """Every shape at sub-pixel positions (some wrapping), sharp, box-blurred, Gaussian-blurred (sigma 1,
    a 5-tap kernel the classifier does not hold) and quantised to uint8 as a video is."""
    height, width, rng = 20, 24, np.random.default_rng(int(size * 10))
    kernels = {"sharp": [1.0], "box": [1 / 3] * 3, "gauss": cv2.getGaussianKernel(5, 1.0).ravel()}
    for shape in SHAPES:
        centers = np.stack([rng.uniform(0, height, 6), rng.uniform(0, width, 6)], axis=1)  # (6, 2)
        centers[0] = [0.3, width - 0.4]  # across both borders
        video = render_video(height, width, torch.from_numpy(centers).float()[None],
                             [{"color": "white", "shape": shape}],
                             size)  # (3, 6, H, W) in [0, 255]
        for name, weights in kernels.items():
            coverage = np.stack([np.rint(_torus_blur(f, weights)) / 255.0 for f in video[0].numpy()])  # (6, H, W)
            region = np.stack([grow_torus(c > 0.5) for c in coverage])
            measured = [measure_object(r, c) for r, c in zip(region, coverage)]
            area, centroid = np.array([m[0] for m in measured]), np.stack([m[1] for m in measured])
            named = classify_shapes(coverage, region, area, centroid)
            assert named.count(shape) >= 5, (shape, name, named)


def test_direction_classifier_on_unit_vectors():
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


def test_heavy_blur_and_noise_lower_stability_not_caption_match():
    """The shape fit models blur, so even strong blur (sigma up to 2 on 8-px shapes) keeps the caption
    match; what it and heavy noise (std 100 of 255) lower is how steady size, shape and path look."""
    _, _, videos, labels = dataset_videos("slow")
    rng = np.random.default_rng(2)
    clean = score_videos(videos, labels)
    blurred = [np.stack([cv2.GaussianBlur(f, (0, 0), rng.uniform(0.5, 2.0)) for f in v]) for v in videos]
    blur = score_videos(blurred, labels)
    assert blur["text_alignment"] >= 0.9
    assert blur["shape_stability"] <= clean["shape_stability"] - 0.05
    assert blur["temporal_consistency"] <= clean["temporal_consistency"] - 0.03
    noisy = [np.clip(v + rng.normal(0.0, 100.0, v.shape), 0, 255).astype(np.uint8) for v in videos]
    noise = score_videos(noisy, labels)
    assert noise["size_stability"] <= clean["size_stability"] - 0.05
    assert noise["smoothness"] <= clean["smoothness"] - 0.05
    assert noise["temporal_consistency"] <= clean["temporal_consistency"] - 0.05


# The sizes the studies score: the GPU studies' 16x16 clips with 6-px shapes at 3 px/frame (16 and 64
# frames), the CPU main job's (8 frames), and the 32x32 data configs (conf/data: 2 and 6 px/frame).
STUDY_SIZES = {
    "published_16f": dict(height=16, width=16, shape_size=6, speed=3.0, frames=16),
    "cpu_main_job": dict(height=16, width=16, shape_size=6, speed=3.0, frames=8),
    "published_64f": dict(height=16, width=16, shape_size=6, speed=3.0, frames=64),
    "default_32": dict(height=32, width=32, shape_size=8, speed=2.0, frames=8),
    "fast_32": dict(height=32, width=32, shape_size=8, speed=6.0, frames=8),
    "smoke_8": dict(height=8, width=8, shape_size=4, speed=2.0, frames=4),  # the script smoke tests' clips
}


@functools.lru_cache(maxsize=None)
def study_videos(name, num_videos=32):
    """Ground-truth clips of the held-out data seed the studies score (uint8), and their labels."""
    ds = MovingShapes(num_videos, seed=10007, **STUDY_SIZES[name])
    items = [ds[i] for i in range(num_videos)]
    return [to_uint8_frames(it["video"]) for it in items], [it["labels"] for it in items]


@pytest.mark.parametrize("name", list(STUDY_SIZES))
def test_ground_truth_scores_at_every_study_size(name):
    videos, labels = study_videos(name, num_videos=8 if name == "published_64f" else 32)
    scores = score_videos(videos, labels)
    assert scores["text_alignment"] >= 0.95 and scores["temporal_consistency"] >= 0.95


def _box3(video):
    return np.stack([cv2.blur(f, (3, 3)) for f in video])  # OpenCV's border (reflected, not wrapped)


def _gauss3(video):
    return np.stack([cv2.GaussianBlur(f, (3, 3), 0) for f in video])


def _noise(video, std=15.0):
    rng = np.random.default_rng(int(video.sum()) % 1000)
    return np.clip(video + rng.normal(0.0, std, video.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("degrade", [_box3, _gauss3, _noise])
def test_mildly_degraded_ground_truth_still_scores_high(degrade):
    videos, labels = study_videos("published_16f")
    scores = score_videos([degrade(v) for v in videos], labels)
    assert scores["text_alignment"] >= 0.9 and scores["temporal_consistency"] >= 0.9


def _teleport(video):
    """From the middle frame on, the object jumps by a third of the frame and goes on from there."""
    height, width = video.shape[1:3]
    jumped = video.copy()
    jumped[len(video) // 2:] = np.roll(video[len(video) // 2:], (height // 3, width // 3), axis=(1, 2))
    return jumped


@pytest.mark.parametrize("broken", ["frozen", "reversed", "teleport"])
def test_frozen_reversed_and_teleporting_objects_are_not_consistent(broken):
    videos, labels = study_videos("published_16f")
    truth = score_videos(videos, labels)
    make = {"frozen": lambda v: np.repeat(v[:1], len(v), axis=0), "reversed": lambda v: v[::-1], "teleport": _teleport}
    scores = score_videos([make[broken](v) for v in videos], labels)
    assert scores["temporal_consistency"] <= truth["temporal_consistency"] - 0.35
    assert scores["identity"] == 1.0 and scores["color_ok"] == 1.0  # the object itself is there throughout
    if broken != "teleport":
        assert scores["text_alignment"] == 0.0 and scores["velocity_match"] == pytest.approx(0.0, abs=1e-9)
        captions_only = score_videos([make[broken](v) for v in videos], [caption_for(lab) for lab in labels])
        assert captions_only["temporal_consistency"] == pytest.approx(0.0, abs=1e-9)  # only the direction counts


def _rotated(direction: str) -> str:
    """The DIRECTIONS name a quarter turn from `direction`."""
    dy, dx = DIRECTIONS[direction]
    return next(n for n, u in DIRECTIONS.items() if np.allclose(u, (dx, -dy)))


def test_wrong_captions_fail_the_part_they_change():
    videos, labels = study_videos("published_16f")
    truth = score_videos(videos, labels)

    def relabel(**change):
        return [[dict(lab, **{k: f(lab) for k, f in change.items()}) for lab in labs] for labs in labels]

    colour = score_videos(videos, relabel(color=lambda lab: "green" if lab["color"] != "green" else "red"))
    assert colour["text_alignment"] == 0.0 and colour["color_ok"] == 0.0 and colour["temporal_consistency"] == 0.0
    shape = score_videos(videos, relabel(shape=lambda lab: SHAPES[(SHAPES.index(lab["shape"]) + 1) % len(SHAPES)]))
    assert shape["text_alignment"] == 0.0 and shape["shape_ok"] == 0.0
    assert shape["temporal_consistency"] == truth["temporal_consistency"]  # consistency does not read the shape name
    turned = score_videos(videos, relabel(direction=lambda lab: _rotated(lab["direction"])))
    assert turned["text_alignment"] == 0.0 and turned["direction_ok"] == 0.0
    assert turned["motion_error"] == pytest.approx(math.sqrt(2.0), abs=0.01)  # |v - v_label| / |v_label|
    assert turned["temporal_consistency"] <= truth["temporal_consistency"] - 0.35


def test_motion_error_is_the_velocity_vector_error():
    videos, labels = study_videos("published_16f")
    assert score_videos(videos, labels)["motion_error"] <= 0.01
    assert score_videos([v[::-1] for v in videos], labels)["motion_error"] == pytest.approx(2.0, abs=0.02)
    halved = [[dict(lab, speed=lab["speed"] / 2) for lab in labs] for labs in labels]
    assert score_videos(videos, halved)["motion_error"] == pytest.approx(1.0, abs=0.02)


def test_scores_name_their_scorer_version_and_sampling_error():
    videos, labels = study_videos("cpu_main_job", num_videos=4)
    frozen = [np.repeat(v[:1], len(v), axis=0) for v in videos[:2]]
    scores = score_videos(videos[:2] + frozen, labels)                 # TA and TC: 1, 1, 0, 0
    assert scores["scorer_version"] == SCORER_VERSION >= 2
    assert scores["text_alignment"] == 0.5
    assert scores["text_alignment_se"] == pytest.approx(np.std([1, 1, 0, 0], ddof=1) / 2)
    assert scores["temporal_consistency_se"] == pytest.approx(0.29, abs=0.01)
    assert math.isnan(score_videos(videos[:1], labels[:1])["text_alignment_se"])


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
    assert set(FILL_RATIO) == set(SHAPES)


def test_near_colour_pixels_with_zero_coverage_are_not_an_object():
    """Pixels within the colour radius but on the far side of the background get zero
    coverage; such a component must count as absent, not crash the tracker."""
    import numpy as np

    from megaslide.eval.motion import measure_object
    mask = np.zeros((8, 8), bool)
    mask[2:4, 2:4] = True
    area, centroid = measure_object(mask, np.zeros((8, 8)))
    assert area == 0.0 and np.isnan(centroid).all()
