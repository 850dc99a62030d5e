"""Data-parallel scaling of the sharded offload engine (issue 37, item 4): 1 GPU against P GPUs at the 7B width with
32K tokens per GPU, the collectives' bandwidth measured in the same run, and 4, 8, 16 GPUs and two nodes predicted.

Launched under torchrun on one node of P GPUs (P = the world size; NCCL, or gloo with smoke=true on CPU):
1. ceilings, in this run: PCIe each way (rank 0, CUDA) and the bus bandwidth of all-gather and reduce-scatter of one
   block's flat bf16 weights over the P ranks ((P-1)/P x bytes / time, the slowest rank's time);
2. one GPU: rank 0 trains the run with the unsharded engine (train.batch_size = clips_per_gpu clips) while the
   other ranks wait: the step time and its breakdown (compute, H2D, D2H, CPU AdamW) and the engine's host state.
   Skipped with one_gpu=false, or refused when one process cannot hold the model (its row is then the predicted
   one, with the reason): a model beyond one host's RAM that P ranks hold;
3. P GPUs: every rank trains its clips_per_gpu clips of the global batch with the engine sharded over the P ranks:
   the slowest rank's figures (each the largest over the ranks), the host state per rank;
4. the cost model, megaslide/perf/planner.py's step for one data-parallel rank (`plan_offload` with parallel.dp):
   max(compute, H2D + all-gather, D2H + reduce-scatter, CPU AdamW) with the ceilings measured here, compute taken
   from the one-GPU step (tokens per GPU are fixed; without one, the P-GPU step) and the AdamW rate from its
   optimizer time. It is checked
   against the P-GPU step measured here (`model_error`) and predicts 4, 8 and 16 GPUs on nodes of
   `gpus_per_node` and two nodes of this machine's P; rows that were not run say `measured: predicted`. Across
   nodes a collective runs at the smaller of the measured bus bandwidth and `inter_node_GBps`, a stated figure
   (this run has one node). The predicted host RAM per rank and node is the planner's: the host state and each
   process's reserve. Speedups: measured rows against the measured GPU, every row's `predicted_speedup_vs_1` against
   the predicted one.
With `reference=<an mfu_overlap result>` nothing runs (one process, no GPU needed): that result's one-GPU step
of the same model and tokens per GPU (its overlap variant: compute and CPU AdamW time, and its PCIe ceilings) stands
in for steps 1-2, `collective_GBps` is a stated bus bandwidth in place of a measured one, and every row is predicted:
the fallback when no machine with several GPUs is at hand.
Writes results/dp_scaling/<name>.json (tables: rows) and the W&B run (harness.ExperimentRun), from rank 0.

    torchrun --nproc-per-node=2 experiments/dp_scaling.py                 # 2 GPUs: 7B width, 32K tokens per GPU
    torchrun --nproc-per-node=2 experiments/dp_scaling.py model.depth=8   # fewer blocks: less host RAM and time
    torchrun --nproc-per-node=2 experiments/dp_scaling.py model=14B one_gpu=false name=h200_x2_14B  # beyond 125 GiB
    torchrun --nproc-per-node=2 experiments/dp_scaling.py smoke=true      # tiny, CPU (gloo)
    python experiments/dp_scaling.py model.depth=20 reference=results/mfu_overlap/h200_7Bwidth_d20_5steps.json \
        collective_GBps=247 name=h200_predicted_d20                        # predicted only, from a one-GPU step
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from experiments.harness import ExperimentRun, pcie_ceiling, progress
from experiments.hydra_config import (base_overrides, compose_run, require_ranges, script_config, script_main,
                                      trial_preset)
from experiments.step_runs import clip_fields, synthetic_batch
from megaslide.config import ParallelConfig, RunConfig
from megaslide.device import precision_dtype, resolve_device
from megaslide.offload.engine import OffloadEngine
from megaslide.parallel.data_parallel import DataParallel
from megaslide.parallel.mesh import init_training_mesh, leave_process_groups, world_size_from_env
from megaslide.perf import planner
from megaslide.perf.host_memory import block_layout, shard_numel
from megaslide.perf.timing import timed

GB = 1e9
SMOKE = {"model": {"preset": "tiny"}, "attention": {"name": "dense"}, "data": {"frames": 4, "height": 8, "width": 8},
         "train": {"device": "cpu"}, "warmup_steps": 1, "timed_steps": 2, "collective_repeats": 5,
         "predict_gpus": [4, 8]}


@dataclass(frozen=True)
class DPScalingConfig:
    """The keys of experiments/conf/dp_scaling.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    one_gpu: bool
    clips_per_gpu: int
    warmup_steps: int
    timed_steps: int
    collective_repeats: int
    pcie_probe_MiB: int
    predict_gpus: list[int]
    gpus_per_node: int
    inter_node_GBps: float
    reference: str
    collective_GBps: float
    wandb_dir: str
    wandb_project: str

    moved_keys: ClassVar[dict[str, str]] = {}

    def validate(self) -> None:
        for key in ("clips_per_gpu", "warmup_steps", "timed_steps", "gpus_per_node"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.collective_repeats < 5:
            raise ValueError(f"collective_repeats={self.collective_repeats} must be >= 5 (a median and a spread)")
        require_ranges(self, positive=("inter_node_GBps",), non_negative=("collective_GBps",))
        if any(p < 1 for p in self.predict_gpus):
            raise ValueError(f"predict_gpus={self.predict_gpus} must each be >= 1")
        if self.reference and not self.collective_GBps > 0:
            raise ValueError(f"reference={self.reference!r} predicts without measuring the collectives: give their "
                             f"bus bandwidth as collective_GBps=<GB/s per GPU> (> 0; with its source in your notes)")
        if self.reference and self.smoke:
            raise ValueError("smoke=true measures, reference= predicts only: drop one of them")


def collective_busbw(dp: DataParallel, numel: int, dtype: torch.dtype, device: torch.device,
                     repeats: int) -> dict[str, float]:
    """Bus bandwidth (GB/s per rank: (P-1)/P x bytes over the slowest rank's median time) of all-gather and
    reduce-scatter of a flat block of `numel` elements (padded to whole shards), as the sharded engine runs them."""
    shard = shard_numel(numel, dp.size)
    whole = torch.zeros(shard * dp.size, dtype=dtype, device=device)
    part = torch.zeros(shard, dtype=dtype, device=device)
    moved = (dp.size - 1) * shard * dtype.itemsize
    ops = {"all_gather": lambda: dist.all_gather_single(whole, part, group=dp.group),
           "reduce_scatter": lambda: dist.reduce_scatter_single(part, whole, group=dp.group)}
    return {f"{name}_GBps": moved / timed(op, device, repeats, group=dp.group, across_ranks=True).median / GB
            for name, op in ops.items()}


def train_steps(run: RunConfig, device: torch.device, dp: DataParallel, cfg: DPScalingConfig) -> dict:
    """Warm-up and timed steps of the engine on `run` (its train.batch_size is the global batch of dp): the
    slowest rank's per-step breakdown and this rank's host bytes."""
    train = dataclasses.replace(run.train, device=device.type)
    torch.manual_seed(train.seed)   # the same initial blocks on every rank
    engine = OffloadEngine.from_config(run.model, device=device, train_cfg=train, offload_cfg=run.offload,
                                       grid=run.grid, execution=run.execution, dp=dp)
    try:
        local = dataclasses.replace(run, train=dataclasses.replace(train, batch_size=cfg.clips_per_gpu))
        batch = synthetic_batch(local, device, engine.model.tokenizer)   # this rank's clips
        losses = [float(engine.train_step(batch, run.train.lr)["loss"]) for _ in range(cfg.warmup_steps)]
        engine.flush()
        first = engine.step
        losses += [float(engine.train_step(batch, run.train.lr)["loss"]) for _ in range(cfg.timed_steps)]
        times = engine.timings(range(first, engine.step))
        host_bytes = engine.host.total_bytes
    finally:
        engine.close()
        del engine
        gc.collect()
    slowest = torch.tensor(list(times.values()), dtype=torch.float64, device=device)
    if dp.group is not None:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=dp.group)
    return {**dict(zip(times, slowest.tolist())), "host_state_GB_per_rank": host_bytes / GB, "losses": losses}


