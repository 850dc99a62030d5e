"""The gather-floor kernel (experiments/kernels/gather_floor.py) against its reference, the op with zero
queries (every sample weighted 1 / K): out = K * deformable_slide_attention(0, k, k + v, offsets), computed in float64
(`gathered_sum_reference`), on CPU through the Triton interpreter; and its sm_90 build."""
from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built
pytest.importorskip("triton")

from tests.attention.test_dsa_triton import launch, sampling  # noqa: E402  (built for the interpreter)
from experiments.kernels import gather_floor  # noqa: E402  (after them)
from tests.helpers import builds_for_sm90  # noqa: E402

if gather_floor._sample_axes is not sampling._sample_axes:  # bound to the helpers of before their rebuild
    gather_floor = importlib.reload(gather_floor)


@pytest.mark.parametrize("layout", gather_floor.LAYOUTS)
@pytest.mark.parametrize("dtype,shape,kernel_size,config", [
    (torch.float32, (2, 3, 5, 7, 2, 24), (3, 3, 3), None),             # odd grid, d = 24 padded to 32
    (torch.bfloat16, (1, 2, 4, 5, 1, 32), (1, 3, 3), launch.LaunchConfig(16, 32, 1, block_y=4)),  # patches
])
def test_gathered_sum_matches_reference(layout, dtype, shape, kernel_size, config):
    g = torch.Generator().manual_seed(sum(shape))
    k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    K = math.prod(kernel_size)
    offsets = 3.0 * torch.randn(*shape[:5], K, 3, generator=g)  # some clamp at the grid's faces
    got = gather_floor.gathered_sum(k, v, offsets, kernel_size, layout=layout, config=config)
    want = gather_floor.gathered_sum_reference(k, v, offsets, kernel_size)
    assert got.dtype == dtype and got.shape == k.shape
    # fp32 accumulation of 2 * 8 * K rows; the bf16 result is one rounding of it
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.to(torch.float64), want, rtol=tol, atol=tol)


def test_bad_layout_is_refused():
    k = torch.zeros(1, 3, 3, 3, 1, 16)
    with pytest.raises(ValueError, match="layout='rows'"):
        gather_floor.gathered_sum(k, k, torch.zeros(1, 3, 3, 3, 1, 27, 3), (3, 3, 3), layout="rows")


def test_gathered_sum_compiles_for_sm90():
    """Both layouts build to sm_90 SASS at the forward's default launch (bf16, d = 64)."""
    assert builds_for_sm90("""
        from experiments.kernels import gather_floor
        from megaslide.attention.dsa import launch

        sig = {"k_ptr": "*bf16", "v_ptr": "*bf16", "off_ptr": "*fp32", "out_ptr": "*bf16", "T": "i32", "H": "i32",
               "W": "i32", "HEADS": "i32", "D": "i32", "stride_tok": "i32", "stride_off_tok": "i32"}
        cfg = launch.forward_launch_config(262144, 64)
        for split in (True, False):
            build(gather_floor._gathered_sum_kernel, sig,
                  {"KT": 3, "KH": 3, "KW": 3, "BLOCK_Q": cfg.block_q, "BLOCK_D": cfg.block_d, "WIDE": False,
                   "EVEN_D": True, "BLOCK_Y": cfg.block_y, "SPLIT": split}, cfg.num_warps,
                  aligned_ints=("D", "stride_tok"))
    """) == 2
