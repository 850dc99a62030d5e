"""Attention ops split at their softmax statistics (megaslide/attention/kept.py): a backward from a kept output and
lse equals the op's own autograd backward bit for bit in fp32, and the recorded output is the op's output. Dense
(SDPA's CPU kernel), DSA / dsa_zero on the gathers and on the fused kernels (TRITON_INTERPRET=1), odd sizes."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megaslide.attention.dense import DenseAttention  # noqa: E402
from megaslide.attention.dsa.op import deformable_slide_attention, neighborhood_attention  # noqa: E402
from megaslide.attention.kept import Record, Replay  # noqa: E402


def _inputs(shape, offsets_shape=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    if offsets_shape is None:
        return [q, k, v]
    return [q, k, v, (torch.randn(offsets_shape, generator=g) * 0.7).requires_grad_()]


def _grads(fn, inputs, dout):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, dout)


def _check(plain, split, inputs):
    """`split(keep, *inputs)` with a Record, then with a Replay of what it kept, against `plain(*inputs)`."""
    with torch.no_grad():
        shape = plain(*inputs).shape
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out, grads = _grads(plain, inputs, dout)
    record = Record()
    with torch.no_grad():
        recorded = split(record, *inputs)
    assert torch.equal(recorded, out)
    kept_out, kept_grads = _grads(lambda *x: split(Replay(record.out, record.lse), *x), inputs, dout)
    assert torch.equal(kept_out, out)
    for a, b in zip(grads, kept_grads):
        assert torch.equal(a, b)


def test_dense_split_equals_sdpa():
    attn = DenseAttention(24, 3)
    q, k, v = _inputs((2, 37, 3, 8))
    _check(lambda *x: attn.attend(*x, None, None), lambda keep, *x: attn.attend(*x, None, None, keep=keep), [q, k, v])
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(attn.attend(q, k, v, None, None).double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["gather", "triton"])
def test_dsa_split_equals_the_op(backend):
    shape, kernel = (1, 3, 2, 3, 1, 4), (3, 1, 3)          # the interpreter is slow: a small odd grid
    inputs = _inputs(shape, (*shape[:5], 9, 3))
    _check(lambda *x: deformable_slide_attention(*x, kernel, backend=backend),
           lambda keep, *x: deformable_slide_attention(*x, kernel, backend=backend, keep=keep), inputs)


@pytest.mark.parametrize("backend", ["gather", "triton"])
def test_neighborhood_split_equals_the_op(backend):
    inputs, kernel = _inputs((1, 5, 3, 4, 2, 8)), (3, 3, 1)
    _check(lambda *x: neighborhood_attention(*x, kernel, backend=backend),
           lambda keep, *x: neighborhood_attention(*x, kernel, backend=backend, keep=keep), inputs)


def test_a_backend_that_keeps_no_lse_is_refused():
    shape = (1, 3, 3, 3, 1, 8)
    q, k, v, offsets = _inputs(shape, (*shape[:5], 27, 3))
    with pytest.raises(ValueError, match="backend='scores' keeps no lse"):
        deformable_slide_attention(q, k, v, offsets, backend="scores", keep=Record())
