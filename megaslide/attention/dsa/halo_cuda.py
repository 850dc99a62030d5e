"""The CUDA C++ halo forward of 3D-DSA (cuda/halo_fwd.cu) from Python, and a plain-torch emulation of it for CPU.

`dsa_halo_forward_cuda` has halo.dsa_halo_forward's contract (out, lse in log2 units, per-tile paths: 1 halo, 0
gathers). On a GPU the CUDA kernel (built with nvcc at first use, cached: megaslide/offload/csrc/build.py, and
loaded with ctypes) runs the tiles whose samples stay in their halo and writes every tile's path; the gather
forward (halo_rest.py, Triton) then runs the others. On CPU tensors `halo_tiles_emulated` runs the kernel's
per-tile algorithm in torch (the halo's K and V rows, S = Q K^T over the halo, each sample's score from its 8
corner entries of S by halo-local index, the softmax, the weights W on the halo's tokens (fractions rounded to
16 bits, as the kernel keeps them), out = W V with W split into bf16 high and low parts) and halo_rest.py
runs the rest under the Triton interpreter, so the tiling, the path choice and the index arithmetic are tested
without a GPU.

Inputs: q, k, v contiguous bf16 (B, T, H, W, heads, d) with d a multiple of 8 up to 128 (padded to 16, 32, 48,
64 or 128 in the kernel); offsets contiguous (B, T, H, W, heads, K, 3) in fp32, bf16 or fp16. fp32 q, k, v are
refused: the kernel's score dot is a bf16 tensor-core dot (tf32 would lose fp32's accuracy); halo.py's Triton
halo forward takes them. Tiles: three powers of two with 16 or 32 queries in all (one or two 16-row blocks of
the dots), default `launch.halo_config(reach).tile`.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from megaslide.attention.dsa.constants import LOG2E
from megaslide.attention.dsa.halo_rest import gather_rest
from megaslide.attention.dsa.launch import halo_config
from megaslide.attention.dsa.op import check_halo_reach, check_inputs
from megaslide.attention.dsa.reference import halo_extent
from megaslide.backends import device_guard

SOURCE = Path(__file__).resolve().parent / "cuda" / "halo_fwd.cu"
TILE_QUERIES = (16, 32)
"""Queries per tile the kernel takes: its dots run on one or two 16-row blocks."""
PADDED_HEAD_DIMS = (16, 32, 48, 64, 128)
"""Head dims the kernel is built for; a multiple of 8 up to 128 is padded to the next one."""
OFFSET_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Offset dtypes the kernel reads, with its code for each."""
SHARED_LIMIT = 232448
"""Shared memory per block of an H100 / H200 (227 KiB), the bound used where no GPU is at hand."""
OUT_WARPS = 4  # halo_fwd.cu's kOutWarps: the warps of out = W V, each with a staging tile
ROW_PAD, SCORE_PAD, STAGE_BYTES = 8, 4, 1024  # as halo_fwd.cu's kRowPad, kScorePad, kStageBytes
PLACE_BYTES = 8  # halo_fwd.cu's Place: a sample's lower corner and its three fractions
FRAC_STEPS = 65536
"""The kernel keeps each fraction as a multiple of 1 / FRAC_STEPS (halo_fwd.cu's kFracScale)."""


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def shared_bytes(tile: Sequence[int], head_dim: int, kernel_size: Sequence[int], reach: int) -> int:
    """Dynamic shared memory of one CTA (halo_fwd.cu's Layout): K then V halo rows (bf16, padded rows), S then W
    (fp32, BQ x padded halo), the Q rows, then each (query, sample)'s place, then the warps' staging tiles, the
    (query, sample) scores and the sums."""
    bq = tile[0] * tile[1] * tile[2]
    d_pad = next(p for p in PADDED_HEAD_DIMS if head_dim <= p)
    extent = halo_extent(tuple(tile), tuple(kernel_size), reach)
    halo_pad = _round_up(extent[0] * extent[1] * extent[2], 16)
    samples = kernel_size[0] * kernel_size[1] * kernel_size[2]
    parts = [halo_pad * (d_pad + ROW_PAD) * 2, bq * (halo_pad + SCORE_PAD) * 4,
             max(bq * (d_pad + ROW_PAD) * 2, bq * samples * PLACE_BYTES, OUT_WARPS * STAGE_BYTES), bq * samples * 4,
             bq * 4]
    return sum(_round_up(part, 128) for part in parts)


