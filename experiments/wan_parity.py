"""Does MegaSlide's Wan equal diffusers' at real size? fp32 parity of `load_pretrained` with
`diffusers.WanTransformer3DModel`, and the time to save and load a diffusers-format folder.

A seeded random `WanTransformer3DModel` of the `model` group's shapes (diffusers' own init: no weights are
downloaded) is saved with diffusers' `save_pretrained` into a temporary folder, loaded with
`megaslide.models.load_pretrained`, and both run in fp32 with TF32 off on one clip: the forward at
`frames x height x width` latents, the forward and backward at the smaller `grad_*` clip (diffusers keeps
every activation). Each row gives the largest error relative to diffusers' largest magnitude, over the
output, or over every parameter's gradient (the worst parameter named). Target: <= 1e-5.

Some gradients are sums with heavy cancellation (a cross-attention key bias), where diffusers' own fp32 result
is farther than 1e-5 from the exact one. So, with `exact=true`, a float64 copy of diffusers (its fp32 casts kept
at float64: `float64_reference`) gives the exact output and gradients, and each row also gives both fp32
models' error against it. The second rule, `within_exact_rule`: for the output and every parameter, ours is
no farther from the exact result than diffusers' fp32 is, plus the target. It follows from the first (the
triangle inequality) and forgives only what diffusers' own rounding does; the page shows both verdicts.
Configuration: experiments/conf/wan_parity.yaml.

    python -m experiments.wan_parity name=h200     # wan-1.3b shapes, 81 frames of 480p; one H200, a few minutes

Two fp32 copies of wan-14b with their gradients (about 230 GB) do not fit one GPU; the 1.3B shapes are the check.
"""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun, progress
from experiments.hydra_config import require_ranges, script_config, script_main
from experiments.report import markdown_table
from megaslide.config import DiTConfig
from megaslide.device import resolve_device
from megaslide.models import load_pretrained
from megaslide.models.wan import diffusers_config, to_diffusers

TARGET = 1e-5
WORST = 8   # parameters listed with their errors, the largest fp32 errors first


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
    exact: bool
    model: DiTConfig
    model_preset: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        """Sizes, the model (a wan block, which diffusers has) and the device, before a model is built or a run
        logged."""
        require_ranges(self, positive=("frames", "height", "width", "grad_frames", "grad_height", "grad_width",
                                       "text_len"))
        for keys in (("frames", "height", "width"), ("grad_frames", "grad_height", "grad_width")):
            self.model.token_grid(*(getattr(self, k) for k in keys), keys=keys)   # each clip patchifies
        diffusers_config(self.model)
        resolve_device(self.device)


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
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@contextlib.contextmanager
def float64_reference():
    """While open, `Tensor.float()` leaves a float64 tensor as it is. diffusers' Wan block and its
    `FP32LayerNorm` call `.float()` to compute in fp32 whatever the weights' dtype, which would round a float64
    run to fp32; with them widened, a float64 copy computes the same math exactly (to about 1e-15)."""
    narrow = torch.Tensor.float
    torch.Tensor.float = lambda self, *args, **kwargs: self if self.dtype == torch.float64 else narrow(self, *args,
                                                                                                      **kwargs)
    try:
        yield
    finally:
        torch.Tensor.float = narrow


def _verdicts(row: dict, fp32: dict[str, float], exact: dict[str, float] | None,
              theirs: dict[str, float] | None) -> dict:
    """`row` with the first rule's verdict on `fp32` (ours against diffusers' fp32, per output or parameter) and,
    given the float64 errors of ours (`exact`) and of diffusers' fp32 (`theirs`), the second rule's."""
    row["within_target"] = max(fp32.values()) <= TARGET
    if exact is not None:
        worst = max(exact, key=lambda k: exact[k] - theirs[k])
        row.update({"exact_err": max(exact.values()), "diffusers_exact_err": max(theirs.values()),
                    "worst_excess": exact[worst] - theirs[worst], "worst_excess_at": worst,
                    "within_exact_rule": all(exact[k] <= theirs[k] + TARGET for k in exact)})
    return row