def predict(run: RunConfig, gpus: int, per_node: int, ceilings: planner.Ceilings, compute_s: float,
            clips_per_gpu: int) -> dict:
    """The cost model's row for `gpus` data-parallel ranks, `per_node` on a node (module docstring, step 4)."""
    ranked = dataclasses.replace(run, parallel=ParallelConfig(dp=gpus),
                                 train=dataclasses.replace(run.train, batch_size=gpus * clips_per_gpu))
    plan = planner.plan_offload(ranked, param_dtype=torch.bfloat16, ceilings=ceilings, ranks_per_node=per_node)
    seconds = {**plan.seconds, "compute": compute_s}
    step = max(seconds.values())
    return {"gpus": gpus, "nodes": math.ceil(gpus / per_node), "predicted_step_s": step,
            "predicted_tokens_per_s": gpus * plan.tokens / step, "predicted_bound": max(seconds, key=seconds.get),
            "predicted_seconds": seconds, "predicted_host_GB_per_rank": plan.host_total / GB,
            "predicted_host_GB_per_node": plan.node_host_total / GB}


def one_gpu(run: RunConfig, device: torch.device, cfg: DPScalingConfig) -> dict:
    """The one-GPU step's figures (rank 0), or why there are none: `one_gpu=false`, or a model whose host state one
    process cannot hold (the planner refuses it before allocating; the P-GPU run may still hold it)."""
    if not cfg.one_gpu:
        return {"status": "not run (one_gpu=false)"}
    try:
        return train_steps(run, device, DataParallel.single(), cfg)
    except ValueError as err:
        return {"status": f"refused: {err}"}


