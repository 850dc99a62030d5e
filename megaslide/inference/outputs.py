"""What a generation run writes: the latents, and the video itself when the model works in pixel space."""
from __future__ import annotations

from pathlib import Path

import torch

from megaslide.data.video_io import MP4_SECONDS, write_mp4


def save_latents(path: str | Path, latents: torch.Tensor) -> list[Path]:
    """Latents (B, C, T, H, W) to `path` (torch.save); with C == 3 (a pixel-space model, whose
    latents are RGB frames in [-1, 1]) also the first video, clamped, to `path` with suffix .mp4,
    written as experiments/sample.py writes its samples (looped to at least MP4_SECONDS). Returns the paths
    written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(latents.cpu(), path)
    written = [path]
    if latents.shape[1] == 3:
        written.append(write_mp4(path.with_suffix(".mp4"), latents[0].float().clamp(-1, 1).cpu(),
                                 min_seconds=MP4_SECONDS))
    return written
