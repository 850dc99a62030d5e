"""The CUDA C++ halo forward of 3D-DSA (megaslide/attention/dsa/halo_cuda.py, cuda/halo_fwd.cu).

On CPU: its emulation in torch (the kernel's per-tile algorithm) with the gather forward of the remaining tiles
under the Triton interpreter (halo_rest.py), against the float64 reference for out and the lse, tiles inside, on
and beyond the halo bound in one call, odd grids, clamped edges and padded head dims, and its paths against the
plain rule (`reference.halo_paths_reference`); the input checks; with nvcc, the kernel's sm_90 build (shared
memory, spills, the layout's size against the Python mirror). On a GPU: the kernel itself on the same cases.

Tolerance rule as tests/attention/test_dsa_halo.py (megaslide.testing.within_tolerance): the float64 reference
is the truth, and the kernel may be at most 2x as wrong as the same-dtype reference, plus a rounding floor.
"""
from __future__ import annotations

import ctypes
import importlib
import re
import shutil
import subprocess

import pytest
import torch

from tests.attention.test_dsa_triton import forward, launch  # built for the interpreter
from megaslide.attention.dsa import halo_cuda, halo_rest
from megaslide.attention.dsa.reference import (deformable_slide_attention_reference,
                                               halo_paths_reference, log_sum_exp_reference)
from megaslide.offload.csrc import build
from megaslide.testing import dsa_halo_inputs, rounding_floor, within_tolerance

if halo_rest._forward_queries is not forward._forward_queries:  # built before the interpreter was set
    importlib.reload(halo_rest)
    importlib.reload(halo_cuda)
assert launch.INTERPRETED

F64 = torch.float64
KERNEL = (3, 3, 3)
SM90_SHARED = 232448  # bytes per block, opt-in
SM90_SM_SHARED = 233472  # bytes per SM; each resident CTA also reserves 1 KiB
CASES = {  # name: (shape, reach, tile, offsets dtype, beyond: (t, y, x) -> centre sample's offset, past the bound)
    # 3 x 5 x 13 in 2 x 4 x 4 tiles (clamped edges along every axis); d 24 runs padded to 32; (0, 1, 9)'s centre
    # sample at x 0.5 and (2, 4, 3)'s at (y 0, x 12) leave their tiles' halos
    "reach1_odd_grid_d24": ((1, 3, 5, 13, 1, 24), 1, (2, 4, 4), torch.float32,
                            {(0, 1, 9): (0.0, 0.0, -8.5), (2, 4, 3): (0.0, -9.0, 8.0)}),
    # 1 x 4 x 4 tiles whose reach-2 halos span 10 tokens along x of 16; bf16 offsets
    "reach2_two_heads_d16": ((1, 3, 7, 16, 2, 16), 2, (1, 4, 4), torch.bfloat16, {(1, 3, 8): (0.5, 2.5, -7.25)}),
    # the default tile at reach 0, d 48 (padded to 48 in the kernel, 64 in the gathers); (0, 0, 0)'s centre sample
    # clamped onto the grid's corner stays in its halo
    "reach0_default_tile_d48": ((2, 4, 5, 9, 1, 48), 0, None, torch.float32,
                                {(2, 1, 7): (0.0, 0.0, -5.0), (0, 0, 0): (-100.0, -100.0, -100.0)}),
}


def halo_case(name: str, device: str = "cpu"):
    shape, reach, tile, offsets_dtype, beyond = CASES[name]
    q, k, v, offsets = dsa_halo_inputs(shape, reach, torch.bfloat16, beyond)
    return [x.to(device) for x in (q, k, v, offsets.to(offsets_dtype))], reach, tile


