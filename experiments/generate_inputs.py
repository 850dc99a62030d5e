"""What generate_full.py and generate_causal.py build alike from their Hydra config: the checks of their own keys,
the model, the noise and the caption ids (the same on every rank), and the sampler's typed config."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments.hydra_config import model_config, require_ranges
from experiments.results_io import check_writable_folder
from megaslide.config import from_dict, require_seed
from megaslide.device import precision_dtype
from megaslide.inference.launch import shutdown
from megaslide.inference.outputs import save_latents
from megaslide.inference.weights import caption_input, load_model


def check_inputs(c: dict) -> None:
    """The keys of a generate_* config that the sampler does not check itself, refused (ValueError naming the key
    and the fix) before any process group, model or noise: the noise shape (frames, height, width: integers >= 1),
    the seed (an integer in [0, 2**63)), the caption (one string) and `out` (a file path in a folder this user can
    write, not a folder), so that a run never ends in a traceback at its first write, after sampling."""
    for key in ("frames", "height", "width", "seed"):
        if isinstance(c[key], bool) or not isinstance(c[key], int):
            raise ValueError(f"{key}={c[key]!r} must be an integer; see experiments/conf/ for its meaning and default")
    require_ranges(SimpleNamespace(**c), positive=("frames", "height", "width"))
    require_seed(c["seed"], "seed")
    if not isinstance(c["caption"], str):
        raise ValueError(f"caption={c['caption']!r} must be one caption (a string), e.g. 'caption=a red circle "
                         f"moving left'")
    if Path(c["out"]).is_dir():
        raise ValueError(f"out={c['out']!r} is a folder; give the file to write the latents to, e.g. "
                         f"out={Path(c['out']) / 'latents.pt'}")
    check_writable_folder(c["out"], "out", of_file=True)


def build_inputs(c: dict, device: torch.device):
    """(model, noise (1, C, T, H, W), the caption as ids (1, L) or embeddings (`caption_input`)), the same on
    every rank, from a generate_* config."""
    model = load_model(model_config(c["model"], c["attention"]), checkpoint=c["checkpoint"], seed=c["seed"],
                       device=device, dtype=precision_dtype(c["dtype"], device, key="dtype"))
    gen = torch.Generator().manual_seed(c["seed"])
    noise = torch.randn(1, model.cfg.in_channels, c["frames"], c["height"], c["width"], generator=gen)
    return model, noise, caption_input(model, [c["caption"]], device)


def sampler_config(cls, c: dict):
    """The sampler's typed config from the keys of the Hydra config that name its fields."""
    return from_dict(cls, {f.name: c[f.name] for f in dataclasses.fields(cls) if f.name in c})


def write_and_leave(ctx, out: str, latents: torch.Tensor) -> None:
    """Rank 0 writes the latents (and the video) with `save_latents` and prints each path; a write that fails (a
    full disk, a folder made read-only while the video was sampled) ends the run with `error: ...` and exit 1,
    never a traceback or a "wrote" line. Every rank leaves its process group either way."""
    try:
        if ctx.is_main:
            for path in save_latents(out, latents):
                print(f"wrote {path}", flush=True)
    except OSError as err:
        sys.exit(f"error: {err}")
    finally:
        shutdown(ctx)
