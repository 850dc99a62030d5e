"""Where the offload engine keeps its streamed blocks' attention output and lse (offload.keep_attention) from
the forward to the backward: on the device, or in pinned host RAM, as the plan places them
(megaslide/perf/kept_attention.py).

A host-kept block's tensors are copied D2H on the D2H lane once its forward is issued; the device copies are
dropped, once that copy is done, when the next block saves, so two blocks' worth pass through the device. In
the backward they come back on the H2D lane one block ahead (`prefetch`), each with its own strides, so that the
backward gets exactly what the forward made. The host buffers are carved from
one arena (`InputBuffers`), one buffer per host-kept block, sized by the first step."""
from __future__ import annotations

import torch

from megaslide.models.kept_attention import KeptAttention
from megaslide.offload.host_state import InputBuffers

ALIGN = 64  # bytes: each kept tensor starts on this boundary of its host buffer


def _span(tensors: list[torch.Tensor]) -> list[int]:
    """Byte offsets of `tensors` in one host buffer, then its length."""
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + -(-t.nbytes // ALIGN) * ALIGN)
    return offsets


class KeptStore:
    """The kept attention of the blocks `gpu` (on the device) and `host` (in `buffers`, one per block) of a
    training step; `lanes` are the engine's."""

    def __init__(self, lanes, gpu: tuple[int, ...], host: tuple[int, ...], pin: bool):
        self.lanes, self.gpu = lanes, set(gpu)
        self.slot = {index: slot for slot, index in enumerate(host)}    # host-kept block -> its buffer
        self.buffers = InputBuffers(len(host), pin)
        self.live: dict[int, list[torch.Tensor]] = {}     # block -> its kept tensors on the device
        self._outgoing: dict[int, tuple] = {}             # host-kept block -> (D2H done event, device tensors)
        self._specs: dict[int, list] = {}                 # host-kept block -> (host views) of its tensors
        self._stored: dict[int, object] = {}              # host-kept block -> event: its D2H is done
        self._read: dict[int, object] = {}                # host-kept block -> event: its H2D is done
        self.stored = {"gpu": 0, "host": 0}               # bytes kept by the last training forward, by place
        self.device_peak = 0                              # most kept bytes on the device at once, this step

    def keeps(self, index: int) -> bool:
        return index in self.gpu or index in self.slot

    def recorder(self, index: int) -> KeptAttention | None:
        """An empty `KeptAttention` for block `index`'s forward to record into, if it keeps its attention."""
        return KeptAttention() if self.keeps(index) else None

    def reset(self) -> None:
        """Before a training forward: forget the last step's (the backward released them)."""
        self._drop_outgoing()
        self.live.clear()
        self.stored = {"gpu": 0, "host": 0}
        self.device_peak = 0

    def save(self, index: int, kept: KeptAttention) -> None:
        """Keep block `index`'s recorded attention, computed by the work issued so far. The device copy of the
        host-kept block before it, made while this one was computed, is dropped: the device holds at most
        max(device-kept, 2) kept blocks at once (megaslide/perf/kept_attention.py)."""
        tensors = kept.tensors
        nbytes = sum(t.nbytes for t in tensors)
        self._count(nbytes)                        # made while the earlier ones were still held
        self._drop_outgoing()
        if index in self.gpu:
            self.live[index] = tensors
            self.stored["gpu"] += nbytes
            return
        slot, offsets = self.slot[index], _span(tensors)
        if offsets[-1] > self.buffers.capacity:
            self.lanes.synchronize()       # no transfer may still use the old buffers
            self.buffers.reserve(offsets[-1])
        d2h = self.lanes.d2h
        d2h.wait(self.lanes.compute.record())      # the tensors are computed
        d2h.wait(self._read.get(index))            # the last step's H2D out of the buffer is done
        views = [self._host_view(slot, offset, t) for offset, t in zip(offsets, tensors)]
        with d2h.timed(nbytes):
            for view, t in zip(views, tensors):
                view.copy_(t, non_blocking=True)
        self._specs[index] = views
        self._stored[index] = d2h.record()
        self._outgoing[index] = (self._stored[index], tensors)
        self.stored["host"] += nbytes

    def _count(self, nbytes: int) -> None:
        """Note `nbytes` more kept bytes on the device beside those held now."""
        held = [t for tensors in self.live.values() for t in tensors]
        held += [t for _, tensors in self._outgoing.values() for t in tensors]
        self.device_peak = max(self.device_peak, nbytes + sum(t.nbytes for t in held))

    def _host_view(self, slot: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        """Bytes [offset, offset + like.nbytes) of buffer `slot` as a tensor laid out like `like`."""
        flat = self.buffers.buffers[slot][offset:offset + like.nbytes].view(like.dtype)
        return flat.as_strided(like.shape, like.stride())

    def _drop_outgoing(self) -> None:
        """Drop the device copies of the host-kept blocks saved so far, once their D2H is done."""
        for index in list(self._outgoing):
            self.lanes.compute.wait(self._outgoing.pop(index)[0])

    def prefetch(self, index: int) -> None:
        """Start bringing host-kept block `index`'s attention back to the device, unless it is there or not kept."""
        if index not in self.slot or index in self.live:
            return
        self._drop_outgoing()
        compute, h2d = self.lanes.compute, self.lanes.h2d
        views = self._specs[index]
        device = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=self.lanes.device) for v in views]
        h2d.wait(compute.record())     # the memory they reuse is free
        h2d.wait(self._stored[index])
        with h2d.timed(sum(v.nbytes for v in views)):
            for dst, src in zip(device, views):
                dst.copy_(src, non_blocking=True)
        self._read[index] = h2d.record()
        self._count(sum(t.nbytes for t in device))
        self.live[index] = device

    def take(self, index: int) -> KeptAttention | None:
        """Block `index`'s kept attention on the device (later compute waits for its H2D), or None."""
        if not self.keeps(index):
            return None
        self.prefetch(index)
        if index in self.slot:
            self.lanes.compute.wait(self._read[index])
        return KeptAttention(*self.live[index])

    def release(self, index: int) -> None:
        """Block `index`'s backward has been issued: its kept attention is no longer needed."""
        self.live.pop(index, None)

    def close(self) -> None:
        self.buffers.close()
