"""Preallocated, head-sharded KV cache for chunk-by-chunk generation.

Every block keeps k and v of shape (B, heads_local, slots * chunk_tokens, d), allocated once
(the kernel layout, so attention reads a prefix view with no copy). Under Ulysses sequence
parallelism a rank holds `heads_local = heads / P` heads of *every* token, so the cache never
moves between ranks.

Chunk c is written to slot c % slots, and a query chunk attends to the filled prefix of
min(c + 1, slots) slots, its own slot included. Keys carry RoPE already, and softmax does not
depend on the order of the keys, so a ring of slots needs no reordering:
- `window=None`: slots = num_chunks, chunk c sees chunks 0..c (block-causal). Writing past
  the last slot is an overflow (ValueError).
- `window=W`: slots = W + 1, chunk c sees chunks c-W..c (a banded block-causal mask), and
  generation may run for any number of chunks (the RoPE table still bounds the length).

The write position and the prefix length are Python ints set once per chunk by
`begin_chunk`, so a forward reads no device value. `host_sync=True` is the ablation: the fill
length lives in a device tensor that every layer reads back with `.item()`, as KV caches that
keep a device-side end index do; each read stalls the host until the GPU catches up.
"""
from __future__ import annotations

import math

import torch


class KVCache:
    def __init__(self, *, depth: int, batch: int, heads: int, head_dim: int, chunk_tokens: int,
                 num_chunks: int, window: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", host_sync: bool = False):
        """depth blocks; `heads` is this rank's head count (heads / P); chunk_tokens real tokens per chunk."""
        for name, value in (("depth", depth), ("batch", batch), ("heads", heads), ("head_dim", head_dim),
                            ("chunk_tokens", chunk_tokens), ("num_chunks", num_chunks)):
            if value < 1:
                raise ValueError(f"KVCache: {name}={value} must be >= 1")
        if window is not None and window < 1:
            raise ValueError(f"KVCache: window={window} must be >= 1 past chunks (or None for all of them)")
        self.depth, self.chunk_tokens, self.window = depth, chunk_tokens, window
        self.num_chunks = num_chunks
        self.slots = num_chunks if window is None else min(num_chunks, window + 1)
        self.host_sync = host_sync
        shape = (batch, heads, self.slots * chunk_tokens, head_dim)
        need = 2 * depth * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        _check_fits(need, torch.device(device), window)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(depth)]  # depth x (B, h, L, d)
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(depth)]  # depth x (B, h, L, d)
        self.nbytes = need
        self._end = torch.zeros((), dtype=torch.long, device=device)  # read back only when host_sync
        self.chunk = -1
        self.offset = 0   # first cache row of the current chunk's slot
        self.filled = 0   # slots a query of the current chunk attends to

    def reset(self) -> None:
        """Start a new video (old contents are overwritten before they are read)."""
        self.chunk, self.offset, self.filled = -1, 0, 0

    def begin_chunk(self, chunk: int) -> None:
        """Make `chunk` (global chunk index) the one that the next forwards write and attend from."""
        if chunk < 0:
            raise ValueError(f"KVCache.begin_chunk: chunk={chunk} must be >= 0")
        if self.window is None and chunk >= self.slots:
            raise ValueError(f"KV cache overflow: chunk {chunk} does not fit a cache of {self.slots} chunks; "
                             f"allocate num_chunks >= {chunk + 1} or set a sliding window")
        self.chunk = chunk
        self.offset = (chunk % self.slots) * self.chunk_tokens
        self.filled = min(chunk + 1, self.slots)
        if self.host_sync:
            self._end.fill_(self.filled * self.chunk_tokens)

    def write_and_view(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the current chunk's k, v (B, chunk_tokens, heads, d) of block `layer` in its slot and
        return the keys and values it attends to, (B, heads, filled * chunk_tokens, d) views."""
        if self.chunk < 0:
            raise ValueError("KVCache.write_and_view: call begin_chunk(chunk) first")
        if k.shape[1] != self.chunk_tokens or k.shape != v.shape:
            raise ValueError(f"KVCache.write_and_view: k, v must be (B, {self.chunk_tokens}, heads, d); got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        rows = slice(self.offset, self.offset + self.chunk_tokens)
        self.k[layer][:, :, rows].copy_(k.transpose(1, 2))  # (B, h, Nc, d)
        self.v[layer][:, :, rows].copy_(v.transpose(1, 2))  # (B, h, Nc, d)
        end = int(self._end.item()) if self.host_sync else self.filled * self.chunk_tokens
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def _check_fits(nbytes: int, device: torch.device, window: int | None) -> None:
    """ValueError before allocating a cache larger than the free memory of a CUDA device."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > free:
        hint = "a smaller window" if window is not None else "a sliding window (window=W past chunks)"
        raise ValueError(f"the KV cache needs {nbytes / 2**30:.2f} GiB but {device} has {free / 2**30:.2f} GiB "
                         f"free; use {hint}, fewer frames, or more sequence-parallel ranks")
