"""End-to-end denoising-step latency per SP mode: the second table of experiments/swiftfusion.py.

One denoising step is `FullSequenceSampler.sample` with a single timestep: shard the latents'
tokens, run every DiT block with its self-attention in the variant's mode over all N tokens,
take the Euler step and gather the latents on every rank. Weights are random (speed does not
depend on their values); the default model is the `wan-1.3b` preset at 60 x 104 latents (1560
tokens per latent frame), so 10 / 21 / 42 latent frames are 15,600 / 32,760 / 65,520 tokens.
Each variant's latents are compared with USP's (bf16 noise level, not an exactness check: the
attention-level correctness check of swiftfusion.py is the exact one).
Configuration: the `step` keys of experiments/conf/swiftfusion.yaml (from swiftfusion_step.yaml)
and its `model` group.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from experiments.hydra_config import require_ranges, require_sizes
from megaslide.perf.timing import timed
from megaslide.config import DiTConfig
from megaslide.inference.full import FullConfig, FullSequenceSampler
from megaslide.inference.weights import caption_input, random_weights_
from megaslide.models.dit import build_dit

CAPTION = "a red circle moving left"


@dataclass(frozen=True)
class StepTableConfig:
    """The denoising-step table's sizes (experiments/conf/swiftfusion_step.yaml)."""

    frames: list[int]   # latent frames, one row group each; empty: no table
    height: int         # latent height
    width: int          # latent width
    max_seconds: float  # a variant slower than this at one length is skipped at the longer ones

    def validate(self) -> None:
        require_sizes("step.frames", self.frames, allow_empty=True)
        require_ranges(self, positive=("height", "width"), finite=("max_seconds",), prefix="step.")


def measure_denoising_steps(rows: list[dict], variants: list, unavailable: dict[str, str | None],
                            model_cfg: DiTConfig, step: StepTableConfig, repeats: int, device: torch.device,
                            dtype: torch.dtype, world: int, on_length: Callable[[], None] = lambda: None) -> None:
    """Append one row per (latent frames, variant) to `rows`. With one rank only `sdpa_1gpu` runs (every SP mode
    would be the same local attention); with P ranks every SP variant runs, `sdpa_1gpu` does not.
    A variant slower than `step.max_seconds` at one length is skipped at the longer ones.
    `on_length()` follows each length, so the caller can save the rows measured so far.
    `max_abs_diff` is against the first variant that ran at that length (named in `diff_vs`)."""
    with torch.device(device):
        model = random_weights_(build_dit(model_cfg), seed=0)
    model.to(dtype).eval()
    ids = caption_input(model, [CAPTION], device)
    chosen = [v for v in variants if (v.plan is None) == (world == 1)]
    too_slow: dict[str, str] = {}
    for frames in step.frames:
        gen = torch.Generator().manual_seed(frames)
        noise = torch.randn(1, model.cfg.in_channels, frames, step.height, step.width, generator=gen)
        tokens = math.prod(model.cfg.token_grid(frames, step.height, step.width))
        reference, reference_name = None, None
        for v in chosen:
            row = {"variant": v.name, "latent_frames": frames, "tokens": tokens}
            why = unavailable.get(v.name) or too_slow.get(v.name)
            if why:
                rows.append({**row, "status": "unavailable" if unavailable.get(v.name) else "skipped", "reason": why})
                continue
            sampler = FullSequenceSampler(model, frames=frames, height=step.height, width=step.width,
                                          config=FullConfig(timesteps=(1.0,), parallel=v.parallel()),
                                          group=None if world == 1 else torch.distributed.group.WORLD)
            last = {}  # the latents of the last timed step, for the comparison
            try:
                with torch.no_grad():
                    timing = timed(lambda: last.update(latents=sampler.sample(noise, ids)), device, repeats,
                                   across_ranks=True)
                latents = last["latents"]
            except torch.cuda.OutOfMemoryError as e:
                rows.append({**row, "status": "oom", "reason": str(e).splitlines()[0]})
                continue
            if reference is None:
                reference, reference_name = latents, v.name
            step_s = timing.median
            rows.append({**row, "status": "ok", "step_s": step_s, **timing.ms(), "tokens_per_s": tokens / step_s,
                         "max_abs_diff": (latents - reference).abs().max().item(), "diff_vs": reference_name})
            if step_s > step.max_seconds:
                too_slow[v.name] = f"{step_s:.2f} s at {tokens} tokens > step.max_seconds={step.max_seconds}"
            sampler = None  # release the sampler before the next mode
            if device.type == "cuda":
                torch.cuda.empty_cache()
        usp = next((r.get("step_s") for r in rows if r["latent_frames"] == frames and r["variant"] == "usp"), None)
        for r in rows:
            if r["latent_frames"] == frames and usp and "step_s" in r:
                r["speedup_vs_usp"] = usp / r["step_s"]
        on_length()
