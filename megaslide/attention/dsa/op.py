"""The public 3D-DSA ops: input checks, backend choice and the Triton custom ops and autograd Functions.

`deformable_slide_attention` is the general op (forward.py, backward.py); `neighborhood_attention` is its
special case with offsets exactly zero (`dsa_zero`), with its own kernels (zero_kernels.py: one key row per
sample, no offset gradient, a deterministic backward) and, off CUDA, dense attention with the window as a
mask (scores.py) on small grids, else the general PyTorch backends called with zero offsets. Backends are
`megaslide.backends.Backend` records with a `can_run(q, offsets, explicit)` check, walked in preference
order for "auto"; an explicit request that cannot run raises a ValueError that says why for every backend.

Layers: the kernels' host launchers (forward.py, backward.py, zero_kernels.py) -> custom ops (opaque to
torch.compile) -> autograd Functions -> the public functions. The custom ops import the kernel modules when
they first run, not with this module: triton is an optional dependency, and `@triton.jit` decides whether a
kernel runs in the CPU interpreter when the kernel is built, after tests have set TRITON_INTERPRET. Imports
point one way: this module -> kernels -> launch.py, sampling.py, rows.py -> constants.py.

Forward only. When no input needs a gradient (none requires grad, or under torch.no_grad /
inference_mode, as in sampling) the Triton backends skip the autograd Function: nothing is
saved for a backward, and neither forward kernel allocates or writes the log-sum-exp.
"""
from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence

import torch

from megaslide.attention.base import Grid, check_fits_grid, option_triple
from megaslide.attention.dsa.constants import MAX_HALO_REACH
from megaslide.attention.dsa.gather import GatherSplit, deformable_slide_attention_gather
from megaslide.attention.dsa.reference import deformable_slide_attention_reference
from megaslide.attention.dsa.scores import (MAX_SCORES, deformable_slide_attention_scores,
                                             neighborhood_attention_scores, score_elements)
from megaslide.backends import Backend, select_backend, triton_kernels_check

KernelSize = tuple[int, int, int]
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TRITON_MAX_HEAD_DIM = 128


