"""Generate a video for a caption from a checkpoint written by experiments/train.py.

    python experiments/sample.py checkpoint=runs/train/checkpoints/step_200.pt caption="a blue square moving up"
    python -m experiments.sample checkpoint=runs/wan/checkpoints/step_200 \
        prompt_embeds=/data/cache/prompts/0.safetensors vae=/ckpt/Wan2.1-T2V-1.3B-Diffusers/vae

Either checkpoint format: a step_N.pt file (EMA weights when the run kept them) or a sharded
step_N/ folder of the offload engine. The video has the training clip's size, looped to at least
MP4_SECONDS (megaslide/data/video_io.py) so that its motion shows. A pixel-space model reads
`caption` with its built-in text encoder; a model trained on a latent cache (data=latent_cache) reads
precomputed caption embeddings (`prompt_embeds`: a prompt file of experiments/precompute.py, or any clip
file of the cache), and its latents are decoded by the Wan VAE folder `vae` (run it as a module then:
diffusers is imported).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from experiments.hydra_config import script_config, script_main
from experiments.results_io import check_writable_folder
from megaslide.config import DataConfig, DiTConfig, from_dict, require_seed
from megaslide.data.video_io import MP4_SECONDS, write_mp4
from megaslide.device import resolve_device
from megaslide.diffusion.samplers import euler_sample
from megaslide.models.dit import VideoDiT
from megaslide.inference.weights import sampling_weights


@dataclass
class SampleConfig:
    """The keys of experiments/conf/sample.yaml."""

    checkpoint: str
    caption: str
    steps: int
    cfg_scale: float
    seed: int
    device: str
    out: str
    prompt_embeds: str   # latent-space models: a safetensors file with "context" (L, text_dim), "context_mask" (L,)
    vae: str             # latent-space models: the diffusers AutoencoderKLWan folder that decodes the latents

    def validate(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1 (Euler steps of the sampler)")
        require_seed(self.seed, "seed")
        if not 0 <= self.cfg_scale < math.inf:   # NaN fails it too
            raise ValueError(f"cfg_scale={self.cfg_scale} must be a finite number >= 0 (1: no guidance)")
        if Path(self.out).suffix.lower() != ".mp4":
            raise ValueError(f"out={self.out!r}: sample.py writes mp4 video only; give a name ending in .mp4")
        check_writable_folder(self.out, "out", of_file=True)
        resolve_device(self.device, key="device")
        if not Path(self.checkpoint).exists():
            raise ValueError(f"checkpoint={self.checkpoint!r} does not exist; pass a checkpoint of "
                             f"experiments/train.py (checkpoints/step_N.pt or checkpoints/step_N/)")


def generate(cfg: SampleConfig) -> torch.Tensor:
    """One video (C, T, H, W) in [-1, 1] at the training clip size."""
    dev = resolve_device(cfg.device, key="device")
    weights, state = sampling_weights(cfg.checkpoint)
    model_cfg, data_cfg = from_dict(DiTConfig, state["model_cfg"]), from_dict(DataConfig, state["data_cfg"])
    latent = data_cfg.name == "latent_cache"
    if latent:
        context, mask, null, null_mask = prompt_embeddings(cfg, data_cfg.root)
        from megaslide.models.encoders import WanVAE   # before the model: a missing package fails fast
        vae = WanVAE(cfg.vae, dev)
    else:
        data_cfg.check_channels(model_cfg.in_channels)
    model = VideoDiT(model_cfg)
    model.load_state_dict(weights)
    model.to(dev).eval()
    g = torch.Generator().manual_seed(cfg.seed)
    noise = torch.randn(1, model_cfg.in_channels, data_cfg.frames, data_cfg.height, data_cfg.width, generator=g)
    if not latent:
        ids, null = model.tokenizer([cfg.caption]).to(dev), model.tokenizer([""]).to(dev)
        x = euler_sample(model, noise.to(dev), ids, null, steps=cfg.steps, cfg_scale=cfg.cfg_scale)
        return x[0].float().clamp(-1, 1).cpu()
    x = euler_sample(model, noise.to(dev), context.to(dev), null.to(dev), steps=cfg.steps, cfg_scale=cfg.cfg_scale,
                     context_mask=mask.to(dev), null_mask=null_mask.to(dev))      # (1, C, T', H', W')
    return vae.decode(x)[0]                                                         # (3, T, H, W)


def prompt_embeddings(cfg: SampleConfig, cache: str) -> tuple[torch.Tensor, ...]:
    """(context (1, L, D), mask (1, L), null context, null mask) from `cfg.prompt_embeds`; the null caption from
    the file, else from the training cache `cache` (a clip file holds none)."""
    if not cfg.prompt_embeds or not Path(cfg.prompt_embeds).is_file():
        raise ValueError(f"prompt_embeds={cfg.prompt_embeds!r}: this model was trained on a latent cache and reads "
                         f"caption embeddings, not caption={cfg.caption!r}; give a prompt file of "
                         f"experiments/precompute.py (prompts=[...]) or a clip file of the cache")
    if not cfg.vae:
        raise ValueError("vae='': this model samples latents; give the Wan VAE folder that decodes them "
                         "(e.g. <Wan2.1-T2V-1.3B-Diffusers>/vae)")
    from megaslide.data import latent_cache
    found = latent_cache.load_tensors(Path(cfg.prompt_embeds))
    if "null_context" not in found:
        null_file = Path(cache) / latent_cache.NULL
        if not null_file.is_file():
            raise ValueError(f"prompt_embeds={cfg.prompt_embeds!r} holds no null caption and the training cache "
                             f"{cache!r} is gone; give a prompt file of experiments/precompute.py")
        null = latent_cache.load_tensors(null_file)
        found.update(null_context=null["context"], null_mask=null["context_mask"])
    return tuple(found[k][None] for k in ("context", "context_mask", "null_context", "null_mask"))


@script_main("sample")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(SampleConfig, hydra_cfg)
    video = generate(cfg)
    try:
        path = write_mp4(cfg.out, video, min_seconds=MP4_SECONDS)
    except OSError as err:   # a full disk, or a folder that turned read-only while the video was sampled
        sys.exit(f"error: {err}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
