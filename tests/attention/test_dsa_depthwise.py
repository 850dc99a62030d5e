"""The offset net's Triton depthwise Conv3d (channels-last), alone and fused with GELU, against F.conv3d
(+ F.gelu), on CPU through the Triton interpreter, for the output and the gradients of x, weight and bias.

Truth: F.conv3d in float64 on the inputs rounded to the tested dtype; the kernel may be at most 2x as
wrong as F.conv3d in the tested dtype, plus a rounding floor (megaslide.testing.within_tolerance).
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built
pytest.importorskip("triton")

from megaslide.attention import build_attention  # noqa: E402
from megaslide.attention.dsa import depthwise, depthwise_kernels  # noqa: E402
from megaslide.attention.dsa.depthwise import depthwise_conv3d  # noqa: E402
from megaslide.models.chunking import read_over_frame_runs  # noqa: E402
from megaslide.testing import check_conv  # noqa: E402
from tests.helpers import builds_for_sm90  # noqa: E402

if not depthwise_kernels.INTERPRETED:  # built earlier in this process without the interpreter
    importlib.reload(depthwise_kernels)


def assert_matches_conv3d(shape, kernel, frames, dtype=torch.float32, gelu=False):
    result = check_conv(shape, frames, dtype, torch.device("cpu"), kernel, gelu=gelu)
    assert result["passed"], result["errors"]


def test_whole_clip_odd_grid():
    assert_matches_conv3d((2, 3, 4, 5, 3), (3, 3, 3), (0, 3))


def test_frame_slab_reads_its_halo_and_pads_only_at_clip_ends():
    """Output frames [1, 4) of 5: frames 0 and 4 are read as the halo, not zero-padded."""
    assert_matches_conv3d((1, 5, 4, 5, 3), (3, 3, 3), (1, 4))


def test_slab_at_the_clip_start_and_a_non_cube_kernel():
    assert_matches_conv3d((1, 4, 3, 6, 5), (1, 3, 5), (0, 2))


def test_bf16_input():
    assert_matches_conv3d((1, 3, 4, 5, 4), (3, 3, 3), (0, 3), dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_gelu_odd_grid_and_channels(dtype):
    """Conv + GELU fused, on a 3 x 5 x 7 grid with 6 channels: every border zero-padded as Conv3d pads."""
    assert_matches_conv3d((1, 3, 5, 7, 6), (3, 3, 3), (0, 3), dtype, gelu=True)


def test_conv_gelu_frame_slab():
    assert_matches_conv3d((2, 5, 3, 5, 3), (3, 3, 3), (1, 4), gelu=True)


def test_gpu_tiles_partial_blocks_and_several_columns_per_weight_program(monkeypatch):
    """The GPU's tiling: x and channel blocks smaller than the row (partial last blocks), runs of 2 frames
    per program (the last partial), and weight programs that each sum several columns, the last one
    partial (interpreter tiles are whole rows and all frames)."""
    monkeypatch.setattr(depthwise, "_conv_blocks", lambda W, C, frames: (4, 4, 1, 2))
    monkeypatch.setattr(depthwise, "_wgrad_blocks", lambda W, C: (4, 4, 1))
    monkeypatch.setattr(depthwise, "WGRAD_PROGRAMS", 2)  # 3 columns (x blocks): 2 and 1 per program
    assert_matches_conv3d((1, 4, 1, 9, 5), (3, 3, 3), (1, 4), gelu=True)


def test_output_dtype_follows_autocast_as_conv3d():
    x = torch.randn(1, 3, 3, 4, 2)
    weight, bias = torch.randn(2, 1, 3, 3, 3), torch.randn(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert depthwise_conv3d(x, weight, bias, backend="triton").dtype == torch.bfloat16
        assert depthwise_conv3d(x, weight, bias, backend="torch").dtype == torch.bfloat16
    assert depthwise_conv3d(x, weight, bias, backend="triton").dtype == torch.float32


def test_dsa_offset_net_same_with_either_backend():
    """The `dsa` module's offsets, chunked into frame runs or not, with the Triton conv and bound and with
    PyTorch's (F.conv3d, torch.tanh)."""
    torch.manual_seed(0)
    grid, dim, heads = (4, 3, 4), 8, 2
    x = torch.randn(1, 48, dim)
    attn = build_attention("dsa", dim, heads, kernel_size=(3, 3, 3))
    torch.nn.init.normal_(attn.offset_proj.weight)  # not the zero init: offsets that depend on the conv
    offsets = {}
    for backend in ("torch", "triton"):
        for chunk in (0, 24):  # 0: the whole grid; 24 tokens: runs of two frames
            attn.net_backend = backend
            offsets[backend, chunk] = read_over_frame_runs(attn, x, grid, chunk)
    for key, got in offsets.items():
        torch.testing.assert_close(got, offsets["torch", 0], rtol=1e-5, atol=1e-5, msg=str(key))


def test_bad_weight_and_frames_are_refused():
    x = torch.randn(1, 3, 3, 3, 4)
    with pytest.raises(ValueError, match=r"weight \(4, 1, 2, 3, 3\).*odd"):
        depthwise_conv3d(x, torch.randn(4, 1, 2, 3, 3), None)
    with pytest.raises(ValueError, match=r"frames=\(2, 5\).*T=3"):
        depthwise_conv3d(x, torch.randn(4, 1, 3, 3, 3), None, frames=(2, 5))


def test_kernels_compile_for_sm90():
    """The interpreter cannot catch GPU lowering errors (the while loops, the tuples of rolling and tap tiles):
    build both, the conv with and without GELU."""
    assert builds_for_sm90("""
        from megaslide.attention.dsa import depthwise as dw, depthwise_kernels as dk

        sizes = {n: "i32" for n in ("H", "W", "C", "shift", "stride_xb", "stride_yb")}
        taps = {"KT": 3, "KH": 3, "KW": 3}
        bx, bc, warps, _ = dw.CONV_BLOCK
        for gelu in (True, False):
            build(dk._conv_kernel, {"x_ptr": "*bf16", "taps_ptr": "*fp32", "bias_ptr": "*fp32", "y_ptr": "*bf16",
                                    "pre_ptr": "*bf16", "TX": "i32", "TY": "i32", **sizes, "FRAMES": "i32"},
                  {**taps, "HAS_BIAS": gelu, "GELU": gelu, "BLOCK_X": bx, "BLOCK_C": bc}, warps, aligned_ints=("C",))
        bx, bc, warps = dw.WGRAD_BLOCK
        build(dk._wgrad_kernel, {"x_ptr": "*fp32", "dy_ptr": "*bf16", "part_ptr": "*fp32", "B": "i32", "TX": "i32",
                                 "TY": "i32", **sizes, "COLS": "i32"},
              {**taps, "BLOCK_X": bx, "BLOCK_C": bc}, warps, aligned_ints=("C",))
    """) == 3