def _needs_grad(*inputs: torch.Tensor) -> bool:
    """Whether autograd will ask for a gradient of any input (else the forward-only path)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in inputs)


# The kernels are wrapped as custom ops so that torch.compile (train.compile) treats them as
# opaque calls: traced by Dynamo, the Triton launches got the float scale as fp64, which the
# kernels' fp32 loop state rejects. The fake functions give compile the output shapes. kernel_size, the
# checked (kt, kh, kw) tuple, goes in as it is; the dispatcher hands it to the op as a list (int[]).
@torch.library.custom_op("megaslide::dsa_fused_forward", mutates_args=())
def _fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                   kernel_size: list[int], scale: float, store_lse: bool,
                   halo_reach: int, halo_kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    if halo_reach >= 0 and halo_kernel == "cuda":  # the CUDA C++ halo forward (halo_cuda.py)
        from megaslide.attention.dsa import halo_cuda  # on first use (module docstring)
        out, lse, _ = halo_cuda.dsa_halo_forward_cuda(q, k, v, offsets, kernel_size, scale, halo_reach,
                                                      store_lse=store_lse)
    elif halo_reach >= 0:  # the Triton halo forward (halo.py); -1: the gather forward
        from megaslide.attention.dsa import halo  # on first use (module docstring)
        out, lse, _ = halo.dsa_halo_forward(q, k, v, offsets, kernel_size, scale, halo_reach, store_lse=store_lse)
    else:
        from megaslide.attention.dsa import forward  # on first use (module docstring)
        out, lse = forward.dsa_forward(q, k, v, offsets, kernel_size, scale, store_lse=store_lse)
    return out, lse if store_lse else q.new_empty(0, dtype=torch.float32)  # an op returns tensors only


@_fused_forward.register_fake
def _(q, k, v, offsets, kernel_size, scale, store_lse, halo_reach, halo_kernel):
    B, T, H, W, heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, heads, T * H * W) if store_lse else 0, dtype=torch.float32)


@torch.library.custom_op("megaslide::dsa_fused_backward", mutates_args=())
def _fused_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, kernel_size: list[int],
                    scale: float, offsets_grad: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from megaslide.attention.dsa import backward  # on first use (module docstring)
    dq, dk, dv, doff = backward.dsa_backward(q, k, v, offsets, out, lse, dout, kernel_size, scale,
                                             offsets_grad=offsets_grad)
    return dq, dk, dv, doff if offsets_grad else offsets.new_empty(0)  # an op returns tensors only


@_fused_backward.register_fake
def _(q, k, v, offsets, out, lse, dout, kernel_size, scale, offsets_grad):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(offsets) if offsets_grad else offsets.new_empty(0))


@torch.library.custom_op("megaslide::na_fused_forward", mutates_args=())
def _na_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: list[int], scale: float,
                store_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from megaslide.attention.dsa import zero_kernels  # on first use (module docstring)
    out, lse = zero_kernels.na_forward(q, k, v, kernel_size, scale, store_lse=store_lse)
    return out, lse if store_lse else q.new_empty(0, dtype=torch.float32)  # an op returns tensors only


@_na_forward.register_fake
def _(q, k, v, kernel_size, scale, store_lse):
    B, T, H, W, heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, heads, T * H * W) if store_lse else 0, dtype=torch.float32)


@torch.library.custom_op("megaslide::na_fused_backward", mutates_args=())
def _na_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dout: torch.Tensor, kernel_size: list[int], scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from megaslide.attention.dsa import zero_kernels  # on first use (module docstring)
    return zero_kernels.na_backward(q, k, v, out, lse, dout, kernel_size, scale)


@_na_backward.register_fake
def _(q, k, v, out, lse, dout, kernel_size, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _DSATritonFunction(torch.autograd.Function):
    """Fused Triton forward (the gather or the halo kernel) / backward; saves q, k, v, offsets, out and the
    log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, kernel_size: KernelSize, scale: float, halo_reach: int, halo_kernel: str):
        q, k, v, offsets = (x.contiguous() for x in (q, k, v, offsets))
        # out (B, T, H, W, heads, d), lse (B, heads, N)
        out, lse = _fused_forward(q, k, v, offsets, kernel_size, scale, True, halo_reach, halo_kernel)
        ctx.save_for_backward(q, k, v, offsets, out, lse)
        ctx.kernel_size = kernel_size
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, out, lse = ctx.saved_tensors
        offsets_grad = ctx.needs_input_grad[3]
        dq, dk, dv, doff = _fused_backward(q, k, v, offsets, out, lse, dout.contiguous(), ctx.kernel_size,
                                           ctx.scale, offsets_grad)
        return dq, dk, dv, doff if offsets_grad else None, None, None, None, None


