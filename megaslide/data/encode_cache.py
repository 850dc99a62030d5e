"""Fill a latent cache (latent_cache.py) from a video folder: each clip through the VAE, each caption through
the text encoder, once.

Every clip is checked before anything is encoded: it must have the cache's height and width as stored and at
least `frames` frames (its first `frames` are encoded), and the clip size must suit the VAE (1 + 4k frames and
sides that are multiples of 8 for Wan 2.1's). A rerun after an interruption keeps the clip files already
written and whole (checked against the manifest) and encodes the rest; a folder holding a cache of other
sources or clips is refused rather than mixed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from megaslide.data import latent_cache as lc
from megaslide.data.video_folder import VideoFolder, clip_size, read_clip


class VideoEncoder(Protocol):
    channels: int

    def size_error(self, frames: int, height: int, width: int) -> str | None: ...
    def latent_shape(self, frames: int, height: int, width: int) -> list[int]: ...
    def encode(self, video: torch.Tensor) -> torch.Tensor: ...


class CaptionEncoder(Protocol):
    text_len: int
    dim: int

    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


def check_clips(folder: VideoFolder, frames: int, height: int, width: int, vae: VideoEncoder) -> None:
    """Refuse the clip size the VAE cannot take (naming the keys) and each clip that does not fit (naming it)."""
    why = vae.size_error(frames, height, width)
    if why:
        raise ValueError(f"frames={frames}, height={height}, width={width}: {why}, which the VAE needs; change "
                         f"frames, height or width")
    for path, _ in folder.entries:
        n, h, w = clip_size(path)
        if (h, w) != (height, width):
            raise ValueError(f"clip {path} is {h}x{w}, not height x width = {height}x{width}; resize it (e.g. ffmpeg "
                             f"-vf scale={width}:{height}) or precompute a cache of its size")
        if n < frames:
            raise ValueError(f"clip {path} has {n} frames, fewer than frames={frames}; lower frames (1 + 4k) or "
                             f"remove the clip's line from captions.jsonl")


def encode_video_folder(root: str | Path, out: str | Path, *, frames: int, height: int, width: int,
                        vae: VideoEncoder, text: CaptionEncoder, sources: dict,
                        progress: bool = True) -> tuple[dict, int]:
    """Encode the clips of video folder `root` into the latent cache `out`; returns its manifest and how many
    clips this call encoded. `sources` names what made the cache (the encoders' paths, settings) and must
    match an existing cache's."""
    folder = VideoFolder(root, frames=frames, height=height, width=width)
    check_clips(folder, frames, height, width, vae)
    out = Path(out)
    clips = [{"file": str(path.relative_to(folder.root)), "caption": caption} for path, caption in folder.entries]
    manifest = {"format": lc.FORMAT, "sources": sources, "latent_shape": vae.latent_shape(frames, height, width),
                "text_len": text.text_len, "text_dim": text.dim, "clips": clips, "complete": False}
    if (out / lc.MANIFEST).is_file():
        old = lc.read_manifest(out, key="out")
        differ = [k for k in ("sources", "latent_shape", "text_len", "text_dim", "clips") if old[k] != manifest[k]]
        if differ:
            raise ValueError(f"out={str(out)!r} holds a latent cache whose {differ} differ from this run's; give "
                             f"another out folder, or delete that one to replace it")
    lc.write_manifest(out, manifest)
    null_entry = {"file": "", "caption": ""}
    if not lc.is_cached(out / lc.NULL, null_entry, lc.entry_shapes(manifest, latent=False)):
        context, mask = text.encode([""])                           # (1, L, D), (1, L)
        lc.write_tensors(out / lc.NULL, {"context": context[0], "context_mask": mask[0]}, null_entry)
    done = 0
    for index, (entry, (path, _)) in enumerate(tqdm(list(zip(clips, folder.entries)), desc="encoding clips",
                                                    disable=not progress, dynamic_ncols=True)):
        file = lc.clip_file(out, index)
        if lc.is_cached(file, entry, lc.entry_shapes(manifest)):
            continue
        latent = vae.encode(read_clip(path, frames)[None])[0]      # (C, T', H', W')
        context, mask = text.encode([entry["caption"]])             # (1, L, D), (1, L)
        lc.write_tensors(file, {"latent": latent, "context": context[0], "context_mask": mask[0]}, entry)
        done += 1
    manifest["complete"] = True
    lc.write_manifest(out, manifest)
    return manifest, done


def encode_prompts(out: str | Path, text: CaptionEncoder, prompts: list[str]) -> list[Path]:
    """Prompt embeddings for sampling (experiments/sample.py prompt_embeds=): out/prompts/<k>.safetensors per
    prompt, holding "context" (L, D), "context_mask" (L,) and the empty caption's "null_context",
    "null_mask" for classifier-free guidance; the prompt in the metadata."""
    contexts, masks = text.encode([*prompts, ""])                   # (P + 1, L, D), (P + 1, L)
    return [lc.write_tensors(Path(out) / lc.PROMPTS / f"{k}.safetensors",
                             {"context": contexts[k], "context_mask": masks[k], "null_context": contexts[-1],
                              "null_mask": masks[-1]}, {"caption": prompt})
            for k, prompt in enumerate(prompts)]