def check_cuda_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                      kernel_size: Sequence[int], reach: int, tile: Sequence[int] | None) -> tuple:
    """The CUDA halo forward's checks (module docstring), before anything is allocated: a ValueError naming the
    parameter and the fix. Returns (kernel_size, tile) as tuples."""
    kernel_size = check_inputs(q, k, v, offsets, kernel_size)
    check_halo_reach(reach)
    if q.dtype != torch.bfloat16:
        raise ValueError(f"q, k, v dtype {q.dtype}: the CUDA halo forward takes bf16 (its score dot runs on bf16 "
                         "tensor cores); cast them with .bfloat16(), or use halo.dsa_halo_forward for fp32")
    if offsets.dtype not in OFFSET_DTYPES:
        raise ValueError(f"offsets dtype {offsets.dtype}: the CUDA halo forward reads fp32, bf16 or fp16 offsets; "
                         "cast them with .float()")
    for name, x in (("q", q), ("k", k), ("v", v), ("offsets", offsets)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    d = q.shape[-1]
    if d % 8 or d > PADDED_HEAD_DIMS[-1]:
        raise ValueError(f"head dim d={d}: the CUDA halo forward takes a multiple of 8 up to 128 (16-byte rows); "
                         "use halo.dsa_halo_forward or the gather forward for other head dims")
    tile = tuple(tile or halo_config(reach).tile)
    if (len(tile) != 3 or any(not isinstance(s, int) or s < 1 or s & (s - 1) for s in tile)
            or tile[0] * tile[1] * tile[2] not in TILE_QUERIES):
        raise ValueError(f"tile={tile}: three powers of two with {' or '.join(map(str, TILE_QUERIES))} queries in "
                         "all, e.g. (2, 4, 4) or (1, 4, 4)")
    if q.shape[0] * q.shape[4] > 65535:
        raise ValueError(f"q: batch x heads = {q.shape[0] * q.shape[4]} is over the kernel's 65535 (the launch "
                         "grid's y); split the batch")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q is on {q.device}: the CUDA halo forward runs on a CUDA device (CPU: its emulation)")
    limit = SHARED_LIMIT
    if q.is_cuda:
        props = torch.cuda.get_device_properties(q.device)
        if props.major < 8:
            raise ValueError(f"q is on {props.name} (sm_{props.major}{props.minor}): the CUDA halo forward needs "
                             "bf16 tensor cores (sm_80 or newer); use the gather forward")
        limit = props.shared_memory_per_block_optin
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.data_ptr() % 16:
                raise ValueError(f"{name} must start on a 16-byte boundary (its rows are copied 16 bytes at a "
                                 "time); call .clone() first")
    need = shared_bytes(tile, d, kernel_size, reach)
    if need > limit:
        raise ValueError(f"halo_reach={reach} with tile={tile} at d={d}: a CTA needs {need} bytes of shared memory, "
                         f"over the device's {limit}; use a smaller halo_reach or tile")
    return kernel_size, tile


def dsa_halo_forward_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                          kernel_size: Sequence[int], scale: float, reach: int, store_lse: bool = True,
                          tile: Sequence[int] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The halo forward (module docstring) with halo.dsa_halo_forward's contract: out (B, T, H, W, heads, d) bf16,
    the fp32 log-sum-exp (B, heads, T*H*W) in log2 units if `store_lse` (else None), and every tile's path
    (B * heads, tiles) int8: 1 halo, 0 gathers. `tile`: (t, y, x) queries per tile (default
    `launch.halo_config(reach).tile`)."""
    kernel_size, tile = check_cuda_inputs(q, k, v, offsets, kernel_size, reach, tile)
    B, T, H, W, heads, d = q.shape
    tiles = -(-T // tile[0]) * -(-H // tile[1]) * -(-W // tile[2])
    out = torch.empty_like(q)  # (B, T, H, W, heads, d)
    lse = torch.empty((B, heads, T * H * W), dtype=torch.float32, device=q.device) if store_lse else None
    if q.is_cuda:
        path = torch.empty((B * heads, tiles), dtype=torch.int8, device=q.device)  # (B * heads, tiles)
        _launch(q, k, v, offsets, out, lse, path, kernel_size, scale, reach, tile)
    else:
        path = halo_tiles_emulated(q, k, v, offsets, kernel_size, scale, reach, tile, out, lse)
    gather_rest(q, k, v, offsets, kernel_size, scale, tile, out, lse, path)
    return out, lse, path


@functools.lru_cache(maxsize=None)
def library(arch: str) -> ctypes.CDLL:
    """The kernel's library for sm_`arch`, built at first use (BuildError if nvcc is missing or fails)."""
    from megaslide.offload.csrc.build import load_cuda

    lib = load_cuda(SOURCE, arch)
    lib.megaslide_dsa_halo_fwd.restype = ctypes.c_int
    lib.megaslide_dsa_halo_fwd.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 3
                                           + [ctypes.c_int] * 13 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p])
    lib.megaslide_dsa_halo_fwd_shared_bytes.restype = ctypes.c_long
    lib.megaslide_dsa_halo_fwd_shared_bytes.argtypes = [ctypes.c_int] * 4
    lib.megaslide_dsa_halo_error_string.restype = ctypes.c_char_p
    lib.megaslide_dsa_halo_error_string.argtypes = [ctypes.c_int]
    return lib


