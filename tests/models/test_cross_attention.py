"""megaslide/models/layers.py: the cross-attention's query groups. The group count rule, and a module whose queries
run in groups against float64 SDPA with the queries whole (output and every parameter and input gradient), on odd
sizes with and without the caption mask."""
import pytest
import torch

from megaslide.models import layers
from megaslide.models.layers import CrossAttention, query_groups


@pytest.mark.parametrize("n,groups", [(1, 1), (8160, 1), (8192, 1), (16320, 2), (65280, 8), (130560, 16),
                                      (3 * 8192 + 3, 9), (2 * 8209, 1), (8209 * 8209, 1)])
def test_query_groups(n, groups):
    got = query_groups(n)
    assert got == groups and n % got == 0
    assert got == 1 or n // got <= layers.QUERY_GROUP_MAX


def _module_outputs(module, x, ctx, mask, grad):
    x, ctx = (t.detach().clone().requires_grad_() for t in (x, ctx))
    out = module(x, ctx, mask)
    params = list(module.parameters())
    return [out.detach(), *torch.autograd.grad(out, [x, ctx, *params], grad)]


@pytest.mark.parametrize("n,masked", [(35, 3), (77, 0)])
def test_grouped_module_equals_whole_queries_in_float64(monkeypatch, n, masked):
    torch.manual_seed(n)
    module = CrossAttention(dim=12, num_heads=3, context_dim=12).double()
    x, ctx, grad = torch.randn(2, n, 12).double(), torch.randn(2, 9, 12).double(), torch.randn(2, n, 12).double()
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 9 - masked:] = False
    monkeypatch.setattr(layers, "QUERY_GROUP_MAX", 10**9)
    whole = _module_outputs(module, x, ctx, mask if masked else None, grad)
    monkeypatch.setattr(layers, "QUERY_GROUP_MAX", 8)
    assert query_groups(n) == {35: 5, 77: 11}[n]
    grouped = _module_outputs(module, x, ctx, mask if masked else None, grad)
    for a, b in zip(grouped, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
