"""Video conversion and writing: uint8 frames, mp4 files (one clip or clips side by side, looped to a
minimum length), PNG grids of sample frames.

Two layouts are accepted everywhere a "video" is taken:
- model layout: float (3, T, H, W) RGB in [-1, 1] (torch or numpy);
- file layout: uint8 (T, H, W, 3) RGB (torch or numpy).
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

# the length every sample mp4 (train.py, sample.py, the generate scripts, the studies) is looped to: a few frames at
# 8 fps last under a second, too short to see the motion
MP4_SECONDS = 3.0


def to_uint8_frames(video: torch.Tensor | np.ndarray) -> np.ndarray:
    """Convert a video to uint8 RGB frames.

    ``video``: float (3, T, H, W) in [-1, 1] (clipped) or uint8 (T, H, W, 3).
    Returns a contiguous numpy uint8 array (T, H, W, 3).
    """
    if isinstance(video, torch.Tensor):
        video = video.detach().cpu()
        video = video.numpy() if video.dtype == torch.uint8 else video.float().numpy()
    video = np.asarray(video)
    if video.dtype == np.uint8:
        if video.ndim != 4 or video.shape[-1] != 3:
            raise ValueError(f"video: uint8 input must be (T, H, W, 3), got shape {video.shape}")
        return np.ascontiguousarray(video)
    if np.issubdtype(video.dtype, np.floating):
        if video.ndim != 4 or video.shape[0] != 3:
            raise ValueError(f"video: float input must be (3, T, H, W) in [-1, 1], got shape {video.shape}")
        scaled = np.clip(np.rint((video + 1.0) * 127.5), 0, 255).astype(np.uint8)  # (3, T, H, W)
        return np.ascontiguousarray(scaled.transpose(1, 2, 3, 0))  # (T, H, W, 3)
    raise ValueError(
        f"video: dtype {video.dtype} is not supported; pass float (3, T, H, W) in [-1, 1] or uint8 (T, H, W, 3)"
    )


def side_by_side(videos: Sequence[torch.Tensor | np.ndarray], gap: int = 4) -> np.ndarray:
    """uint8 frames (T, H, W_1 + gap + W_2 + ..., 3): the videos (either layout, equal T and H) next to each
    other, left to right, with `gap` columns of mid grey between them."""
    clips = [to_uint8_frames(v) for v in videos]  # (T, H, W_i, 3) each
    if not clips:
        raise ValueError("side_by_side: videos is empty; pass at least one video")
    if len({c.shape[:2] for c in clips}) > 1:
        raise ValueError(f"side_by_side: the videos' (T, H) differ: {[c.shape[:2] for c in clips]}; pass clips of "
                         f"equal length and height")
    if gap < 0:
        raise ValueError(f"side_by_side: gap={gap} must be >= 0")
    T, H = clips[0].shape[:2]
    spacer = np.full((T, H, gap, 3), 128, np.uint8)
    parts = [part for c in clips for part in (spacer, c)][1:]
    return np.concatenate(parts, axis=2)  # (T, H, sum W_i + gaps, 3)


def write_mp4(path: str | Path, video: torch.Tensor | np.ndarray, fps: float = 8.0, crf: int = 18,
              min_seconds: float = 0.0) -> Path:
    """Write a video as H.264 mp4 with the ffmpeg of imageio-ffmpeg, all or nothing.

    ``video``: float (3, T, H, W) in [-1, 1] or uint8 (T, H, W, 3). ``crf``: x264
    constant rate factor (0 = lossless luma, 18 = visually lossless, 51 = worst).
    ``min_seconds``: a clip shorter than that at ``fps`` is looped (played whole, again and again)
    until it lasts at least that long, so that the motion of a few frames can be seen (MP4_SECONDS for the
    samples people watch; 0 for a clip that is data, e.g. for an evaluator).
    Odd frame sizes are written with full-resolution chroma (yuv444p) instead of yuv420p.
    ffmpeg writes a hidden temp file beside ``path`` that replaces ``path`` only when ffmpeg
    succeeded, so a failed write (read-only folder, full disk) raises OSError naming ``path`` and
    the cause and leaves neither a partial video nor the temp file. Returns the path written.
    """
    import imageio_ffmpeg

    frames = to_uint8_frames(video)  # (T, H, W, 3)
    if fps <= 0:
        raise ValueError(f"fps={fps} must be > 0")
    if not 0 <= crf <= 51:
        raise ValueError(f"crf={crf} must lie in [0, 51]")
    if not min_seconds >= 0:
        raise ValueError(f"min_seconds={min_seconds} must be >= 0 (0 writes the clip once)")
    frames = np.tile(frames, (max(1, math.ceil(min_seconds * fps / len(frames))), 1, 1, 1))  # (loops * T, H, W, 3)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    height, width = frames.shape[1:3]
    pixel_format = "yuv420p" if height % 2 == 0 and width % 2 == 0 else "yuv444p"
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error",
               "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(fps), "-i", "-",
               "-an", "-c:v", "libx264", "-pix_fmt", pixel_format, "-crf", str(crf), "-f", "mp4", str(tmp)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(command, input=frames.tobytes(), capture_output=True, check=False)
        if done.returncode != 0:
            cause = done.stderr.decode(errors="replace").strip().splitlines()
            raise OSError(f"ffmpeg exited with status {done.returncode}: {cause[-1] if cause else 'no message'}")
        os.replace(tmp, path)
    except OSError as err:
        if tmp.is_file():
            tmp.unlink()
        raise OSError(f"could not write the video {path}: {err}") from err
    return path


def frame_grid_png(
    path: str | Path,
    videos: Sequence[torch.Tensor | np.ndarray],
    labels: Sequence[str] | None = None,
    num_frames: int = 8,
) -> Path:
    """Save a PNG grid: one row per video, ``num_frames`` frames spread evenly over its clip.

    ``videos``: list of videos in either layout (may differ in T, H, W); ``labels``: one
    title per row (e.g. captions) or None. Returns the path written.
    """
    from matplotlib.figure import Figure

    if not videos:
        raise ValueError("videos is empty; pass at least one video")
    if labels is not None and len(labels) != len(videos):
        raise ValueError(f"labels has {len(labels)} entries but videos has {len(videos)}; pass one label per video")
    if num_frames < 1:
        raise ValueError(f"num_frames={num_frames} must be >= 1")
    clips = [to_uint8_frames(v) for v in videos]
    cols = min(num_frames, max(len(c) for c in clips))
    # each row: a band for its label and frame titles, then its frames; in inches, so that any number of rows
    # keeps the same layout (no label cut off above one row, no empty band above many)
    band, frame_h, pad = 0.4, 1.1, 0.05
    height = len(clips) * (band + frame_h) + pad
    fig = Figure(figsize=(1.2 * cols, height))
    axes = fig.subplots(len(clips), cols, squeeze=False)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=pad / height, top=1 - band / height, wspace=0.05,
                        hspace=band / frame_h)
    for row, clip in enumerate(clips):
        steps = np.linspace(0, len(clip) - 1, num=min(cols, len(clip))).round().astype(int)
        for col, ax in enumerate(axes[row]):
            ax.axis("off")
            if col < len(steps):
                ax.imshow(clip[steps[col]], interpolation="nearest")
                ax.set_title(f"t={steps[col]}", fontsize=6)
        if labels is not None:
            axes[row][0].text(0.0, 1.2, labels[row], transform=axes[row][0].transAxes, fontsize=7, va="bottom")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
