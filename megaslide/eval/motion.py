"""MovingShapes scores: text alignment, temporal consistency and motion error without weights.

Videos are parsed with the known palette and shapes of ``megaslide.data.moving_shapes``:

1. Segmentation: a pixel belongs to palette colour c if its RGB distance to c is below
   ``COLOR_RADIUS`` (100, less than half the smallest palette distance, 255).
2. Object: per frame and labelled colour, the largest 8-connected component of that colour
   on the torus (components touching across opposite borders are merged, so shapes that
   wrap around stay whole), if it has at least ``min_area`` pixels.
3. Per frame, weighting each pixel of the component's region (the component grown by
   ``REGION_RADIUS`` pixels, so that blurred and anti-aliased edges are inside) by how much
   the colour covers it (projection onto colour - background, background = median colour):
   area and centroid (computed after rolling the object to the frame centre, so wrapping
   shapes are handled exactly).
4. Shape, by analysis through synthesis: each shape of SHAPES is rendered at the object's
   centroid with the area it measured, unblurred and blurred by the separable kernel
   [a, 1 - 2a, a] for each a of ``BLUR_WEIGHTS`` applied 1 to ``BLUR_PASSES`` times
   (a = 1/3 is the 3x3 box blur, a = 0.274 OpenCV's 3x3 Gaussian; more passes blur
   wider), and compared with the coverage inside the region; the shape of
   least squared error names the frame's shape, the majority names the object's. Pixels
   on the frame's border are left out of the comparison: a blur or convolution that pads
   the border instead of wrapping it distorts them.
5. Motion: centroids are unwrapped (each frame step taken as the shortest displacement on
   the torus) and fitted with a constant velocity v by least squares. Direction = the
   DIRECTIONS unit vector of largest cosine with v ("static" below ``MIN_SPEED``).

Per labelled object, with v_label = label speed x the label direction's unit vector:
- aligned: colour present in at least half the frames, shape and direction match the label;
- identity: fraction of frames where the colour is present;
- size_stability: 1 - std(area) / mean(area), clipped to [0, 1];
- shape_stability: fraction of present frames whose shape is the majority shape;
- smoothness: 1 - rms residual of the constant-velocity fit / (half the object's linear
  size, sqrt(mean area) / 2), clipped to [0, 1];
- motion_error: |v - v_label| / |v_label|, the error of the velocity vector (labels with
  speed > 0 only; a caption carries no speed);
- velocity_match: 1 - |v - v_ref| / |v_ref|, clipped to [0, 1], where v_ref = v_label, or
  |v| x the label direction when the label has no speed (then only the direction counts);
  0 when |v_ref| is below MIN_SPEED (every caption says its object moves);
- temporal_consistency: mean(identity, size_stability, shape_stability, smoothness) x
  velocity_match. The object must persist and keep its size and shape, and move steadily
  with the caption's velocity: a frozen object, one moving the wrong way and one that
  teleports all score low.
An object seen in fewer than two frames scores only its identity, motion_error 1 and
temporal_consistency 0. A video is aligned if all its labelled objects are; other scores
average over objects.

Limits: motion is only unambiguous while each step between detections is shorter than
half the frame (MovingShapes enforces this for its own videos); shapes below ~6 px are
read less reliably (a blurred 5-px diamond looks like a circle); overlapping shapes of a
multi-shape video lower size and shape stability while they overlap.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from megaslide.data.moving_shapes import COLORS, DIRECTIONS, SHAPES, parse_caption, signed_distance
from megaslide.data.video_io import to_uint8_frames

SCORER_VERSION = 2  # bump whenever a score's meaning changes: results of different versions never pool
COLOR_RADIUS = 100.0
REGION_RADIUS = 3
MIN_SPEED = 0.25  # px/frame below which an object counts as static
FILL_RATIO: dict[str, float] = {
    # area / (bounding box side)^2 of each shape, as MovingShapes draws them
    "circle": math.pi / 4.0,
    "square": 1.0,
    "triangle": 0.5,
    "diamond": 0.5,
}
BLUR_WEIGHTS: tuple[float, ...] = (0.1, 0.2, 0.274, 1.0 / 3.0)  # a of the kernel [a, 1 - 2a, a]; see step 4
BLUR_PASSES = 3


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


def classify_direction(velocity: np.ndarray, min_speed: float = MIN_SPEED) -> str:
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


def _circular_mean(mass: np.ndarray, period: int) -> float:
    """Circular mean position of a 1-D mass (period,) on a ring of `period` positions."""
    angles = np.arange(period) * (2.0 * math.pi / period)
    mean_angle = math.atan2(float(mass @ np.sin(angles)), float(mass @ np.cos(angles)))
    return (mean_angle * period / (2.0 * math.pi)) % period


def grow_torus(mask: np.ndarray, radius: int = REGION_RADIUS) -> np.ndarray:
    """``mask`` (H, W) bool grown by ``radius`` pixels (a square neighbourhood), wrapping at the borders."""
    grown = mask.copy()
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            grown |= np.roll(mask, (dy, dx), axis=(0, 1))
    return grown


def measure_object(region: np.ndarray, coverage: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """Area and centroid (y, x) on the torus of one object.

    ``region``: bool (H, W), the pixels that may belong to the object; ``coverage``: float
    (H, W) in [0, 1], how much of each pixel the object covers (None: the region itself).
    Area = sum of coverage over the region; the centroid is its coverage-weighted mean,
    computed with the covered mass rolled so that its circular mean sits at the frame
    centre (a region grown past the frame size wraps onto itself), then rolled back.
    Area 0 (and a NaN centroid) if the coverage is 0 over the region.
    """
    height, width = region.shape
    coverage = region.astype(np.float64) if coverage is None else coverage  # (H, W)
    weight = region * coverage  # (H, W)
    area = float(weight.sum())
    if area <= 0:  # colour-near pixels that the colour does not cover at all: no object
        return 0.0, np.full(2, np.nan)
    shift = (height // 2 - int(round(_circular_mean(weight.sum(axis=1), height))),
             width // 2 - int(round(_circular_mean(weight.sum(axis=0), width))))
    weight = np.roll(weight, shift, axis=(0, 1))  # (H, W): the object's mass centred
    center_y = float(weight.sum(axis=1) @ np.arange(height)) / area
    center_x = float(weight.sum(axis=0) @ np.arange(width)) / area
    return area, np.array([(center_y - shift[0]) % height, (center_x - shift[1]) % width])


def render_shapes(area: np.ndarray, centroid: np.ndarray, height: int, width: int) -> torch.Tensor:
    """Coverage of every shape of SHAPES at the given areas and centroids, on the torus.

    ``area`` (n,), ``centroid`` (n, 2) (y, x). Returns float64 (len(SHAPES), n, H, W) in
    [0, 1], anti-aliased as MovingShapes renders.
    """
    center = torch.from_numpy(np.asarray(centroid, dtype=np.float64))  # (n, 2)
    ys = torch.arange(height, dtype=torch.float64).view(1, height, 1)  # (1, H, 1)
    xs = torch.arange(width, dtype=torch.float64).view(1, 1, width)  # (1, 1, W)
    dy = torch.remainder(ys - center[:, 0].view(-1, 1, 1) + height / 2.0, height) - height / 2.0  # (n, H, 1)
    dx = torch.remainder(xs - center[:, 1].view(-1, 1, 1) + width / 2.0, width) - width / 2.0  # (n, 1, W)
    area = torch.from_numpy(np.asarray(area, dtype=np.float64)).view(-1, 1, 1)  # (n, 1, 1)
    alphas = [(0.5 - signed_distance(s, dy, dx, torch.sqrt(area / FILL_RATIO[s]))).clamp(0.0, 1.0) for s in SHAPES]
    return torch.stack(alphas)  # (S, n, H, W)


def _blur_pass(images: torch.Tensor, a: float) -> torch.Tensor:
    """One pass of the separable kernel [a, 1 - 2a, a] over the last two axes, wrapping at the borders."""
    for axis in (-2, -1):
        images = (1.0 - 2.0 * a) * images + a * (images.roll(1, axis) + images.roll(-1, axis))
    return images


def classify_shapes(coverage: np.ndarray, region: np.ndarray, area: np.ndarray, centroid: np.ndarray) -> list[str]:
    """Per frame, the shape that best explains an object's coverage (module docstring, step 4).

    ``coverage`` float (n, H, W) in [0, 1]; ``region`` bool (n, H, W); ``area`` (n,);
    ``centroid`` (n, 2). Returns n names of SHAPES.
    """
    height, width = coverage.shape[1:]
    observed = torch.from_numpy(np.asarray(coverage, dtype=np.float64))  # (n, H, W)
    inside = torch.from_numpy(np.asarray(region, dtype=np.float64))  # (n, H, W)
    inside[:, [0, -1], :] = 0.0  # frame borders: see the module docstring
    inside[:, :, [0, -1]] = 0.0
    templates = render_shapes(area, centroid, height, width)  # (S, n, H, W)
    best = ((templates - observed) ** 2 * inside).sum(dim=(-2, -1))  # (S, n): unblurred
    for a in BLUR_WEIGHTS:
        blurred = templates
        for _ in range(BLUR_PASSES):
            blurred = _blur_pass(blurred, a)
            best = torch.minimum(best, ((blurred - observed) ** 2 * inside).sum(dim=(-2, -1)))
    return [SHAPES[i] for i in best.argmin(dim=0).tolist()]


def track_colors(frames: np.ndarray, colors: Sequence[str], min_area: int = 4) -> list[ObjectTrack]:
    """Detect the largest torus component of each named colour in every frame.

    ``frames``: uint8 (T, H, W, 3). The background colour is the per-channel median of
    all pixels; a pixel's coverage by colour c is its projection onto (c - background),
    clipped to [0, 1]. Returns one ObjectTrack per colour.
    """
    num_frames, height, width = frames.shape[:3]
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
        coverage = np.clip(projection, 0.0, 1.0).astype(np.float64)  # (T, H, W)
        near = np.linalg.norm(pixels - rgb, axis=-1) < COLOR_RADIUS  # (T, H, W)
        regions = np.zeros((num_frames, height, width), bool)  # (T, H, W)
        for t in range(num_frames):
            labels, count = torus_components(near[t])  # (H, W)
            if count == 0:
                continue
            sizes = np.bincount(labels.ravel(), minlength=count + 1)[1:]  # (count,)
            if sizes.max() < min_area:
                continue
            regions[t] = grow_torus(labels == 1 + int(sizes.argmax()))
            area, centroid = measure_object(regions[t], coverage[t])
            if area > 0:
                track.present[t], track.area[t], track.centroid[t] = True, area, centroid
        seen = np.nonzero(track.present)[0]  # (n,)
        if seen.size:
            shapes = classify_shapes(coverage[seen], regions[seen], track.area[seen], track.centroid[seen])
            for t, shape in zip(seen, shapes):
                track.shape[t] = shape
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


def velocity_error(velocity: np.ndarray, direction: str, speed: float) -> float:
    """|velocity - speed x unit(direction)| / speed; inf when speed is below MIN_SPEED."""
    if not speed >= MIN_SPEED:
        return math.inf
    return float(np.hypot(*(velocity - speed * np.asarray(DIRECTIONS[direction])))) / speed


def score_object(track: ObjectTrack, label: dict[str, Any], height: int, width: int) -> dict[str, float]:
    """Scores of one labelled object (see the module docstring); motion_error NaN without a label speed."""
    identity = float(track.present.mean())
    label_speed = label.get("speed")
    fit = fit_motion(track.centroid, track.present, height, width)
    if fit is None:  # seen in fewer than two frames: only identity can score, the velocity counts as 0
        parts = ("size_stability", "shape_stability", "smoothness", "velocity_match", "color_ok", "shape_ok")
        scores = dict.fromkeys(parts, 0.0)
        scores.update(identity=identity, direction_ok=0.0, aligned=0.0, temporal_consistency=0.0)
        scores["motion_error"] = 1.0 if label_speed else math.nan
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
    reference_speed = label_speed if label_speed else fit.speed
    scores["velocity_match"] = max(0.0, 1.0 - velocity_error(fit.velocity, label["direction"], reference_speed))
    steadiness = np.mean([scores[k] for k in ("identity", "size_stability", "shape_stability", "smoothness")])
    scores["temporal_consistency"] = float(steadiness * scores["velocity_match"])
    scores["motion_error"] = velocity_error(fit.velocity, label["direction"], label_speed) if label_speed else math.nan
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
    size_stability, shape_stability, smoothness, velocity_match and motion_error (NaN if
    no label has a speed; averaged over videos that have one); for each, "<name>_se", the
    standard error of that mean over the videos (sample std / sqrt(count); NaN below two),
    the evaluation's sampling error; plus num_videos and scorer_version (SCORER_VERSION:
    scores of different versions are not comparable).
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
        means[f"{key}_se"] = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
    means["num_videos"] = float(len(per_video))
    means["scorer_version"] = float(SCORER_VERSION)
    return means
