"""What every self-attention variant shares and what each one fills in.

Shared: the projections, QK-norm, RoPE and the output projection. A variant is one class
(registered in `megaslide.attention`) that owns:
- `name`, its registry name, and `Options`, a frozen dataclass of its own options whose
  `__post_init__` checks their values;
- `attend(q, k, v, x, grid)`, the token mixing itself, and `reads_input`, whether it reads
  x, the attention input (DSA's offset net does; a chunked block keeps x whole only then). A variant
  that reads x does so token-wise up to a halo along time, in `read_input(x, grid, t0, t1)` (frames
  [t0, t1)), and its `attend` also takes `read=`, that for all frames, which the chunk runner
  (megaslide/models/chunking.py) computes over runs of frames;
- `check_grid(options, grid)`, `keys_per_query(options, grid)`, `temporal_reach(options)`,
  `extra_macs_per_token(...)` and `attend_memory(...)`: what config validation, FLOP and
  activation-memory accounting need to know without building the module (parameters are counted
  on a meta-device build, `count_params`);
- optionally `keep_reason(options, device_type)` "" and `attend(..., keep=)`: the variant's op split at its
  softmax statistics, so that the offload engine's backward need not re-run it (megaslide/attention/kept.py).
Callers that need the projected heads (the KV-cached causal generator, sequence
parallelism) use `project_qkv` and `project_out` around their own attention.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from megaslide.nn import RMSNorm
from megaslide.nn.qk_rope import qk_norm_rope

Grid = tuple[int, int, int]
QK_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class AttendMemory:
    """What `attend` holds on the device in training, in bytes per video token (the offload planner's
    activation model, megaslide/perf/activation_memory.py, adds the block around it).

    keeps: how attend keeps q, k, v for its backward: "as_passed" (views included), "contiguous"
    (a strided one is copied first) or "none" (it keeps copies of its own, counted in `saved`);
    saved: everything else it keeps from forward to backward (output, lse, offsets, copies);
    forward, backward: what its forward (beyond `saved`) and its backward allocate at their peaks
    (intermediates, input gradients, accumulators);
    scratch, scratch_cap, heads: buffers that the backward keeps within `scratch_cap` bytes (0: no
    bound) by running whole heads at a time, at least one (DSA's fp32 ds, p and key-tile entry lists
    over head groups, dsa/backward.py)."""

    keeps: str
    saved: int
    forward: int
    backward: int
    scratch: int = 0
    scratch_cap: int = 0
    heads: int = 1

    def scratch_bytes(self, tokens: int) -> int:
        """The backward's scratch for `tokens` tokens, as its launches bound it."""
        total = self.scratch * tokens
        per_head = total // self.heads
        if not self.scratch_cap or not per_head:
            return total
        return min(total, max(1, self.scratch_cap // per_head) * per_head)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a variant that takes none."""


def option_triple(option: str, value, *, odd: bool = False) -> tuple[int, int, int]:
    """`value` (three ints, or one int for all three) as a tuple (t, h, w) of positive ints, odd ones if `odd`;
    else a ValueError naming `attention.<option>`. Floats and strings are refused, not rounded."""
    t = (value,) * 3 if isinstance(value, int) else tuple(value)
    if len(t) != 3 or not all(isinstance(v, int) and v >= 1 and (v % 2 or not odd) for v in t):
        what = "odd positive" if odd else "positive"
        raise ValueError(f"attention.{option}={value!r} must be three {what} ints (t, h, w), or one for all three")
    return t


def check_fits_grid(option: str, value: tuple[int, int, int], grid: Grid, fix: str) -> None:
    """A ValueError naming `attention.<option>` where `value` exceeds the token grid along an axis."""
    for axis, v, s in zip("thw", value, grid):
        if v > s:
            raise ValueError(f"attention.{option}={value} is larger than the token grid {tuple(grid)} "
                             f"along {axis} ({v} > {s}); {fix}")


class SelfAttention(nn.Module):
    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    reads_input: ClassVar[bool] = False  # whether `attend` reads x (else a caller may pass None)
    # how sequence-parallel training splits it (megaslide/parallel/sp_train.py): "global" (all-to-all or ring
    # attention over every token), "frames" (each rank over its frames and the halo `frame_window` says), None (none)
    sp_form: ClassVar[str | None] = None

    def __init__(self, dim: int, num_heads: int, *, qk_norm: bool = True, layer_idx: int = 0, **options):
        """`options` are this variant's own (`Options` fields); `layer_idx` is the block's index."""
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide dim={dim}")
        self.options = self.parse_options(options)
        self.layer_idx = layer_idx
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(dim, eps=QK_NORM_EPS) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(dim, eps=QK_NORM_EPS) if qk_norm else nn.Identity()
        self.qk_rope_backend = "auto"  # of `qk_norm_rope`; a test may ask for "triton" on CPU (the interpreter)

    @classmethod
    def parse_options(cls, given: Any = None):
        """`given` (None, a mapping, or any variant's options dataclass) as `cls.Options`, field by
        field: an option this variant does not take raises a ValueError that names it, the variant
        and the options it takes; missing ones take their defaults."""
        if isinstance(given, cls.Options):
            return given
        values = dataclasses.asdict(given) if dataclasses.is_dataclass(given) else dict(given or {})
        known = [f.name for f in dataclasses.fields(cls.Options)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            takes = f"takes only {known}" if known else "takes no options"
            raise ValueError(f"attention option(s) {unknown} unknown to the {cls.name!r} attention, which {takes}")
        return cls.Options(**values)

    @classmethod
    def check_grid(cls, options, grid: Grid) -> None:
        """Raise a ValueError naming the option if `options` do not fit the token grid (T, H, W)."""

    @classmethod
    def keys_per_query(cls, options, grid: Grid) -> int:
        """Keys each video token attends to in self-attention on the token grid (T, H, W)."""
        raise NotImplementedError

    @classmethod
    def temporal_reach(cls, options) -> int | None:
        """How many token frames away from its query a key can be, at most (None: unbounded, the whole
        clip). A block run with `execution.slab_frames` runs its attention over a slab of frames padded by
        this halo."""
        return None

    def frame_window(self, frames: int, t0: int, t1: int) -> tuple[int, int]:
        """The token frames [a, b) that the queries of frames [t0, t1) of a clip of `frames` frames read, chosen so
        that `attend` over the sub-grid [a, b) gives those queries the output they get over the whole clip (for
        a variant whose `sp_form` is "frames"). Default: `temporal_reach` frames on each side, cut at the clip's
        ends (where the clamps at the ends then fall as on the whole clip)."""
        reach = self.temporal_reach(self.options)
        if reach is None:
            raise NotImplementedError(f"attention {self.name!r} reads the whole clip: it has no frame window")
        return max(0, t0 - reach), min(frames, t1 + reach)

    @classmethod
    def extra_macs_per_token(cls, options, dim: int, num_heads: int) -> int:
        """Multiply-adds per video token of the weights beyond the shared projections."""
        return 0

    @classmethod
    def keep_reason(cls, options, device_type: str) -> str:
        """"" if `attend` takes `keep=` (kept.py) with these options on a device of this type, else why not:
        the offload engine then re-runs the attention in its backward (offload.keep_attention)."""
        return f"attention {cls.name!r} has no form split at its softmax statistics"

    @classmethod
    def attend_memory(cls, options, dim: int, num_heads: int, act: int, chunked: bool) -> AttendMemory:
        """`attend`'s activation memory (see `AttendMemory`) when q, k, v hold `act` bytes per
        element (2 under bf16 autocast, 4 in fp32), in a block run whole or token-chunked."""
        raise NotImplementedError(f"attention {cls.name!r} does not describe its activation memory (attend_memory)")

    def project_qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *,
                    qk_rope_backend: str | None = None):
        """x (B, N, D), rope: cos, sin (N, d/2) -> q, k, v (B, N, heads, d), QK-norm and RoPE applied to q
        and k by `megaslide.nn.qk_rope.qk_norm_rope` on backend `qk_rope_backend` (None: the module's
        `qk_rope_backend`, "auto": the fused kernels on CUDA where they run, else the eager reference;
        `megaslide.nn.qk_rope.choose_backend` says which and why)."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)                                       # (B, N, D) each
        q_weight, k_weight = (norm.weight if isinstance(norm, RMSNorm) else None for norm in (self.q_norm, self.k_norm))
        q, k = qk_norm_rope(q, k, q_weight, k_weight, *rope, heads=self.num_heads, eps=QK_NORM_EPS,
                            backend=qk_rope_backend or self.qk_rope_backend)   # (B, N, h, d) each
        return q, k, v.view(B, N, self.num_heads, self.head_dim)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.out(o.flatten(2))  # (B, N, h, d) -> (B, N, D)

    def read_input(self, x: torch.Tensor, grid: Grid, t0: int, t1: int) -> torch.Tensor:
        """What a variant that `reads_input` reads of x (B, N, D) for token frames [t0, t1), (B, t1 - t0, ...)."""
        raise NotImplementedError(f"attention {self.name!r} reads no input (reads_input is False)")

    def attend(self, q, k, v, x, grid):
        """q, k, v (B, N, h, d); x (B, N, D) the attention input (None unless `reads_input`);
        grid (T, H, W) -> (B, N, h, d). A variant whose `keep_reason` is "" also takes `keep=`: a
        `kept.Record` or `kept.Replay` that runs its op."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, rope, grid: Grid) -> torch.Tensor:
        q, k, v = self.project_qkv(x, rope)       # (B, N, h, d) each
        o = self.attend(q, k, v, x, grid)         # (B, N, h, d)
        return self.project_out(o)                # (B, N, D)