def library_for(device: torch.device) -> ctypes.CDLL:
    """The kernel's library built for `device`'s architecture."""
    major, minor = torch.cuda.get_device_capability(device)
    return library(f"{major}{minor}")


def _launch(q, k, v, offsets, out, lse, path, kernel_size, scale, reach, tile) -> None:
    """Run the CUDA kernel on torch's current stream of q's device: writes path, and out / lse of path-1 tiles."""
    lib = library_for(q.device)
    with device_guard(q):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        code = call_kernel(lib, stream, q, k, v, offsets, out, lse, path, kernel_size, scale, reach, tile)
    if code != 0:
        raise RuntimeError(f"the CUDA halo forward failed to launch: {lib.megaslide_dsa_halo_error_string(code)!r} "
                           f"(cudaError_t {code}; shape {tuple(q.shape)}, tile {tile}, reach {reach})")


def call_kernel(lib: ctypes.CDLL, stream: int | None, q, k, v, offsets, out, lse, path, kernel_size, scale, reach,
                tile) -> int:
    """One call of the library's launcher with the tensors' pointers and the sizes in its C signature's order;
    returns its cudaError_t code (0: launched)."""
    B, T, H, W, heads, d = q.shape
    return lib.megaslide_dsa_halo_fwd(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), offsets.data_ptr(), OFFSET_DTYPES[offsets.dtype],
        out.data_ptr(), lse.data_ptr() if lse is not None else None, path.data_ptr(),
        B, T, H, W, heads, d, *kernel_size, *tile, reach, scale * LOG2E, int(lse is not None), stream)