REFERENCE_KEYS = ("dim", "depth", "num_heads", "ffn_dim", "qk_norm")   # what makes a block's work and its state


def reference_step(path: str, run: RunConfig, clips_per_gpu: int) -> tuple[dict, dict]:
    """The one-GPU step of an experiments/mfu_overlap.py result (its overlap variant) and its PCIe ceilings, after
    checking that it trained this run's blocks (REFERENCE_KEYS, the attention) on clips_per_gpu of this run's clips."""
    try:
        data = json.loads(open(path).read())
        model, bench = data["model_cfg"], data["bench"]
        overlap = next(v for v in data["variants"] if v["variant"] == "overlap")
    except (OSError, ValueError, KeyError, StopIteration) as err:
        raise ValueError(f"reference={path!r} is not an mfu_overlap result with an overlap variant ({err!r}); give "
                         f"one of results/mfu_overlap/*.json") from None
    ours = dataclasses.asdict(run.model)
    differ = [f"model.{k}={ours[k]} (the reference: {model[k]})" for k in REFERENCE_KEYS if model[k] != ours[k]]
    if model["attention"]["name"] != run.model.attention.name:
        differ.append(f"attention={run.model.attention.name} (the reference: {model['attention']['name']})")
    theirs = bench["batch"] * math.prod(run.model.token_grid(bench["frames"], bench["height"], bench["width"]))
    if theirs != clips_per_gpu * math.prod(run.grid):
        differ.append(f"{clips_per_gpu * math.prod(run.grid)} tokens per GPU (the reference: {theirs})")
    if differ:
        raise ValueError(f"reference={path!r} timed other work than this run: " + "; ".join(differ)
                         + ". Set those keys to match, or give a reference of this run's model")
    step = {k: overlap[k] for k in ("compute_s", "optimizer_s", "h2d_s", "d2h_s")}
    return {"step_time_s": overlap["step_s"], **step, "reference": path}, data["ceilings"]["pcie"]


