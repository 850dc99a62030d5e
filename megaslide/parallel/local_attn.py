"""Attention on one (query block, key block) pair with its log-sum-exp: the brick of every SP mode.

Every sequence-parallel mode reduces to: a rank holds a block of queries and, one after the
other, blocks of keys/values; it computes attention on each pair, keeps the per-row
log-sum-exp (lse), and merges the partial results exactly in fp32.

Tensors in this file use the kernel layout (B, h, N, d). A *layout* says which global token
positions the rows of a block hold: a tuple of `Segment`s, in row order. Padding and causal
masks are expressed through positions, so the same code serves contiguous shards (ring),
gathered shards (Ulysses) and interleaved shards (hybrid with ring_intra placement).

Backends: `megaslide.backends.Backend` records, walked in order (FORWARD_BACKENDS for the forward,
BACKWARD_BACKENDS for the backward); each `can_run(q, k, v, explicit) -> (ok, why)`:
- `cudnn` (forward only): `torch.ops.aten._scaled_dot_product_cudnn_attention` with its lse,
  the kernel PyTorch's SDPA picks on Hopper; probed like `flash`. The backward takes the next
  backend, which needs only the merged out and lse.
- `flash`: `torch.ops.aten._scaled_dot_product_flash_attention` and its backward (CUDA, fp16 /
  bf16), which return / accept the lse. It is probed once per device and dtype against the
  explicit path and used only if it agrees.
- `explicit`: scores materialised in fp32 (fp64 for fp64 inputs). The readable reference;
  memory O(Nq * Nk) per pair, so meant for CPU tests and small sizes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megaslide.backends import Backend, choose_backend


@dataclass(frozen=True)
class Segment:
    """`length` consecutive tokens starting at global position `start`."""

    start: int
    length: int


Layout = tuple[Segment, ...]


def contiguous_layout(start: int, length: int) -> Layout:
    return (Segment(start, length),)


def layout_from_shards(shard_ids: list[int] | tuple[int, ...], shard_len: int) -> Layout:
    """Rows made of whole shards `shard_ids` (shard s holds positions [s*shard_len, (s+1)*shard_len)),
    in that order; neighbouring shards that continue each other are merged into one segment."""
    segments: list[Segment] = []
    for s in shard_ids:
        start = s * shard_len
        if segments and segments[-1].start + segments[-1].length == start:
            segments[-1] = Segment(segments[-1].start, segments[-1].length + shard_len)
        else:
            segments.append(Segment(start, shard_len))
    return tuple(segments)


@dataclass(frozen=True)
class BlockPair:
    """Rows of the query block that attend to rows of the key block.

    `causal=True` means a square, top-left aligned causal mask (query row i sees key rows <= i);
    otherwise every query row sees every key row."""

    q_rows: slice
    k_rows: slice
    causal: bool


def plan_block_pairs(q_layout: Layout, k_layout: Layout, *, causal: bool,
                     seq_len: int | None) -> list[BlockPair]:
    """The attention work between a query block and a key block, as full or square-causal pairs.

    Keys at positions >= `seq_len` are padding and are dropped (they always form a suffix of
    their segment). With `causal`, a key segment entirely after a query segment is skipped,
    one entirely before it is a full pair, and one starting at the same position is split into
    a square causal pair plus (if the queries outnumber the valid keys) a full rectangle."""
    pairs: list[BlockPair] = []
    q_off = 0
    for qs in q_layout:
        k_off = 0
        for ks in k_layout:
            k_valid = ks.length if seq_len is None else max(0, min(ks.length, seq_len - ks.start))
            pairs.extend(_segment_pairs(qs, q_off, ks, k_off, k_valid, causal))
            k_off += ks.length
        q_off += qs.length
    return pairs


def _segment_pairs(qs: Segment, q_off: int, ks: Segment, k_off: int, k_valid: int,
                   causal: bool) -> list[BlockPair]:
    if k_valid == 0:
        return []
    q_rows = slice(q_off, q_off + qs.length)
    k_rows = slice(k_off, k_off + k_valid)
    if not causal or ks.start + k_valid - 1 <= qs.start:
        return [BlockPair(q_rows, k_rows, causal=False)]
    if ks.start > qs.start + qs.length - 1:
        return []
    if ks.start != qs.start:
        raise ValueError(f"causal attention needs key and query segments that are disjoint or start "
                         f"together; got queries {qs} and keys {ks}: shard the sequence evenly")
    m = min(qs.length, k_valid)
    pairs = [BlockPair(slice(q_off, q_off + m), slice(k_off, k_off + m), causal=True)]
    if qs.length > k_valid:
        pairs.append(BlockPair(slice(q_off + k_valid, q_off + qs.length), k_rows, causal=False))
    return pairs


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- explicit kernel
def _explicit_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Scaled scores (B, h, Nq, Nk) in the accumulation dtype, -inf above the diagonal if causal."""
    cdt = compute_dtype(q.dtype)
    s = torch.matmul(q.to(cdt), k.to(cdt).transpose(-1, -2)) * scale  # (B, h, Nq, Nk)
    if causal:
        nq, nk = s.shape[-2:]
        above = torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1)  # (Nq, Nk)
        s = s.masked_fill(above, float("-inf"))
    return s


