"""VBench-style video quality formulas that need no pretrained weights.

- ``temporal_flickering``: VBench's formula exactly, on uint8 frames.
- ``consistency``: VBench's subject/background consistency given per-frame features. VBench
  gets the features from DINO (subject) or CLIP (background); ``frame_consistency`` plugs
  in a weight-free stand-in encoder instead (``color_histogram_features`` by default, or
  ``pixel_features``), so its numbers are comparable across our runs, not to VBench's.
  Like VBench's, it measures that appearance persists, not how things move: with the
  histogram encoder a frozen clip scores 1 and an object that teleports scores as high as
  one moving steadily. The motion-aware consistency that claim verdicts use is
  ``megaslide.eval.motion``'s ``temporal_consistency``.
- ``dynamic_degree``: VBench's decision rule on optical flow, with OpenCV's Farneback or
  DIS flow standing in for RAFT (see the function for the exact formula).

All functions take uint8 RGB frames (T, H, W, 3), numpy or torch; convert model outputs
with ``megaslide.data.video_io.to_uint8_frames``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

FrameEncoder = Callable[[np.ndarray], np.ndarray]


def _as_uint8_frames(frames: torch.Tensor | np.ndarray, min_frames: int = 2) -> np.ndarray:
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu().numpy()
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(
            f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}; "
            "convert with megaslide.data.video_io.to_uint8_frames"
        )
    if frames.shape[0] < min_frames:
        raise ValueError(f"frames has T={frames.shape[0]} frames; this metric needs at least {min_frames}")
    return frames


def temporal_flickering(frames: torch.Tensor | np.ndarray, chunk: int = 16) -> float:
    """VBench temporal flickering: ``(255 - mean_t mean|f_t - f_{t+1}|) / 255``.

    ``frames``: uint8 (T, H, W, 3), T >= 2. The inner mean runs over pixels and channels,
    the outer over the T - 1 consecutive pairs. 1.0 means a static clip. ``chunk`` bounds
    the int16 working set to ``chunk + 1`` frames.
    """
    frames = _as_uint8_frames(frames)
    pair_means = []
    for start in range(0, frames.shape[0] - 1, chunk):
        block = frames[start : start + chunk + 1].astype(np.int16)  # (c + 1, H, W, 3)
        diff = np.abs(block[1:] - block[:-1])  # (c, H, W, 3)
        pair_means.append(diff.reshape(diff.shape[0], -1).mean(axis=1))  # (c,)
    return float((255.0 - np.concatenate(pair_means).mean()) / 255.0)


def consistency(features: torch.Tensor | np.ndarray) -> float:
    """VBench subject/background consistency of per-frame features.

    ``features``: (T, D), T >= 2. Returns the mean over t = 1..T-1 of
    ``(max(0, cos(f_{t-1}, f_t)) + max(0, cos(f_0, f_t))) / 2``, computed in float64.
    An all-zero feature row has cosine 0 with everything.
    """
    if isinstance(features, torch.Tensor):
        features = features.detach().cpu().double().numpy()
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"features must be (T, D) with T >= 2, got shape {features.shape}")
    norms = np.linalg.norm(features, axis=1, keepdims=True)  # (T, 1)
    unit = features / np.maximum(norms, 1e-12)  # (T, D)
    cos_prev = np.sum(unit[1:] * unit[:-1], axis=1)  # (T-1,)
    cos_first = unit[1:] @ unit[0]  # (T-1,)
    return float(np.mean((np.maximum(cos_prev, 0.0) + np.maximum(cos_first, 0.0)) / 2.0))


def color_histogram_features(frames: torch.Tensor | np.ndarray, bins: int = 8) -> np.ndarray:
    """Weight-free stand-in for DINO features: square-rooted joint RGB histograms.

    ``frames``: uint8 (T, H, W, 3). Returns float64 (T, bins**3); each row is the square
    root of the frame's normalised histogram, so the cosine of two rows is their
    Bhattacharyya coefficient. Invariant to where things are (so blind to motion, coherent
    or not), sensitive to their colours.
    """
    frames = _as_uint8_frames(frames, min_frames=1)
    if bins < 1 or bins > 256 or 256 % bins != 0:
        raise ValueError(f"bins={bins} must divide 256 (1, 2, 4, ..., 256)")
    num_frames = frames.shape[0]
    quantized = frames.astype(np.int64) // (256 // bins)  # (T, H, W, 3)
    codes = (quantized[..., 0] * bins + quantized[..., 1]) * bins + quantized[..., 2]  # (T, H, W)
    codes = codes.reshape(num_frames, -1) + np.arange(num_frames)[:, None] * bins**3  # (T, H*W)
    counts = np.bincount(codes.ravel(), minlength=num_frames * bins**3).reshape(num_frames, bins**3)
    return np.sqrt(counts / codes.shape[1])  # (T, bins**3)


def pixel_features(frames: torch.Tensor | np.ndarray, size: int = 16) -> np.ndarray:
    """Weight-free stand-in for CLIP features: the frame area-averaged to size x size.

    ``frames``: uint8 (T, H, W, 3). Returns float64 (T, 3 * size * size) in [0, 1].
    Sensitive to layout, so a moving object lowers it, as a changing background would.
    """
    frames = _as_uint8_frames(frames, min_frames=1)
    if size < 1:
        raise ValueError(f"size={size} must be >= 1")
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).double() / 255.0  # (T, 3, H, W)
    small = torch.nn.functional.adaptive_avg_pool2d(video, (size, size))  # (T, 3, size, size)
    return small.reshape(frames.shape[0], -1).numpy()  # (T, 3*size*size)


def frame_consistency(frames: torch.Tensor | np.ndarray, encoder: FrameEncoder = color_histogram_features) -> float:
    """``consistency`` of ``encoder(frames)``; ``frames`` uint8 (T, H, W, 3), T >= 2.

    An appearance score (see the module docstring): it does not punish a frozen or teleporting
    object; ``megaslide.eval.motion.score_videos``' temporal_consistency does.
    """
    frames = _as_uint8_frames(frames)
    return consistency(encoder(frames))


def _gray(frame: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)


def farneback_flow(prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Dense Farneback flow from uint8 RGB ``prev`` (H, W, 3) to ``nxt``: float32 (H, W, 2) as (dx, dy)."""
    import cv2

    return cv2.calcOpticalFlowFarneback(
        _gray(prev), _gray(nxt), None, pyr_scale=0.5, levels=3, winsize=9, iterations=5, poly_n=5, poly_sigma=1.1,
        flags=0
    )