def halo_tiles_emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                        kernel_size: Sequence[int], scale: float, reach: int, tile: Sequence[int],
                        out: torch.Tensor, lse: torch.Tensor | None) -> torch.Tensor:
    """The CUDA kernel's algorithm in torch (module docstring), for every tile at once: returns the paths
    (B * heads, tiles) int8 and writes out (B, T, H, W, heads, d) and lse (B, heads, N) (if given) for the valid
    queries of path-1 tiles only; inputs as `dsa_halo_forward_cuda`, checked."""
    B, T, H, W, heads, d = q.shape
    grid, N, bh = (T, H, W), T * H * W, B * heads
    kt, kh, kw = kernel_size
    extent = halo_extent(tuple(tile), tuple(kernel_size), reach)  # (ET, EY, EX)
    counts = [-(-s // st) for s, st in zip(grid, tile)]
    tiles, bq = counts[0] * counts[1] * counts[2], tile[0] * tile[1] * tile[2]
    p, i = torch.arange(tiles), torch.arange(bq)  # (tiles,), (BQ,)
    first = [p // (counts[1] * counts[2]) * tile[0], p // counts[2] % counts[1] * tile[1], p % counts[2] * tile[2]]
    in_tile = [i // (tile[1] * tile[2]), i // tile[2] % tile[1], i % tile[2]]  # (BQ,) each
    coords = [f[:, None] + o[None, :] for f, o in zip(first, in_tile)]  # (tiles, BQ) each, before clamping
    valid = (coords[0] < T) & (coords[1] < H) & (coords[2] < W)  # (tiles, BQ)
    coords = [c.clamp(max=s - 1) for c, s in zip(coords, grid)]  # (tiles, BQ) each
    n = (coords[0] * H + coords[1]) * W + coords[2]  # (tiles, BQ) query tokens
    origin = [torch.clamp(torch.clamp(f - kk // 2 - reach, max=s - e), min=0)
              for f, kk, s, e in zip(first, kernel_size, grid, extent)]  # (tiles,) each

    # the halo's tokens: row-major over (ET, EY, EX); rows off the grid are zero
    hh = torch.arange(extent[0] * extent[1] * extent[2])  # (HALO,)
    local = [hh // (extent[1] * extent[2]), hh // extent[2] % extent[1], hh % extent[2]]  # (HALO,) each
    at = [o[:, None] + h[None, :] for o, h in zip(origin, local)]  # (tiles, HALO) each
    on_grid = (at[0] < T) & (at[1] < H) & (at[2] < W)  # (tiles, HALO)
    halo_tok = torch.where(on_grid, (at[0] * H + at[1]) * W + at[2], 0)  # (tiles, HALO)

    def rows(x):  # (B, T, H, W, heads, d) -> (B * heads, N, d) fp32
        return x.reshape(B, N, heads, d).transpose(1, 2).reshape(bh, N, d).float()

    q_t = rows(q)[:, n]  # (BH, tiles, BQ, d)
    k_h = rows(k)[:, halo_tok] * on_grid[None, :, :, None]  # (BH, tiles, HALO, d)
    scores = q_t @ k_h.transpose(-1, -2)  # (BH, tiles, BQ, HALO) fp32

    # every sample's clamped position, halo-local corners and fractions, as the kernel computes them (fp32)
    samples = kt * kh * kw
    off = offsets.reshape(B, N, heads, samples, 3).transpose(1, 2).reshape(bh, N, samples, 3).float()[:, n]
    j = torch.arange(samples)  # (K,)
    window = [j // (kh * kw), j // kw % kh, j % kw]  # (K,) each
    inside = torch.ones(bh, tiles, bq, samples, dtype=torch.bool)  # (BH, tiles, BQ, K)
    lower, fracs, steps = [], [], []  # per axis: halo-local lower corner, fp32 fraction, its 16-bit rounding
    for axis in range(3):
        size, kk, e = grid[axis], kernel_size[axis], extent[axis]
        start = torch.clamp(torch.clamp(coords[axis] - kk // 2, min=0), max=size - kk)  # (tiles, BQ)
        raw = (start[:, :, None] + window[axis]).float() + off[..., axis]  # (BH, tiles, BQ, K)
        pos = torch.clamp(raw, min=0.0, max=float(size - 1))
        lower_f = torch.floor(pos)
        o = origin[axis][None, :, None, None]  # (1, tiles, 1, 1)
        inside &= (pos >= o) & (pos <= o + e - 1)
        frac = torch.where(valid[None, :, :, None], pos - lower_f, 0.0)  # a query past the grid: lower corner only
        fracs.append(frac)
        steps.append(torch.clamp(torch.round(frac * FRAC_STEPS), max=FRAC_STEPS - 1) / FRAC_STEPS)
        lower.append(torch.clamp(lower_f.long() - o, 0, e - 1))
    path = (inside | ~valid[None, :, :, None]).flatten(2).all(dim=2)  # (BH, tiles)

    def corners(frac: list) -> list:
        """(halo-local index, weight) of the 8 corners at these fractions, each (BH, tiles, BQ, K), in the kernel's
        order; an upper corner (inside the halo wherever its weight is above 0 on a path-1 tile; the clamp keeps
        path-0 tiles' indices, which the kernel never computes, on the halo) exists where its fraction is above 0."""
        upper = [torch.clamp(lo + (f > 0).long(), max=e - 1) for lo, f, e in zip(lower, frac, extent)]
        found = []
        for ct in range(2):
            for cy in range(2):
                for cx in range(2):
                    idx = ((upper[0] if ct else lower[0]) * extent[1] + (upper[1] if cy else lower[1])) \
                        * extent[2] + (upper[2] if cx else lower[2])
                    w = ((frac[0] if ct else 1 - frac[0]) * (frac[1] if cy else 1 - frac[1])
                         * (frac[2] if cx else 1 - frac[2]))
                    found.append((idx, w))
        return found

    s = sum(w * scores.gather(3, idx) for idx, w in corners(fracs)) * (scale * LOG2E)  # (BH, tiles, BQ, K) log2
    m = s.amax(dim=3, keepdim=True)  # (BH, tiles, BQ, 1)
    prob = torch.exp2(s - m)  # (BH, tiles, BQ, K)
    denom = prob.sum(dim=3)  # (BH, tiles, BQ)
    weights = torch.zeros_like(scores)  # (BH, tiles, BQ, HALO): W, the numerator's weight on each halo token
    for idx, w in corners(steps):  # W's fractions in the kernel's 16 bits
        weights.scatter_add_(3, idx, prob * w)
    hi = weights.bfloat16().float()  # W = hi + lo to about 16 bits, both bf16 operands of the kernel's dot
    lo = (weights - hi).bfloat16().float()
    v_h = rows(v)[:, halo_tok] * on_grid[None, :, :, None]  # (BH, tiles, HALO, d)
    out_t = (hi @ v_h + lo @ v_h) / denom[..., None]  # (BH, tiles, BQ, d)

    keep = path[:, :, None] & valid[None]  # (BH, tiles, BQ) queries the kernel stores
    sel_bh, sel_tile, sel_q = keep.nonzero(as_tuple=True)
    sel_n = n[sel_tile, sel_q]
    out.view(B, N, heads, d)[sel_bh // heads, sel_n, sel_bh % heads] = out_t[keep].to(out.dtype)
    if lse is not None:
        lse[sel_bh // heads, sel_bh % heads, sel_n] = (m[..., 0] + torch.log2(denom))[keep]
    return path.to(torch.int8)