def _explicit_forward(q, k, v, causal, scale):
    s = _explicit_scores(q, k, causal, scale)  # (B, h, Nq, Nk)
    m = s.amax(dim=-1, keepdim=True)  # (B, h, Nq, 1)
    p = torch.exp(s - m)  # (B, h, Nq, Nk), unnormalised
    denom = p.sum(dim=-1, keepdim=True)  # (B, h, Nq, 1)
    out = torch.matmul(p, v.to(p.dtype)) / denom  # (B, h, Nq, d)
    lse = (m + torch.log(denom)).squeeze(-1)  # (B, h, Nq)
    return out, lse


def _explicit_backward(dout, q, k, v, out, lse, causal, scale):
    s = _explicit_scores(q, k, causal, scale)  # (B, h, Nq, Nk)
    p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))  # (B, h, Nq, Nk): final probabilities
    cdt = p.dtype
    dout = dout.to(cdt)
    dv = torch.matmul(p.transpose(-1, -2), dout)  # (B, h, Nk, d)
    dp = torch.matmul(dout, v.to(cdt).transpose(-1, -2))  # (B, h, Nq, Nk)
    delta = (dout * out.to(cdt)).sum(-1, keepdim=True)  # (B, h, Nq, 1)
    ds = p * (dp - delta)  # (B, h, Nq, Nk)
    dq = torch.matmul(ds, k.to(cdt)) * scale  # (B, h, Nq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.to(cdt)) * scale  # (B, h, Nk, d)
    return dq, dk, dv


# ----------------------------------------------------------------------------- cuDNN kernel (forward)
def _cudnn_forward(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]  # (B, h, Nq, d), (B, h, Nq, 1)
    return out.float(), lse.reshape(q.shape[:3]).float()


# ----------------------------------------------------------------------------- flash kernel
def _flash_forward(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]  # (B, h, Nq, d), (B, h, Nq)
    return out.float(), lse.float()


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    # Dense (not varlen) call: no cumulative sequence lengths, as the forward returns None for them;
    # without dropout the philox seed/offset are unused scalars. The lse must be contiguous.
    no_rng = torch.empty((), dtype=torch.long)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.float().contiguous(), None, None,
        q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale)
    return dq.float(), dk.float(), dv.float()


def _probe(forward, backward, device: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Run a fast path (and its backward, if any) once on a tiny input against the explicit path."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(1, 2, 80, 64, device=device, dtype=dtype, generator=gen)
                         for _ in range(4))
        for causal in (False, True):
            out, lse = forward(q, k, v, causal, 0.125)
            ref_out, ref_lse = _explicit_forward(q, k, v, causal, 0.125)
            checks = [("out", out, ref_out), ("lse", lse, ref_lse)]
            if backward is not None:
                grads = backward(dout, q, k, v, ref_out, ref_lse, causal, 0.125)
                ref_grads = _explicit_backward(dout, q, k, v, ref_out, ref_lse, causal, 0.125)
                checks += zip(("dq", "dk", "dv"), grads, ref_grads)
            for name, a, b in checks:
                err = (a.float() - b.float()).abs().max().item()
                if not err < 0.05:
                    return False, f"{name} differs from the explicit path by {err:.3g} (causal={causal})"
        return True, "ok"
    except (RuntimeError, TypeError, AttributeError) as e:
        return False, f"op failed: {type(e).__name__}: {e}"


@functools.cache
def _flash_probe(device: str, dtype: torch.dtype) -> tuple[bool, str]:
    return _probe(_flash_forward, _flash_backward, device, dtype)


@functools.cache
def _cudnn_probe(device: str, dtype: torch.dtype) -> tuple[bool, str]:
    return _probe(_cudnn_forward, None, device, dtype)


