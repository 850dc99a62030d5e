"""Layer-wise streaming of DiT blocks through two device-side block shells.

Three lanes of work (`Lanes`): compute, host->device (H2D) and device->host (D2H), each a
CUDA stream on a GPU. CUDA events order them; the host never waits for the GPU inside the
loops. On a CPU device the same code runs: every op has finished when it returns, so the
lanes are plain contexts and events are no-ops; CI tests the scheduling logic this way.
`serial=True` (the overlap=False ablation) synchronises after every piece of work.

Two shells (double buffering): block l always computes in shell l % 2, a flat device
buffer whose views are block l's parameters (`BlockLayout.mount`). While block l computes,
block l +- 1 is copied into the other shell.
- forward (no grad): keeps only block inputs (`SavedInputs`: on the device, or with activation
  offload parked in pinned host memory and brought back one block ahead of the backward, so
  HBM holds about two block inputs whatever the depth);
- backward: re-streams blocks in reverse, computes block l's gradients from its saved input
  (`grad`: the runner's `block_grad`, which recomputes what it needs; not for a resident tail,
  below), and produces the gradients of its input,
  of the shared modulation t_mod and of the caption features ctx (summed over blocks in
  reverse order, as autograd sums them in a resident backward), the block's flat parameter
  gradient, and per-parameter gradient norms (on the device, for global-norm clipping). The
  flat gradient is sent D2H into the block's pinned staging buffer, and a callback hands it
  on to the optimizer.

Boundaries (`stride=k`, offload.boundary_stride): the forward keeps the inputs of blocks 0, k,
2k, ... only (and all inputs of the last segment, which the backward starts with). The backward
takes the streamed blocks segment by segment, [s, s+k) in reverse: it re-streams blocks s..s+k-2
and re-runs their forward without grad from the stored input of block s, keeping their outputs
(the inputs of blocks s+1..s+k-1) on the device, then recomputes and backpropagates s+k-1..s as
above. The same ops on the same inputs: the gradients equal stride 1's bit for bit. Host bytes of
parked inputs fall from about L to L/k block inputs, at the price of k-1 blocks' forward and H2D
per segment; the device holds a segment's k inputs at once (megaslide/perf/stream_schedule.py
counts all of this for the planner). Segments cover the
streamed blocks only: a resident tail (below) keeps its graphs and goes first, as with stride 1.

The shell a streamed block runs in is chosen as it is loaded: one already holding its current
weights, else the shell the block before it did not use. So consecutive blocks alternate shells
(the H2D of the next block overlaps this one's compute) also where the backward jumps from block s
to the re-run of block s-k.

Kept attention (`kept`, offload.keep_attention): the forward keeps the attention output and lse of the blocks
the plan names, on the device or parked in pinned host RAM (megaslide/offload/kept_store.py, which brings a
parked one back one block ahead of its backward), and a block's `grad` replays them instead of re-running its
attention forward (megaslide/models/chunking.py, "Kept attention"). They are this rank's activations, so data
parallel sharding (below) leaves them alone.

Sharded over data-parallel ranks (`group`, the host state's `Shard`): each rank's host holds 1/P of every
block. A load copies this rank's shard H2D and all-gathers the block into the shell on the device; a block's
flat gradient is reduce-scattered on the device (the replicas' mean: the ranks' sum over `replicas`, fewer than
the ranks when sequence-parallel ranks each give a part of a replica's gradient) and only this rank's shard goes
D2H. Every rank issues the same loads in the same order, so the collectives match.

Resident tail (`resident=k`, offload.resident_blocks): the last k blocks each get a shell of
their own and, in a training forward, run with grad enabled and keep their autograd graph.
They are the first blocks of the backward, which then neither re-streams nor recomputes
them: HBM traded for k blocks' H2D and recompute.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megaslide.models.block_grad import autograd_block_grad
from megaslide.models.kept_attention import KeptAttention
from megaslide.offload.host_state import BlockLayout, HostState, InputBuffers, Shard
from megaslide.offload.kept_store import KeptStore
from megaslide.perf.stream_schedule import backward_ops, last_segment_start


class DoneEvent:
    """A CUDA event's stand-in on the CPU, where all work is done when the call returns."""

    def synchronize(self) -> None:
        pass


