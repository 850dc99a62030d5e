"""Will a training run fit, and how fast can it go? The planner's prediction, before anything is allocated.

It composes train.py's config (experiments/conf/plan.yaml includes train.yaml), so it takes the
overrides of any train.py command and plans exactly the run that command makes: the offload engine's
host RAM, HBM and step time (`offload=engine`: the fitted estimate, whose error on the committed H200 steps
experiments/planner_error.py reports, and a lower bound from ceilings only), or the resident trainer's HBM.
`check=true` also compares the plan with this machine (MemAvailable, free HBM) and exits with status 1,
naming what does not fit, before anything is allocated.

    python -m experiments.plan model=7B model.in_channels=3 offload=engine data.frames=16 data.height=64 data.width=128
    python -m experiments.plan model=7B model.in_channels=3 offload=engine offload.resident_blocks=4
    python -m experiments.plan model=7B model.in_channels=3 offload=engine data.frames=64 execution.chunk_tokens=8192 \
        offload.activation_offload=true
    python -m experiments.plan model=105B model.in_channels=3 offload=engine check=true  # fails: what does not fit
    python -m experiments.plan model=1B attention=dsa model.in_channels=3 offload=engine train.device=cuda \
        offload.keep_attention=auto hbm_budget_GB=149 host_budget_GB=134   # where the kept attention goes on an H200
    python -m experiments.plan model=1B attention=dsa model.in_channels=3 offload=engine data.frames=256 \
        data.height=136 data.width=240 train.batch_size=1 execution.chunk_tokens=16320 execution.slab_frames=auto \
        offload.activation_offload=true train.precision=bf16 hbm_budget_GB=140   # the fewest slabs that fit
    python -m experiments.plan model=14B model.in_channels=3 offload=engine parallel.dp=2  # host GB per rank, node

With parallel.dp = P the plan is one rank's (its batch share, its 1/P shard of the block state) and the node's
host RAM holds `ranks_per_node` of them (default: all P on this node); host_budget_GB, where the kept attention
is placed, is the node's, shared by those ranks.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.hydra_config import require_ranges, run_config, script_main
from megaslide.config import SLAB_AUTO, RunConfig, from_dict
from megaslide.device import precision_dtype
from megaslide.perf.memory import hbm_available_bytes, host_available_bytes
from megaslide.perf.planner import (GB, Budgets, Ceilings, OffloadPlan, ResidentPlan, plan_offload, plan_resident,
                                    require_fit, resident_slabs)


@dataclass(frozen=True)
class PlanConfig:
    """The run train.py would make with the same overrides, and plan.yaml's own keys."""

    run: RunConfig
    check: bool
    ceilings: dict[str, float | None]
    ranks_per_node: int | None = None   # data parallel: the parallel.dp ranks on one node (None: all of them)
    hbm_budget_GB: float = 0.0     # the budgets of the kept attention and of slab_frames=auto; 0: this machine's
    host_budget_GB: float = 0.0


def plan_config(cfg: DictConfig) -> PlanConfig:
    """plan.yaml's config: the RunConfig of its train.yaml part (validated, for any device) and its own keys."""
    c = OmegaConf.to_container(cfg, resolve=True)
    config = from_dict(PlanConfig, {"run": run_config(c, check_device=False), "check": c["check"],
                                    "ranks_per_node": c["ranks_per_node"], "ceilings": c["ceilings"],
                                    "hbm_budget_GB": c["hbm_budget_GB"], "host_budget_GB": c["host_budget_GB"]})
    stated_ceilings(config)   # refused here, whatever the run (a resident plan uses none)
    require_ranges(config, non_negative=("hbm_budget_GB", "host_budget_GB"))
    return config


def stated_ceilings(cfg: PlanConfig) -> Ceilings:
    """The planner's ceilings with the ones plan.yaml's `ceilings` states (null: the default), each checked."""
    return Ceilings(**{k: v for k, v in cfg.ceilings.items() if v is not None})


def run_device(run: RunConfig) -> torch.device:
    """The device the run trains on: train.device, with auto as train.py resolves it here."""
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(auto if run.train.device == "auto" else run.train.device)


def make_plan(cfg: PlanConfig) -> OffloadPlan | ResidentPlan:
    """The plan of the run: the offload engine's with offload.enabled, else the resident trainer's."""
    run = cfg.run
    device = run_device(run)
    dtype = precision_dtype(run.train.precision, device)
    budgeted = run.offload.keep_attention != "off" or run.execution.slab_frames == SLAB_AUTO
    autocast = dtype == torch.bfloat16
    if not run.offload.enabled:
        run = resident_slabs(run, budgets(cfg, device).hbm, autocast=autocast) if budgeted else run
        return plan_resident(run, autocast=autocast)
    return plan_offload(run, param_dtype=dtype, ceilings=stated_ceilings(cfg),
                        build_on_host=run.offload.builds_on_host(run.model), ranks_per_node=cfg.ranks_per_node,
                        budgets=budgets(cfg, device) if budgeted else None)


def budgets(cfg: PlanConfig, device: torch.device) -> Budgets:
    """The HBM and host RAM that the kept attention and execution.slab_frames=auto are planned within: the stated
    budgets, else this machine's."""
    hbm = int(cfg.hbm_budget_GB * GB) or hbm_available_bytes(device)
    if not hbm:
        keys = [f"offload.keep_attention={cfg.run.offload.keep_attention}"] * (cfg.run.offload.keep_attention != "off")
        keys += [f"execution.slab_frames={SLAB_AUTO}"] * (cfg.run.execution.slab_frames == SLAB_AUTO)
        raise ValueError(f"{' and '.join(keys)} {'is' if len(keys) == 1 else 'are'} planned within an HBM budget, and "
                         f"this machine has no {device.type} device to measure: set hbm_budget_GB (e.g. 140 for the "
                         f"free HBM of an H200)")
    return Budgets(hbm, int(cfg.host_budget_GB * GB) or host_available_bytes(), device.type)


def report(cfg: PlanConfig) -> int:
    """Print the plan; with `check`, 1 when it does not fit this machine (saying what), else 0."""
    plan = make_plan(cfg)
    print(plan.table())
    if not cfg.check:
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        require_fit(plan, device, cfg.run.offload.gpu_memory_fraction)
    except ValueError as err:
        print(f"does not fit this machine: {err}")
        return 1
    print(f"fits this machine ({device.type})")
    return 0


@script_main("plan")
def main(cfg: DictConfig) -> None:
    sys.exit(report(plan_config(cfg)))


if __name__ == "__main__":
    main()