class _NATritonFunction(torch.autograd.Function):
    """Zero-offset Triton forward / backward; saves q, k, v, out and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, kernel_size: KernelSize, scale: float):
        q, k, v = (x.contiguous() for x in (q, k, v))
        out, lse = _na_forward(q, k, v, kernel_size, scale, True)  # (B, T, H, W, heads, d), (B, heads, N)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel_size = kernel_size
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _na_backward(q, k, v, out, lse, dout.contiguous(), ctx.kernel_size, ctx.scale)
        return dq, dk, dv, None, None


class DSASplit:
    """The fused kernels as a `SplitOp` (megaslide/attention/kept.py) on q, k, v (B, T, H, W, heads, d) and
    offsets (B, T, H, W, heads, K, 3): out as the op returns it, lse (B, heads, N) fp32 (log2 units); the same
    kernels and the same contiguous inputs as `_DSATritonFunction`."""

    def __init__(self, kernel_size: KernelSize, scale: float):
        self.kernel_size, self.scale = kernel_size, scale

    def forward(self, q, k, v, offsets):
        q, k, v, offsets = (x.contiguous() for x in (q, k, v, offsets))
        return _fused_forward(q, k, v, offsets, self.kernel_size, self.scale, True, -1, "triton")   # the gather forward

    def backward(self, inputs, out, lse, dout, needs):
        q, k, v, offsets = (x.contiguous() for x in inputs)
        dq, dk, dv, doff = _fused_backward(q, k, v, offsets, out, lse, dout.contiguous(), self.kernel_size,
                                           self.scale, needs[3])
        return dq, dk, dv, doff if needs[3] else None


class NASplit(DSASplit):
    """The zero-offset kernels as a `SplitOp` on q, k, v (B, T, H, W, heads, d), as `_NATritonFunction` runs them."""

    def forward(self, q, k, v):
        q, k, v = (x.contiguous() for x in (q, k, v))
        return _na_forward(q, k, v, self.kernel_size, self.scale, True)

    def backward(self, inputs, out, lse, dout, needs):
        q, k, v = (x.contiguous() for x in inputs)
        return _na_backward(q, k, v, out, lse, dout.contiguous(), self.kernel_size, self.scale)


def _dsa_triton(q, k, v, offsets, kernel_size: KernelSize, scale: float, halo_reach: int | None = None,
                halo_kernel: str = "triton") -> torch.Tensor:
    """The fused kernels; forward only when no input needs a gradient. halo_reach: the forward runs on the
    halo kernel (`halo_kernel`: halo.py's Triton one or halo_cuda.py's CUDA one) with halos for offsets of up to
    that many tokens; None: the gather forward."""
    reach = -1 if halo_reach is None else halo_reach
    if _needs_grad(q, k, v, offsets):
        return _DSATritonFunction.apply(q, k, v, offsets, kernel_size, scale, reach, halo_kernel)
    q, k, v, offsets = (x.contiguous() for x in (q, k, v, offsets))
    return _fused_forward(q, k, v, offsets, kernel_size, scale, False, reach, halo_kernel)[0]


def _na_triton(q, k, v, offsets, kernel_size: KernelSize, scale: float) -> torch.Tensor:
    """The zero-offset kernels (offsets, all zero, are not read); forward only, without an lse,
    when no input needs a gradient."""
    if _needs_grad(q, k, v):
        return _NATritonFunction.apply(q, k, v, kernel_size, scale)
    q, k, v = (x.contiguous() for x in (q, k, v))
    return _na_forward(q, k, v, kernel_size, scale, False)[0]


def can_run_reference(q: torch.Tensor, offsets: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    """The PyTorch reference runs on any device and floating dtype."""
    return True, "pure PyTorch, any device and dtype"


def can_run_scores(q: torch.Tensor, offsets: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    """The score-matrix backend runs on any device and floating dtype while its O(B * heads * N^2)
    matrices stay small; "auto" takes it only where it beats the gathers: while a query's row
    of N scores is at most twice its 8 K corner reads."""
    B, T, H, W, heads, _ = q.shape
    size, tokens, reads = score_elements(q), T * H * W, 8 * offsets.shape[-2]
    if size > MAX_SCORES:
        return False, f"score matrices of B * heads * N * N = {size} elements exceed {MAX_SCORES}"
    if not explicit and tokens > 2 * reads:
        return False, f"N = {tokens} tokens per row > 2 x {reads} corner reads: the gathers are faster"
    return True, f"score matrices of {size} elements"


def can_run_na_scores(q: torch.Tensor, offsets: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    """Masked dense attention (neighbourhood attention, zero offsets) runs on any device and
    floating dtype; "auto" takes it while a query's N keys are at most NA_SCORES_PER_SAMPLE x its
    K window reads (past that the gathers are faster)."""
    B, T, H, W, heads, _ = q.shape
    tokens, reads = T * H * W, offsets.shape[-2]
    if not explicit and tokens > NA_SCORES_PER_SAMPLE * reads:
        return False, f"N = {tokens} keys per query > {NA_SCORES_PER_SAMPLE} x {reads} reads: the gathers are faster"
    return True, f"dense attention over N = {tokens} keys with the window as a mask"


NA_SCORES_PER_SAMPLE = 32
"""Keys per window sample up to which masked dense attention beats the gathers on CPU."""


def can_run_gather(q: torch.Tensor, offsets: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    """The gather backend runs on any device and floating dtype; "auto" takes it where the
    fused kernels cannot run (CPU)."""
    return True, "PyTorch gathers with a hand-written backward, any device and dtype"


def can_run_triton(q: torch.Tensor, offsets: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    """The fused kernels need triton, fp32/fp16/bf16, d <= 128 and a launch grid within
    CUDA's limits, on CUDA; on CPU only under the Triton interpreter (TRITON_INTERPRET=1)
    and only when asked for by name."""
    return _can_run_kernels(q, offsets, explicit)


def can_run_na_triton(q: torch.Tensor, offsets: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    """The zero-offset kernels run where the fused kernels run (`can_run_triton`)."""
    return _can_run_kernels(q, offsets, explicit)


def _can_run_kernels(q: torch.Tensor, offsets: torch.Tensor, explicit: bool) -> tuple[bool, str]:
    if not TRITON_AVAILABLE:
        return False, "triton is not installed"
    if q.dtype not in TRITON_DTYPES or offsets.dtype not in TRITON_DTYPES:
        return False, (f"dtypes q={q.dtype}, offsets={offsets.dtype} not supported "
                       "(use float32, float16 or bfloat16)")
    B, T, H, W, heads, d = q.shape
    if d > TRITON_MAX_HEAD_DIM:
        return False, f"head dim d={d} exceeds {TRITON_MAX_HEAD_DIM}"
    if B * heads > 65535 or T * H * W >= 2**31:
        return False, f"B * heads = {B * heads} > 65535 or T * H * W = {T * H * W} >= 2**31"
    return triton_kernels_check("megaslide.attention.dsa.launch", q.device, explicit, "fused kernels")


BACKENDS: tuple[Backend, ...] = (
    Backend("triton", can_run_triton, _dsa_triton),
    Backend("scores", can_run_scores, deformable_slide_attention_scores),
    Backend("gather", can_run_gather, deformable_slide_attention_gather),
    Backend("reference", can_run_reference, deformable_slide_attention_reference),
)
"""In the order "auto" tries them."""

NA_BACKENDS: tuple[Backend, ...] = (Backend("triton", can_run_na_triton, _na_triton),
                                    Backend("scores", can_run_na_scores, neighborhood_attention_scores),
                                    *BACKENDS[2:])
"""`neighborhood_attention`'s backends, in the order "auto" tries them: its own kernels, masked dense
attention (scores.py), then the general PyTorch backends, given zero offsets that need no gradient."""


def check_kernel_size(kernel_size: int | Sequence[int], grid: Grid | None = None) -> KernelSize:
    """The one check of DSA's window: kernel_size (three ints, or one for all three) as (kt, kh, kw), each odd
    and >= 1 and, given the token grid (T, H, W), at most its size along that axis; else a ValueError naming
    attention.kernel_size, the grid and the fix. `DSAOptions` checks its value with it (the grid fit when a
    config is validated against a clip, `DSAAttention.check_grid`) and the public functions their argument."""
    kernel_size = option_triple("kernel_size", kernel_size, odd=True)
    if grid is not None:
        check_fits_grid("kernel_size", kernel_size, grid, "use a smaller odd kernel or more tokens")
    return kernel_size


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                 kernel_size: int | Sequence[int]) -> KernelSize:
    """Validate shapes, dtypes, devices and kernel sizes; return kernel_size as (kt, kh, kw)."""
    kernel_size = check_qkv(q, k, v, kernel_size, offsets=offsets)
    expected = (*q.shape[:5], math.prod(kernel_size), 3)
    if tuple(offsets.shape) != expected:
        raise ValueError(f"offsets must have shape (B, T, H, W, heads, K, 3) = {expected} for "
                         f"kernel_size={kernel_size}, got {tuple(offsets.shape)}")
    return kernel_size


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int | Sequence[int],
              **others: torch.Tensor) -> KernelSize:
    """Validate q, k, v (and the tensors in `others`, by name: floating, on q's device) and the
    kernel sizes against q's grid (`check_kernel_size`); return kernel_size as (kt, kh, kw)."""
    for name, x in (("q", q), ("k", k), ("v", v), *others.items()):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    if q.dim() != 6 or min(q.shape) < 1:
        raise ValueError(f"q must be a non-empty (B, T, H, W, heads, d) tensor, got shape {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}; cast it first")
    for name, x in (("k", k), ("v", v), *others.items()):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; move them to one device")
    return check_kernel_size(kernel_size, q.shape[1:4])


def check_halo_reach(halo_reach: int | None) -> int | None:
    """halo_reach: None, or an int in [0, MAX_HALO_REACH] (tokens of offset the halo forward's halos cover);
    else a ValueError naming the key and the fix."""
    if halo_reach is not None and (isinstance(halo_reach, bool) or not isinstance(halo_reach, int)
                                   or not 0 <= halo_reach <= MAX_HALO_REACH):
        raise ValueError(f"halo_reach (attention.halo_reach) must be None (the gather forward) or an int in "
                         f"[0, {MAX_HALO_REACH}] (tokens of offset the halo forward covers; tiles with larger "
                         f"offsets take the gathers), got {halo_reach!r}")
    return halo_reach


HALO_KERNELS = ("triton", "cuda")
"""The halo forward's kernels: halo.py (Triton, fp32 and bf16) and halo_cuda.py (CUDA C++, bf16)."""


def check_halo_kernel(halo_kernel: str, halo_reach: int | None) -> str:
    """halo_kernel: one of HALO_KERNELS; "cuda" only with a halo_reach (it is a halo forward). Else a
    ValueError naming the key and the fix."""
    if halo_kernel not in HALO_KERNELS:
        raise ValueError(f"halo_kernel (attention.halo_kernel) must be one of {list(HALO_KERNELS)}, "
                         f"got {halo_kernel!r}")
    if halo_kernel == "cuda" and halo_reach is None:
        raise ValueError("halo_kernel='cuda' (attention.halo_kernel) runs the halo forward: set halo_reach "
                         "(attention.halo_reach, e.g. 1) too, or use halo_kernel='triton'")
    return halo_kernel


def check_scale(scale: float | None, q: torch.Tensor) -> float:
    """The softmax scale: d ** -0.5 when None, else a finite number (a ValueError otherwise)."""
    if scale is None:
        return q.shape[-1] ** -0.5
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None (for d ** -0.5), got {scale!r}")
    return float(scale)


SPLIT_BACKENDS = ("triton", "gather")
"""The backends split at their lse (`keep=`): the fused kernels, and on any device the gathers."""


def split_op(backend: str, backends: tuple[Backend, ...], q: torch.Tensor, offsets: torch.Tensor,
             kernel_size: KernelSize, scale: float, fused: type):
    """The `SplitOp` of `backend` ("auto": the fused kernels, `fused`), a ValueError where it cannot run."""
    if backend == "gather":
        return GatherSplit(kernel_size, scale)
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend={backend!r} keeps no lse; a kept attention runs on one of {SPLIT_BACKENDS}")
    select_backend("triton", backends, q, offsets)
    return fused(kernel_size, scale)


def deformable_slide_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               offsets: torch.Tensor,
                               kernel_size: int | Sequence[int] = (3, 3, 3), *,
                               scale: float | None = None, backend: str = "auto", keep=None,
                               halo_reach: int | None = None, halo_kernel: str = "triton") -> torch.Tensor:
    """3D Deformable Slide Attention.

    Every query token and head attends to K = kt * kh * kw samples: sample j starts at
    position j (row-major over (it, iy, ix)) of the query's clamped window (along an axis
    of size S with kernel k the window of query i starts at clamp(i - k // 2, 0, S - k)),
    moves by its offset (dt, dy, dx) in token units, is clamped to [0, S - 1] per axis,
    and reads K and V by trilinear interpolation of the 8 surrounding tokens. Then
    out = softmax_j(scale * <q, K_j>) @ V_j. With zero offsets this is exactly 3D
    neighbourhood attention. Gradients reach q, k, v and offsets (zero where the clamp
    is active).

    Args:
        q, k, v: (B, T, H, W, heads, d), one floating dtype and device.
        offsets: (B, T, H, W, heads, K, 3), floating, last axis (dt, dy, dx).
        kernel_size: (kt, kh, kw) (or one int for all three), odd and <= (T, H, W).
        scale: softmax scale; d ** -0.5 when None.
        backend: "auto" (triton on CUDA; else scores on small grids, gather beyond),
            "triton", "scores" (per-(batch, head) score matrices), "gather" (weighted row
            gathers; both with a hand-written backward) or "reference" (readable, slow: the
            judge the others are tested against).
        keep: a `kept.Record` or `kept.Replay` (megaslide/attention/kept.py): run the op split at its lse,
            on backend triton (or auto: `DSASplit`) or gather (`GatherSplit`); a ValueError says why where
            it cannot run.
        halo_reach: with the triton backend, run the forward on the halo kernel (halo.py: scores on tensor
            cores over each query tile's halo), with halos that cover offsets of up to this many tokens;
            tiles whose samples leave their halo take the gather forward, and the backward is the same.
            None: the gather forward. The other backends, and a `keep` split, compute the same op on their own forward.
        halo_kernel: the halo forward's kernel, "triton" (halo.py) or "cuda" (halo_cuda.py: CUDA C++, bf16
            inputs, built with nvcc at first use; its emulation in torch on CPU tensors).

    Returns:
        (B, T, H, W, heads, d) in q's dtype.
    """
    kernel_size = check_inputs(q, k, v, offsets, kernel_size)
    scale = check_scale(scale, q)
    halo_reach = check_halo_reach(halo_reach)
    halo_kernel = check_halo_kernel(halo_kernel, halo_reach)
    if keep is not None:
        return keep(split_op(backend, BACKENDS, q, offsets, kernel_size, scale, DSASplit), q, k, v, offsets)
    chosen = select_backend(backend, BACKENDS, q, offsets)
    if chosen.name == "triton":
        return _dsa_triton(q, k, v, offsets, kernel_size, scale, halo_reach, halo_kernel)
    return chosen.run(q, k, v, offsets, kernel_size, scale)


