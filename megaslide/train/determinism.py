"""Seeding, and `train.deterministic`: a training run that gives the same bits every time at a fixed seed.

What a GPU run does differently from one run to the next at a fixed seed, and what deterministic mode does about it
(docs/quality_study.md, "Repeatability", says what each source did to the quality study):
- DSA's fused backward (megaslide/attention/dsa/backward.py): the key tiles' entry lists are filled through int32
  atomic cursors, so the order of the entries in a list, and with it the fp32 summation order of dK / dV, changes
  from run to run (the sums use no float atomics). Under `torch.use_deterministic_algorithms(True)` it builds the
  exact lists and sorts them, so every list is summed in one order.
- SDPA's backward (dense self-attention, cross-attention to the caption, Swin's windows): flash attention and the
  memory-efficient kernel add dQ over key blocks with float atomics, which varies once the keys span more than one
  block (dense's self-attention over the clip, not the short caption or a Swin window); cuDNN attention has no
  deterministic backward. Under the flag flash and memory-efficient take their deterministic backward, and SDPA
  does not pick cuDNN.
- cuDNN convolutions (the patch embedding): a weight-gradient algorithm may use atomics, and `cudnn.benchmark` picks
  algorithms by timing. The flag restricts cuDNN to deterministic algorithms; benchmark is turned off.
- cuBLAS: repeatable only with a fixed workspace config (`CUBLAS_WORKSPACE_CONFIG`), which cuBLAS and PyTorch read
  once per process, at its first cuBLAS call; under the flag PyTorch refuses a matmul without it.
- torch.compile (train.compile): Inductor times candidate configs of its reduction kernels and keeps the fastest,
  whose summation order may differ; under the flag it keeps one config without timing.
Left off: PyTorch's flag also fills every new tensor's memory (`torch.empty` and the like) with NaN, so that a read
of uninitialised memory repeats. MegaSlide's ops write what they allocate before they read it, so the fill, a pass
over every allocation of the step, makes nothing repeatable that was not; the mode turns it off
(`torch.utils.deterministic.fill_uninitialized_memory`). An op that did read such memory would show as two runs
that differ, which experiments/determinism.py checks on the GPU.
Fixed already, on and off: every batch (data indices, caption dropout, timesteps, noise) comes from (seed, step) on
the host (megaslide/diffusion/batches.py), the data sets take their seed from the config, the model is built on the
host under the seed, and MegaSlide's other kernels sum in a fixed order: the DSA forward, the zero-offset kernels
(zero_kernels.py), the offset net's depthwise conv (depthwise_kernels.py) and QK-norm + RoPE (qk_rope_kernels.py).
The study's runs in several processes (workers) each seed themselves. Process groups (NCCL, gloo) are outside this
mode: it is checked on one GPU.
"""
from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
"""The workspace configs with which cuBLAS gives the same bits every run (NVIDIA's cuBLAS docs, "Results
reproducibility"); the first is the one deterministic mode sets."""


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (seed mod 2**32, its range) and torch's global generators (CPU and every GPU)."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def fix_cublas_workspace() -> None:
    """Set CUBLAS_WORKSPACE_CONFIG to a deterministic config unless it holds one; a ValueError naming
    train.deterministic where it is too late (CUDA already started: cuBLAS may have read it) or set otherwise."""
    value = os.environ.get(CUBLAS_ENV)
    if value in CUBLAS_DETERMINISTIC:
        return
    if value is not None:
        raise ValueError(f"train.deterministic=true needs {CUBLAS_ENV} in {list(CUBLAS_DETERMINISTIC)}, but it is "
                         f"{value!r}: unset it or export {CUBLAS_ENV}={CUBLAS_DETERMINISTIC[0]}")
    if torch.cuda.is_initialized():
        raise ValueError(f"train.deterministic=true needs {CUBLAS_ENV}={CUBLAS_DETERMINISTIC[0]} before this process "
                         f"first uses CUDA (cuBLAS reads it once), and CUDA has started already: export "
                         f"{CUBLAS_ENV}={CUBLAS_DETERMINISTIC[0]} before starting, or train.deterministic=false")
    os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC[0]


@contextlib.contextmanager
def deterministic_mode(device: torch.device) -> Iterator[None]:
    """Inside: `torch.use_deterministic_algorithms(True)` (an op without a deterministic implementation raises),
    without its fill of new memory (module docstring), cuDNN deterministic without benchmarking and, on CUDA, a
    deterministic cuBLAS workspace (`fix_cublas_workspace`, which stays set: it cannot change once read). The
    switches are restored on exit."""
    if device.type == "cuda":
        fix_cublas_workspace()
    cudnn, fill = torch.backends.cudnn, torch.utils.deterministic
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              cudnn.deterministic, cudnn.benchmark, fill.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=False)
    cudnn.deterministic, cudnn.benchmark, fill.fill_uninitialized_memory = True, False, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        cudnn.deterministic, cudnn.benchmark, fill.fill_uninitialized_memory = before[2:]
