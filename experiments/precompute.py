"""Encode a video folder once into a latent cache that training reads (data=latent_cache).

    python -m experiments.precompute root=/data/clips out=/data/clips_cache \
        vae=/ckpt/Wan2.1-T2V-1.3B-Diffusers/vae text_encoder=/ckpt/Wan2.1-T2V-1.3B-Diffusers/text_encoder \
        tokenizer=/ckpt/Wan2.1-T2V-1.3B-Diffusers/tokenizer frames=81 height=480 width=832 prompts='[a cat]'

The Wan VAE (diffusers' AutoencoderKLWan) makes the latents, normalised by its config's latents_mean /
latents_std; umT5 (transformers' UMT5EncoderModel) makes the caption embeddings, zero-padded to text_len with
their mask; `prompts=[...]` also writes prompt embeddings to sample with (root='' vae='': prompts only).
Every clip is checked (size, frame count) before the first is encoded; an interrupted run picks up where it
stopped when run again with the same settings. Run it as a module (python -m: experiments/kernels would hide
the `kernels` package that diffusers imports). Needs the wan extra: pip install -e ".[wan]".
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from experiments.hydra_config import script_config, script_main
from experiments.results_io import check_writable_folder
from megaslide.data.encode_cache import check_clips, encode_prompts, encode_video_folder
from megaslide.data.video_folder import VideoFolder
from megaslide.device import precision_dtype, resolve_device
from megaslide.extras import require


@dataclass
class PrecomputeConfig:
    """The keys of experiments/conf/precompute.yaml."""

    root: str
    out: str
    vae: str
    text_encoder: str
    tokenizer: str
    frames: int
    height: int
    width: int
    text_len: int
    prompts: list[str]
    device: str
    precision: str

    def validate(self) -> None:
        for key in ("frames", "height", "width", "text_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if not self.root and not self.prompts:
            raise ValueError("root='' and prompts=[]: nothing to encode; give a video folder, prompts, or both")
        for key in ("root", "vae", "text_encoder", "tokenizer") if self.root else ("text_encoder", "tokenizer"):
            if not Path(getattr(self, key)).is_dir():
                raise ValueError(f"{key}={getattr(self, key)!r} is not a folder; give a local path")
        if self.root and Path(self.out).resolve() == Path(self.root).resolve():
            raise ValueError(f"out={self.out!r} is the video folder itself; give the cache a folder of its own")
        check_writable_folder(self.out, "out")   # a file there, or no write access: before any encoder loads
        precision_dtype(self.precision, resolve_device(self.device, key="device"), key="precision")


@script_main("precompute")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(PrecomputeConfig, hydra_cfg)
    for module in ("diffusers", "transformers", "safetensors"):   # all three, before any model is loaded
        require(module, "experiments/precompute.py")
    from megaslide.models.encoders import UMT5Text, WanVAE
    device = resolve_device(cfg.device, key="device")
    dtype = precision_dtype(cfg.precision, device, key="precision")
    vae = WanVAE(cfg.vae, device, dtype) if cfg.root else None
    if cfg.root:   # every clip checked before the (large) text encoder loads; encode_video_folder checks again
        check_clips(VideoFolder(cfg.root, cfg.frames, cfg.height, cfg.width), cfg.frames, cfg.height, cfg.width, vae)
    text = UMT5Text(cfg.text_encoder, cfg.tokenizer, cfg.text_len, device, dtype)
    if cfg.root:
        sources = {k: str(Path(getattr(cfg, k)).resolve()) for k in ("vae", "text_encoder", "tokenizer")}
        sources.update(frames=cfg.frames, height=cfg.height, width=cfg.width, precision=cfg.precision)
        manifest, encoded = encode_video_folder(cfg.root, cfg.out, frames=cfg.frames, height=cfg.height,
                                                width=cfg.width, vae=vae, text=text, sources=sources)
        clips = len(manifest["clips"])
        print(f"latent cache {cfg.out}: {clips} clips ({encoded} encoded now, {clips - encoded} already cached), "
              f"latents {tuple(manifest['latent_shape'])}, captions {manifest['text_len']} x {manifest['text_dim']}")
        print(f"train on it: python experiments/train.py data=latent_cache data.root={cfg.out} ...")
    for path, prompt in zip(encode_prompts(cfg.out, text, cfg.prompts), cfg.prompts):
        print(f"prompt {prompt!r}: {path}  (python -m experiments.sample prompt_embeds={path} ...)")

if __name__ == "__main__":
    main()