def neighborhood_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kernel_size: int | Sequence[int] = (3, 3, 3), *,
                           scale: float | None = None, backend: str = "auto", keep=None) -> torch.Tensor:
    """3D neighbourhood attention: `deformable_slide_attention` with offsets exactly zero (`dsa_zero`).

    Every query token and head attends to the kt * kh * kw tokens of its clamped window
    (along an axis of size S with kernel k the window of query i starts at
    clamp(i - k // 2, 0, S - k)): out = softmax_j(scale * <q, K_j>) @ V_j. There are no
    offsets and so no offset gradient; gradients reach q, k and v.

    Args:
        q, k, v: (B, T, H, W, heads, d), one floating dtype and device.
        kernel_size: (kt, kh, kw) (or one int for all three), odd and <= (T, H, W).
        scale: softmax scale; d ** -0.5 when None.
        backend: "auto" (triton on CUDA; else scores on small grids, gather beyond), "triton"
            (zero_kernels.py: one key row per sample, deterministic backward without atomics),
            "scores" (dense attention with the window as a mask), or "gather", "reference":
            the general PyTorch backends given zero offsets that need no gradient.
        keep: as `deformable_slide_attention`'s, through the zero-offset kernels (`NASplit`) or the
            gathers given zero offsets.

    Returns:
        (B, T, H, W, heads, d) in q's dtype.
    """
    kernel_size = check_qkv(q, k, v, kernel_size)
    scale = check_scale(scale, q)
    offsets = q.new_zeros(()).expand(*q.shape[:5], math.prod(kernel_size), 3)  # (B, T, H, W, heads, K, 3), no memory
    if keep is not None:
        op = split_op(backend, NA_BACKENDS, q, offsets, kernel_size, scale, NASplit)
        return keep(op, q, k, v, offsets) if isinstance(op, GatherSplit) else keep(op, q, k, v)
    return select_backend(backend, NA_BACKENDS, q, offsets).run(q, k, v, offsets, kernel_size, scale)
