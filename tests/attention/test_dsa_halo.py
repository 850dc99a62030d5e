"""The halo forward of 3D-DSA (megaslide/attention/dsa/halo.py) against the float64 reference, on CPU through
the Triton interpreter: out and the log-sum-exp with tiles inside, on and beyond the halo bound in one call,
odd grids, clamped edges, padded head dims, fp32 and bf16; its choice of path against the plain rule
(`reference.halo_paths_reference`); and the op's backward after the halo forward.

Tolerance rule as tests/attention/test_dsa_triton.py (megaslide.testing.within_tolerance): with every input
rounded to the tested dtype, the float64 reference is the truth, and the kernel may be at most 2x as wrong
as the same-dtype reference, plus a floor at rounding level.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.attention.test_dsa_triton import FLOOR_ULPS, forward, launch, run  # noqa: E402  (built for the interpreter)
from megaslide.attention.dsa import deformable_slide_attention, halo  # noqa: E402
from megaslide.attention.dsa.launch import HaloConfig  # noqa: E402
from megaslide.testing import check_dsa_halo, dsa_halo_inputs, rounding_floor, within_tolerance  # noqa: E402
from tests.helpers import builds_for_sm90  # noqa: E402

if halo._forward_queries is not forward._forward_queries:  # halo.py was built before the interpreter was set
    importlib.reload(halo)
assert launch.INTERPRETED

F64 = torch.float64
KERNEL = (3, 3, 3)


def assert_close(name, got, want, same_dtype):
    err = (got.to(F64) - want).abs().max().item()
    ref_err = (same_dtype.to(F64) - want).abs().max().item()
    floor = rounding_floor(got.dtype, want, FLOOR_ULPS)
    assert within_tolerance(err, ref_err, floor), f"{name}: error {err:.3e} > 2 x {ref_err:.3e} + {floor:.1e}"


def check_halo_forward(shape, reach, tile, dtype, beyond):
    """The halo forward's out and lse against the reference and its paths against the plain rule
    (megaslide.testing.check_dsa_halo); returns the path counts."""
    check = check_dsa_halo(*dsa_halo_inputs(shape, reach, dtype, beyond), reach, tile)
    assert check["passed"], check
    return check["paths"]


def test_mixed_tiles_odd_grid_padded_head_dim():
    # 3 x 5 x 13 in two tiles of 4 x 8 x 8 (clamped edges on every side) whose reach-1 halos span 12 tokens
    # along x: [0, 11] and [1, 12]; (0, 1, 9)'s centre sample at x 0.5 leaves the second, (2, 4, 3)'s at
    # y 0, x 11 stays in the first. d = 24 runs padded to 32
    counts = check_halo_forward((1, 3, 5, 13, 1, 24), 1, (4, 8, 8), torch.float32,
                                beyond={(0, 1, 9): (0.0, 0.0, -8.5), (2, 4, 3): (0.0, -9.0, 8.0)})
    assert counts["halo"] > 0 and counts["gather"] > 0, counts


def test_reach_two_bf16_two_heads():
    # 3 x 7 x 16 in two tiles of 4 x 8 x 8 whose reach-2 halos span 14 tokens along x: [0, 13] and [2, 15]
    counts = check_halo_forward((1, 3, 7, 16, 2, 16), 2, (4, 8, 8), torch.bfloat16,
                                beyond={(1, 3, 8): (0.5, 2.5, -7.25)})
    assert counts["halo"] > 0 and counts["gather"] > 0, counts


def test_fp32_d128_scores_summed_over_two_chunks():
    # fp32 at d = 128: the score dot runs as two chunks of 64 head columns (halo.FP32_DOT_CHUNK); 2 x 4 x 4
    # tiles at reach 0 on 3 x 4 x 9, one tile moved to the gathers
    counts = check_halo_forward((1, 3, 4, 9, 1, 128), 0, (2, 4, 4), torch.float32, beyond={(2, 1, 7): (0.0, 0.0, -5.0)})
    assert counts["halo"] > 0 and counts["gather"] > 0, counts


def test_path_choice_counts():
    """Tiles whose samples stay in their halo take it, the rest the gathers: one sample 5 tokens past the
    bound moves exactly its tile, in its head only; a far offset clamped at the grid's corner stays in the
    corner tile's halo. (Offsets on the bound: the accuracy tests, whose paths match the plain rule.)"""
    # 3 x 8 x 16 in two tiles of 4 x 8 x 8 whose reach-1 halos span [0, 11] and [4, 15] along x
    shape, reach, tile = (1, 3, 8, 16, 2, 16), 1, (4, 8, 8)
    q, k, v, offsets = dsa_halo_inputs(shape, reach, torch.float32)
    moved = offsets.new_zeros(offsets.shape)
    moved[0, 1, 5, 9, 1, 4, 2] = -(reach + 5)  # query (t 1, y 5, x 9), sample at x 3: tile 1 of head 1
    moved[0, 0, 0, 0, 0, 4, :] = -100.0  # clamped onto (0, 0, 0): in tile 0's halo
    _, _, path = halo.dsa_halo_forward(q, k, v, moved, KERNEL, 0.25, reach, store_lse=False, config=HaloConfig(tile))
    assert halo.path_counts(path) == {"halo": 3, "gather": 1}
    assert path.tolist() == [[1, 1], [1, 0]]


