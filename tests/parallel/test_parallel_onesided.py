"""One-sided transport selection on CPU: the symmetric-memory path must decline with a reason and
"auto" must fall back to P2P. (The one-sided data path itself needs CUDA peers; the GPU benchmark
checks it against SDPA.)"""
from __future__ import annotations

import pytest
import torch

from megaslide.parallel.onesided import can_use_symm_mem, resolve_transport, symm_mem_backend


def test_cpu_tensors_decline_symm_mem():
    ok, reason = can_use_symm_mem(None, torch.device("cpu"))
    assert not ok and "cpu" in reason
    assert symm_mem_backend(torch.device("cpu")) is None  # no allocator to name off CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA branch")
def test_cuda_device_without_cuda_declines():
    ok, reason = can_use_symm_mem(None, torch.device("cuda", 0))
    assert not ok and "CUDA is not available" in reason


def test_resolve_transport_falls_back_or_explains():
    cpu = torch.device("cpu")
    assert resolve_transport("p2p", None, cpu) == "p2p"
    assert resolve_transport("auto", None, cpu) == "p2p"
    with pytest.raises(ValueError, match="transport='symm_mem' is unavailable here"):
        resolve_transport("symm_mem", None, cpu)
    with pytest.raises(ValueError, match="choose one of"):
        resolve_transport("nvshmem", None, cpu)
