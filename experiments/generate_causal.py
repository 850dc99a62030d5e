"""Sample one video chunk by chunk with a KV cache (causal generation), sequence-parallel under torchrun.

    python experiments/generate_causal.py                                 # the tiny model, one CPU process
    torchrun --standalone --nproc_per_node 2 experiments/generate_causal.py model=wan-1.3b frames=21 height=60 width=104

Every rank builds the same model (a checkpoint of experiments/train.py, or seeded random weights
of the `model` preset) and noise; rank 0 prints when each chunk is final and writes the latents,
and the video for a pixel-space model.
"""
from __future__ import annotations

import time

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.generate_inputs import build_inputs, check_inputs, sampler_config, write_and_leave
from experiments.hydra_config import script_main
from megaslide.inference.causal import CausalConfig, CausalGenerator
from megaslide.inference.launch import init_distributed


@script_main("generate_causal")
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(cfg, resolve=True)
    check_inputs(c)
    ctx = init_distributed(c["device"])
    model, noise, ids = build_inputs(c, ctx.device)
    config = sampler_config(CausalConfig, c)
    generator = CausalGenerator(model, frames=c["frames"], height=c["height"], width=c["width"], config=config,
                                group=ctx.group)
    start, chunks = time.perf_counter(), []
    for chunk in generator.generate(noise, ids):
        chunks.append(chunk.latents.cpu())  # waits for the chunk
        if ctx.is_main:
            print(f"chunk {chunk.index} (latent frames {chunk.start}..{chunk.start + config.chunk_frames - 1}) "
                  f"final after {time.perf_counter() - start:.3f} s", flush=True)
    write_and_leave(ctx, c["out"], torch.cat(chunks, dim=2))


if __name__ == "__main__":
    main()
