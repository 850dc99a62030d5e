"""MovingShapes scores: text alignment, temporal consistency and motion error without weights.

Videos are parsed with the known palette and shapes of ``megaslide.data.moving_shapes``:

1. Segmentation: a pixel belongs to palette colour c if its RGB distance to c is below
   ``COLOR_RADIUS`` (100, less than half the smallest palette distance, 255).
2. Object: per frame and labelled colour, the largest 8-connected component of that colour
   on the torus (components touching across opposite borders are merged, so shapes that
   wrap around stay whole), if it has at least ``min_area`` pixels.
3. Per frame, weighting each pixel of the component (grown by one pixel) by how much the
   colour covers it (projection onto colour - background, background = median colour, so
   anti-aliased edges count partially): area, centroid (computed after rolling the object
   to the frame centre, so wrapping shapes are handled exactly), and a shape descriptor:
   kurtosis = the mean over the y and x axes of the weighted pixels' fourth central moment
   / variance^2, and vertical offset = (centroid_y - box centre_y) / box height. The
   kurtosis of a shape's marginals tells the shapes apart without their size: uniform
   (square) 1.8, semicircle (circle) 2.0, triangular (diamond, and the triangle's both
   marginals) 2.4; the offset tells the triangle (1/6) from the rest (0). Unlike the box fill
   ratio, it does not swing with the sub-pixel position of small anti-aliased shapes.
   Templates: circle (2.0, 0), square (1.8, 0), triangle (2.4, 1/6), diamond (2.4, 0); the
   nearest template (offset weighted x4) names the frame's shape, the majority names the
   object's.
4. Motion: centroids are unwrapped (each frame step taken as the shortest displacement on
   the torus) and fitted with a constant velocity by least squares. Direction = the
   DIRECTIONS unit vector of largest cosine with the velocity ("static" below
   ``min_speed``); speed = |velocity|.

Per labelled object:
- aligned: colour present in at least half the frames, shape and direction match the label;
- identity: fraction of frames where the colour is present;
- size_stability: 1 - std(area) / mean(area), clipped to [0, 1];
- shape_stability: fraction of present frames whose shape is the majority shape;
- smoothness: 1 - rms residual of the constant-velocity fit / (half the object's linear
  size, sqrt(mean area) / 2), clipped to [0, 1];
- temporal_consistency: mean of the four numbers above;
- motion_error: |fitted speed - label speed| / label speed (labels with speed > 0 only).
An object seen in fewer than two frames scores only its identity, and motion_error 1.
A video is aligned if all its labelled objects are; other scores average over objects.

Limits: motion is only unambiguous while each step between detections is shorter than
half the frame (MovingShapes enforces this for its own videos); shapes below ~8 px are
read less reliably; overlapping shapes of a multi-shape video lower size and shape
stability while they overlap.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from megaslide.data.moving_shapes import COLORS, DIRECTIONS, parse_caption
from megaslide.data.video_io import to_uint8_frames

COLOR_RADIUS = 100.0
SHAPE_TEMPLATES: dict[str, tuple[float, float]] = {
    # (kurtosis of the x and y marginals, vertical centroid offset / box height)
    "circle": (2.0, 0.0),
    "square": (1.8, 0.0),
    "triangle": (2.4, 1.0 / 6.0),
    "diamond": (2.4, 0.0),
}
_OFFSET_WEIGHT = 4.0


@dataclass
class ObjectTrack:
    """What was detected of one colour in a video of T frames (H x W).

    present (T,) bool; area (T,) pixels (0 when absent); centroid (T, 2) (y, x) in
    [0, H) x [0, W), NaN when absent; shape: T entries, None when absent.
    """

    color: str
    present: np.ndarray
    area: np.ndarray
    centroid: np.ndarray
    shape: list[str | None]


@dataclass
class MotionFit:
    """Constant-velocity fit: velocity (2,) (vy, vx) px/frame, speed, rms residual (px)."""

    velocity: np.ndarray
    speed: float
    residual: float


def classify_shape(kurtosis: float, offset: float) -> str:
    """Nearest SHAPE_TEMPLATES entry to a (marginal kurtosis, vertical offset) descriptor."""

    def distance(template: tuple[float, float]) -> float:
        return (kurtosis - template[0]) ** 2 + (_OFFSET_WEIGHT * (offset - template[1])) ** 2

    return min(SHAPE_TEMPLATES, key=lambda name: distance(SHAPE_TEMPLATES[name]))


def classify_direction(velocity: np.ndarray, min_speed: float = 0.25) -> str:
    """DIRECTIONS name of largest cosine with ``velocity`` (vy, vx); "static" if slower than min_speed."""
    speed = float(np.hypot(*velocity))
    if not speed >= min_speed:
        return "static"
    return max(DIRECTIONS, key=lambda name: float(np.dot(DIRECTIONS[name], velocity)) / speed)


def torus_components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """8-connected components of a bool mask (H, W) on the torus.

    Returns labels (H, W) int (0 = background, 1..n objects) and n.
    """
    import cv2

    count, labels = cv2.connectedComponents(mask.astype(np.uint8), connectivity=8)
    parent = list(range(count))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for first, last in ((labels[:, 0], labels[:, -1]), (labels[0, :], labels[-1, :])):
        for shift in (-1, 0, 1):
            near = np.roll(last, shift)  # neighbours across the border, wrapping along it too
            for a, b in zip(first[(first > 0) & (near > 0)], near[(first > 0) & (near > 0)]):
                parent[find(int(a))] = find(int(b))
    roots = np.array([find(a) for a in range(count)])  # (count,)
    _, merged = np.unique(roots, return_inverse=True)  # background keeps id 0
    return merged[labels], int(merged.max())


def _circular_mean(coords: np.ndarray, period: int) -> float:
    angles = coords * (2.0 * math.pi / period)
    mean_angle = math.atan2(np.sin(angles).mean(), np.cos(angles).mean())
    return (mean_angle * period / (2.0 * math.pi)) % period


def _dilate_torus(mask: np.ndarray) -> np.ndarray:
    grown = mask.copy()
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            grown |= np.roll(mask, (dy, dx), axis=(0, 1))
    return grown


def measure_object(mask: np.ndarray, coverage: np.ndarray | None = None) -> tuple[float, np.ndarray, float, float]:
    """Area, centroid (y, x) on the torus, marginal kurtosis and vertical offset of one object.

    ``mask``: bool (H, W), the object's pixels; ``coverage``: float (H, W) in [0, 1], how
    much of each pixel the object covers (None: the mask itself). Measurements use the
    coverage inside the mask grown by one pixel, so anti-aliased edges count partially:
    area = sum of weights; kurtosis = mean over y and x of the weighted fourth central
    moment / variance^2; box height = sum of the per-row maximum weight; the box centre is
    the weighted mean row of that per-row profile. The object is
    rolled so that its circular mean sits at the frame centre, measured there, and the
    centroid is rolled back.
    """
    height, width = mask.shape
    ys, xs = np.nonzero(mask)
    shift = (height // 2 - int(round(_circular_mean(ys, height))), width // 2 - int(round(_circular_mean(xs, width))))
    region = _dilate_torus(np.roll(mask, shift, axis=(0, 1)))  # (H, W)
    coverage = mask.astype(np.float64) if coverage is None else coverage  # (H, W)
    weight = region * np.roll(coverage, shift, axis=(0, 1))  # (H, W)
    area = float(weight.sum())
    if area <= 0:  # colour-near pixels that the colour does not cover at all: no object
        return 0.0, np.full(2, np.nan), 0.0, 0.0
    rows, cols = np.arange(height, dtype=np.float64), np.arange(width, dtype=np.float64)
    row_mass, col_mass = weight.sum(axis=1), weight.sum(axis=0)  # (H,), (W,)
    center_y = float(row_mass @ rows) / area
    center_x = float(col_mass @ cols) / area
    row_profile = weight.max(axis=1)  # (H,)
    box_h = float(row_profile.sum())
    offset = (center_y - float(row_profile @ rows) / box_h) / box_h
    kurtosis = 0.5 * (_kurtosis(row_mass, rows - center_y) + _kurtosis(col_mass, cols - center_x))
    centroid = np.array([(center_y - shift[0]) % height, (center_x - shift[1]) % width])
    return area, centroid, kurtosis, offset


def _kurtosis(mass: np.ndarray, distance: np.ndarray) -> float:
    """Fourth central moment / variance^2 of a 1-D mass (n,) at signed distances (n,) from its mean."""
    total = float(mass.sum())
    variance = float(mass @ distance ** 2) / total
    return float(mass @ distance ** 4) / total / variance ** 2 if variance > 0 else 0.0


def track_colors(frames: np.ndarray, colors: Sequence[str], min_area: int = 4) -> list[ObjectTrack]:
    """Detect the largest torus component of each named colour in every frame.

    ``frames``: uint8 (T, H, W, 3). The background colour is the per-channel median of
    all pixels; a pixel's coverage by colour c is its projection onto (c - background),
    clipped to [0, 1]. Returns one ObjectTrack per colour.
    """
    num_frames = frames.shape[0]
    pixels = frames.astype(np.float32)  # (T, H, W, 3)
    background = np.median(pixels.reshape(-1, 3), axis=0)  # (3,)
    tracks = []
    for color in colors:
        rgb = np.array(COLORS[color], dtype=np.float32)  # (3,)
        track = ObjectTrack(
            color,
            present=np.zeros(num_frames, bool),
            area=np.zeros(num_frames),
            centroid=np.full((num_frames, 2), np.nan),
            shape=[None] * num_frames,
        )
        contrast = rgb - background  # (3,)
        projection = (pixels - background) @ contrast / max(float(contrast @ contrast), 1.0)  # (T, H, W)
        coverage = np.clip(projection, 0.0, 1.0)  # (T, H, W)
        near = np.linalg.norm(pixels - rgb, axis=-1) < COLOR_RADIUS  # (T, H, W)
        for t in range(num_frames):
            labels, count = torus_components(near[t])  # (H, W)
            if count == 0:
                continue
            sizes = np.bincount(labels.ravel(), minlength=count + 1)[1:]  # (count,)
            if sizes.max() < min_area:
                continue
            area, centroid, kurtosis, offset = measure_object(labels == 1 + int(sizes.argmax()), coverage[t])
            if area <= 0:
                continue
            track.present[t] = True
            track.area[t] = area
            track.centroid[t] = centroid
            track.shape[t] = classify_shape(kurtosis, offset)
        tracks.append(track)
    return tracks


def fit_motion(centroid: np.ndarray, present: np.ndarray, height: int, width: int) -> MotionFit | None:
    """Least-squares constant-velocity fit of torus centroids (T, 2) over present frames (T,).

    Returns None with fewer than two present frames.
    """
    times = np.nonzero(present)[0]  # (n,)
    if times.size < 2:
        return None
    extent = np.array([height, width], dtype=np.float64)  # (2,)
    steps = np.diff(centroid[times], axis=0)  # (n-1, 2)
    steps = (steps + extent / 2.0) % extent - extent / 2.0  # shortest step on the torus
    path = np.concatenate([centroid[times[:1]], centroid[times[0]] + np.cumsum(steps, axis=0)])  # (n, 2)
    design = np.stack([np.ones(times.size), times.astype(np.float64)], axis=1)  # (n, 2)
    coef, *_ = np.linalg.lstsq(design, path, rcond=None)  # (2, 2): rows intercept, velocity
    residual = path - design @ coef  # (n, 2)
    velocity = coef[1]
    return MotionFit(velocity, float(np.hypot(*velocity)), float(np.sqrt(np.mean(np.sum(residual**2, axis=1)))))


def score_object(track: ObjectTrack, label: dict[str, Any], height: int, width: int) -> dict[str, float]:
    """Scores of one labelled object (see the module docstring); motion_error NaN without a label speed."""
    identity = float(track.present.mean())
    fit = fit_motion(track.centroid, track.present, height, width)
    if fit is None:  # seen in fewer than two frames: only identity can score, the speed counts as 0
        scores = dict.fromkeys(("size_stability", "shape_stability", "smoothness", "color_ok", "shape_ok"), 0.0)
        scores.update(identity=identity, direction_ok=0.0, aligned=0.0, temporal_consistency=identity / 4.0)
        scores["motion_error"] = 1.0 if label.get("speed") else math.nan
        return scores
    shapes = [s for s in track.shape if s is not None]
    areas = track.area[track.present]
    majority, votes = Counter(shapes).most_common(1)[0]
    scores = {
        "identity": identity,
        "size_stability": float(np.clip(1.0 - areas.std() / areas.mean(), 0.0, 1.0)),
        "shape_stability": votes / len(shapes),
        "smoothness": float(np.clip(1.0 - fit.residual / (0.5 * math.sqrt(areas.mean())), 0.0, 1.0)),
        "color_ok": float(identity >= 0.5),
        "shape_ok": float(majority == label["shape"]),
        "direction_ok": float(classify_direction(fit.velocity) == label["direction"]),
    }
    scores["aligned"] = scores["color_ok"] * scores["shape_ok"] * scores["direction_ok"]
    parts = ("identity", "size_stability", "shape_stability", "smoothness")
    scores["temporal_consistency"] = float(np.mean([scores[k] for k in parts]))
    label_speed = label.get("speed")
    scores["motion_error"] = abs(fit.speed - label_speed) / label_speed if label_speed else math.nan
    return scores


def score_video(
    video: torch.Tensor | np.ndarray, labels: Sequence[dict[str, Any]] | str, min_area: int = 4
) -> dict[str, float]:
    """Scores of one video against its labels (or its caption).

    ``video``: float (3, T, H, W) in [-1, 1] or uint8 (T, H, W, 3); ``labels``: list of
    {"color", "shape", "direction"[, "speed"]} dicts, or a caption string. Object scores
    are averaged; "text_alignment" is 1 only if every object is aligned.
    """
    if isinstance(labels, str):
        labels = parse_caption(labels)
    if not labels:
        raise ValueError("labels is empty; pass one label dict per shape, or the caption")
    frames = to_uint8_frames(video)  # (T, H, W, 3)
    if frames.shape[0] < 2:
        raise ValueError(f"video has T={frames.shape[0]} frames; motion scores need at least 2")
    height, width = frames.shape[1:3]
    tracks = track_colors(frames, [lab["color"] for lab in labels], min_area=min_area)
    per_object = [score_object(track, lab, height, width) for track, lab in zip(tracks, labels)]
    scores = {key: float(np.mean([s[key] for s in per_object])) for key in per_object[0] if key != "motion_error"}
    errors = [s["motion_error"] for s in per_object if not math.isnan(s["motion_error"])]
    scores["motion_error"] = float(np.mean(errors)) if errors else math.nan
    scores["text_alignment"] = float(all(s["aligned"] == 1.0 for s in per_object))
    del scores["aligned"]
    return scores


def score_videos(
    videos: Sequence[torch.Tensor | np.ndarray] | torch.Tensor,
    labels: Sequence[Sequence[dict[str, Any]] | str],
    min_area: int = 4,
) -> dict[str, float]:
    """Mean MovingShapes scores over videos.

    ``videos``: a batch (B, 3, T, H, W) in [-1, 1] or a list of videos in either layout;
    ``labels``: per video, its label list or caption. Returns the means of
    text_alignment, color_ok, shape_ok, direction_ok, temporal_consistency, identity,
    size_stability, shape_stability, smoothness and motion_error (NaN if no label has a
    speed; averaged over videos that have one), plus num_videos.
    """
    if len(videos) != len(labels):
        raise ValueError(f"videos has {len(videos)} entries but labels has {len(labels)}; pass one label set per video")
    if len(videos) == 0:
        raise ValueError("videos is empty; pass at least one video")
    per_video = [score_video(v, lab, min_area=min_area) for v, lab in zip(videos, labels)]
    means = {}
    for key in per_video[0]:
        values = [s[key] for s in per_video if not math.isnan(s[key])]
        means[key] = float(np.mean(values)) if values else math.nan
    means["num_videos"] = float(len(per_video))
    return means
