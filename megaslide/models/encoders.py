"""The frozen encoders of Wan 2.x, from local diffusers / transformers folders: the video VAE
(`diffusers.AutoencoderKLWan`) and the umT5 text encoder (`transformers.UMT5EncoderModel` + its tokenizer).

They run once, to fill a latent cache (experiments/precompute.py), and the VAE again to decode samples
(experiments/sample.py). Nothing is downloaded: every path must be a local folder. Both follow Wan's
diffusers pipeline: latents are the encoder's mean normalised per channel by the VAE config's
`latents_mean` / `latents_std`; captions are tokenized to `text_len` tokens and their embeddings past the
last real token are zero, with a mask that is True on the real tokens.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megaslide.extras import require


def _folder(path: str | Path, key: str, holds: str) -> Path:
    folder = Path(path)
    if not (folder / "config.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ValueError(f"{key}={str(path)!r} is not a local {holds} folder (no config.json); give e.g. the "
                         f"{holds}/ folder of a Wan 2.x diffusers checkpoint (nothing is downloaded)")
    return folder


class WanVAE:
    """Wan's 3D causal VAE. Clips (B, 3, T, H, W) in [-1, 1] with T = 1 + k * `temporal` and H, W multiples of
    `spatial` <-> normalised latents (B, z_dim, 1 + k, H / spatial, W / spatial)."""

    def __init__(self, path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32, key: str = "vae"):
        diffusers = require("diffusers", "the Wan VAE")
        self.vae = diffusers.AutoencoderKLWan.from_pretrained(str(_folder(path, key, "vae")), torch_dtype=dtype,
                                                              local_files_only=True)
        self.vae.to(device).eval().requires_grad_(False)
        self.device, self.dtype = device, dtype
        c = self.vae.config
        self.temporal = 2 ** sum(c.temperal_downsample)
        self.spatial = 2 ** len(c.temperal_downsample) * (c.patch_size or 1)
        self.mean = torch.tensor(c.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)  # (1, z, 1, 1, 1)
        self.std = torch.tensor(c.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)    # (1, z, 1, 1, 1)

    @property
    def channels(self) -> int:
        return self.mean.shape[1]

    def size_error(self, frames: int, height: int, width: int) -> str | None:
        """Why a clip of this size cannot be encoded, or None."""
        if frames % self.temporal != 1:
            return f"{frames} frames is not 1 + {self.temporal}k (e.g. {1 + self.temporal * (frames // self.temporal)})"
        if height % self.spatial or width % self.spatial:
            return f"{height}x{width} is not a multiple of {self.spatial} in height and width"
        return None

    def latent_shape(self, frames: int, height: int, width: int) -> list[int]:
        """(C, T', H', W') of a clip's latents."""
        return [self.channels, 1 + (frames - 1) // self.temporal, height // self.spatial, width // self.spatial]

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Clips (B, 3, T, H, W) in [-1, 1] -> normalised latents (B, C, T', H', W') float32 on the CPU."""
        mu = self.vae.encode(video.to(self.device, self.dtype)).latent_dist.mean.float().cpu()
        return (mu - self.mean) / self.std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents (B, C, T', H', W') -> clips (B, 3, T, H, W) in [-1, 1], float32 on the CPU."""
        z = latents.float().cpu() * self.std + self.mean
        return self.vae.decode(z.to(self.device, self.dtype)).sample.float().clamp(-1, 1).cpu()


class UMT5Text:
    """umT5 caption embeddings: captions -> context (B, text_len, text_dim), zero past the real tokens, and
    mask (B, text_len) bool."""

    def __init__(self, path: str | Path, tokenizer: str | Path, text_len: int, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        transformers = require("transformers", "the umT5 text encoder")
        if text_len < 1:
            raise ValueError(f"text_len={text_len} must be >= 1 (Wan uses 512)")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(_folder(tokenizer, "tokenizer", "tokenizer")), local_files_only=True)
        self.model = transformers.UMT5EncoderModel.from_pretrained(
            str(_folder(path, "text_encoder", "text_encoder")), torch_dtype=dtype, local_files_only=True)
        self.model.to(device).eval().requires_grad_(False)
        self.text_len, self.device = text_len, device
        self.dim = self.model.config.d_model

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(context (B, L, D) float32, mask (B, L) bool) on the CPU, L = text_len."""
        tokens = self.tokenizer(captions, padding="max_length", max_length=self.text_len, truncation=True,
                                add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)  # (B, L) x 2
        hidden = self.model(ids, mask).last_hidden_state.float()                          # (B, L, D)
        mask = mask.bool()
        empty = [c for c, row in zip(captions, mask) if not row.any()]
        if empty:   # no real token: the cross-attention would attend to nothing
            raise ValueError(f"tokenizer gave no tokens for captions {empty}; it must add an end token, as umT5's does")
        return (hidden * mask[..., None]).cpu(), mask.cpu()