def check_against_reference(q, k, v, offsets, reach, tile):
    """out and lse of `dsa_halo_forward_cuda` against float64 beside the same-dtype reference, and its paths
    against the plain rule; returns the path counts."""
    scale = q.shape[-1] ** -0.5
    out, lse, path = halo_cuda.dsa_halo_forward_cuda(q, k, v, offsets, KERNEL, scale, reach, tile=tile)
    q, k, v, offsets, out, lse, path = (x.cpu() for x in (q, k, v, offsets, out, lse, path))
    wide = [x.to(F64) for x in (q, k, v, offsets)]
    cases = {"out": (out, deformable_slide_attention_reference(*wide, KERNEL, scale),
                     deformable_slide_attention_reference(q, k, v, offsets, KERNEL, scale)),
             "lse": (lse, log_sum_exp_reference(wide[0], wide[1], wide[3], KERNEL, scale),
                     log_sum_exp_reference(q.float(), k.float(), offsets, KERNEL, scale))}
    for name, (got, want, ref) in cases.items():
        err = (got.to(F64) - want).abs().max().item()
        ref_err = (ref.to(F64) - want).abs().max().item()
        floor = rounding_floor(got.dtype, want)
        assert got.shape == want.shape and within_tolerance(err, ref_err, floor), \
            f"{name}: error {err:.3e} > 2 x {ref_err:.3e} + {floor:.1e}"
    tile = tile or launch.halo_config(reach).tile
    assert torch.equal(path, halo_paths_reference(offsets, KERNEL, reach, tile))
    return {"halo": int(path.sum()), "gather": int((path == 0).sum())}


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_halo_and_interpreted_gathers_match_reference(name):
    counts = check_against_reference(*halo_case(name)[0], *halo_case(name)[1:])
    assert counts["halo"] > 0 and counts["gather"] > 0, counts


def test_gather_rest_runs_only_path_zero_tiles():
    """halo_rest leaves path-1 tiles untouched and writes the gather forward's out and lse for path-0 tiles."""
    q, k, v, offsets = dsa_halo_inputs((1, 3, 4, 4, 1, 16), 1, torch.bfloat16)  # 2 x 1 x 1 tiles of 2 x 4 x 4
    path = torch.tensor([[1, 0]], dtype=torch.int8)  # tile 1: frame 2 (the grid's last, a clipped tile)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 1, 48), float("nan"))
    halo_rest.gather_rest(q, k, v, offsets, KERNEL, 0.25, (2, 4, 4), out, lse, path)
    want, want_lse = forward.dsa_forward(q, k, v, offsets, KERNEL, 0.25)
    assert torch.equal(out[:, 2:], want[:, 2:]) and out[:, :2].isnan().all()
    assert torch.equal(lse[..., 32:], want_lse[..., 32:]) and lse[..., :32].isnan().all()


def test_store_lse_false_returns_none():
    (q, k, v, offsets), reach, tile = halo_case("reach2_two_heads_d16")
    out, lse, path = halo_cuda.dsa_halo_forward_cuda(q, k, v, offsets, KERNEL, 0.25, reach, store_lse=False,
                                                     tile=tile)
    assert lse is None and out.dtype == torch.bfloat16 and path.shape == (2, 3 * 2 * 4)


@pytest.mark.parametrize("change, match", [
    (lambda x: {**x, "q": x["q"].float(), "k": x["k"].float(), "v": x["v"].float()}, r"dtype.*bf16.*halo\.dsa_halo"),
    (lambda x: {**x, "offsets": x["offsets"].double()}, r"offsets dtype"),
    (lambda x: {**x, "q": x["q"].transpose(2, 3).contiguous().transpose(2, 3)}, r"q must be contiguous"),
    (lambda x: {**x, **{n: x[n][..., :12].contiguous() for n in "qkv"}}, r"head dim d=12.*multiple of 8"),
    (lambda x: {**x, **{n: torch.zeros(*x[n].shape[:5], 136, dtype=torch.bfloat16) for n in "qkv"}},
     r"head dim d=136"),
    (lambda x: {**x, "reach": 3}, r"halo_reach"),
    (lambda x: {**x, "reach": True}, r"halo_reach"),
    (lambda x: {**x, "tile": (2, 2, 2)}, r"tile=\(2, 2, 2\).*16 or 32"),
    (lambda x: {**x, "tile": (3, 4, 4)}, r"tile=\(3, 4, 4\)"),
    (lambda x: {**x, **{n: torch.zeros(*x[n].shape[:5], 128, dtype=torch.bfloat16) for n in "qkv"},
                "reach": 2, "tile": (2, 4, 4)}, r"halo_reach=2 .*shared memory"),
])
def test_input_checks_name_the_parameter(change, match):
    (q, k, v, offsets), _, _ = halo_case("reach1_odd_grid_d24")
    args = change({"q": q, "k": k, "v": v, "offsets": offsets, "reach": 1, "tile": None})
    with pytest.raises(ValueError, match=match):
        halo_cuda.dsa_halo_forward_cuda(args["q"], args["k"], args["v"], args["offsets"], KERNEL, 0.25,
                                        args["reach"], tile=args["tile"])


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")


