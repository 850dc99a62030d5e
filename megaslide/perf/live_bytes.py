"""Peak bytes of live tensors on any device: a measured stand-in for `torch.cuda.max_memory_allocated`
where there is no allocator to ask (CPU runs, CI).

`LiveTensorBytes` is a TorchDispatchMode: every storage an op creates while it is active is
counted, once, from its creation until it is freed (a weakref finalizer on the storage), rounded
up to the CUDA caching allocator's 512-byte blocks; views, in-place results and outputs that
alias an input add nothing. Tensors made before it was entered count only when `track`ed (the
state a step starts from). It sees the ops of the thread that entered it, so a worker thread's
work (the offload engine's CPU AdamW) is not counted. Kernels differ between devices: a CPU run
measures the CPU kernels' memory (e.g. DSA's gather backend, not the fused CUDA kernels).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this


class LiveTensorBytes(TorchDispatchMode):
    """with LiveTensorBytes() as live: ...  then live.peak (bytes), live.current."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage data_ptr -> counted bytes

    def reset_peak(self) -> None:
        self.peak = self.current

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors that exist already (each storage once)."""
        for t in tensors:
            self._add(t.untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._sizes:
            return
        size = -(-size // BLOCK) * BLOCK
        self._sizes[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._add(t.untyped_storage())
        return out