class Lane:
    """One stream of work with busy-time and byte accounting."""

    def __init__(self, name: str, device: torch.device, stream, serial: bool):
        self.name, self.device, self.stream, self.serial = name, device, stream, serial
        self.tag: int | None = None     # training step the work belongs to (None: not accounted)
        self._spans: list = []          # (tag, start, end, bytes); start/end: CUDA events or perf_counter
        self._entered: list = []        # stream contexts entered, innermost last

    def __enter__(self):
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        self._entered.append(ctx)
        return ctx.__enter__()

    def __exit__(self, *exc):
        return self._entered.pop().__exit__(*exc)

    def record(self):
        """An event that completes when the work issued so far on this lane is done."""
        if self.stream is None:
            return DoneEvent()
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event) -> None:
        """Later work on this lane starts after `event` (no host wait)."""
        if self.stream is not None and event is not None and not isinstance(event, DoneEvent):
            self.stream.wait_event(event)

    def marker(self):
        """A timestamp on this lane: a timing event on a GPU, perf_counter on CPU."""
        if self.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    @contextlib.contextmanager
    def timed(self, nbytes: int = 0):
        """Run the body on this lane and add its span to the busy time."""
        with self:
            start = self.marker()
            yield
            end = self.marker()
        self._spans.append((self.tag, start, end, nbytes))
        if self.serial:
            self.synchronize()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def take_busy(self, steps: range) -> tuple[float, int]:
        """(seconds, bytes) of the work tagged with a step in `steps`; forgets all work of
        earlier steps. The lane must be idle (synchronised)."""
        mine = [s for s in self._spans if s[0] in steps]
        self._spans = [s for s in self._spans if s[0] is not None and s[0] >= steps.stop]
        return sum(elapsed(a, b) for _, a, b, _ in mine), sum(n for *_, n in mine)


