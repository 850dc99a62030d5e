"""Which streamed blocks keep their self-attention output and lse (offload.keep_attention), and where.

Kept, a block's backward replays the attention output (B, N, D in the compute dtype) and its log-sum-exp (fp32,
per token and head) instead of re-running the attention forward (megaslide/attention/kept.py). Each kept block
holds `kept_block_bytes` from its forward to its backward: on the device, or in pinned host RAM, copied D2H in
the forward and brought back one block ahead of the backward. Host-kept blocks pass through the device, two at a
time (`STAGING_BLOCKS`: one being filled or used, one in flight). The planner (megaslide/perf/planner.py) places
them within the budgets left beside the rest of the step: the device first (no transfers), then host RAM, the
rest re-run. The device keeps the latest blocks and host RAM the ones before them, so the host-kept blocks pass
through the device before the first device-kept one is made and after the last one is freed: the device holds
`device_blocks` = max(device-kept, staging) of them at any time. The offload engine keeps exactly what the plan
says (megaslide/offload/kept_store.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from megaslide.config import DiTConfig

GB = 1e9
STAGING_BLOCKS = 2   # host-kept blocks on the device at once: the one in use and the one in flight


def kept_block_bytes(cfg: DiTConfig, tokens: int, act: int) -> int:
    """One block's kept attention for `tokens` tokens: the output (`act` bytes per element) and the fp32 lse."""
    return tokens * (cfg.dim * act + 4 * cfg.num_heads)


@dataclass(frozen=True)
class KeptAttentionPlan:
    """The streamed blocks by where their attention output and lse are kept: `gpu`, `host`, or `recompute`
    (the attention re-runs), each `block_bytes`; `reason` says why blocks re-run ("" when none do)."""

    mode: str
    gpu: tuple[int, ...] = ()
    host: tuple[int, ...] = ()
    recompute: tuple[int, ...] = ()
    block_bytes: int = 0
    reason: str = ""

    @property
    def gpu_bytes(self) -> int:
        return len(self.gpu) * self.block_bytes

    @property
    def host_bytes(self) -> int:
        return len(self.host) * self.block_bytes

    @property
    def device_blocks(self) -> int:
        """The most kept blocks on the device at once (module docstring)."""
        return max(len(self.gpu), STAGING_BLOCKS if self.host else 0)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "gpu": list(self.gpu), "host": list(self.host), "recompute": list(self.recompute),
                "bytes_per_block": self.block_bytes, "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes,
                "reason": self.reason}

    def line(self) -> str:
        return (f"kept attention ({self.mode}): gpu {list(self.gpu)}, host {list(self.host)}, recompute "
                f"{list(self.recompute)}; {self.block_bytes / GB:.2f} GB per block" +
                (f" ({self.reason})" if self.reason else ""))


def place_kept_attention(mode: str, streamed: int, block_bytes: int, *, hbm_free: int, host_free: int,
                         unable: str = "") -> KeptAttentionPlan:
    """Place the kept attention of blocks 0..streamed-1 (offload.keep_attention `mode`) in `hbm_free` device bytes
    and `host_free` host bytes (module docstring). `unable`: why the attention cannot be kept at all ("" if it
    can). "on" raises a ValueError naming the key unless every block is kept; "auto" keeps what fits."""
    blocks = tuple(range(streamed))
    if mode == "off" or not streamed:
        return KeptAttentionPlan(mode, recompute=blocks, block_bytes=block_bytes, reason="offload.keep_attention=off"
                                 if mode == "off" else "")
    if unable:
        if mode == "on":
            raise ValueError(f"offload.keep_attention=on, but {unable}; set offload.keep_attention=auto (re-run "
                             f"the attention where it cannot be kept) or off")
        return KeptAttentionPlan(mode, recompute=blocks, block_bytes=block_bytes, reason=unable)
    room = max(0, hbm_free) // block_bytes                 # kept blocks the device holds at once
    on_gpu = min(streamed, room)
    on_host = min(streamed - on_gpu, max(0, host_free) // block_bytes) if room >= STAGING_BLOCKS else 0
    kept = on_gpu + on_host
    if mode == "on" and kept < streamed:
        raise ValueError(f"offload.keep_attention=on: the attention output and lse of {streamed} blocks "
                         f"({block_bytes / GB:.2f} GB each) do not fit: free HBM holds {on_gpu} and free host RAM "
                         f"{on_host} beside the rest of the step; set offload.keep_attention=auto (keep what fits) "
                         f"or off, or use fewer tokens per step")
    gpu, host = blocks[streamed - on_gpu:], blocks[streamed - kept:streamed - on_gpu]
    reason = "" if kept == streamed else "no room left in HBM or host RAM"
    return KeptAttentionPlan(mode, gpu, host, blocks[:streamed - kept], block_bytes, reason)
