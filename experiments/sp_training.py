"""A sequence-parallel training step of one clip on P GPUs (issue 37: SP on the 1B 256-frame clip).

Started by torchrun with P processes (or plain python for P = 1), it trains the run of train.py's groups
(experiments/conf/sp_training.yaml: 1B, DSA, 48 latent frames of 1080p) with parallel.sp = P on the resident
trainer and times the step (median and spread of `repeats`, the slowest rank's). In the same run it measures what
the cost model (megaslide/parallel/sp_cost.py) needs: one halo exchange of the busiest rank (forward and
backward) and the gradient all-reduce, as bandwidths. It fits the one-GPU blocks' time to the measured step and
predicts the step on `predict_gpus` GPUs at this clip and at `predict_frames` frames (DSA's work grows linearly
with the frames), each row marked `predicted`. Rank 0 writes results/sp_training/<name>.json.

With `offload=engine` the clip trains on the offload engine instead (its host state sharded over the ranks; the
clip may be longer than the resident trainer holds, e.g. data.frames=256 execution.slab_frames=auto): the step and
the halo exchange are measured, and no row is predicted (the cost model is the resident trainer's).

    python -m experiments.sp_training
    torchrun --standalone --nproc-per-node=2 -m experiments.sp_training
    torchrun --standalone --nproc-per-node=2 -m experiments.sp_training smoke=true     # CPU, gloo
    torchrun --standalone --nproc-per-node=2 -m experiments.sp_training offload=engine data.frames=256 \
        execution.slab_frames=auto
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.harness import ExperimentRun, progress
from experiments.hydra_config import compose_run, require_ranges, script_config, script_main
from experiments.step_runs import synthetic_batch
from megaslide.device import precision_dtype, resolve_device
from megaslide.models.dit import count_params
from megaslide.parallel.halo import exchange_halo
from megaslide.parallel.mesh import init_training_mesh, leave_process_groups, world_size_from_env
from megaslide.parallel.sp_cost import GB, predict_step, window_share, work_share
from megaslide.parallel.sp_train import ShardRunner
from megaslide.perf.timing import timed
from megaslide.train.trainer import build_engine

SMOKE = ["model=tiny", "data.frames=6", "data.height=8", "data.width=8", "execution.chunk_tokens=32",
         "train.device=cpu", "train.precision=fp32"]


@dataclass(frozen=True)
class SPTrainingConfig:
    """The keys of experiments/conf/sp_training.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    warmup_steps: int
    repeats: int
    predict_gpus: list[int]
    predict_frames: int
    gpus_per_node: int
    intra_node_GBps: float
    inter_node_GBps: float
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        if self.warmup_steps < 1 or self.repeats < 5:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 1 and repeats={self.repeats} >= 5")
        if min(self.predict_gpus, default=0) < 1 or self.predict_frames < 1 or self.gpus_per_node < 1:
            raise ValueError(f"predict_gpus={self.predict_gpus}, predict_frames={self.predict_frames} and "
                             f"gpus_per_node={self.gpus_per_node} must be >= 1 (predict_gpus non-empty)")
        require_ranges(self, positive=("intra_node_GBps", "inter_node_GBps"))


def measure_comm(engine, run, device, world: int) -> dict:
    """The busiest rank's halo exchange (forward + backward: two exchanges) and the gradient all-reduce, timed on
    the trained model; their bytes and bandwidths. Nothing on one rank."""
    if world == 1:
        return {}
    sp, model = engine.sp, engine.model
    block, (T, H, W) = model.blocks[0], run.grid
    runner = ShardRunner(model.runner, sp)
    windows, _ = runner.windows(block, T)
    shard = sp.shard
    dtype = engine.autocast_dtype or torch.float32
    x = torch.randn(1, shard.valid, run.model.dim, device=device, dtype=dtype, requires_grad=True)

    def exchange():
        y = exchange_halo(x, shard, windows, sp.group)
        y.backward(torch.ones_like(y))

    halo_frames = max((b - a) - (t1 - t0) for (a, b), (t0, t1) in zip(windows, map(shard.bounds, range(world))))
    frame_bytes = H * W * run.model.dim * dtype.itemsize
    exchange_s = timed(exchange, device, 5, across_ranks=True).median / 2
    halo = {"halo_frames": halo_frames, "frame_bytes": frame_bytes, "exchange_s": exchange_s,
            "link_GBps": halo_frames * frame_bytes / exchange_s / GB}
    if run.offload.enabled:   # its gradient sum is the reduce-scatter of each block's shards, on its D2H lane
        return halo
    params = list(model.parameters())
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    allreduce_s = timed(lambda: sp.reduce_gradients(params), device, 5, across_ranks=True).median
    return {**halo, "grad_bytes": grad_bytes, "allreduce_s": allreduce_s,
            "allreduce_busbw_GBps": 2 * (world - 1) / world * grad_bytes / allreduce_s / GB}


