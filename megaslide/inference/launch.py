"""Process-group setup for sequence-parallel inference under torchrun (or one plain process).

    torchrun --standalone --nproc_per_node 2 -m experiments.sp_inference

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), picks NCCL for CUDA and gloo for CPU, binds each rank to GPU LOCAL_RANK, and
turns NVLink multicast (NVLS) off before the first communicator exists: NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (the lent machines do not support it). A plain `python`
run (no WORLD_SIZE) gets a one-rank context with no process group.

Convention of the inference code: an SP `group` of None means "no sequence parallelism" (one
rank, no collectives); pass `ctx.group` (the world group) to shard over all ranks.
"""
from __future__ import annotations

import argparse
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None                 # "nccl" | "gloo" | None (one process, no group)
    group: dist.ProcessGroup | None     # the world group, or None without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, local_rank: int) -> torch.device:
    """"auto" -> cuda:LOCAL_RANK if CUDA is available, else cpu; "cuda" -> cuda:LOCAL_RANK."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}: choose auto, cpu or cuda")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu' (gloo)")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                         f"start at most that many processes per node")
    return torch.device("cuda", local_rank)


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the torchrun job described by the environment (or return a one-rank context)."""
    os.environ.update(MULTICAST_OFF)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return DistContext(0, 1, 0, dev, None, None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistContext(rank, world, local_rank, dev, backend, dist.group.WORLD)


def shutdown(ctx: DistContext) -> None:
    if ctx.backend is not None and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in an SP group; None (no sequence parallelism) counts as one."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside an SP group; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def barrier(ctx: DistContext) -> None:
    if ctx.backend is not None:
        dist.barrier()


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Command-line options shared by the generation entry points (`causal.main`, `full.main`)."""
    parser.add_argument("--preset", default="tiny", help="DiT preset with random weights (e.g. wan-1.3b)")
    parser.add_argument("--checkpoint", default="", help="a checkpoint of experiments/train.py instead of a preset")
    parser.add_argument("--frames", type=int, default=6, help="latent frames")
    parser.add_argument("--height", type=int, default=8, help="latent height")
    parser.add_argument("--width", type=int, default=8, help="latent width")
    parser.add_argument("--caption", default="a red circle moving left")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                        help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", default="latents.pt", help="where rank 0 saves the latents (B, C, T, H, W)")


def build_model(args: argparse.Namespace, ctx: DistContext):
    """(model, noise (1, C, T, H, W), caption ids (1, L)) from `add_model_args` options, the same on
    every rank: weights from the checkpoint, or seeded random weights for a preset."""
    from megaslide.config import DiTConfig, from_dict
    from megaslide.inference.sharded import random_weights_
    from megaslide.models.dit import VideoDiT, build_dit
    from megaslide.train.checkpoint import load_checkpoint

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
    if args.checkpoint:
        state = load_checkpoint(args.checkpoint)
        model = VideoDiT(from_dict(DiTConfig, state["model_cfg"]))
        model.load_state_dict(state["ema"] or state["model"])
        model.to(ctx.device)
    else:
        with torch.device(ctx.device):
            model = random_weights_(build_dit(args.preset), args.seed)
    model.to(dtype).eval()
    gen = torch.Generator().manual_seed(args.seed)
    noise = torch.randn(1, model.cfg.in_channels, args.frames, args.height, args.width, generator=gen)
    return model, noise, model.tokenizer([args.caption]).to(ctx.device)
