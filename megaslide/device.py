"""Device and precision choice, written once for training, sampling and distributed inference."""
from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, *, key: str = "device", local_rank: int = 0) -> torch.device:
    """"auto" -> cuda:local_rank if CUDA is available, else cpu; "cuda" -> cuda:local_rank.

    `key` is the config key the caller's user typed (e.g. `train.device`), so that an error
    names the user's own setting and how to fix it."""
    if name not in DEVICE_CHOICES:
        raise ValueError(f"{key}={name!r}: choose one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{key}=cuda but no CUDA device is visible; use {key}=cpu or {key}=auto")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                         f"start at most that many processes per node")
    return torch.device("cuda", local_rank)


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision_dtype(precision: str, device: torch.device, *, key: str = "train.precision") -> torch.dtype:
    """A precision setting as a dtype: "auto" is bf16 on CUDA and fp32 elsewhere. Training: the
    resident engine autocasts to it, the offload engine keeps its block weights in it; inference
    runs the model in it. `key` names the caller's setting in the error."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if precision not in PRECISIONS:
        raise ValueError(f"{key}={precision!r}: choose auto, {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]
