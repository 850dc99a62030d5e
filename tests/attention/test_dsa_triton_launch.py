"""How the fused kernels are launched, under the Triton interpreter: the backward over head groups
(backward.dsa_backward with a bounded scratch of entries and key-tile lists) against one launch over all
heads, every gradient bit-identical (the interpreter runs programs in order, so the lists' order is fixed);
and the order in which programs take query blocks (sampling._query_block) against the float64 reference."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megaslide.attention.dsa import deformable_slide_attention
from tests.attention.test_dsa_triton import backward, forward, launch, make_inputs, zero_kernels

SHAPE, KERNEL = (2, 1, 4, 5, 3, 16), (1, 3, 3)  # B = 2, N = 20, 3 heads of d = 16
K = 9
PER_HEAD = 2 * 20 * (K * (32 + 4 * 8) + 12)  # one head's scratch: B x N x (K x (32-B entry + 8 int32 records) + 12)


def test_heads_per_group_rule():
    assert backward.heads_per_group(2, 20, 3, K, scratch_bytes=2 * PER_HEAD) == 2
    assert backward.heads_per_group(2, 20, 3, K, scratch_bytes=2 * PER_HEAD - 1) == 1
    assert backward.heads_per_group(2, 20, 3, K, scratch_bytes=PER_HEAD - 1) == 1  # one at least
    assert backward.heads_per_group(2, 20, 3, K, scratch_bytes=10 * PER_HEAD) == 3
    # the 262K-token benchmark shape (16 heads, K = 27): 456 MB per head, 2 heads per launch within 1 GiB
    assert backward.heads_per_group(1, 2 ** 18, 16, 27) == 2
    # 2M tokens: 3.6 GB per head, one head per launch
    assert backward.heads_per_group(1, 2 ** 21, 16, 27) == 1


@pytest.mark.parametrize("heads_per_launch,offsets_grad", [
    (1, True),    # 3 launches
    (2, True),    # 2 launches, the last one partial
    (2, False),
])
def test_grouped_backward_equals_one_launch(heads_per_launch, offsets_grad):
    q, k, v, offsets, grad_out = make_inputs(SHAPE, KERNEL, torch.bfloat16, offset_std=1.5)
    offsets = offsets.float()  # as the module calls it: bf16 activations, fp32 offsets
    out, lse = forward.dsa_forward(q, k, v, offsets, KERNEL, 0.25)
    args = (q, k, v, offsets, out, lse, grad_out, KERNEL, 0.25, offsets_grad)
    whole = backward.dsa_backward(*args)
    grouped = backward.dsa_backward(*args, scratch_bytes=heads_per_launch * PER_HEAD)
    assert backward.heads_per_group(2, 20, 3, K, heads_per_launch * PER_HEAD) == heads_per_launch
    for name, a, b in zip(["dq", "dk", "dv", "doffsets"], whole, grouped):
        if not offsets_grad and name == "doffsets":
            assert a is None and b is None
            continue
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert whole[1].dtype == torch.bfloat16 and whole[1].abs().sum() > 0


@pytest.mark.parametrize("grid,kernel_size,block_y", [
    ((2, 3, 8), (1, 3, 3), 1),   # runs, swept: H > T, W % BLOCK_Q = 0
    ((3, 2, 8), (1, 1, 3), 1),   # runs in order: H <= T
    ((2, 5, 7), (1, 3, 3), 2),   # 2 x 4 patches, partial at the bottom and the right edge
    ((2, 6, 3), (1, 3, 3), 4),   # 4 x 2 patches, a band and a column block partial
    ((2, 3, 2), (1, 3, 1), 8),   # 8 x 1 patches taller than the frame
])
def test_block_order_covers_every_query_once(grid, kernel_size, block_y):
    """With 8-query blocks, (2, 3, 8) takes the swept order (y slowest), and patches (block_y > 1) their
    band order: a block left out would leave its output unwritten, one taken twice would add its dK / dV
    twice, and a patch row past the grid must neither load out of bounds nor store."""
    shape = (1, *grid, 1, 16)
    q, k, v, offsets, grad_out = make_inputs(shape, kernel_size, torch.float32, offset_std=2.0)
    config = launch.LaunchConfig(block_q=8, block_d=16, num_warps=1, block_y=block_y)
    out, lse = forward.dsa_forward(q, k, v, offsets, kernel_size, 0.25, config=config)
    grads = backward.dsa_backward(q, k, v, offsets, out, lse, grad_out, kernel_size, 0.25,
                                 offsets_grad=True, config=config)
    leaves = [x.double().requires_grad_() for x in (q, k, v, offsets)]
    want = deformable_slide_attention(*leaves, kernel_size, scale=0.25, backend="reference")
    want_grads = torch.autograd.grad(want, leaves, grad_out.double())
    for got, ref in zip([out, *grads], [want, *want_grads]):
        torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_a_clip_past_the_int32_entry_lists_is_refused_before_the_scratch(monkeypatch):
    """The entry lists are indexed with int32: a head whose records could reach 2**31 is refused with a
    message that names the limit and the fix, before the scratch is allocated (stand-in: 2**27 tiles per
    entry makes this small clip's bound 2 x 20 x 9 x 2**27 > 2**31)."""
    q, k, v, offsets, grad_out = make_inputs(SHAPE, KERNEL, torch.float32)
    out, lse = forward.dsa_forward(q, k, v, offsets, KERNEL, 0.25)
    monkeypatch.setattr(backward, "MAX_TILES_PER_ENTRY", 2 ** 27)
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: pytest.fail("allocated before refusing"))
    with pytest.raises(ValueError, match=r"int32: batch 2 x 20 tokens x K=9 .*execution.slab_frames"):
        backward.dsa_backward(q, k, v, offsets, out, lse, grad_out, KERNEL, 0.25, offsets_grad=True)


