"""Does MegaSlide's Wan equal diffusers' at real size? fp32 parity of `load_pretrained` with
`diffusers.WanTransformer3DModel`, and the time to save and load a diffusers-format folder.

A seeded random `WanTransformer3DModel` of the `model` group's shapes (diffusers' own init: no weights are
downloaded) is saved with diffusers' `save_pretrained` into a temporary folder, loaded with
`megaslide.models.load_pretrained`, and both run in fp32 with TF32 off on one clip: the forward at
`frames x height x width` latents, the forward and backward at the smaller `grad_*` clip (diffusers keeps
every activation). Each row gives the largest error relative to diffusers' largest magnitude, over the
output, or over every parameter's gradient (the worst parameter named). Target: <= 1e-5.
Configuration: experiments/conf/wan_parity.yaml.

    python -m experiments.wan_parity name=h200     # wan-1.3b shapes, 81 frames of 480p; one H200, a few minutes

Two fp32 copies of wan-14b with their gradients (about 230 GB) do not fit one GPU; the 1.3B shapes are the check.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun, progress
from experiments.hydra_config import script_config, script_main
from experiments.report import markdown_table
from megaslide.config import DiTConfig
from megaslide.device import resolve_device
from megaslide.models import load_pretrained
from megaslide.models.wan import diffusers_config, to_diffusers

TARGET = 1e-5


@dataclass(frozen=True)
class WanParityConfig:
    """The keys of experiments/conf/wan_parity.yaml (their meaning is documented there)."""

    name: str
    device: str
    seed: int
    frames: int
    height: int
    width: int
    grad_frames: int
    grad_height: int
    grad_width: int
    text_len: int
    model: DiTConfig
    model_preset: str
    wandb_dir: str
    wandb_project: str


def _diffusers():
    try:
        import diffusers
    except ImportError:
        raise ImportError('experiments/wan_parity.py needs diffusers: pip install -e ".[wan]"') from None
    return diffusers


def _inputs(cfg: WanParityConfig, frames: int, height: int, width: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = cfg.model
    x = torch.randn(1, m.in_channels, frames, height, width, generator=g)
    context = torch.randn(1, cfg.text_len, m.text_dim, generator=g)
    return x.to(device), torch.tensor([731.0], device=device), context.to(device)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def check(cfg: WanParityConfig) -> tuple[list[dict], dict]:
    """The parity rows (forward, gradients) and the timings of saving and loading the folder."""
    device = resolve_device(cfg.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    config = {k: v for k, v in diffusers_config(cfg.model).items() if not k.startswith("_")}
    torch.manual_seed(cfg.seed)
    ref = _diffusers().WanTransformer3DModel(**config)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        ref.save_pretrained(folder)
        saved = time.perf_counter()
        model = load_pretrained(folder)
        loaded = time.perf_counter()
    progress(f"diffusers saved in {saved - start:.1f} s, load_pretrained read it in {loaded - saved:.1f} s")
    ref, model = ref.to(device), model.to(device)
    rows = []
    x, t, ctx = _inputs(cfg, cfg.frames, cfg.height, cfg.width, device, cfg.seed + 1)
    with torch.no_grad():
        want = ref(hidden_states=x, timestep=t, encoder_hidden_states=ctx).sample
        got = model(x, t, ctx)
    rows.append({"check": "forward", "token_grid": cfg.model.token_grid(*x.shape[2:]),
                 "max_rel_err": _relative(got, want)})
    del want, got
    x, t, ctx = _inputs(cfg, cfg.grad_frames, cfg.grad_height, cfg.grad_width, device, cfg.seed + 2)
    want = ref(hidden_states=x, timestep=t, encoder_hidden_states=ctx).sample
    weight = torch.randn_like(want)
    (want * weight).sum().backward()
    got = model(x, t, ctx)
    (got * weight).sum().backward()
    theirs = dict(ref.named_parameters())
    errors = {key: _relative(g.reshape(theirs[key].shape), theirs[key].grad)
              for name, p in model.named_parameters() for key, g in to_diffusers(name, p.grad).items()}
    worst = max(errors, key=errors.get)
    rows.append({"check": "gradients", "token_grid": cfg.model.token_grid(*x.shape[2:]),
                 "output_rel_err": _relative(got, want), "max_rel_err": errors[worst], "worst_param": worst,
                 "params": len(errors)})
    for row in rows:
        row["within_target"] = row["max_rel_err"] <= TARGET
    return rows, {"save_s": saved - start, "load_s": loaded - saved, "device": str(device)}


@script_main("wan_parity")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(WanParityConfig, hydra_cfg)
    run = ExperimentRun("wan_parity", cfg.name, dataclasses.asdict(cfg), cfg.wandb_dir, cfg.wandb_project)
    rows, timing = check(cfg)
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "wandb_dir", "wandb_project")}
    run.finish({"config": {**config, "model": dataclasses.asdict(cfg.model)}, "target": TARGET, "rows": rows,
                "timing": timing}, {f"max_rel_err/{r['check']}": r["max_rel_err"] for r in rows})
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
