"""VideoFolder: captioned mp4 clips from a directory, decoded with decord.

Layout::

    root/
      captions.jsonl      one JSON object per line: {"file": "a.mp4", "caption": "..."}
      a.mp4
      ...

Each item samples ``frames`` frames uniformly over the whole clip (the middle frame of
``frames`` equal segments; short clips repeat frames) and resizes them to
(height, width) while decoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

# decord2 3.4.0 returns mis-shaped frames for some output widths (2..16, 24, 48, 72 in
# our checks). When that happens the clip is decoded at this width and resized in torch.
_FALLBACK_DECODE_WIDTH = 128


def _import_decord():
    try:
        import decord
    except ImportError as error:
        raise ImportError(
            "VideoFolder needs decord to read videos: pip install decord2 (or megaslide[video])"
        ) from error
    return decord


def uniform_frame_indices(num_available: int, frames: int) -> np.ndarray:
    """Indices (frames,) of the middle frame of ``frames`` equal segments of the clip."""
    if num_available < 1:
        raise ValueError(f"num_available={num_available}: the clip has no frames")
    positions = (np.arange(frames) + 0.5) * num_available / frames  # (frames,)
    return np.minimum(np.floor(positions), num_available - 1).astype(np.int64)


def read_video_frames(path: str | Path, frames: int, height: int, width: int) -> np.ndarray:
    """Decode ``frames`` uniformly sampled frames of ``path`` as uint8 (frames, height, width, 3)."""
    decord = _import_decord()
    reader = decord.VideoReader(str(path), width=width, height=height, num_threads=1)
    return decode_frames(path, uniform_frame_indices(len(reader), frames), height, width, reader)


def decode_frames(path: str | Path, indices, height: int, width: int, reader=None) -> np.ndarray:
    """Frames ``indices`` of ``path`` resized to (height, width) while decoding: uint8 (len(indices), height,
    width, 3). ``reader``: a decord VideoReader of ``path`` at that size, if one is open."""
    decord = _import_decord()
    reader = reader or decord.VideoReader(str(path), width=width, height=height, num_threads=1)
    if tuple(reader[0].shape) == (height, width, 3):
        return reader.get_batch(indices).asnumpy()  # (T, H, W, 3)
    reader = decord.VideoReader(str(path), width=_FALLBACK_DECODE_WIDTH, height=height, num_threads=1)
    if tuple(reader[0].shape) != (height, _FALLBACK_DECODE_WIDTH, 3):
        raise RuntimeError(
            f"decord {decord.__version__} decoded {path} with shape {tuple(reader[0].shape)}; "
            "expected RGB frames, try another decord version"
        )
    wide = torch.from_numpy(reader.get_batch(indices).asnumpy())  # (T, H, Wd, 3)
    wide = wide.permute(0, 3, 1, 2).float()  # (T, 3, H, Wd)
    resized = torch.nn.functional.interpolate(wide, size=(height, width), mode="area")  # (T, 3, H, W)
    return resized.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()  # (T, H, W, 3)


def clip_size(path: str | Path) -> tuple[int, int, int]:
    """(frames, height, width) of a clip as stored."""
    reader = _import_decord().VideoReader(str(path), num_threads=1)
    height, width, _ = reader[0].shape
    return len(reader), height, width


def read_clip(path: str | Path, frames: int) -> torch.Tensor:
    """The first `frames` frames of a clip at its stored size: float32 (3, frames, H, W) RGB in [-1, 1]."""
    _, height, width = clip_size(path)
    video = torch.from_numpy(decode_frames(path, list(range(frames)), height, width))  # (T, H, W, 3) uint8
    return video.permute(3, 0, 1, 2).float() / 127.5 - 1.0                            # (3, T, H, W)


class VideoFolder(Dataset):
    """Captioned mp4 clips listed in ``root/captions.jsonl``.

    Item ``i`` is a dict: "video" float32 (3, T, H, W) RGB in [-1, 1]; "caption" str;
    "path" str (the clip's file).
    """

    def __init__(
        self, root: str | Path, frames: int, height: int, width: int, captions_file: str = "captions.jsonl"
    ) -> None:
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"root={str(root)!r} is not a directory; pass the folder holding the mp4 files")
        captions_path = root / captions_file
        if not captions_path.is_file():
            raise ValueError(
                f"captions file {str(captions_path)!r} is missing; write one JSON line per clip, "
                'e.g. {"file": "a.mp4", "caption": "a red circle moving left"}'
            )
        if frames < 1 or height < 1 or width < 1:
            raise ValueError(f"frames={frames}, height={height}, width={width} must all be >= 1")
        self.root = root
        self.frames = frames
        self.height = height
        self.width = width
        self.entries = self._read_captions(captions_path)
        self._check_first_clip(captions_path)

    def _check_first_clip(self, captions_path: Path) -> None:
        """Decode the first clip now: a missing decord or an unreadable file stops a run before its model is
        built, not at its first batch (ValueError, shown by the scripts as a message naming the clip)."""
        path = self.entries[0][0]
        try:
            read_video_frames(path, self.frames, self.height, self.width)
        except ImportError as error:
            raise ValueError(f"{error} (needed for the clips of {captions_path.parent})") from error
        except Exception as error:  # decord raises its own DECORDError for a damaged or non-video file
            raise ValueError(f"{path}, the first clip of {captions_path}, could not be decoded ({error}); re-encode "
                             f"it as an H.264 mp4 or remove its line") from error

    def _read_captions(self, captions_path: Path) -> list[tuple[Path, str]]:
        entries = []
        for line_no, line in enumerate(captions_path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{captions_path}:{line_no} is not valid JSON ({error})") from error
            if not isinstance(record, dict) or "file" not in record or "caption" not in record:
                raise ValueError(f'{captions_path}:{line_no} needs keys "file" and "caption", got {line.strip()!r}')
            video_path = self.root / record["file"]
            if not video_path.is_file():
                raise ValueError(f"{captions_path}:{line_no} names {str(video_path)!r}, which does not exist")
            entries.append((video_path, str(record["caption"])))
        if not entries:
            raise ValueError(f"captions file {str(captions_path)!r} lists no clips; add one JSON line per clip")
        return entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, caption = self.entries[index]
        frames = read_video_frames(path, self.frames, self.height, self.width)  # (T, H, W, 3) uint8
        video = torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1.0  # (3, T, H, W)
        return {"video": video, "caption": caption, "path": str(path)}