def dis_flow(prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Dense DIS flow (OpenCV "medium" preset) from ``prev`` (H, W, 3) to ``nxt``: float32 (H, W, 2)."""
    import cv2

    estimator = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
    return estimator.calc(_gray(prev), _gray(nxt), None)


FLOW_METHODS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "farneback": farneback_flow,
    "dis": dis_flow,
}


def top_flow_magnitude(flow: np.ndarray, top_fraction: float = 0.05) -> float:
    """Mean of the largest ``top_fraction`` of per-pixel flow magnitudes of ``flow`` (H, W, 2).

    VBench takes ``int(H * W * 0.05)`` pixels; we take at least one.
    """
    magnitude = np.sqrt(np.sum(np.square(flow.astype(np.float64)), axis=-1)).ravel()  # (H*W,)
    count = max(1, int(magnitude.size * top_fraction))
    return float(np.partition(magnitude, magnitude.size - count)[-count:].mean())


def flow_scores(frames: torch.Tensor | np.ndarray, method: str = "farneback", top_fraction: float = 0.05) -> np.ndarray:
    """Per consecutive pair, the mean of the top ``top_fraction`` flow magnitudes (pixels).

    ``frames``: uint8 (T, H, W, 3). Returns float64 (T - 1,).
    """
    if method not in FLOW_METHODS:
        raise ValueError(f"method={method!r} is unknown; choose from {list(FLOW_METHODS)}")
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction={top_fraction} must lie in (0, 1]")
    frames = _as_uint8_frames(frames)
    flow_fn = FLOW_METHODS[method]
    return np.array([top_flow_magnitude(flow_fn(a, b), top_fraction) for a, b in zip(frames[:-1], frames[1:])])


def dynamic_degree(
    frames: torch.Tensor | np.ndarray,
    threshold: float | None = None,
    min_moving_pairs: int | None = None,
    fps: float = 8.0,
    method: str = "farneback",
) -> bool:
    """VBench's "is this video dynamic?" rule with OpenCV flow in place of RAFT.

    ``frames``: uint8 (T, H, W, 3), T >= 2, ideally sampled at about 8 fps as VBench does.
    For each consecutive pair, s_t = mean of the top 5% per-pixel flow magnitudes. The
    video is dynamic if at least ``min_moving_pairs`` pairs have s_t > ``threshold``, with
    VBench's defaults ``threshold = max(1, 8 / fps) * 6 * min(H, W) / 256`` and
    ``min_moving_pairs = round(4 * T / 16)`` (we use at least 1). The benchmark number is
    the fraction of dynamic videos.

    Differences to VBench: Farneback/DIS are classical coarse-to-fine estimators; unlike
    RAFT (20 refinement iterations, learned features) they under-estimate large
    displacements on untextured regions and need texture or edges to lock on, so
    borderline videos can flip. Use the real VBench path (``vbench_adapter``) for
    numbers comparable with published ones.
    """
    frames = _as_uint8_frames(frames)
    if fps <= 0:
        raise ValueError(f"fps={fps} must be > 0")
    num_frames, height, width = frames.shape[:3]
    if threshold is None:
        threshold = max(1.0, 8.0 / fps) * 6.0 * min(height, width) / 256.0
    if min_moving_pairs is None:
        min_moving_pairs = max(1, round(4 * num_frames / 16))
    scores = flow_scores(frames, method=method)  # (T-1,)
    return bool(np.sum(scores > threshold) >= min_moving_pairs)
