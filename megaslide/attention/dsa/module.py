"""The DSA self-attention module (`dsa`, `dsa_zero` in the registry).

Offsets are predicted from the block input: a depthwise Conv3d over the token grid and GELU (one fused
op, depthwise.py), and a Linear to heads * K * 3, bounded by `max_offset * tanh` (bounded.py). The
Linear starts at zero, so a fresh `dsa` layer is exactly 3D neighbourhood attention and learns to move
its samples. `dsa_zero` is the ablation: offsets fixed at exactly zero, run as 3D neighbourhood
attention (`neighborhood_attention`: no offsets tensor, no offset gradient). It keeps the
(inert) offset net so both variants have the same parameter count. Both take `DSAOptions`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megaslide.attention import register_attention
from megaslide.attention.base import AttendMemory, Grid, SelfAttention
from megaslide.attention.dsa.bounded import bounded_offsets
from megaslide.attention.dsa.depthwise import depthwise_conv3d
from megaslide.attention.dsa.constants import SCRATCH_BYTES, backward_scratch_bytes
from megaslide.attention.dsa.op import (BACKENDS, SPLIT_BACKENDS, KernelSize, check_halo_kernel, check_halo_reach,
                                        check_kernel_size, deformable_slide_attention, neighborhood_attention)


@dataclass(frozen=True)
class DSAOptions:
    kernel_size: KernelSize = (3, 3, 3)  # sampling kernel (kt, kh, kw), odd
    max_offset: float = 4.0              # offsets bounded by max_offset * tanh, in tokens
    backend: str = "auto"                # the op's backend: auto or one of dsa.op.BACKENDS
    halo_reach: int | None = None        # triton forward on the halo kernel, halos for offsets <= this; None: off
    halo_kernel: str = "triton"          # the halo forward's kernel: triton (halo.py) or cuda (halo_cuda.py, bf16)

    def __post_init__(self):
        object.__setattr__(self, "kernel_size", check_kernel_size(self.kernel_size))
        object.__setattr__(self, "max_offset", float(self.max_offset))
        if self.max_offset < 0:
            raise ValueError(f"attention.max_offset={self.max_offset} must be >= 0")
        check_halo_reach(self.halo_reach)
        check_halo_kernel(self.halo_kernel, self.halo_reach)
        known = ["auto", *(b.name for b in BACKENDS)]
        if self.backend not in known:
            raise ValueError(f"attention.backend={self.backend!r}: choose one of {known}")

    @property
    def num_samples(self) -> int:
        """K = kt * kh * kw, the samples of every query and head."""
        return math.prod(self.kernel_size)


@register_attention
class DSAAttention(SelfAttention):
    name = "dsa"
    Options = DSAOptions
    fixed_zero_offsets = False
    reads_input = True  # the offset net reads the attention input
    sp_form = "frames"  # over a rank's frames and a halo of `temporal_reach` frames (base.frame_window)

    def __init__(self, dim: int, num_heads: int, **kw):
        super().__init__(dim, num_heads, **kw)
        self.offset_conv = nn.Conv3d(dim, dim, kernel_size=3, padding=1, groups=dim)  # depthwise
        self.offset_proj = nn.Linear(dim, num_heads * self.options.num_samples * 3)
        # the offset net's conv and bound follow the op: Triton kernels where the op may take its own
        # (auto, triton), else PyTorch's
        self.net_backend = self.options.backend if self.options.backend in ("auto", "triton") else "torch"

    def initialize_weights(self) -> None:
        nn.init.zeros_(self.offset_proj.weight)
        nn.init.zeros_(self.offset_proj.bias)

    @classmethod
    def check_grid(cls, options: DSAOptions, grid: Grid) -> None:
        check_kernel_size(options.kernel_size, grid)

    @classmethod
    def keys_per_query(cls, options: DSAOptions, grid: Grid) -> int:
        return options.num_samples

    @classmethod
    def temporal_reach(cls, options: DSAOptions) -> int:
        # an edge query's clamped window spans kt - 1 frames on one side; a sample moves by at most
        # max_offset (tanh can round to exactly 1); its upper trilinear corner (read for the offset
        # gradient even at weight 0) is one frame further
        kt = options.kernel_size[0]
        return kt + (0 if cls.fixed_zero_offsets else math.ceil(options.max_offset))

    @classmethod
    def keep_reason(cls, options: DSAOptions, device_type: str) -> str:
        # the backends split at their lse (op.split_op): the fused kernels and the gathers; auto is the
        # fused kernels on CUDA only (on the CPU it picks by size)
        if options.backend in SPLIT_BACKENDS or (options.backend == "auto" and device_type == "cuda"):
            return ""
        return (f"attention.backend={options.backend!r} on {device_type} keeps no lse; a kept attention runs on "
                f"backend triton (CUDA, or the CPU under TRITON_INTERPRET=1) or gather")

    @classmethod
    def extra_macs_per_token(cls, options: DSAOptions, dim: int, num_heads: int) -> int:
        return 27 * dim + dim * num_heads * options.num_samples * 3

    @classmethod
    def attend_memory(cls, options: DSAOptions, dim: int, num_heads: int, act: int, chunked: bool) -> AttendMemory:
        # the fused kernels (the CUDA path) keep contiguous q, k, v, offsets (fp32), the output and
        # lse; the offset net, unless chunked (then recomputed from the kept input), keeps the conv's
        # fp32 input (read in place, depthwise.py) and the GELU and Linear inputs; its bound keeps
        # only the offsets the op keeps (bounded.py). Forward: the Linear output (chunked: the offsets
        # of the runs before their concatenation). Backward: dq, dk, dv and fp32 d(offsets), and a scratch
        # of 32-byte entries and the key tiles' entry lists (backward.py) of at most SCRATCH_BYTES, head group by
        # group
        offsets = 4 * num_heads * options.num_samples * 3
        saved = act * dim + 4 * num_heads + offsets
        forward = offsets if chunked else offsets * act // 4
        if not chunked:
            saved += 4 * dim + 2 * act * dim
        scratch = num_heads * backward_scratch_bytes(options.num_samples)
        return AttendMemory("contiguous", saved, forward, 3 * act * dim + offsets, scratch=scratch,
                            scratch_cap=SCRATCH_BYTES, heads=num_heads)

    def offsets(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        """x (B, N, D) -> offsets (B, T, H, W, heads, K, 3) in token units, |.| < max_offset. A chunked block
        runs the net over runs of frames instead (`read_input`, megaslide/models/chunking.py)."""
        return self.read_input(x, grid, 0, grid[0])

    def read_input(self, x: torch.Tensor, grid: Grid, t0: int, t1: int) -> torch.Tensor:
        """Offsets (B, t1 - t0, H, W, heads, K, 3) of frames [t0, t1) of x (B, N, D), read from frames
        [t0 - 1, t1 + 1): the 3x3x3 conv's one-frame halo. The conv's zero padding along t is then
        used only at the clip's ends, as over the whole grid."""
        B, _, D = x.shape
        T, H, W = grid
        a, b = max(t0 - 1, 0), min(t1 + 1, T)
        h = x[:, a * H * W:b * H * W].reshape(B, b - a, H, W, D)    # (B, b-a, H, W, D), in place
        h = depthwise_conv3d(h, self.offset_conv.weight, self.offset_conv.bias, (t0 - a, t1 - a),
                             backend=self.net_backend, gelu=True)   # (B, t1-t0, H, W, D), after GELU
        o = self.offset_proj(h)                                      # (B, t1-t0, H, W, heads*K*3)
        o = o.view(B, t1 - t0, H, W, self.num_heads, self.options.num_samples, 3)  # (B, t1-t0, H, W, heads, K, 3)
        return bounded_offsets(o, self.options.max_offset, backend=self.net_backend)  # fp32

    def attend(self, q, k, v, x, grid, read: torch.Tensor | None = None, keep=None):
        """As `SelfAttention.attend`; `read`: the offsets (`read_input` of every frame) when the caller
        computed them (a chunked block), else they come from x; `keep`: run the op split at its lse (kept.py)."""
        B, N, h, d = q.shape
        q6, k6, v6 = (t.reshape(B, *grid, h, d) for t in (q, k, v))  # (B, T, H, W, h, d)
        kernel_size, backend = self.options.kernel_size, self.options.backend
        if self.fixed_zero_offsets:
            o = neighborhood_attention(q6, k6, v6, kernel_size, backend=backend, keep=keep)  # (B, T, H, W, h, d)
        else:
            offsets = self.offsets(x, grid) if read is None else read             # (B, T, H, W, h, K, 3)
            o = deformable_slide_attention(q6, k6, v6, offsets, kernel_size, backend=backend, keep=keep,
                                           halo_reach=self.options.halo_reach, halo_kernel=self.options.halo_kernel)
        return o.reshape(B, N, h, d)                                  # (B, N, h, d)


@register_attention
class DSAZeroAttention(DSAAttention):
    name = "dsa_zero"
    fixed_zero_offsets = True
    reads_input = False

    @classmethod
    def attend_memory(cls, options: DSAOptions, dim: int, num_heads: int, act: int, chunked: bool) -> AttendMemory:
        # the zero-offset kernels (the CUDA path) keep contiguous q, k, v, the output and lse; no
        # offsets. Backward: dq, dk, dv in the input dtype (no fp32 scratch) and fp32 delta = <dO, out>
        return AttendMemory("contiguous", act * dim + 4 * num_heads, 0, 3 * act * dim + 4 * num_heads)