def elapsed(start, end) -> float:
    """Seconds between two markers of `Lane.marker` (CUDA events must have completed)."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


class Lanes:
    """compute, h2d and d2h lanes. compute is the current stream, so tensors made by the
    caller need no extra ordering; h2d and d2h are side streams."""

    def __init__(self, device: torch.device, serial: bool):
        cuda = device.type == "cuda"
        self.device = device
        self.compute = Lane("compute", device, torch.cuda.current_stream(device) if cuda else None, serial)
        self.h2d = Lane("h2d", device, torch.cuda.Stream(device) if cuda else None, serial)
        self.d2h = Lane("d2h", device, torch.cuda.Stream(device) if cuda else None, serial)

    @property
    def tag(self) -> int | None:
        return self.compute.tag

    @tag.setter
    def tag(self, value: int | None) -> None:
        for lane in (self.compute, self.h2d, self.d2h):
            lane.tag = value

    @property
    def serial(self) -> bool:
        return self.compute.serial

    @serial.setter
    def serial(self, value: bool) -> None:
        for lane in (self.compute, self.h2d, self.d2h):
            lane.serial = value

    def synchronize(self) -> None:
        for lane in (self.compute, self.h2d, self.d2h):
            lane.synchronize()


class BlockShell:
    """Device buffers for one block at a time: weights (padded,) viewed by `params`, and the
    flat gradient (padded,) of the last block recomputed here (`padded`: the block's elements, padded to
    whole shards when sharded). Sharded, also this rank's shard of each: `stage` (the weights' H2D
    lands there, then the all-gather reads it) and `grad_shard` (the reduce-scatter's output)."""

    def __init__(self, layout: BlockLayout, device: torch.device, dtype: torch.dtype, shard: Shard):
        self.weights = torch.empty(shard.padded, device=device, dtype=dtype)
        self.grads = torch.zeros(shard.padded, device=device, dtype=dtype)
        sharded = shard.ranks > 1
        self.stage = torch.empty(shard.numel, device=device, dtype=dtype) if sharded else None
        self.grad_shard = torch.empty(shard.numel, device=device, dtype=dtype) if sharded else None
        self.params = [nn.Parameter(v) for v in layout.views(self.weights)]
        self.holds: tuple[int, int] | None = None  # (block, version) now in `weights`
        self.ready = None       # event: the H2D of `holds` is done
        self.free = None        # event: compute is done with `weights`
        self.grads_free = None  # event: `grads` may be overwritten (its D2H is done)


@dataclass
class BlockInputs:
    """What every block call needs besides its input tokens."""

    t_mod: torch.Tensor                      # (B, R, D)
    ctx: torch.Tensor                        # (B, L, D)
    ctx_mask: torch.Tensor                   # (B, L)
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (N, d/2)
    grid: tuple[int, int, int]


@dataclass
class BackwardResult:
    grad_x: torch.Tensor                     # (B, N, D) gradient of the first block's input
    grad_t_mod: torch.Tensor                 # (B, R, D) summed over blocks
    grad_ctx: torch.Tensor                   # (B, L, D) summed over blocks
    norms: list[dict[int, torch.Tensor]]     # per block: parameter slot -> () gradient norm (fp32); unsharded
    shard_squares: list[torch.Tensor]        # sharded: per block () fp32, the squared norm of this rank's
                                             # shard of the replicas' mean gradient (its D2H source)


class SavedInputs:
    """The block inputs that a training forward keeps for the backward's recompute, with those the
    backward's re-run adds (see `inputs_on_device` for how many are on the device when).

    The forward keeps the inputs of blocks 0, k, 2k, ... (k = `stride`) and of the whole last segment
    (from `last`). Without `host` each stays on the device until its block's backward. With `host`
    (offload.activation_offload) the input of block j*k, j < host.count, goes to host buffer j on the
    D2H lane while its block computes, and comes back on the H2D lane during the last block of the
    segment after it, beside the weight prefetch. `live` holds the inputs on the device:
    - forward: before input l is saved, compute waits for the D2H of any parked input <= l-2, which
      is then dropped (its copy overlapped at least blocks l-2 and l-1);
    - backward: a parked input is allocated on the compute lane as the block before it in the
      backward begins, filled on the H2D lane while that block recomputes, and dropped after its own
      block's backward; the re-run's outputs (`hold`) stay until their blocks' backward.
    The next forward rewrites a host buffer only after the H2D that read it."""

    def __init__(self, lanes: Lanes, host: InputBuffers | None, stride: int = 1, last: int = 0):
        self.lanes, self.host, self.stride, self.last = lanes, host, stride, last
        self.live: dict[int, torch.Tensor] = {}   # block -> its input on the device
        self.peak = 0                              # most entries of `live` at once since `reset`
        parked = host.count if host is not None else 0
        self._parked: list[torch.Tensor | None] = [None] * parked  # buffer j -> block j*k's input in it
        self._stored: list = [None] * parked       # buffer j -> event: its D2H is done
        self._read: list = [None] * parked         # buffer j -> event: its H2D is done (it may be rewritten)

    def keeps(self, index: int) -> bool:
        """Whether the forward saves block `index`'s input (a streamed block's)."""
        return index % self.stride == 0 or index >= self.last

    def parks(self, index: int) -> bool:
        return index % self.stride == 0 and 0 <= index // self.stride < len(self._parked)

    def reset(self, like: torch.Tensor) -> None:
        """Before a training forward whose block inputs are like `like` (B, N, D)."""
        for index in [i for i in self.live if self.parks(i)]:
            self._drop(index)
        self.live.clear()
        if self.host is not None and like.nbytes > self.host.capacity:
            self.lanes.synchronize()  # no transfer may still use the old buffers
            self.host.reserve(like.nbytes)
        self.peak = 0

    def _add(self, index: int, x: torch.Tensor) -> None:
        self.live[index] = x
        self.peak = max(self.peak, len(self.live))

    def _drop(self, index: int) -> None:
        self.lanes.compute.wait(self._stored[index // self.stride])  # the D2H has read it; its memory may be reused
        del self.live[index]

    def save(self, index: int, h: torch.Tensor) -> None:
        """Keep block `index`'s input h (B, N, D), computed by the work issued so far."""
        for done in [i for i in self.live if self.parks(i) and i <= index - 2]:
            self._drop(done)
        self._add(index, h)
        if not self.parks(index):
            return
        d2h, slot = self.lanes.d2h, index // self.stride
        d2h.wait(self.lanes.compute.record())  # h is computed
        d2h.wait(self._read[slot])             # the last step's H2D out of the buffer is done
        dst = self._parked[slot] = self.host.view(slot, h)
        with d2h.timed(h.nbytes):
            dst.copy_(h, non_blocking=True)
        self._stored[slot] = d2h.record()

    def hold(self, index: int, h: torch.Tensor) -> None:
        """Keep block `index`'s input h (B, N, D), re-run in the backward, on the device until its backward."""
        self._add(index, h)

    def prefetch(self, index: int) -> None:
        """Start bringing block `index`'s input back to the device, unless it is there."""
        if index in self.live or not self.parks(index):
            return
        compute, h2d, slot = self.lanes.compute, self.lanes.h2d, index // self.stride
        src = self._parked[slot]
        x = torch.empty_like(src, device=self.lanes.device)  # (B, N, D), allocated on the compute lane
        h2d.wait(compute.record())       # the memory x reuses is free
        h2d.wait(self._stored[slot])
        with h2d.timed(x.nbytes):
            x.copy_(src, non_blocking=True)
        self._read[slot] = h2d.record()
        self._add(index, x)

    def take(self, index: int) -> torch.Tensor:
        """Block `index`'s input (B, N, D) on the device; later compute waits for its H2D."""
        self.prefetch(index)
        if self.parks(index):
            self.lanes.compute.wait(self._read[index // self.stride])
        return self.live[index]

    def release(self, index: int) -> None:
        """Block `index`'s backward has been issued: its input is no longer needed."""
        del self.live[index]


def _kept(kept: KeptAttention | None) -> dict:
    """The `kept=` keyword of a block run or gradient, where the block keeps its attention."""
    return {} if kept is None else {"kept": kept}


class BlockStreamer:
    """Runs `blocks` (modules whose parameters get mounted here) from host weights.

    `before_load(l)` is called before block l's weights are copied in: the optimizer makes
    the copy wait for block l's pending update there. `version(l)` counts the updates
    submitted for block l, so a shell still holding the current weights is not reloaded.
    With `offload_inputs` the saved block inputs are parked in `host.inputs` (`SavedInputs`); `stride`
    is offload.boundary_stride (see the module docstring).
    `run(block, x, t_mod, ctx, ctx_mask, rope, grid)` runs a block (the model's `BlockRunner.block`:
    token chunks and frame slabs as the execution config says; default: the block whole), and
    `grad(block, x, t_mod, ctx, ctx_mask, rope, grid, grad_out, params)` gives a streamed block's gradients
    from its saved input (the model's `BlockRunner.block_grad`; default: autograd through `run` again).
    `kept` (offload.keep_attention): the blocks whose attention output and lse the forward keeps (`run` and
    `grad` then take `kept=`, as the runner's do) and where."""

    def __init__(self, blocks: nn.ModuleList, host: HostState, lanes: Lanes, device: torch.device,
                 compute_ctx: Callable[[], contextlib.AbstractContextManager],
                 before_load: Callable[[int], None], version: Callable[[int], int], resident: int = 0,
                 offload_inputs: bool = False, run: Callable[..., torch.Tensor] | None = None, stride: int = 1,
                 grad: Callable[..., tuple] | None = None, kept: KeptStore | None = None,
                 group: dist.ProcessGroup | None = None, replicas: int | None = None):
        self.run = run or (lambda block, *inputs: block(*inputs))
        self.grad = grad or functools.partial(autograd_block_grad, self.run)
        if not 0 <= resident <= len(blocks):
            raise ValueError(f"offload.resident_blocks={resident} must be in [0, {len(blocks)}] (the model's depth)")
        if stride < 1:
            raise ValueError(f"offload.boundary_stride={stride} must be >= 1")
        if (group is not None) != (host.shard.ranks > 1):
            raise ValueError(f"the host state is sharded over {host.shard.ranks} ranks; pass their process group "
                             f"exactly when there are several")
        self.blocks, self.host, self.lanes, self.stride, self.group = blocks, host, lanes, stride, group
        self.replicas = host.shard.ranks if replicas is None else replicas   # a block gradient's sum over them
        self.compute_ctx, self.before_load, self.version = compute_ctx, before_load, version
        self.first_resident = streamed = len(blocks) - resident
        layout = host.layout
        self.shells = [BlockShell(layout, device, host.param_dtype, host.shard) for _ in range(2 + resident)]
        self._placed = [self.shells[2 + index - streamed] if index >= streamed else self.shells[index % 2]
                        for index in range(len(blocks))]  # block -> the shell it is mounted on
        self._busy = self.shells[1]                        # the streamed shell chosen last
        for index, block in enumerate(blocks):
            layout.mount(block, self._placed[index].params)
        self.inputs = SavedInputs(lanes, host.inputs if offload_inputs else None, stride,
                                  last_segment_start(streamed, stride))
        self.kept = kept or KeptStore(lanes, (), (), pin=False)

    def shell(self, index: int) -> BlockShell:
        """The shell block `index` computes in (chosen by its last `load`)."""
        return self._placed[index]

    def _place(self, index: int, tag: tuple[int, int]) -> BlockShell:
        """Where block `index` runs next: its own shell in the resident tail; else a streamed shell that
        holds `tag` (its current weights), else the one the last streamed block chosen did not take. The
        block is mounted there."""
        if index >= self.first_resident:
            return self._placed[index]
        held = [shell for shell in self.shells[:2] if shell.holds == tag]
        self._busy = held[0] if held else self.shells[1] if self._busy is self.shells[0] else self.shells[0]
        if self._placed[index] is not self._busy:
            self.host.layout.mount(self.blocks[index], self._busy.params)
            self._placed[index] = self._busy
        return self._busy

    def invalidate(self) -> None:
        """Forget what the shells hold (after host weights changed outside the optimizer)."""
        for shell in self.shells:
            shell.holds = None

    def load(self, index: int) -> None:
        """Copy block `index`'s weights into its shell on the H2D lane, unless already there. Sharded: this rank's
        shard goes H2D into the shell's stage and the group all-gathers the block from the stages, ordered on
        the H2D lane (the collective waits for the copy; the lane's later work, and `shell.ready`, for it)."""
        tag = (index, self.version(index))
        shell = self._place(index, tag)
        if shell.holds == tag:
            return
        self.before_load(index)
        h2d = self.lanes.h2d
        h2d.wait(shell.free)
        src = self.host.blocks[index].weights
        with h2d.timed(src.numel() * src.element_size()):
            if self.group is None:
                shell.weights.copy_(src, non_blocking=True)
            else:
                shell.stage.copy_(src, non_blocking=True)
                dist.all_gather_single(shell.weights, shell.stage, group=self.group)
        shell.ready = h2d.record()
        shell.holds = tag

    @torch.no_grad()
    def forward(self, h: torch.Tensor, inp: BlockInputs, keep_inputs: bool) -> tuple[torch.Tensor, list]:
        """h (B, N, D) through all blocks -> (output (B, N, D), for the resident tail if
        `keep_inputs`: per block (input leaf, output with graph)). With `keep_inputs` the streamed
        blocks' inputs that the backward starts from go to `self.inputs` (`SavedInputs.keeps`)."""
        compute, kept = self.lanes.compute, []
        if keep_inputs:
            self.inputs.reset(h)
            self.kept.reset()
        self.load(0)
        for index, block in enumerate(self.blocks):
            shell = self.shell(index)
            tail = keep_inputs and index >= self.first_resident
            if keep_inputs and not tail and self.inputs.keeps(index):
                self.inputs.save(index, h)   # before the wait for the weights: its D2H needs only h
            compute.wait(shell.ready)
            with compute.timed(), self.compute_ctx():
                if tail:
                    x = h.detach().requires_grad_()
                    with torch.enable_grad():
                        out = self.run(block, x, inp.t_mod, inp.ctx, inp.ctx_mask, inp.rope, inp.grid)  # (B, N, D)
                    kept.append((x, out))
                    h = out.detach()
                else:
                    record = self.kept.recorder(index) if keep_inputs else None
                    h = self.run(block, h, inp.t_mod, inp.ctx, inp.ctx_mask, inp.rope, inp.grid,
                                 **_kept(record))                                             # (B, N, D)
                    if record is not None:
                        self.kept.save(index, record)
            shell.free = compute.record()
            if index + 1 < len(self.blocks):
                self.load(index + 1)
        return h, kept

    def backward(self, grad_h: torch.Tensor, kept: list, inp: BlockInputs, *, grads_to_host: bool,
                 on_block_grads: Callable[[int, BlockShell, object, list[bool]], None]) -> BackwardResult:
        """Gradients of a forward run with `keep_inputs`, which returned `kept`; `grad_h` (B, N, D)
        is the gradient of the last block's output. `inp.t_mod` and `inp.ctx` must be leaves that require grad.

        For each block, after its flat gradient is in `shell.grads`, and (if `grads_to_host`)
        once its D2H into the host staging buffer is issued: `on_block_grads(l, shell, landed,
        used)` with `landed` the event of that D2H (None without it) and `used[i]` whether
        parameter i got a gradient (one that did not is zero in `shell.grads`). Sharded (always with
        `grads_to_host`): on the D2H lane the group reduce-scatters `shell.grads` into this rank's shard, which
        is divided by the group size (the replicas' mean), its squared norm taken, and copied D2H; the
        compute lane waits for the last of these before this returns.

        The resident tail goes first, then the streamed blocks as `backward_ops` orders them: a
        segment's re-run (`_rerun`) before its blocks' backward."""
        compute, d2h, layout = self.lanes.compute, self.lanes.d2h, self.host.layout
        depth, stride = len(self.blocks), self.stride
        grad_t_mod = grad_ctx = None
        norms: list[dict[int, torch.Tensor]] = [{} for _ in range(depth)]
        squares: list[torch.Tensor] = [None] * depth
        ops = [(index, True) for index in reversed(range(self.first_resident, depth))]
        ops += backward_ops(self.first_resident, stride)
        streamed_grads = [index for index, grad in ops if grad and index < self.first_resident]
        self.load(ops[0][0])
        for position, (index, with_grad) in enumerate(ops):
            following = ops[position + 1][0] if position + 1 < len(ops) else None
            if not with_grad:
                self._rerun(index, inp)
                self.load(following)
                continue
            shell, block = self.shell(index), self.blocks[index]
            streamed = index < self.first_resident
            if streamed and index % stride == 0:
                self.inputs.prefetch(index - stride)  # first: its H2D waits only for the compute issued so far
            compute.wait(shell.ready)
            compute.wait(shell.grads_free)
            if streamed:
                x = self.inputs.take(index)                                                # (B, N, D)
                kept_attention = self.kept.take(index)
                following_grad = streamed_grads.index(index) + 1
                if following_grad < len(streamed_grads):
                    self.kept.prefetch(streamed_grads[following_grad])  # its H2D overlaps this backward
            else:
                x, out = kept[index - self.first_resident]                                 # kept graph
                kept[index - self.first_resident] = None  # its graph is freed once this backward returns
            with compute.timed():
                if streamed:
                    with self.compute_ctx():
                        grad_h, g_t_mod, g_ctx, param_grads = self.grad(
                            block, x, inp.t_mod, inp.ctx, inp.ctx_mask, inp.rope, inp.grid, grad_h, shell.params,
                            **_kept(kept_attention))
                else:
                    grads = torch.autograd.grad(out, [x, inp.t_mod, inp.ctx, *shell.params], grad_h,
                                                allow_unused=True)
                    grad_h, g_t_mod, g_ctx, param_grads = grads[0], grads[1], grads[2], grads[3:]
                grad_t_mod = g_t_mod if grad_t_mod is None else grad_t_mod + g_t_mod  # (B, R, D)
                grad_ctx = g_ctx if grad_ctx is None else grad_ctx + g_ctx             # (B, L, D)
                used = [g is not None for g in param_grads]
                present = [(slot, g) for slot, g in enumerate(param_grads) if g is not None]
                if self.group is None:
                    dtype = None if shell.grads.dtype == torch.float32 else torch.float32
                    block_norms = torch._foreach_norm([g for _, g in present], 2, dtype=dtype)
                    norms[index] = {slot: n for (slot, _), n in zip(present, block_norms)}
                views = layout.views(shell.grads)
                torch._foreach_copy_([views[slot] for slot, _ in present], [g for _, g in present])
                for slot, g in enumerate(param_grads):
                    if g is None:
                        views[slot].zero_()
            if streamed:
                self.inputs.release(index)
                self.kept.release(index)
            shell.free = grads_ready = compute.record()
            landed = None
            if grads_to_host:
                d2h.wait(grads_ready)
                dst = self.host.blocks[index].grads
                with d2h.timed(dst.numel() * dst.element_size()):
                    if self.group is None:
                        dst.copy_(shell.grads, non_blocking=True)
                    else:
                        squares[index] = self._reduce_scatter(shell)
                        dst.copy_(shell.grad_shard, non_blocking=True)
                landed = d2h.record()
            on_block_grads(index, shell, landed, used)
            shell.grads_free = landed if grads_to_host else compute.record()
            if following is not None:
                self.load(following)
        if self.group is not None:
            compute.wait(d2h.record())   # the shards' squared norms are computed
        return BackwardResult(grad_h, grad_t_mod, grad_ctx, norms, squares)

    def _reduce_scatter(self, shell: BlockShell) -> torch.Tensor:
        """On the current (D2H) lane: this rank's shard of the replicas' mean of `shell.grads` (the sum over the
        group's ranks / `replicas`) into `shell.grad_shard`; returns its squared norm () fp32."""
        dist.reduce_scatter_single(shell.grad_shard, shell.grads, group=self.group)   # the ranks' sum
        shell.grad_shard.div_(self.replicas)
        return torch.linalg.vector_norm(shell.grad_shard, dtype=torch.float32).square()

    def _rerun(self, index: int, inp: BlockInputs) -> None:
        """Block `index`'s forward again, without grad, from its saved input: its output is the next
        block's input, kept on the device for that block's backward."""
        compute, shell = self.lanes.compute, self.shell(index)
        x = self.inputs.take(index)                                                        # (B, N, D)
        compute.wait(shell.ready)
        with compute.timed(), torch.no_grad(), self.compute_ctx():
            out = self.run(self.blocks[index], x, inp.t_mod, inp.ctx, inp.ctx_mask, inp.rope, inp.grid)
        self.inputs.hold(index + 1, out)                                                   # (B, N, D)
        shell.free = compute.record()