@pytest.mark.parametrize("halo_kernel, dtype", [("triton", torch.float32), ("cuda", torch.bfloat16)])
def test_op_backward_after_halo_forward(halo_kernel, dtype):
    """The op with halo_reach runs the halo forward and the gather kernels' backward on the lse it stored; with
    halo_kernel="cuda" the forward is halo_cuda.py's (on CPU tensors its emulation of the CUDA kernel)."""
    q, k, v, offsets = dsa_halo_inputs((1, 3, 4, 5, 1, 16), 1, dtype)  # two tiles of 2 x 4 x 4
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    inputs = [q, k, v, offsets, grad]
    truth = run("reference", inputs, KERNEL, F64)
    same_dtype = run("reference", inputs, KERNEL, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, offsets)]
    out = deformable_slide_attention(*leaves, KERNEL, backend="triton", halo_reach=1, halo_kernel=halo_kernel)
    got = [out.detach(), *torch.autograd.grad(out, leaves, grad)]
    for name, g, want, ref in zip(["out", "dq", "dk", "dv", "doffsets"], got, truth, same_dtype):
        assert_close(name, g, want, ref)


@pytest.mark.parametrize("reach, kernel", [(-1, "triton"), (1.5, "triton"), (True, "triton"), (3, "triton"),
                                           (None, "cuda"), (1, "CUDA")])
def test_bad_reach_or_halo_kernel_is_refused(reach, kernel):
    q = torch.zeros(1, 3, 3, 3, 1, 16)
    offsets = torch.zeros(1, 3, 3, 3, 1, 27, 3)
    with pytest.raises(ValueError, match="halo_reach" if kernel == "triton" else "halo_kernel"):
        deformable_slide_attention(q, q, q, offsets, KERNEL, backend="reference", halo_reach=reach,
                                   halo_kernel=kernel)


def test_halo_kernel_builds_for_sm90_with_few_shuffles():
    """The interpreter cannot catch GPU lowering errors (the dots, the branch to the gather forward) nor a
    kernel that swells in lowering: build the kernel to sm_90 SASS (tests/helpers.py: builds_for_sm90) on a
    small tile, then on the benchmark's reach-1 tile (1 x 4 x 4 queries, a 5 x 8 x 8 halo padded to 512,
    d 64), and bound the warp shuffles of each: its reductions take a few dozen, while a `tl.gather` from an
    on-chip tile, lowered to shuffles, takes thousands on the small tile and on the large one swells the
    kernel past what LLVM builds in reasonable time (halo.py's module docstring)."""
    assert builds_for_sm90("""
        from megaslide.attention.dsa import halo

        MAX_SHUFFLES = 256
        fwd = {**{n: "*bf16" for n in ["q_ptr", "k_ptr", "v_ptr", "out_ptr"]}, "off_ptr": "*fp32",
               "lse_ptr": "*fp32", "path_ptr": "*i8", **{n: "i32" for n in ["T", "H", "W", "HEADS", "D", "stride_tok",
                                                                              "stride_off_tok"]}, "qk_scale": "fp32"}
        small = {"KT": 3, "KH": 3, "KW": 3, "TILE_T": 2, "TILE_Y": 2, "TILE_X": 4, "REACH": 0, "ET": 4, "EY": 4,
                 "EX": 6, "HALO": 128, "BLOCK_D": 32, "STORE_LSE": True, "WIDE": False, "EVEN_D": False,
                 "PRECISION": "tf32", "DOT_FP32": False, "DOT_CHUNK": 32}
        bench = {**small, "TILE_T": 1, "TILE_Y": 4, "TILE_X": 4, "REACH": 1, "ET": 5, "EY": 8, "EX": 8, "HALO": 512,
                 "BLOCK_D": 64, "EVEN_D": True, "DOT_CHUNK": 64}
        for tile in (small, bench):
            compiled = build(halo._dsa_halo_fwd_kernel, fwd, tile, 4, aligned_ints=("D", "stride_tok"))
            shuffles = compiled.asm["ptx"].count("shfl.sync")
            assert shuffles <= MAX_SHUFFLES, f"{shuffles} warp shuffles in the PTX at HALO {tile['HALO']}"
    """) == 2


