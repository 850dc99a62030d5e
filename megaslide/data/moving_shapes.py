"""MovingShapes: a procedural, captioned video dataset with known ground truth.

Each video shows ``num_shapes`` coloured shapes on a plain background, each moving in a
straight line at constant speed. Nothing is read from disk: a video is a pure function of
``(seed, index)``. The caption names colour, shape and direction ("a red circle moving
left"), and every item carries the exact centroid trajectory, so the scores of
``megaslide.eval.motion`` can check generated videos without pretrained weights.

Geometry (pixel units, pixel (i, j) has its centre at y = i, x = j):
- ``shape_size`` s is the side of the shape's bounding box: circle of diameter s, square
  of side s, diamond (square turned 45 degrees) of diagonal s, isosceles triangle of base
  s and height s with its apex up. Box fill ratios: pi/4, 1, 1/2, 1/2.
- A shape's position is its area centroid (for the triangle, s/6 below its box centre).
- ``boundary="wrap"``: the frame is a torus and shapes leaving one edge re-enter at the
  opposite one, so "moving left" stays true for any speed and clip length. Speeds must
  stay below half the frame so that motion is unambiguous.
  ``boundary="inside"``: start positions are drawn so that every shape stays fully inside
  the frame for the whole clip (needs ``speed * (frames - 1)`` to fit).
- Anti-aliasing uses the signed distance d of each pixel centre to the shape outline:
  coverage = clamp(0.5 - d, 0, 1).
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "cyan": (0, 255, 255),
    "magenta": (255, 0, 255),
    "white": (255, 255, 255),
}

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")

_DIAG = 1.0 / math.sqrt(2.0)
DIRECTIONS: dict[str, tuple[float, float]] = {
    # unit vectors (dy, dx); image y grows downwards
    "left": (0.0, -1.0),
    "right": (0.0, 1.0),
    "up": (-1.0, 0.0),
    "down": (1.0, 0.0),
    "up-left": (-_DIAG, -_DIAG),
    "up-right": (-_DIAG, _DIAG),
    "down-left": (_DIAG, -_DIAG),
    "down-right": (_DIAG, _DIAG),
}

BOUNDARIES: tuple[str, ...] = ("wrap", "inside")

_CAPTION_PART = re.compile(r"^a (?P<color>[a-z]+) (?P<shape>[a-z]+) moving (?P<direction>[a-z-]+)$")


def caption_for(labels: Sequence[dict[str, Any]]) -> str:
    """Caption of a video from its labels: "a red circle moving left and a ..."."""
    return " and ".join(f"a {lab['color']} {lab['shape']} moving {lab['direction']}" for lab in labels)


def parse_caption(caption: str) -> list[dict[str, str]]:
    """Inverse of ``caption_for``: a list of {"color", "shape", "direction"} dicts (no speed)."""
    labels = []
    for part in caption.strip().split(" and "):
        match = _CAPTION_PART.match(part)
        if match is None:
            raise ValueError(
                f"caption={caption!r}: part {part!r} is not of the form 'a <color> <shape> moving <direction>'"
            )
        label = match.groupdict()
        _check_names("color", [label["color"]], COLORS)
        _check_names("shape", [label["shape"]], SHAPES)
        _check_names("direction", [label["direction"]], DIRECTIONS)
        labels.append(label)
    return labels


def _check_names(param: str, names: Sequence[str], known: Sequence[str]) -> None:
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{param}: unknown {unknown}; choose from {list(known)}")


def signed_distance(shape: str, dy: torch.Tensor, dx: torch.Tensor, size: float) -> torch.Tensor:
    """Signed distance (pixels, negative inside) of offsets (dy, dx) from a shape's centroid.

    ``dy``, ``dx``: broadcastable tensors of offsets from the centroid; returns their
    broadcast shape. Square, diamond and triangle use the largest distance to their edge
    lines (exact on edges, a slight under-estimate near outside corners).
    """
    half = size / 2.0
    if shape == "circle":
        return torch.sqrt(dy * dy + dx * dx) - half
    if shape == "square":
        return torch.maximum(dy.abs(), dx.abs()) - half
    if shape == "diamond":
        return (dy.abs() + dx.abs() - half) * _DIAG
    if shape == "triangle":
        # apex at dy = -2s/3, base at dy = +s/3 from x = -s/2 to s/2
        norm = math.sqrt(1.25)
        base = dy - size / 3.0
        right = (dx - 0.5 * dy - size / 3.0) / norm
        left = (-dx - 0.5 * dy - size / 3.0) / norm
        return torch.maximum(base, torch.maximum(left, right))
    raise ValueError(f"shape={shape!r} is unknown; choose from {list(SHAPES)}")


def render_video(
    height: int,
    width: int,
    centers: torch.Tensor,
    labels: Sequence[dict[str, Any]],
    size: float,
    background: tuple[int, int, int] = (0, 0, 0),
    wrap: bool = True,
    antialias: bool = True,
) -> torch.Tensor:
    """Render shapes at given centroids.

    ``centers``: (S, T, 2) centroid (y, x) per shape and frame; ``labels``: S dicts with
    "color" and "shape". Later shapes are drawn over earlier ones. Returns float32
    (3, T, H, W) RGB in [0, 255].
    """
    num_frames = centers.shape[1]
    ys = torch.arange(height, dtype=torch.float32).view(1, height, 1)  # (1, H, 1)
    xs = torch.arange(width, dtype=torch.float32).view(1, 1, width)  # (1, 1, W)
    bg = torch.tensor(background, dtype=torch.float32).view(3, 1, 1, 1)  # (3, 1, 1, 1)
    video = bg.expand(3, num_frames, height, width).clone()  # (3, T, H, W)
    for center, label in zip(centers, labels):
        dy = ys - center[:, 0].view(-1, 1, 1)  # (T, H, 1)
        dx = xs - center[:, 1].view(-1, 1, 1)  # (T, 1, W)
        if wrap:
            dy = torch.remainder(dy + height / 2.0, height) - height / 2.0  # (T, H, 1)
            dx = torch.remainder(dx + width / 2.0, width) - width / 2.0  # (T, 1, W)
        dist = signed_distance(label["shape"], dy, dx, size)  # (T, H, W)
        alpha = (0.5 - dist).clamp(0.0, 1.0) if antialias else (dist <= 0).float()  # (T, H, W)
        color = torch.tensor(COLORS[label["color"]], dtype=torch.float32).view(3, 1, 1, 1)  # (3, 1, 1, 1)
        video = video * (1.0 - alpha) + color * alpha  # (3, T, H, W)
    return video


class MovingShapes(Dataset):
    """Procedural captioned videos of shapes moving in straight lines.

    Item ``i`` is a dict:
    - "video": float32 (3, T, H, W) RGB in [-1, 1];
    - "caption": str, e.g. "a red circle moving left and a blue square moving up";
    - "trajectory": float32 (num_shapes, T, 2), centroid (y, x) in pixels of each shape
      in each frame (inside [0, H) x [0, W) when wrapping);
    - "labels": list of num_shapes dicts {"color", "shape", "direction", "speed"}.

    Args:
        num_videos: length of the dataset.
        frames, height, width: clip size T, H, W.
        num_shapes: shapes per video; each gets a different colour.
        speed: pixels per frame, a number or a (low, high) range sampled per shape. "Fast"
            motion means more pixels per frame than an attention window covers, e.g. 6-10
            px/frame at 32x32.
        shape_size: side of a shape's bounding box, pixels.
        seed: base seed; a video depends only on (seed, index).
        colors, shapes, directions: allowed names (default: all of COLORS, SHAPES,
            DIRECTIONS).
        background: RGB background colour (default black); must differ from the allowed colours.
        boundary: "wrap" (torus) or "inside" (shapes never touch the border).
        antialias: soft edges from the signed distance, else hard edges.
    """

    def __init__(
        self,
        num_videos: int,
        frames: int = 16,
        height: int = 32,
        width: int = 32,
        num_shapes: int = 1,
        speed: float | tuple[float, float] = 2.0,
        shape_size: float = 8.0,
        seed: int = 0,
        colors: Sequence[str] | None = None,
        shapes: Sequence[str] | None = None,
        directions: Sequence[str] | None = None,
        background: tuple[int, int, int] = (0, 0, 0),
        boundary: str = "wrap",
        antialias: bool = True,
    ) -> None:
        self.colors = list(COLORS) if colors is None else list(colors)
        self.shapes = list(SHAPES) if shapes is None else list(shapes)
        self.directions = list(DIRECTIONS) if directions is None else list(directions)
        _check_names("colors", self.colors, COLORS)
        _check_names("shapes", self.shapes, SHAPES)
        _check_names("directions", self.directions, DIRECTIONS)
        if not self.colors or not self.shapes or not self.directions:
            raise ValueError("colors, shapes and directions must each allow at least one name")
        if num_videos < 1:
            raise ValueError(f"num_videos={num_videos} must be >= 1")
        if frames < 2:
            raise ValueError(f"frames={frames} must be >= 2 for a video with motion")
        if not 3 <= shape_size <= min(height, width) / 2:
            raise ValueError(
                f"shape_size={shape_size} must lie in [3, min(height, width) / 2 = {min(height, width) / 2}]"
            )
        if not 1 <= num_shapes <= len(self.colors):
            raise ValueError(
                f"num_shapes={num_shapes} must lie in [1, len(colors) = {len(self.colors)}]: "
                "every shape of a video gets its own colour"
            )
        if boundary not in BOUNDARIES:
            raise ValueError(f"boundary={boundary!r} is unknown; choose from {list(BOUNDARIES)}")
        if tuple(background) in [COLORS[c] for c in self.colors]:
            raise ValueError(f"background={background} equals an allowed colour; pick another background or colors")
        low, high = (float(speed), float(speed)) if np.isscalar(speed) else (float(speed[0]), float(speed[1]))
        if not 0 <= low <= high:
            raise ValueError(f"speed={speed} must be a number >= 0 or a range (low, high) with 0 <= low <= high")
        if boundary == "wrap" and high >= min(height, width) / 2:
            raise ValueError(
                f"speed={speed} must stay below min(height, width) / 2 = {min(height, width) / 2} px/frame "
                "with boundary='wrap', or wrapped motion is ambiguous"
            )
        self.margin = math.ceil(2.0 * shape_size / 3.0) + 1.0
        if boundary == "inside":
            travel = high * (frames - 1)
            if travel + 2 * self.margin > min(height, width) - 1:
                raise ValueError(
                    f"speed={speed}, frames={frames}, shape_size={shape_size}: a path of {travel:.1f} px plus "
                    f"margins of {self.margin:.0f} px does not fit in {height}x{width} with boundary='inside'; "
                    "use boundary='wrap' or lower speed/frames"
                )
        self.num_videos = num_videos
        self.frames = frames
        self.height = height
        self.width = width
        self.num_shapes = num_shapes
        self.speed_range = (low, high)
        self.shape_size = float(shape_size)
        self.seed = seed
        self.background = tuple(int(c) for c in background)
        self.boundary = boundary
        self.antialias = antialias

    def __len__(self) -> int:
        return self.num_videos

    def sample_labels(self, index: int) -> tuple[list[dict[str, Any]], torch.Tensor]:
        """Labels and start centroids (num_shapes, 2) of video ``index``; pure in (seed, index)."""
        rng = np.random.default_rng([self.seed, index])
        color_ids = rng.choice(len(self.colors), size=self.num_shapes, replace=False)
        labels, starts = [], []
        for color_id in color_ids:
            direction = self.directions[rng.integers(len(self.directions))]
            label = {
                "color": self.colors[color_id],
                "shape": self.shapes[rng.integers(len(self.shapes))],
                "direction": direction,
                "speed": float(rng.uniform(*self.speed_range)),
            }
            labels.append(label)
            starts.append(self._start_position(rng, label))
        return labels, torch.tensor(starts, dtype=torch.float32)

    def _start_position(self, rng: np.random.Generator, label: dict[str, Any]) -> list[float]:
        if self.boundary == "wrap":
            return [rng.uniform(0, self.height), rng.uniform(0, self.width)]
        position = []
        for unit, extent in zip(DIRECTIONS[label["direction"]], (self.height, self.width)):
            travel = unit * label["speed"] * (self.frames - 1)
            low = self.margin - min(0.0, travel)
            high = extent - 1 - self.margin - max(0.0, travel)
            position.append(rng.uniform(low, high))
        return position

    def trajectory(self, labels: Sequence[dict[str, Any]], starts: torch.Tensor) -> torch.Tensor:
        """Centroids (num_shapes, T, 2) from labels and start centroids (num_shapes, 2)."""
        steps = torch.arange(self.frames, dtype=torch.float32).view(1, -1, 1)  # (1, T, 1)
        velocity = torch.tensor(
            [[u * lab["speed"] for u in DIRECTIONS[lab["direction"]]] for lab in labels], dtype=torch.float32
        ).view(-1, 1, 2)  # (S, 1, 2)
        centers = starts.view(-1, 1, 2) + steps * velocity  # (S, T, 2)
        if self.boundary == "wrap":
            extent = torch.tensor([self.height, self.width], dtype=torch.float32)  # (2,)
            centers = torch.remainder(centers, extent)  # (S, T, 2)
        return centers

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_videos:
            raise IndexError(f"index {index} out of range for {self.num_videos} videos")
        labels, starts = self.sample_labels(index)
        centers = self.trajectory(labels, starts)  # (S, T, 2)
        video = render_video(
            self.height,
            self.width,
            centers,
            labels,
            self.shape_size,
            background=self.background,
            wrap=self.boundary == "wrap",
            antialias=self.antialias,
        )  # (3, T, H, W) in [0, 255]
        return {
            "video": video / 127.5 - 1.0,  # (3, T, H, W) in [-1, 1]
            "caption": caption_for(labels),
            "trajectory": centers,
            "labels": labels,
        }


def collate(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch dataset items: tensors are stacked on a new dim 0, everything else is listed.

    With MovingShapes items: "video" (B, 3, T, H, W), "trajectory" (B, S, T, 2),
    "caption" list of B str, "labels" list of B lists.
    """
    if not items:
        raise ValueError("items is empty; collate needs at least one dataset item")
    batch = {}
    for key, value in items[0].items():
        values = [item[key] for item in items]
        batch[key] = torch.stack(values) if isinstance(value, torch.Tensor) else values
    return batch