def predictions(cfg: SPTrainingConfig, run, world: int, step_s: float, comm: dict) -> list[dict]:
    """The cost model's steps on cfg.predict_gpus GPUs at this clip and at cfg.predict_frames frames, fitted to
    the measured step (its compute: the step less the measured exchanges and all-reduce)."""
    m, (T, H, W) = run.model, run.grid
    attn = m.attention
    reach = attn.variant.temporal_reach(attn.options)
    share = window_share(m, m.text_len)
    exchanges = m.depth * (3 if run.execution.checkpoint_blocks else 2)
    frame_bytes = H * W * m.dim * (2 if run.train.precision == "bf16" else 4)
    grad_bytes = comm.get("grad_bytes") or 4 * count_params(m)  # fp32 gradients
    measured = predict_step(world, compute_s=1.0, frames=T, reach=reach, share=share, frame_bytes=frame_bytes,
                            exchanges=exchanges, grad_bytes=grad_bytes, link_GBps=comm.get("link_GBps", 1.0),
                            allreduce_GBps=comm.get("allreduce_busbw_GBps", 1.0))
    compute_1gpu = max(step_s - measured.halo_s - measured.allreduce_s, 0.0) / work_share(T, world, reach, share)
    rows = []
    for frames in sorted({T, cfg.predict_frames // m.patch_size[0]}):  # token frames
        for gpus in cfg.predict_gpus:
            if gpus > frames:
                continue
            local = gpus <= cfg.gpus_per_node
            link = comm.get("link_GBps", cfg.intra_node_GBps) if local else cfg.inter_node_GBps
            bus = comm.get("allreduce_busbw_GBps", cfg.intra_node_GBps) if local else cfg.inter_node_GBps
            p = predict_step(gpus, compute_s=compute_1gpu * frames / T, frames=frames, reach=reach, share=share,
                             frame_bytes=frame_bytes, exchanges=exchanges, grad_bytes=grad_bytes, link_GBps=link,
                             allreduce_GBps=bus)
            rows.append({"status": "predicted", "gpus": gpus, "latent_frames": frames * m.patch_size[0],
                         "step_s": p.step_s, "compute_s": p.compute_s, "halo_s": p.halo_s,
                         "allreduce_s": p.allreduce_s, "nodes": -(-gpus // cfg.gpus_per_node)})
    for r in rows:
        one = next((o for o in rows if o["gpus"] == 1 and o["latent_frames"] == r["latent_frames"]), None)
        r["step_vs_1gpu"] = r["step_s"] / one["step_s"] if one else None
    return rows


def benchmark(cfg: SPTrainingConfig, hydra_cfg: DictConfig) -> None:
    world = world_size_from_env()
    run = compose_run(hydra_cfg, [*(SMOKE if cfg.smoke else []), f"parallel.sp={world}"])
    attn = run.model.attention
    if attn.variant.temporal_reach(attn.options) is None:
        raise ValueError(f"attention={attn.name}: the cost model of experiments/sp_training.py counts a halo of "
                         f"bounded reach; use attention=dsa or attention=dsa_zero")
    device = resolve_device(run.train.device, key="train.device", local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    mesh = init_training_mesh(run.parallel, device)
    rank = 0 if mesh is None else mesh.get_rank()
    clip = f"{hydra_cfg.model.preset}_{run.model.attention.name}_{run.data.frames}f"
    name = cfg.name or f"{'smoke' if cfg.smoke else clip}_{world}gpu"
    progress(f"sp_training: {world} rank(s), grid {run.grid}")
    torch.manual_seed(run.train.seed)
    engine = build_engine(run.model, run.train, run.offload, device=device, grid=run.grid, execution=run.execution,
                          mesh=mesh, parallel=run.parallel)
    batch = synthetic_batch(run, device, engine.model.tokenizer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    step = timed(lambda: losses.append(float(engine.train_step(batch, run.train.lr)["loss"])), device, cfg.repeats,
                 warmup=cfg.warmup_steps, across_ranks=world > 1)
    comm = measure_comm(engine, run, device, world)
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    measured = {"status": "measured", "gpus": world, "latent_frames": run.data.frames, "step_s": step.median,
                **step.ms(), "peak_hbm_GB": peak, "losses": losses, "tokens": math.prod(run.grid)}
    rows = [measured, *([] if run.offload.enabled else predictions(cfg, run, world, step.median, comm))]
    if rank == 0:
        payload = {"world_size": world, "engine": "offload" if run.offload.enabled else "resident",
                   "grid": list(run.grid), "device": str(device),
                   "dtype": str(precision_dtype(run.train.precision, device)), "comm": comm, "steps": rows,
                   "run": dataclasses.asdict(run)}
        out = ExperimentRun("sp_training", name, OmegaConf.to_container(hydra_cfg, resolve=True), cfg.wandb_dir,
                            cfg.wandb_project, trial=cfg.smoke)
        path = out.finish(payload, {"step_s": step.median})
        print(f"wrote {path}")
    engine.close()
    leave_process_groups()


@script_main("sp_training")
def main(cfg: DictConfig) -> None:
    benchmark(script_config(SPTrainingConfig, cfg), cfg)


if __name__ == "__main__":
    main()
