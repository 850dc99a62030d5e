"""Training steps of a big model as train.py builds it (random init, or model.pretrained read block by block),
timed on one fixed synthetic clip: losses, step time and its parts, MFU, peak host RSS and HBM, and the
planner's host RAM and HBM beside them. Nothing is checkpointed or sampled: a 14B model's checkpoint would
not fit the device's disk. A run on a CPU is a trial: its result goes under runs/wan_step/<name>/results/, not
into the tracked results/ (unless MEGASLIDE_RESULTS_DIR says where). Configuration:
experiments/conf/wan_step.yaml (train.py's groups and overrides).

    python -m experiments.wan_step model=tiny model.block=wan offload=engine data.frames=4 timed=2   # CPU, seconds
    python -m experiments.wan_step model=wan-14b model.in_channels=3 model.text_encoder=true offload=engine \
        offload.init_on_host=false data.frames=21 data.height=60 data.width=104 train.batch_size=1 train.device=cuda
"""
from __future__ import annotations

import resource
import time

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.harness import ExperimentRun
from experiments.hydra_config import base_overrides, run_config, script_main
from experiments.plan import PlanConfig, make_plan
from experiments.step_runs import synthetic_batch
from megaslide.device import resolve_device
from megaslide.perf.flops import H200_DATASHEET_BF16_TFLOPS, dit_flops, mfu
from megaslide.perf.memory import GB
from megaslide.perf.timing import sync
from megaslide.train.trainer import build_engine, lr_at


@script_main("wan_step")
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(cfg, resolve=True)
    run = run_config(c)
    if c["warmup"] < 0 or c["timed"] < 1:
        raise ValueError(f"warmup={c['warmup']}, timed={c['timed']}: give warmup >= 0 and timed >= 1")
    plan = make_plan(PlanConfig(run, check=False, ceilings={}))
    device = resolve_device(run.train.device, key="train.device")
    experiment = ExperimentRun("wan_step", c["name"], config=c, trial=device.type != "cuda")
    torch.manual_seed(run.train.seed)
    start = time.perf_counter()
    engine = build_engine(run.model, run.train, run.offload, device=device, grid=run.grid, execution=run.execution)
    build_s = time.perf_counter() - start
    batch = synthetic_batch(run, device, engine.model.tokenizer)
    losses, seconds = [], []
    for step in range(c["warmup"] + c["timed"]):
        sync(device)
        start = time.perf_counter()
        out = engine.train_step(batch, lr_at(run.train, step))
        losses.append(out["loss"].item())
        sync(device)
        seconds.append(time.perf_counter() - start)
    step_s = sum(seconds[c["warmup"]:]) / c["timed"]
    flops = dit_flops(run.model, run.train.batch_size, run.grid).train
    result = {
        "run_overrides": base_overrides(run),   # python -m experiments.plan <them> plans this run
        "tokens": run.train.batch_size * run.grid[0] * run.grid[1] * run.grid[2], "build_s": build_s,
        "losses": losses, "step_s": step_s, "step_times_s": seconds,
        "timings": engine.timings(range(c["warmup"], c["warmup"] + c["timed"])),
        "mfu": mfu(flops, step_s, H200_DATASHEET_BF16_TFLOPS) if device.type == "cuda" else None,
        "peak_host_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
        "peak_hbm_GB": torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None,
        "plan_host_GB": plan.host_total / GB if run.offload.enabled else None,
        "plan_hbm_GB": plan.hbm_total / GB,
    }
    path = experiment.finish(result, {k: v for k, v in result.items() if isinstance(v, float)})
    engine.close()
    for key, value in result.items():
        print(f"{key:>18}: {value}")
    print(f"result: {path}")


if __name__ == "__main__":
    main()