def _fused_kernel_check(q) -> tuple[bool, str]:
    """What the fused CUDA kernels need of the inputs."""
    if q.device.type != "cuda":
        return False, f"needs CUDA tensors, got {q.device.type}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False, f"needs fp16/bf16, got {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return False, f"needs head_dim a multiple of 8 and <= 256, got {q.shape[-1]}"
    return True, "ok"


def _cudnn_can_run(q, k, v, explicit: bool) -> tuple[bool, str]:
    ok, why = _fused_kernel_check(q)
    if ok and q.shape[-1] > 128:
        ok, why = False, f"needs head_dim <= 128, got {q.shape[-1]}"
    return _cudnn_probe(str(q.device), q.dtype) if ok else (ok, why)


def _flash_can_run(q, k, v, explicit: bool) -> tuple[bool, str]:
    ok, why = _fused_kernel_check(q)
    return _flash_probe(str(q.device), q.dtype) if ok else (ok, why)


def _explicit_can_run(q, k, v, explicit: bool) -> tuple[bool, str]:
    return True, "ok"


FORWARD_BACKENDS = (
    Backend("cudnn", _cudnn_can_run, _cudnn_forward),
    Backend("flash", _flash_can_run, _flash_forward),
    Backend("explicit", _explicit_can_run, _explicit_forward),
)
"""Forward of one pair, (q, k, v, causal, scale) -> (out, lse), in the order they are tried."""
BACKWARD_BACKENDS = (
    Backend("flash", _flash_can_run, _flash_backward),
    Backend("explicit", _explicit_can_run, _explicit_backward),
)
"""Backward of one pair, (dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), in the order they are
tried (cuDNN's forward has no backward here)."""


def select_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   backward: bool = False) -> tuple[Backend, dict[str, str]]:
    """The first backend that can run these tensors' forward (or backward), and why each earlier one
    could not."""
    return choose_backend("auto", BACKWARD_BACKENDS if backward else FORWARD_BACKENDS, q, k, v)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with lse. q (B, h, Nq, d), k/v (B, h, Nk, d); causal needs Nq == Nk.

    Returns out (B, h, Nq, d) and lse (B, h, Nq), both in the accumulation dtype (fp32, or fp64
    for fp64 inputs)."""
    backend, _ = select_backend(q, k, v)
    out, lse = backend.run(q, k, v, causal, scale)
    cdt = compute_dtype(q.dtype)
    return out.to(cdt), lse.to(cdt)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one pair given the *final* out (B, h, Nq, d) and lse (B, h, Nq) of the query
    rows (merged over all key blocks): then the pair's dq, dk, dv are its exact share of the
    full gradients. Returns dq (B, h, Nq, d), dk and dv (B, h, Nk, d) in the accumulation dtype."""
    backend, _ = select_backend(q, k, v, backward=True)
    cdt = compute_dtype(q.dtype)
    return tuple(g.to(cdt) for g in backend.run(dout, q, k, v, out, lse, causal, scale))


def merge_into_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a partial result into running accumulators, in place, exactly:
    lse' = log(e^acc_lse + e^lse), out' = acc_out e^(acc_lse - lse') + out e^(lse - lse').
    acc_out, out (B, h, n, d); acc_lse, lse (B, h, n). Accumulators start at 0 and -inf."""
    new_lse = torch.logaddexp(acc_lse, lse)  # (B, h, n)
    acc_out.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
    acc_out.add_(out * torch.exp(lse - new_lse).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def block_forward_(acc_out: torch.Tensor, acc_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, pairs: list[BlockPair], scale: float) -> None:
    """Attend q (B, h, Nq, d) to k/v (B, h, Nk, d) over `pairs`, merging into the accumulators
    acc_out (B, h, Nq, d) and acc_lse (B, h, Nq)."""
    for pair in pairs:
        out, lse = attention_forward(q[:, :, pair.q_rows], k[:, :, pair.k_rows], v[:, :, pair.k_rows],
                                     causal=pair.causal, scale=scale)
        merge_into_(acc_out[:, :, pair.q_rows], acc_lse[:, :, pair.q_rows], out, lse)


def block_backward_(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dout: torch.Tensor,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, pairs: list[BlockPair], scale: float) -> None:
    """Add the gradients of the `pairs` between q (B, h, Nq, d) and k/v (B, h, Nk, d) to dq
    (B, h, Nq, d), dk and dv (B, h, Nk, d); dout/out (B, h, Nq, d) and lse (B, h, Nq) are final."""
    for pair in pairs:
        qr, kr = pair.q_rows, pair.k_rows
        gq, gk, gv = attention_backward(dout[:, :, qr], q[:, :, qr], k[:, :, kr], v[:, :, kr],
                                        out[:, :, qr], lse[:, :, qr], causal=pair.causal, scale=scale)
        dq[:, :, qr] += gq
        dk[:, :, kr] += gk
        dv[:, :, kr] += gv
