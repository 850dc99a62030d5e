"""The single-process brick of every SP mode: block planning, the explicit kernel, lse merging.

A 'local ring' (keys split into blocks with their global positions, merged block by block)
must equal plain attention over all keys, for outputs and gradients, in fp64; in fp32 the
kernel's error must stay within 2x that of PyTorch's SDPA in fp32.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaslide.parallel.local_attn import (BlockPair, Segment, _cudnn_forward, _flash_backward, _flash_forward,
                                           attention_backward,
                                           attention_forward, block_backward_, block_forward_, contiguous_layout,
                                           layout_from_shards, plan_block_pairs, select_backend)
from megaslide.testing import within_tolerance


def reference(q, k, v, causal, seq_len=None):
    """Plain attention, (B, h, N, d) layout, positions 0..N-1, keys >= seq_len masked."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, h, N, N)
    n = q.shape[2]
    pos = torch.arange(n)
    masked = torch.zeros(n, n, dtype=torch.bool)
    if causal:
        masked |= pos[None, :] > pos[:, None]
    if seq_len is not None:
        masked |= pos[None, :] >= seq_len
    return s.masked_fill(masked, float("-inf")).softmax(-1) @ v  # (B, h, N, d)


def rand(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_plan_block_pairs_by_hand():
    a, b = contiguous_layout(0, 4), contiguous_layout(4, 4)
    assert plan_block_pairs(a, a, causal=False, seq_len=None) == [BlockPair(slice(0, 4), slice(0, 4), False)]
    assert plan_block_pairs(a, a, causal=True, seq_len=None) == [BlockPair(slice(0, 4), slice(0, 4), True)]
    assert plan_block_pairs(a, b, causal=True, seq_len=None) == []  # keys after every query
    assert plan_block_pairs(b, a, causal=True, seq_len=None) == [BlockPair(slice(0, 4), slice(0, 4), False)]
    # padding: positions >= 6 are dropped from the key block
    assert plan_block_pairs(a, b, causal=False, seq_len=6) == [BlockPair(slice(0, 4), slice(0, 2), False)]
    assert plan_block_pairs(a, b, causal=False, seq_len=4) == []
    # diagonal block with 2 valid keys: a 2x2 causal square, then rows 2..3 see both keys
    assert plan_block_pairs(b, b, causal=True, seq_len=6) == [BlockPair(slice(0, 2), slice(0, 2), True),
                                                              BlockPair(slice(2, 4), slice(0, 2), False)]


def test_plan_block_pairs_interleaved_layouts():
    q_layout = (Segment(0, 2), Segment(4, 2))  # a ring_intra Ulysses group: shards 0 and 2
    k_layout = (Segment(2, 2), Segment(6, 2))  # shards 1 and 3
    assert plan_block_pairs(q_layout, k_layout, causal=True, seq_len=None) == [
        BlockPair(slice(2, 4), slice(0, 2), False)]
    assert len(plan_block_pairs(q_layout, k_layout, causal=False, seq_len=None)) == 4
    with pytest.raises(ValueError, match="shard the sequence evenly"):
        plan_block_pairs((Segment(0, 4),), (Segment(2, 4),), causal=True, seq_len=None)


def test_layout_from_shards_merges_neighbours():
    assert layout_from_shards([0, 1], 3) == (Segment(0, 6),)
    assert layout_from_shards([0, 2], 3) == (Segment(0, 3), Segment(6, 3))
    assert layout_from_shards([1, 2, 4], 2) == (Segment(2, 4), Segment(8, 2))


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_kernel_matches_reference(causal):
    q, k, v, dout = (rand(2, 3, 7, 5, seed=s) for s in range(4))
    out, lse = attention_forward(q, k, v, causal=causal, scale=5 ** -0.5)
    torch.testing.assert_close(out, reference(q, k, v, causal), rtol=0, atol=1e-12)
    s = q @ k.transpose(-1, -2) * 5 ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=1e-12)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    reference(*leaves, causal).backward(dout)
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, scale=5 ** -0.5)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal, seq_len", [(False, None), (True, None), (True, 10), (False, 9)])
def test_local_ring_of_blocks_equals_full_attention(causal, seq_len):
    """Queries of the middle block against keys split into 3 blocks, merged through the lse."""
    n, blocks = 4, 3
    q, k, v, dout = (rand(1, 2, n * blocks, 3, seed=10 + s) for s in range(4))
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference(*ref_leaves, causal, seq_len)
    ref.backward(dout)
    layouts = [contiguous_layout(j * n, n) for j in range(blocks)]
    me = 1
    rows = slice(me * n, (me + 1) * n)
    out = torch.zeros(1, 2, n, 3, dtype=torch.float64)
    lse = torch.full((1, 2, n), float("-inf"), dtype=torch.float64)
    for j in (1, 0, 2):  # ring order of rank 1: own block first
        kb = slice(j * n, (j + 1) * n)
        block_forward_(out, lse, q[:, :, rows], k[:, :, kb], v[:, :, kb],
                       plan_block_pairs(layouts[me], layouts[j], causal=causal, seq_len=seq_len), 3 ** -0.5)
    torch.testing.assert_close(out, ref[:, :, rows].detach(), rtol=0, atol=1e-12)
    dq = torch.zeros_like(out)
    for j in range(blocks):
        kb = slice(j * n, (j + 1) * n)
        dk, dv = torch.zeros_like(out), torch.zeros_like(out)
        block_backward_(dq, dk, dv, dout[:, :, rows], q[:, :, rows], k[:, :, kb], v[:, :, kb], out, lse,
                        plan_block_pairs(layouts[me], layouts[j], causal=causal, seq_len=seq_len), 3 ** -0.5)
        # rank 1's share of dK/dV for block j: the reference restricted to queries of rows `rows`
        part = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = reference(*part, causal, seq_len)
        o.backward(torch.where((torch.arange(n * blocks) // n == me)[None, None, :, None], dout, 0.0))
        torch.testing.assert_close(dk, part[1].grad[:, :, kb], rtol=0, atol=1e-12)
        torch.testing.assert_close(dv, part[2].grad[:, :, kb], rtol=0, atol=1e-12)
    torch.testing.assert_close(dq, ref_leaves[0].grad[:, :, rows], rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_error_within_twice_torch(causal):
    q64, k64, v64, do64 = (rand(2, 4, 33, 16, seed=20 + s) for s in range(4))
    ref_leaves = [t.clone().requires_grad_(True) for t in (q64, k64, v64)]
    ref = reference(*ref_leaves, causal)
    ref.backward(do64)
    refs = [ref.detach()] + [t.grad for t in ref_leaves]
    q, k, v, do = (t.float() for t in (q64, k64, v64, do64))
    torch_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch_out = F.scaled_dot_product_attention(*torch_leaves, is_causal=causal)
    torch_out.backward(do)
    torch_res = [torch_out.detach()] + [t.grad for t in torch_leaves]
    out, lse = attention_forward(q, k, v, causal=causal, scale=16 ** -0.5)
    ours = [out] + list(attention_backward(do, q, k, v, out, lse, causal=causal, scale=16 ** -0.5))
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, torch_res, refs):
        err, bar = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
        assert within_tolerance(err, bar, 0.0), f"{name}: {err:.3g} > 2 x torch's {bar:.3g}"


def test_cpu_selects_explicit_and_says_why_not_the_fused_kernels():
    q = rand(1, 1, 4, 8, dtype=torch.float32)
    backend, why_not = select_backend(q, q, q)
    assert backend.name == "explicit"
    assert "CUDA" in why_not["flash"] and "CUDA" in why_not["cudnn"]
    backend, why_not = select_backend(q, q, q, backward=True)
    assert backend.name == "explicit" and set(why_not) == {"flash"}  # cuDNN has no backward here
    assert "CUDA" in why_not["flash"]


@pytest.mark.parametrize("causal", [False, True])
def test_flash_op_calls_match_this_torch_schema(causal):
    """The CUDA fast path cannot run here; its aten calls are checked on meta tensors (shapes, dtypes,
    argument conventions), so a schema change in torch fails in CI rather than on the GPU."""
    q, k, v = (torch.empty(2, 3, 40, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    out, lse = _flash_forward(q, k, v, causal, 0.125)
    assert out.shape == (2, 3, 40, 64) and out.dtype == torch.float32
    assert lse.shape == (2, 3, 40) and lse.dtype == torch.float32
    dq, dk, dv = _flash_backward(torch.empty_like(q), q, k, v, out, lse, causal, 0.125)
    assert dq.shape == dk.shape == dv.shape == (2, 3, 40, 64) and dq.dtype == torch.float32


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_op_call_matches_this_torch_schema(causal):
    """The cuDNN forward returns lse as (B, h, Nq, 1); ours hands it on as (B, h, Nq) fp32 (meta tensors)."""
    q, k, v = (torch.empty(2, 3, 40, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    out, lse = _cudnn_forward(q, k, v, causal, 0.125)
    assert out.shape == (2, 3, 40, 64) and out.dtype == torch.float32
    assert lse.shape == (2, 3, 40) and lse.dtype == torch.float32
