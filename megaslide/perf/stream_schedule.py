"""The offload engine's streaming schedule, counted: which blocks the backward re-runs and recomputes, how
many block weights it copies host-to-device, how many block inputs it parks on the host and how many it
holds on the device. megaslide/offload/streamer.py runs this schedule (`backward_ops`); the planner
(megaslide/perf/planner.py) counts bytes and FLOPs with the same functions, so the two cannot drift."""
from __future__ import annotations


def backward_ops(streamed: int, stride: int) -> list[tuple[int, bool]]:
    """The backward's work on the streamed blocks 0..streamed-1, in order: (block, with grad). Segments
    [s, s+stride) in reverse; each but the last (whose inputs the forward kept) first re-runs the forward
    of s..s+stride-2 without grad, then every block of the segment is recomputed with grad, in reverse."""
    ops: list[tuple[int, bool]] = []
    last = last_segment_start(streamed, stride)
    for start in reversed(range(0, streamed, stride)):
        end = min(start + stride, streamed)
        if start < last:
            ops += [(index, False) for index in range(start, end - 1)]
        ops += [(index, True) for index in reversed(range(start, end))]
    return ops


def last_segment_start(streamed: int, stride: int) -> int:
    """The first block of the last segment (0 when nothing is streamed)."""
    return max(0, (streamed - 1) // stride * stride)


def weight_loads(depth: int, resident_blocks: int, stride: int = 1) -> int:
    """Block weight copies H2D in one training step: every block's in the forward, then those of the
    backward (`backward_ops`) that no shell holds, following `BlockStreamer.load`'s choice of shell. The
    forward leaves its last two streamed blocks in the shells; the resident tail never reloads."""
    streamed = depth - resident_blocks
    shells, busy, loads = [streamed - 2, streamed - 1], 1, depth
    for index, _ in backward_ops(streamed, stride):
        if index in shells:
            busy = shells.index(index)
        else:
            busy = 1 - busy
            shells[busy] = index
            loads += 1
    return loads


def parked_inputs(depth: int, resident_blocks: int, stride: int = 1) -> int:
    """How many block inputs a training step with activation offload parks on the host, each copied
    D2H in the forward and H2D in the backward: the segments' stored inputs (blocks 0, k, 2k, ... of
    the streamed ones) but the last two, which the backward starts with while they are still on the
    device."""
    streamed = depth - resident_blocks
    return max(0, -(-streamed // stride) - 2)


def inputs_on_device(depth: int, resident_blocks: int, stride: int, parked: bool) -> tuple[int, int, int]:
    """Saved block inputs on the device (entries of `SavedInputs.live`) in a training step: (after the
    forward, the most while a segment other than the last is recomputed, the most at any time). With
    `parked` (activation offload): the last segment's and the boundary before it after the forward; a
    segment's own while it runs, plus the next boundary brought back during its last block. Without:
    every kept input after the forward; the earlier boundaries beside a segment's own."""
    streamed = depth - resident_blocks
    if streamed == 0:
        return 0, 0, 0
    segments = -(-streamed // stride)
    last = streamed - last_segment_start(streamed, stride)      # inputs of the last segment
    if segments == 1:
        return last, 0, last
    if parked:
        after, middle = 1 + last, max(stride, 2 if segments > 2 else 0)
    else:
        after, middle = segments - 1 + last, segments - 2 + stride
    return after, middle, max(after, middle)