def model_ceilings(reference: dict, ranks: int, run: RunConfig, busbw: dict, pcie: dict | None,
                   inter_node: float | None) -> planner.Ceilings:
    """The planner's ceilings from this run: PCIe each way, the CPU AdamW rate of the `reference` step (on `ranks`
    GPUs, each updating 1/ranks of the blocks), the smaller collective bus bandwidth (across nodes at most
    `inter_node`)."""
    base = planner.Ceilings()
    blocks = run.model.depth * block_layout(run.model).param_count / ranks
    collective = min(busbw.values()) if busbw else base.collective_GBps
    pcie = pcie or {"h2d_GBps": base.h2d_GBps, "d2h_GBps": base.d2h_GBps}
    adam = blocks / reference["optimizer_s"] / 1e9 if reference["optimizer_s"] > 0 else base.cpu_adam_gparams
    return dataclasses.replace(base, h2d_GBps=pcie["h2d_GBps"], d2h_GBps=pcie["d2h_GBps"], cpu_adam_gparams=adam,
                               collective_GBps=min(collective, inter_node) if inter_node else collective)


def measure(run: RunConfig, single_run: RunConfig, cfg: DPScalingConfig, world: int, name: str, config: dict
            ) -> tuple[ExperimentRun | None, dict, dict | None, dict[int, dict], dict | None]:
    """Steps 1-3 of the module docstring on this rank: (the W&B run, rank 0's only; the collectives' bandwidth; the
    PCIe ceilings; the measured steps by GPU count; the one-GPU figures or why there are none)."""
    device = resolve_device(run.train.device, key="train.device", local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if precision_dtype(run.train.precision, device) != torch.bfloat16 and not cfg.smoke:
        raise ValueError(f"train.precision={run.train.precision!r} on {device.type}: the scaling rows are bf16; "
                         f"use train.device=cuda (or smoke=true)")
    dp = DataParallel.of(init_training_mesh(run.parallel, device))
    exp = ExperimentRun("dp_scaling", name, config, cfg.wandb_dir, cfg.wandb_project, rank=dp.rank,
                        trial=cfg.smoke) if dp.is_main else None
    block = block_layout(run.model).numel
    pcie = pcie_ceiling(device, cfg.pcie_probe_MiB * 2 ** 20) if device.type == "cuda" and dp.is_main else None
    dtype = precision_dtype(run.train.precision, device)
    busbw = collective_busbw(dp, block, dtype, device, cfg.collective_repeats) if world > 1 else {}
    single = one_gpu(single_run, device, cfg) if dp.is_main else None
    dp.barrier()
    sharded = train_steps(run, device, dp, cfg) if world > 1 else None
    measured = {gpus: m for gpus, m in ((1, single), (world, sharded)) if m is not None and "step_time_s" in m}
    if exp is not None and not measured:
        raise ValueError(f"nothing was measured ({single['status']}): run on several GPUs, or with a model one "
                         f"process holds")
    return exp, busbw, pcie, measured, single


@script_main("dp_scaling")
def main(hydra_cfg: DictConfig) -> None:
    base = OmegaConf.merge(hydra_cfg, trial_preset(hydra_cfg, smoke=SMOKE) or {})   # the script's run and its own keys
    cfg = script_config(DPScalingConfig, base)
    world = world_size_from_env()
    if cfg.reference and world > 1:
        raise ValueError(f"reference={cfg.reference!r} predicts only: run it as one process (python, not torchrun "
                         f"with {world})")
    run = compose_run(base, [f"parallel.dp={world}", f"train.batch_size={world * cfg.clips_per_gpu}"])
    single_run = compose_run(base, [f"train.batch_size={cfg.clips_per_gpu}"])
    name = cfg.name or ("smoke" if cfg.smoke else f"h200_x{world}")
    config = {**clip_fields(run), "world": world, **dataclasses.asdict(cfg), "run_overrides": base_overrides(base)}
    if cfg.reference:   # nothing runs: the reference's one-GPU step and the stated collective bandwidth
        reference, pcie = reference_step(cfg.reference, single_run, cfg.clips_per_gpu)
        exp = ExperimentRun("dp_scaling", name, config, cfg.wandb_dir, cfg.wandb_project)
        busbw, measured, single, ranks = {"stated_GBps": cfg.collective_GBps}, {}, reference, 1
    else:
        exp, busbw, pcie, measured, single = measure(run, single_run, cfg, world, name, config)
        if exp is None:
            leave_process_groups()
            return
        # the model's calibration: the one-GPU step, else the P-GPU one (whose AdamW does 1/P of the blocks)
        ranks, reference = min(measured.items())
    intra, across = (model_ceilings(reference, ranks, run, busbw, pcie, cap) for cap in (None, cfg.inter_node_GBps))
    tokens = cfg.clips_per_gpu * math.prod(run.grid)
    rows = [] if 1 in measured else [{**predict(run, 1, 1, intra, reference["compute_s"], cfg.clips_per_gpu),
                                      "measured": "reference" if cfg.reference else "predicted", **(single or {})}]
    if cfg.reference:   # the reference's own step, which the model was calibrated on, beside its prediction
        rows[0]["model_error"] = abs(rows[0]["predicted_step_s"] - reference["step_time_s"]) / reference["step_time_s"]
    for gpus, m in measured.items():
        row = {**predict(run, gpus, gpus, intra, reference["compute_s"], cfg.clips_per_gpu),
               "measured": "run", **m, "tokens_per_s": gpus * tokens / m["step_time_s"]}
        row["model_error"] = abs(row["predicted_step_s"] - row["step_time_s"]) / row["step_time_s"]
        rows.append(row)
    counts = [2, *cfg.predict_gpus] if cfg.reference else cfg.predict_gpus
    predicted = [(g, min(g, cfg.gpus_per_node)) for g in counts] + ([] if cfg.reference else [(2 * world, world)])
    for gpus, per_node in predicted:
        ceilings = intra if gpus <= per_node else across
        rows.append({**predict(run, gpus, per_node, ceilings, reference["compute_s"], cfg.clips_per_gpu),
                     "measured": "predicted"})
    for row in rows:   # measured against the measured GPU, predicted against the predicted one
        if "tokens_per_s" in row and 1 in measured:
            row["speedup_vs_1"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["predicted_speedup_vs_1"] = row["predicted_tokens_per_s"] / rows[0]["predicted_tokens_per_s"]
    # a reference's PCIe was measured by its own run: kept apart, so that it is not counted as this run's measurement
    measured_pcie = {"pcie_of_reference": pcie} if cfg.reference else {"pcie": pcie}
    payload = {"config": config, "ceilings": {**measured_pcie, "collectives": busbw,
                                              "model_intra_node": dataclasses.asdict(intra),
                                              "model_inter_node": dataclasses.asdict(across)},
               "tables": {"rows": rows}}
    headline = {}
    if world in measured and world > 1:
        headline = {f"model_error_{world}gpu": rows[1]["model_error"], f"step_s_{world}gpu": rows[1]["step_time_s"]}
        if 1 in measured:
            headline.update({f"speedup_{world}gpu": rows[1]["speedup_vs_1"], "host_state_per_rank_ratio":
                             rows[1]["host_state_GB_per_rank"] / rows[0]["host_state_GB_per_rank"]})
    progress(f"rows {rows}")
    progress(f"wrote {exp.finish(payload, headline)}")
    leave_process_groups()


if __name__ == "__main__":
    main()