def test_int64_row_offsets_give_the_same_bits(monkeypatch):
    """A (batch, head) whose element offsets could reach 2**31 indexes its rows in int64 (`row_flags`' WIDE:
    2M tokens at a 1024-element token stride). Forced on this small clip, every output and gradient of the
    DSA kernels and the zero-offset kernels equals the int32 path's, bit for bit."""
    original = forward.row_flags
    assert original(2 ** 21, 1024, 64, 64) == {"WIDE": True, "EVEN_D": True}
    assert original(2 ** 21 - 1, 1024, 48, 64) == {"WIDE": False, "EVEN_D": False}
    q, k, v, offsets, grad_out = make_inputs(SHAPE, KERNEL, torch.bfloat16, offset_std=1.5)
    offsets = offsets.float()

    def run():
        out, lse = forward.dsa_forward(q, k, v, offsets, KERNEL, 0.25)
        grads = backward.dsa_backward(q, k, v, offsets, out, lse, grad_out, KERNEL, 0.25, offsets_grad=True)
        z_out, z_lse = zero_kernels.na_forward(q, k, v, KERNEL, 0.25)
        return [out, *grads, z_out, *zero_kernels.na_backward(q, k, v, z_out, z_lse, grad_out, KERNEL, 0.25)]

    narrow = run()
    for module in (forward, backward, zero_kernels):
        monkeypatch.setattr(module, "row_flags", lambda *a: {**original(*a), "WIDE": True})
    for name, a, b in zip(["out", "dq", "dk", "dv", "doffsets", "zero out", "zero dq", "zero dk", "zero dv"],
                          narrow, run()):
        assert a.abs().sum() > 0 and torch.equal(a, b), name


def test_forward_default_takes_patches_on_the_gpu_only(monkeypatch):
    """The forward's default launch (`forward_launch_config`): on a GPU, a 4-row patch of the split-row
    kernels' 4 warps of SPLIT_WARP_ELEMENTS where BLOCK_Q leaves it at least 4 wide, rows under the
    interpreter; the query pass (`query_launch_config`: `split_launch_config`'s tiles) and the zero-offset
    kernels (`launch_config`, LAUNCH_ELEMENTS) keep rows; only the query pass caps registers, at block_d <= 64."""
    assert launch.forward_launch_config(262144, 64) == launch.launch_config(262144, 64)   # interpreted here
    monkeypatch.setattr(launch, "INTERPRETED", False)
    dims = (8, 16, 64, 80, 128, 256)
    got = {d: launch.forward_launch_config(262144, d) for d in dims}
    assert {d: (c.block_q, c.block_y) for d, c in got.items()} == {8: (64, 4), 16: (64, 4), 64: (32, 4),
                                                                  80: (16, 4), 128: (16, 4), 256: (8, 1)}
    split = {d: launch.split_launch_config(262144, d) for d in dims}
    assert {d: (c.block_q, c.num_warps) for d, c in split.items()} == {8: (32, 2), 16: (32, 2), 64: (16, 2),
                                                                      80: (8, 2), 128: (8, 2), 256: (8, 2)}
    assert all(c.num_warps == 4 for c in got.values())
    assert {d: launch.launch_config(262144, d).block_q for d in dims} == {8: 32, 16: 32, 64: 16, 80: 8, 128: 8,
                                                                          256: 8}
    assert all(c.block_y == 1 for c in split.values()) and all(launch.launch_config(262144, d).block_y == 1
                                                                for d in dims)
    query = {d: launch.query_launch_config(262144, d) for d in dims}
    assert all(c == replace(split[d], maxnreg=launch.QUERY_MAXNREG if d <= 64 else None)
               for d, c in query.items())   # capped where block_d <= MAXNREG_HEAD_DIM
    assert all(c.maxnreg is None for c in (*got.values(), *split.values()))
    assert all(launch.launch_config(262144, d).maxnreg is None for d in dims)


@pytest.mark.parametrize("block_y", [2, 4])
def test_zero_offset_kernels_on_patches(block_y):
    """The zero-offset kernels (forward, dq, dk/dv over each key's inverse window) on patch blocks of a
    grid that no patch tiles evenly, against the float64 reference with zero offsets."""
    kernel_size = (3, 3, 3)
    q, k, v, offsets, grad_out = make_inputs((1, 3, 5, 6, 1, 16), kernel_size, torch.float32)
    config = launch.LaunchConfig(block_q=8, block_d=16, num_warps=1, block_y=block_y)
    out, lse = zero_kernels.na_forward(q, k, v, kernel_size, 0.25, config=config)
    grads = zero_kernels.na_backward(q, k, v, out, lse, grad_out, kernel_size, 0.25, config=config)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want = deformable_slide_attention(*leaves, torch.zeros_like(offsets, dtype=torch.float64), kernel_size,
                                      scale=0.25, backend="reference")
    want_grads = torch.autograd.grad(want, leaves, grad_out.double())
    for got, ref in zip([out, *grads], [want, *want_grads]):
        torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_patch_shape_is_checked():
    with pytest.raises(ValueError, match="block_y=3 must be a power of two dividing block_q=8"):
        launch.LaunchConfig(block_q=8, block_d=16, num_warps=1, block_y=3)
    with pytest.raises(ValueError, match="block_y=16 must be a power of two dividing block_q=8"):
        launch.LaunchConfig(block_q=8, block_d=16, num_warps=1, block_y=16)
    assert launch.query_programs((2, 5, 7), launch.LaunchConfig(8, 16, 1, block_y=2)) == 2 * 3 * 2
    assert launch.query_programs((2, 5, 7), launch.LaunchConfig(8, 16, 1)) == 9
