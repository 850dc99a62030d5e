"""The gather forward of the tiles a halo forward left: a Triton launch over every tile of the halo forward's
tiling that returns at once where the tile's path is 1 (done on the halo) and otherwise runs the gather forward
(`forward._forward_queries`) for the tile's queries, as halo.py's own fallback branch does. The CUDA halo
forward (halo_cuda.py) writes its paths first, then runs this for the tiles it refused.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from megaslide.attention.dsa.constants import LOG2E
from megaslide.attention.dsa.forward import _forward_queries
from megaslide.attention.dsa.launch import head_dim_block
from megaslide.attention.dsa.rows import row_flags
from megaslide.attention.dsa.sampling import _query_tile
from megaslide.backends import device_guard


@triton.jit
def _halo_rest_kernel(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, lse_ptr, path_ptr,
                      T, H, W, HEADS, D, stride_tok, stride_off_tok, qk_scale,
                      KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                      TILE_T: tl.constexpr, TILE_Y: tl.constexpr, TILE_X: tl.constexpr,
                      BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr, WIDE: tl.constexpr, EVEN_D: tl.constexpr):
    pid_bh = tl.program_id(1)
    p = tl.program_id(0)
    if tl.load(path_ptr + pid_bh * tl.num_programs(0) + p) == 0:
        b = (pid_bh // HEADS).to(tl.int64)
        h = pid_bh % HEADS
        _, _, _, n, q_valid, t, y, x = _query_tile(T, H, W, TILE_T, TILE_Y, TILE_X)  # (BQ,) queries of the tile
        _forward_queries(q_ptr, k_ptr, v_ptr, off_ptr, out_ptr, lse_ptr, b, h, n, q_valid, t, y, x,
                         T, H, W, HEADS, D, stride_tok, stride_off_tok, qk_scale, KT, KH, KW,
                         BLOCK_D, STORE_LSE, WIDE, EVEN_D)


def gather_rest(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                kernel_size: Sequence[int], scale: float, tile: Sequence[int], out: torch.Tensor,
                lse: torch.Tensor | None, path: torch.Tensor) -> None:
    """Write out (B, T, H, W, heads, d) and, if given, lse (B, heads, N) for the queries of every tile whose
    path (B * heads, tiles) int8 is 0, by the gather forward; tiles of path 1 are left as they are. Inputs as
    `forward.dsa_forward`; `tile` = (t, y, x) queries per tile, powers of two."""
    B, T, H, W, heads, d = q.shape
    kt, kh, kw = kernel_size
    block_d = head_dim_block(d)
    with device_guard(q):
        _halo_rest_kernel[(path.shape[1], B * heads)](
            q, k, v, offsets, out, lse if lse is not None else out, path,  # lse never written without STORE_LSE
            T, H, W, heads, d, q.stride(3), offsets.stride(3), scale * LOG2E,
            KT=kt, KH=kh, KW=kw, TILE_T=tile[0], TILE_Y=tile[1], TILE_X=tile[2], BLOCK_D=block_d,
            STORE_LSE=lse is not None, num_warps=4, **row_flags(T * H * W, q.stride(3), d, block_d),
        )
