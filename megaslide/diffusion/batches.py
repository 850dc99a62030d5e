"""Deterministic training batches: everything random in step s comes from seed and s alone.

Data indices, caption dropout, timesteps and noise are drawn from a generator seeded by
(seed, step). Resuming at step s therefore sees exactly the batches an uninterrupted run
would have seen, and two trainers (resident and offloaded) can be fed identical batches.

Captions reach the model in one of two forms, whichever the dataset gives: words, turned into
token ids by the model's built-in tokenizer, or caption embeddings of a real text encoder
precomputed into a latent cache (items with "context" and "context_mask"; a dropped caption
takes the cache's embedding of the empty caption, "null_context").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaslide.config import TrainConfig
from megaslide.diffusion.flow import sample_timesteps


@dataclass
class Batch:
    x0: torch.Tensor       # (B, C, T, H, W) clean latents
    context: torch.Tensor  # (B, L) caption token ids, or (B, L, text_dim) caption embeddings; dropped: empty
    t: torch.Tensor        # (B,) flow time in (0, 1)
    noise: torch.Tensor    # (B, C, T, H, W)
    captions: list[str]
    mask: torch.Tensor | None = None  # (B, L) True where an embedding is a real token; None with token ids

    def to(self, device) -> "Batch":
        return Batch(self.x0.to(device), self.context.to(device), self.t.to(device), self.noise.to(device),
                     self.captions, None if self.mask is None else self.mask.to(device))


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def make_batch(dataset, tokenizer, cfg: TrainConfig, step: int, rows: slice = slice(None)) -> Batch:
    """Step `step`'s batch of cfg.batch_size clips, or of its `rows` only (a data-parallel rank's share): every
    random number of the whole batch is drawn, so a share holds exactly those rows of the whole batch, and only
    its own clips are read."""
    g = step_generator(cfg.seed, step)
    idx = torch.randint(len(dataset), (cfg.batch_size,), generator=g).tolist()
    items = [dataset[i] for i in idx[rows]]
    x0 = torch.stack([it["video"] for it in items])                           # (b, C, T, H, W), b rows
    drop = (torch.rand(cfg.batch_size, generator=g) < cfg.caption_dropout)[rows]   # (b,)
    captions = ["" if d else it["caption"] for it, d in zip(items, drop.tolist())]
    t = sample_timesteps(cfg.batch_size, g, cfg.logit_normal_mean, cfg.logit_normal_std)[rows]  # (b,)
    noise = torch.randn((cfg.batch_size, *x0.shape[1:]), generator=g)[rows]    # (b, C, T, H, W)
    if "context" not in items[0]:
        return Batch(x0, tokenizer(captions), t, noise, captions)
    null, null_mask = dataset.null_context                                     # (L, Dt), (L,)
    context = torch.stack([null if d else it["context"] for it, d in zip(items, drop.tolist())])  # (b, L, Dt)
    mask = torch.stack([null_mask if d else it["context_mask"] for it, d in zip(items, drop.tolist())])  # (b, L)
    return Batch(x0, context, t, noise, captions, mask)
