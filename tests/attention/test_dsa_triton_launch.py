"""The fused backward over head groups (kernels.dsa_backward with a bounded fp32 dK / dV
scratch) against one launch over all heads, under the Triton interpreter: every gradient
bit-identical, for groups that divide the heads and for a partial last group."""
from __future__ import annotations

import pytest
import torch

from tests.attention.test_dsa_triton import kernels, make_inputs

SHAPE, KERNEL = (2, 3, 4, 5, 3, 16), (3, 3, 3)  # B = 2, 3 heads of d = 16
PER_HEAD = 2 * 4 * 2 * 60 * 16  # fp32 dK + dV bytes of one head: 2 x 4 B x B x N x d


def test_heads_per_group_rule():
    assert kernels.heads_per_group(2, 60, 3, 16, torch.bfloat16, scratch_bytes=2 * PER_HEAD) == 2
    assert kernels.heads_per_group(2, 60, 3, 16, torch.bfloat16, scratch_bytes=PER_HEAD - 1) == 1  # one at least
    assert kernels.heads_per_group(2, 60, 3, 16, torch.float16, scratch_bytes=10 * PER_HEAD) == 3
    assert kernels.heads_per_group(2, 60, 3, 16, torch.float32, scratch_bytes=1) == 3  # fp32: the outputs
    # 2M tokens x 16 heads x 128 in bf16 within the default 1 GiB: one head (2 GiB) per launch
    assert kernels.heads_per_group(1, 2 ** 21, 16, 128, torch.bfloat16) == 1
    # the 262K-token benchmark shape (16 heads x 64): 128 MiB per head, 8 heads per launch
    assert kernels.heads_per_group(1, 2 ** 18, 16, 64, torch.bfloat16) == 8


@pytest.mark.parametrize("offsets_grad", [True, False])
@pytest.mark.parametrize("heads_per_launch", [1, 2])  # 3 launches; 2 launches with a partial last group
def test_grouped_backward_equals_one_launch(heads_per_launch, offsets_grad):
    q, k, v, offsets, grad_out = make_inputs(SHAPE, KERNEL, torch.bfloat16, offset_std=1.5)
    offsets = offsets.float()  # as the module calls it: bf16 activations, fp32 offsets
    out, lse = kernels.dsa_forward(q, k, v, offsets, KERNEL, 0.25)
    args = (q, k, v, offsets, out, lse, grad_out, KERNEL, 0.25, offsets_grad)
    whole = kernels.dsa_backward(*args)
    grouped = kernels.dsa_backward(*args, scratch_bytes=heads_per_launch * PER_HEAD)
    assert kernels.heads_per_group(2, 60, 3, 16, torch.bfloat16, heads_per_launch * PER_HEAD) == heads_per_launch
    for name, a, b in zip(["dq", "dk", "dv", "doffsets"], whole, grouped):
        if not offsets_grad and name == "doffsets":
            assert a is None and b is None
            continue
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert whole[1].dtype == torch.bfloat16 and whole[1].abs().sum() > 0
