"""Where does a training step go? Step time and the top operators per attention variant.

For each variant: build the reference Trainer on MovingShapes, warm up, time `--steps`
steps (synchronised), then run `torch.profiler` over two more and keep the operators
with the most device time (CPU time on a CPU run). Batches are made inside the step, so
the data cost is part of the step time.

    python experiments/profile_step.py --device cpu --dim 64 --depth 2 --frames 4 --size 16   # tiny
    python experiments/profile_step.py --device cuda --frames 16 --size 32 --batch 16         # GPU
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from experiments.report import markdown_table
from experiments.results_io import write_result
from megaslide.config import AttentionConfig, DataConfig, DiTConfig, TrainConfig
from megaslide.train.trainer import Trainer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_variant(name: str, args: argparse.Namespace) -> dict:
    model = DiTConfig(dim=args.dim, depth=args.depth, num_heads=args.heads, ffn_dim=4 * args.dim, text_dim=128,
                      attention=AttentionConfig(name, {"window": tuple(args.swin_window)} if name == "swin" else None))
    data = DataConfig(frames=args.frames, height=args.size, width=args.size, shape_size=max(3, args.size // 4),
                      speed=args.size / 5)
    train = TrainConfig(device=args.device, batch_size=args.batch, steps=10**9, log_every=10**9, compile=args.compile)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model, data, train, tmp)
        for _ in range(args.warmup):
            trainer.train_step()
        sync(trainer.device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step()
        sync(trainer.device)
        step_s = (time.perf_counter() - t0) / args.steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                trainer.train_step()
            sync(trainer.device)
    on_gpu = trainer.device.type == "cuda"
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events)
    top = [{"variant": name, "op": e.key[:60], "ms_per_step": getattr(e, key) / 2e3,
            "share": getattr(e, key) / total, "calls_per_step": e.count / 2} for e in events[:args.top]]
    t, h, w = model.token_grid(args.frames, args.size, args.size)
    return {"variant": name, "tokens_per_step": args.batch * t * h * w, "step_ms": 1e3 * step_s, "profiled_ms_per_step": total / 2e3,
            "top": top}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["dense", "swin", "dsa", "dsa_zero"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--size", type=int, default=32, help="frame height and width in pixels (patch 2)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--swin-window", type=int, nargs=3, default=[2, 4, 4])
    p.add_argument("--compile", action="store_true", help="train.compile: torch.compile each DiT block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (with --compile they include compiling)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--name", default="cpu_tiny")
    args = p.parse_args(argv)
    rows = [profile_variant(v, args) for v in args.variants]
    write_result("profile_step", args.name, {"config": vars(args), "rows": [{k: v for k, v in r.items() if k != "top"}
                                                                             for r in rows],
                                             "tables": {"top operators": [t for r in rows for t in r["top"]]}})
    print(markdown_table([t for r in rows for t in r["top"]]))
    print(markdown_table([{k: v for k, v in r.items() if k != "top"} for r in rows]))


if __name__ == "__main__":
    main()