def _grads(model: torch.nn.Module, run, seed: int, ours: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output of `run()` and every parameter's gradient of its random projection (out * w).sum(), in
    diffusers' names; w is drawn in fp32 from `seed` whatever the output's dtype, so every run gets the same."""
    model.zero_grad(set_to_none=True)
    out = run()
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)).sum().backward()
    if not ours:
        return out.detach(), {k: p.grad for k, p in model.named_parameters()}
    return out.detach(), {k: g for name, p in model.named_parameters() for k, g in to_diffusers(name, p.grad).items()}


def check(cfg: WanParityConfig) -> tuple[list[dict], list[dict], dict]:
    """The parity rows (forward, gradients), the parameters with the largest fp32 errors, and the timings of
    saving and loading the folder."""
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
    fwd_in = _inputs(cfg, cfg.frames, cfg.height, cfg.width, device, cfg.seed + 1)
    grad_in = _inputs(cfg, cfg.grad_frames, cfg.grad_height, cfg.grad_width, device, cfg.seed + 2)
    diffusers = lambda x, t, ctx: ref(hidden_states=x, timestep=t, encoder_hidden_states=ctx).sample   # noqa: E731
    with torch.no_grad():
        forward = _relative(model(*fwd_in), diffusers(*fwd_in))
    # ref's fp32 gradients, held here: the float64 pass below drops them from ref (set to None) before it converts
    out_want, want_grads = _grads(ref, lambda: diffusers(*grad_in), cfg.seed + 3, ours=False)
    out_got, got_grads = _grads(model, lambda: model(*grad_in), cfg.seed + 3, ours=True)
    fp32 = {k: _relative(g.reshape(want_grads[k].shape), want_grads[k]) for k, g in got_grads.items()}
    exact = theirs = None
    if cfg.exact:
        progress("float64 reference at the gradient clip: diffusers with its fp32 casts widened")
        del model
        ref.zero_grad(set_to_none=True)
        ref.double()
        with float64_reference():
            out_exact, exact_grads = _grads(ref, lambda: diffusers(*(v.double() for v in grad_in)), cfg.seed + 3,
                                            ours=False)
        exact = {"output": _relative(out_got, out_exact),
                 **{k: _relative(g.reshape(exact_grads[k].shape), exact_grads[k]) for k, g in got_grads.items()}}
        theirs = {"output": _relative(out_want, out_exact),
                  **{k: _relative(want_grads[k], exact_grads[k]) for k in got_grads}}
    rows = [_verdicts({"check": "forward", "token_grid": cfg.model.token_grid(*fwd_in[0].shape[2:]),
                       "max_rel_err": forward}, {"output": forward}, None, None)]
    worst = max(fp32, key=fp32.get)
    rows.append(_verdicts({"check": "gradients", "token_grid": cfg.model.token_grid(*grad_in[0].shape[2:]),
                           "output_rel_err": _relative(out_got, out_want), "max_rel_err": fp32[worst],
                           "worst_param": worst, "params": len(fp32)}, fp32, exact, theirs))
    params = [{"param": k, "fp32_rel_err": fp32[k], **({} if exact is None else {
        "exact_err": exact[k], "diffusers_exact_err": theirs[k]})} for k in sorted(fp32, key=fp32.get)[-WORST:][::-1]]
    return rows, params, {"save_s": saved - start, "load_s": loaded - saved, "device": str(device)}


@script_main("wan_parity")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(WanParityConfig, hydra_cfg)
    run = ExperimentRun("wan_parity", cfg.name, dataclasses.asdict(cfg), cfg.wandb_dir, cfg.wandb_project)
    rows, params, timing = check(cfg)
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "wandb_dir", "wandb_project")}
    run.finish({"config": {**config, "model": dataclasses.asdict(cfg.model)}, "target": TARGET, "rows": rows,
                "tables": {"worst_params": params}, "timing": timing},
               {f"max_rel_err/{r['check']}": r["max_rel_err"] for r in rows})
    print(markdown_table(rows))
    print(markdown_table(params))


if __name__ == "__main__":
    main()
