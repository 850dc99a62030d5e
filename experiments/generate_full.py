"""Sample one video by full-sequence sampling (every latent frame at once), sequence-parallel under torchrun.

    python experiments/generate_full.py                                   # the tiny model, one CPU process
    torchrun --standalone --nproc_per_node 2 experiments/generate_full.py parallel.sp_mode=torus
    torchrun --standalone --nproc_per_node 2 experiments/generate_full.py model=wan-1.3b frames=21 height=60 width=104

Every rank builds the same model (a checkpoint of experiments/train.py, or seeded random weights
of the `model` preset) and noise; rank 0 writes the latents, and the video for a pixel-space model.
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from experiments.generate_inputs import build_inputs, check_inputs, sampler_config, write_and_leave
from experiments.hydra_config import script_main
from megaslide.inference.full import FullConfig, FullSequenceSampler
from megaslide.inference.launch import init_distributed


@script_main("generate_full")
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(cfg, resolve=True)
    check_inputs(c)
    ctx = init_distributed(c["device"])
    model, noise, ids = build_inputs(c, ctx.device)
    sampler = FullSequenceSampler(model, frames=c["frames"], height=c["height"], width=c["width"],
                                  config=sampler_config(FullConfig, c), group=ctx.group)
    video = sampler.sample(noise, ids)
    write_and_leave(ctx, c["out"], video)


if __name__ == "__main__":
    main()