def test_halo_too_large_for_the_chip_names_the_option(monkeypatch):
    """A halo whose K rows do not fit the GPU's shared memory fails at launch in the compiler (only a GPU
    raises it); the op turns that into an error naming halo_reach and the fixes."""
    from triton.runtime.errors import OutOfResources

    class TooLarge:
        def __getitem__(self, grid):
            def launch_(*args, **kwargs):
                raise OutOfResources(327680, 232448, "shared memory")
            return launch_

    monkeypatch.setattr(halo, "_dsa_halo_fwd_kernel", TooLarge())
    q, k, v, offsets = dsa_halo_inputs((1, 3, 4, 5, 1, 48), 2, torch.float32)
    with pytest.raises(ValueError, match=r"halo_reach=2 .*7x10x10 halo of 48-wide float32 K rows.*bf16 inputs"):
        halo.dsa_halo_forward(q, k, v, offsets, KERNEL, 0.25, 2)


def test_gpu_check_halo_cases_fit_the_chip_in_fp32():
    """The GPU check's largest halo cases (gpu_check_dsa.HALO_CASES: reach 1 at d 64, reach 2 at d 32, reach 0 at
    d 128 with its score dot in two chunks) build
    for sm_90 in fp32 within the H100's and H200's 227 KB of shared memory per block (fp32 at reach 2 and d 48,
    or at reach 1 and d 128, takes 320 KB and is refused at launch: the test above)."""
    assert builds_for_sm90("""
        from megaslide.attention.dsa import halo

        LIMIT = 232448
        fwd = {**{n: "*fp32" for n in ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "off_ptr", "lse_ptr"]},
               "path_ptr": "*i8", **{n: "i32" for n in ["T", "H", "W", "HEADS", "D", "stride_tok", "stride_off_tok"]},
               "qk_scale": "fp32"}
        base = {"KT": 3, "KH": 3, "KW": 3, "STORE_LSE": True, "WIDE": False, "EVEN_D": True, "PRECISION": "ieee",
                "DOT_FP32": False}
        reach1_d64 = {**base, "TILE_T": 2, "TILE_Y": 4, "TILE_X": 4, "REACH": 1, "ET": 6, "EY": 8, "EX": 8,
                      "HALO": 512, "BLOCK_D": 64, "DOT_CHUNK": 64}
        reach2_d32 = {**base, "TILE_T": 1, "TILE_Y": 4, "TILE_X": 4, "REACH": 2, "ET": 7, "EY": 10, "EX": 10,
                      "HALO": 1024, "BLOCK_D": 32, "DOT_CHUNK": 32}
        reach0_d128 = {**base, "TILE_T": 2, "TILE_Y": 4, "TILE_X": 4, "REACH": 0, "ET": 4, "EY": 6, "EX": 6,
                       "HALO": 256, "BLOCK_D": 128, "DOT_CHUNK": 64}  # two chunks of the score dot
        for tile in (reach1_d64, reach2_d32, reach0_d128):
            compiled = build(halo._dsa_halo_fwd_kernel, fwd, tile, 4, aligned_ints=("D", "stride_tok"))
            assert compiled.metadata.shared <= LIMIT, (tile, compiled.metadata.shared)
    """) == 3
