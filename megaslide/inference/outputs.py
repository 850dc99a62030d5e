"""What a generation run writes: the latents, and the video itself when the model works in pixel space."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from megaslide.data.video_io import MP4_SECONDS, write_mp4


def save_latents(path: str | Path, latents: torch.Tensor) -> list[Path]:
    """Latents (B, C, T, H, W) to `path` (torch.save); with C == 3 (a pixel-space model, whose
    latents are RGB frames in [-1, 1]) also the first video, clamped, to `path` with suffix .mp4,
    written as experiments/sample.py writes its samples (looped to at least MP4_SECONDS). Returns the paths
    written.

    All or nothing: the latents go to a hidden temp file beside `path` that replaces it only once written whole,
    and a video that cannot be written takes the new latents with it; a failed write (full disk, read-only
    folder) raises OSError naming the path and the cause and leaves no partial file and no temp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(latents.cpu(), tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:   # torch.save reports a short write as a RuntimeError
        tmp.unlink(missing_ok=True)
        raise OSError(f"could not write the latents {path}: {err}") from err
    written = [path]
    if latents.shape[1] == 3:
        try:
            written.append(write_mp4(path.with_suffix(".mp4"), latents[0].float().clamp(-1, 1).cpu(),
                                     min_seconds=MP4_SECONDS))
        except OSError as err:
            path.unlink(missing_ok=True)
            raise OSError(f"{err} (the latents {path} were removed with it)") from err
    return written
