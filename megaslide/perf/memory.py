"""Memory accounting: peak HBM, host RSS, host RAM available, HBM capacity.

Host figures come from /proc (Linux), with `os.sysconf` as the fallback for the machine's
RAM, so nothing here needs psutil. Pinned bytes are not measured here: the offload engine
pins one arena and reports its size (`HostState.pinned_bytes`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

GB = 1e9


def _read_kib_field(path: str, field: str) -> int | None:
    """Value in bytes of a `Field:   123 kB` line of a /proc file, or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_rss_bytes() -> int:
    """Resident set size of this process (VmRSS), 0 where /proc is missing."""
    return _read_kib_field("/proc/self/status", "VmRSS") or 0


def host_total_bytes() -> int:
    """Physical RAM of the machine."""
    total = _read_kib_field("/proc/meminfo", "MemTotal")
    if total is not None:
        return total
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_available_bytes() -> int:
    """RAM a new allocation can get without swapping (MemAvailable); free pages as fallback."""
    avail = _read_kib_field("/proc/meminfo", "MemAvailable")
    if avail is not None:
        return avail
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def hbm_available_bytes(device: torch.device, fraction: float = 0.0) -> int | None:
    """Device memory this process may still allocate: free memory, lowered to `fraction` of
    the card when a cap is set (as `torch.cuda.set_per_process_memory_fraction` enforces);
    None on a device without HBM accounting (CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    if fraction > 0:
        free = min(free, int(fraction * total) - torch.cuda.memory_reserved(device))
    return max(free, 0)


def peak_hbm_bytes(device: torch.device) -> int:
    """Peak bytes held by tensors on `device` since the last reset (0 on CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak_hbm(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.init()  # a fresh process has no allocator stats to reset until CUDA is initialised
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class MemoryReport:
    peak_hbm_GB: float     # torch.cuda.max_memory_allocated
    host_rss_GB: float     # VmRSS of this process (pinned pages included once touched)
    pinned_GB: float       # the engine's pinned arena

    def as_dict(self) -> dict:
        return asdict(self)


def memory_report(device: torch.device, pinned_bytes: int) -> MemoryReport:
    return MemoryReport(peak_hbm_bytes(device) / GB, host_rss_bytes() / GB, pinned_bytes / GB)