@needs_nvcc
def test_kernel_builds_for_sm90_within_shared_memory_without_spills(tmp_path):
    """Build the library as build.load_cuda does, with ptxas's report: the default tile (2 x 4 x 4 at reach 1)
    at d 64 and d 128 spills nothing, and its shared memory (the layout's, read from the library, equal to the
    Python mirror, plus any static) fits 227 KiB; at d 64 two CTAs fit an SM."""
    lib_path = tmp_path / "libhalo_fwd.so"
    cmd = [build.nvcc(), *build.cuda_compile_flags("90"), "-Xptxas", "-v", str(halo_cuda.SOURCE), "-o", str(lib_path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = {}  # (BQ, D_PAD) -> ptxas's lines for that kernel
    for entry, body in re.findall(r"Compiling entry function '(\S+)' for 'sm_90'\n(.*?)(?=Compiling entry|\Z)",
                                  done.stdout + done.stderr, re.S):
        bq, d_pad = map(int, re.search(r"halo_fwd_kernelILi(\d+)ELi(\d+)E", entry).groups())
        report[(bq, d_pad)] = body
    assert len(report) == len(halo_cuda.TILE_QUERIES) * len(halo_cuda.PADDED_HEAD_DIMS), sorted(report)
    lib = ctypes.CDLL(str(lib_path))
    lib.megaslide_dsa_halo_fwd_shared_bytes.restype = ctypes.c_long
    tile = launch.halo_config(1).tile
    for d in (64, 128):
        body = report[(32, d)]
        assert re.search(r"\b0 bytes spill stores", body), body
        static = re.search(r"(\d+) bytes smem", body)
        dynamic = halo_cuda.shared_bytes(tile, d, KERNEL, 1)
        assert dynamic == lib.megaslide_dsa_halo_fwd_shared_bytes(32, d, 384, 27)  # 6 x 8 x 8 halo
        total = dynamic + (int(static.group(1)) if static else 0)
        assert total <= SM90_SHARED, (d, total)
        if d == 64:
            assert 2 * (total + 1024) <= SM90_SM_SHARED, total


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the launcher's failure where no GPU is present")
def test_the_launcher_takes_its_c_signature_through_ctypes(monkeypatch, tmp_path):
    """The library's launcher called as `_launch` calls it, with the argument types `library` declares: on a
    machine without a GPU it returns a CUDA error code (the runtime finds no device before any launch) and its
    message, where a mismatch between the declared and the C argument list would raise a TypeError."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    halo_cuda.library.cache_clear()
    lib = halo_cuda.library("90")
    (q, k, v, offsets), reach, tile = halo_case("reach1_odd_grid_d24")
    out, lse, path = torch.empty_like(q), torch.empty(1, 1, 3 * 5 * 13), torch.empty(1, 8, dtype=torch.int8)
    code = halo_cuda.call_kernel(lib, None, q, k, v, offsets, out, lse, path, KERNEL, 0.25, reach, tile)
    assert code != 0 and lib.megaslide_dsa_halo_error_string(code)
    halo_cuda.library.cache_clear()


@needs_nvcc
def test_cuda_build_is_cached_per_architecture(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    sm90, sm80 = (build.cuda_library_path(halo_cuda.SOURCE, arch) for arch in ("90", "80"))
    assert tmp_path in sm90.parents and sm90 != sm80 and sm90.name == "libhalo_fwd.so"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_matches_reference(name):
    """The kernel on the GPU, bf16: out and lse against float64, paths against the plain rule, the same bits
    twice (no atomics), and the library's shared-memory size equal to the Python mirror."""
    (q, k, v, offsets), reach, tile = halo_case(name, "cuda")
    counts = check_against_reference(q, k, v, offsets, reach, tile)
    assert counts["halo"] > 0 and counts["gather"] > 0, counts
    runs = [halo_cuda.dsa_halo_forward_cuda(q, k, v, offsets, KERNEL, 0.25, reach, tile=tile) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    tile = tile or launch.halo_config(reach).tile
    lib = halo_cuda.library_for(q.device)
    extent = [s + 2 + 2 * reach for s in tile]
    halo_pad = -(-extent[0] * extent[1] * extent[2] // 16) * 16
    assert lib.megaslide_dsa_halo_fwd_shared_bytes(tile[0] * tile[1] * tile[2], q.shape[-1], halo_pad, 27) == \
        halo_cuda.shared_bytes(tile, q.shape[-1], KERNEL, reach)
