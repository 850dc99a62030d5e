"""Will an offloaded run fit, and how fast can it go? The planner's prediction, before anything is allocated.

Prints host RAM, HBM and the step-time floor of `megaslide.offload.planner.plan_offload` for
the DiT of the `model` and `attention` groups at the given step size; `check=true` also
compares it with this machine (MemAvailable, free HBM) and exits with status 1, naming what
does not fit, before anything is allocated. Configuration: experiments/conf/plan.yaml.

    python -m experiments.plan model=7B                      # predicted host RAM, HBM and step-time floor
    python -m experiments.plan model=7B resident_blocks=4    # keep the last 4 blocks on the GPU
    python -m experiments.plan model=7B frames=64 model.chunk_tokens=8192 activation_offload=true
    python -m experiments.plan model=105B check=true         # fails with what does not fit
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from experiments.hydra_config import script_config, script_main
from megaslide.config import DiTConfig
from megaslide.offload.planner import Ceilings, OffloadPlan, plan_offload, require_fit

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class PlanConfig:
    """The keys of experiments/conf/plan.yaml (their meaning is documented there)."""

    batch: int
    frames: int
    height: int
    width: int
    precision: str
    optimizer_device: str
    grad_clip: bool
    resident_blocks: int
    activation_offload: bool
    check: bool
    ceilings: dict[str, float | None]
    model: DiTConfig
    model_preset: str


def make_plan(cfg: PlanConfig) -> OffloadPlan:
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision={cfg.precision!r}: choose one of {sorted(PRECISIONS)}")
    ceilings = Ceilings(**{k: v for k, v in cfg.ceilings.items() if v is not None})
    return plan_offload(cfg.model, batch=cfg.batch, grid=cfg.model.token_grid(cfg.frames, cfg.height, cfg.width),
                        param_dtype=PRECISIONS[cfg.precision], optimizer_device=cfg.optimizer_device,
                        grad_clip=cfg.grad_clip, resident_blocks=cfg.resident_blocks,
                        activation_offload=cfg.activation_offload, ceilings=ceilings)


def report(cfg: PlanConfig) -> int:
    """Print the plan; with `check`, 1 when it does not fit this machine (saying what), else 0."""
    plan = make_plan(cfg)
    print(plan.table())
    if not cfg.check:
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        require_fit(plan, device)
    except ValueError as err:
        print(f"does not fit this machine: {err}")
        return 1
    print(f"fits this machine ({device.type})")
    return 0


@script_main("plan")
def main(cfg: DictConfig) -> None:
    sys.exit(report(script_config(PlanConfig, cfg)))


if __name__ == "__main__":
    main()
