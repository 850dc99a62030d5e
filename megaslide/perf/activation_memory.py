"""Device bytes of one DiT block's activations in training, derived from the shapes (allocates nothing).

What a block holds follows from what each op of `DiTBlock.forward` saves for its backward,
on CUDA, with the dtypes the block runs in (`ActivationDtypes`): under bf16 autocast the
linears, the convolution and attention make bf16 (`act` = 2 bytes), LayerNorm runs in fp32
on an fp32 copy of its input, RMSNorm (QK-norm) runs fused on its input as passed, and the
residual stream has the dtype of the block's weights (`residual`: bf16 block shells in the
offload engine, fp32 in the resident trainer, whose fp32 gates promote it). Self-attention's
share comes from the variant (`SelfAttention.attend_memory`: the one source per variant, as
`extra_macs_per_token` is for FLOPs). Sizes below are bytes per video token (one sample)
unless they say otherwise; D = dim, F = ffn_dim.

Kept from a block's (re)computed forward to its backward, unchunked:
- norms: LayerNorm's fp32 inputs (4D each; the first one only when the block input is
  bf16, else it is the input itself), its fp32 outputs (4D each, kept by the adaLN
  modulation) and statistics (8 B each);
- the inputs of the qkv, cross-attention q and fc1 projections (act x D each);
- the qkv output (3 act D, kept by QK-norm, which saves its strided q and k views, or by an
  attention that keeps v as passed), q and k after RoPE (2 act D) and a contiguous v (act D)
  as the variant keeps them, QK-norm statistics; the variant's own `saved`;
- the three gated branch outputs (act D each: a gate keeps what it multiplies; two in the `wan` block family,
  whose cross-attention is ungated and whose norm 2 output, kept by no modulation, is not counted), the
  cross-attention q (before and after QK-norm), output and lse, the MLP hidden
  (fc1 and GELU outputs, 2 act F), and the block output (residual D).
Peak of an unchunked block's backward: everything kept, plus dL/d(GELU output) (act F) while
fc2's backward runs (its saved input is released only when it returns). The peak inside its
attention backward (what precedes attention, the variant's `saved` and `backward`, and two
gradients) and inside its forward (the variant's `forward`) are lower for every preset, and
are the other candidates.

Token-chunked blocks (`execution.chunk_tokens` = c; how the runner, megaslide/models/chunking.py, runs
them, slabs included): the token-wise work runs over slices under
checkpoints, so the whole sequence keeps only q, k, v (cat of the slices), the attention
input where the variant reads it (fp32), the variant's `saved` and the block output; a slice
of c tokens holds the token-wise activations above. These moments compete:
- the concatenation of the slices: each slice's qkv output (v is a view of it), rotated q, k
  and attention input, beside their concatenations (the block drops the slices right after);
- the attention's forward, and the end of the block's forward: the block output with its slices;
- the attention backward: the kept tensors, dL/d(attention output), dL/d(block input)
  (accumulated over the slices) and the variant's `backward`;
- a slice's backward: the kept tensors, both accumulated gradients (a slice's gradient
  reaches the whole tensor through `slice_backward`, full size) and one slice's token-wise
  activations and MLP gradient; as it ends, one more full-size gradient of each is summed in.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaslide.config import DiTConfig, ExecutionConfig


@dataclass(frozen=True)
class ActivationDtypes:
    """Element bytes of a block's activations: `act` for matmul / attention outputs (2 under bf16
    autocast, 4 in fp32), `residual` for the residual stream (the dtype of the block's weights)."""

    act: int
    residual: int

    @property
    def autocast(self) -> bool:
        return self.act < 4


@dataclass(frozen=True)
class BlockMemory:
    """One block's device bytes for `tokens` video tokens (batch x clip), by item.

    kept: held from its forward (with grad) to its backward, output included;
    peak: alive at the peak of its recomputed forward and backward, output included, beside the
    block input and the incoming gradient (the caller holds those) and its parameter gradients;
    forward: alive at the peak of a forward without grad, input excluded."""

    kept: dict[str, int]
    peak: dict[str, int]
    moment: str           # where `peak` is reached
    forward: dict[str, int]

    @property
    def kept_total(self) -> int:
        return sum(self.kept.values())

    @property
    def peak_total(self) -> int:
        return sum(self.peak.values())

    @property
    def forward_total(self) -> int:
        return sum(self.forward.values())


def _scaled(per_token: dict[str, int], tokens: int) -> dict[str, int]:
    return {k: v * tokens for k, v in per_token.items() if v}


def _largest(moments: dict[str, dict[str, int]]) -> tuple[str, dict[str, int]]:
    name = max(moments, key=lambda m: sum(moments[m].values()))
    return name, moments[name]


def block_memory(cfg: DiTConfig, tokens: int, dtypes: ActivationDtypes, frames: int = 1,
                 execution: ExecutionConfig | None = None) -> BlockMemory:
    """`DiTBlock(cfg)`'s activation bytes for `tokens` video tokens (batch x tokens per clip, of
    `frames` token frames: it matters only with `slab_frames`) in the given dtypes, run as `execution`
    says (megaslide/models/chunking.py; default: whole). See the module docstring for what is counted and why."""
    execution = execution or ExecutionConfig()
    D, F, heads = cfg.dim, cfg.ffn_dim, cfg.num_heads
    a, r = dtypes.act, dtypes.residual
    variant, options = cfg.attention.variant, cfg.attention.options
    chunk, slab = execution.chunk_tokens, execution.slab_frames
    slabbed = 0 < slab < frames
    if slabbed:   # the largest slab: s frames and a halo of r on each side; its slices are the whole slab if unset
        span = min(frames, slab + 2 * variant.temporal_reach(options))
        wide, kept, tokens = r * D * tokens, tokens * slab // frames, tokens * span // frames
        chunk = chunk or kept
    attend = variant.attend_memory(options, D, heads, a, chunked=bool(chunk))
    qk = cfg.qk_norm
    first_norm_copy = 4 * D if dtypes.autocast and r < 4 else 0
    keeps_qk = attend.keeps != "none"

    def scratch(n: int) -> dict[str, int]:
        return {f"{cfg.attention.name} attention backward: scratch": attend.scratch_bytes(n)}

    # token-wise work after self-attention: kept per token, and one of it for a slice when chunked
    # the wan block family's cross-attention is ungated, on a LayerNorm output that no modulation keeps
    wan = cfg.block == "wan"
    post = {"norms 2, 3: fp32 inputs, outputs, statistics": (12 if wan else 16) * D + 16,
            "cross q and fc1 projection inputs": 2 * a * D,
            "cross-attention q, output, lse": a * D * (3 if qk else 2) + 4 * heads + (4 if qk else 0),
            "gated branch outputs (attention, MLP)" if wan else "gated branch outputs (attention, cross, MLP)":
                (2 if wan else 3) * a * D,
            "MLP hidden (fc1, GELU outputs)": 2 * a * F}
    mlp_grad = {"MLP backward: dL/d(GELU output)": a * F}
    output = {"block output": r * D}
    name = cfg.attention.name
    if not chunk:
        pre = {"norm 1: fp32 input, output, statistics": first_norm_copy + 4 * D + 8,
               "qkv projection input": a * D,
               "qkv output, rotated q and k, QK-norm statistics":
                   (3 * a * D if qk or attend.keeps == "as_passed" else 0) + (2 * a * D if keeps_qk else 0)
                   + (a * D if attend.keeps == "contiguous" else 0) + (8 if qk else 0),
               f"{name} attention (kept)": attend.saved}
        kept = {**pre, **post, **output}
        attention_backward = {**_scaled({**pre, **output, f"{name} attention backward": attend.backward,
                                         "dL/d(attention output), dL/d(residual)": a * D + r * D}, tokens),
                              **scratch(tokens)}
        attention_forward = {**pre, "attention input (fp32)": 4 * D, f"{name} attention forward": attend.forward}
        moment, peak = _largest({"MLP backward": _scaled({**kept, **mlp_grad}, tokens),
                                 "attention backward": attention_backward,
                                 "attention forward": _scaled(attention_forward, tokens)})
        _, forward = _largest({
            "attention": {"attention input (fp32)": 4 * D, "qkv output, rotated q and k": 5 * a * D,
                          f"{name} attention": attend.saved + attend.forward},
            "MLP": {"residual": r * D, "MLP hidden (fc1, GELU outputs)": 2 * a * F}})
        return BlockMemory(_scaled(kept, tokens), peak, moment, _scaled(forward, tokens))

    reads = 4 * D if variant.reads_input else 0
    whole = {"q, k, v (whole sequence)": 3 * a * D if keeps_qk else 0,
             "attention input (fp32, whole sequence)": reads,
             f"{name} attention (kept)": attend.saved, **output}
    slice_tokens = min(chunk, tokens)
    slice_part = _scaled({**post, **mlp_grad, "slice output": r * D}, slice_tokens)
    slices = {"slice outputs: qkv, rotated q and k, attention input": 5 * a * D + reads}
    concatenated = {"concatenated q, k, v, attention input": 3 * a * D + reads}
    concatenation = _scaled({**slices, **concatenated}, tokens)
    attention_forward = _scaled({**concatenated, f"{name} attention (kept)": attend.saved,
                                 f"{name} attention forward": attend.forward}, tokens)
    forward_end = _scaled({**whole, "concatenated q, k, v": 0 if keeps_qk else 3 * a * D,
                           "block output slices": r * D}, tokens)
    _, forward = _largest({"concatenation": concatenation, "attention forward": attention_forward,
                           "forward end": forward_end})
    moments = {
        "concatenation": concatenation,
        "attention forward": attention_forward,
        "forward end": forward_end,
        "attention backward": {**_scaled({**whole, f"{name} attention backward": attend.backward,
                                          "dL/d(attention output), dL/d(block input)": a * D + r * D}, tokens),
                               **scratch(tokens)},
        "slice backward": {**_scaled({**whole, "dL/d(attention output), dL/d(block input)": a * D + r * D},
                                     tokens), **slice_part},
        "slice gradient accumulation": _scaled({**whole, "dL/d(attention output), dL/d(block input), twice":
                                                2 * (a * D + r * D)}, tokens),
    }
    if not slabbed:
        moment, peak = _largest(moments)
        return BlockMemory(_scaled(whole, tokens), peak, moment, forward)
    # a slab: the attention part over its `tokens` (halo included), the finishing slices over its kept rows;
    # beside it the whole clip's slab outputs and, in backward, the block output and dL/d(block input),
    # which sums the slabs' full-size input gradients as each slab's backward ends
    slab_whole = _scaled({k: v for k, v in whole.items() if k not in output}, tokens)
    finish = _scaled({**post, **mlp_grad, "slice output": r * D}, min(chunk, kept))
    grads = {"dL/d(attention output), dL/d(slab input)": a * D + r * D}
    outputs = {"slab outputs (whole clip)": wide}
    held = {"block output (whole clip)": wide, "dL/d(block input), accumulated (whole clip)": wide}
    slab_moments = {
        "slab concatenation": {**concatenation, **outputs},
        "slab attention forward": {**attention_forward, **outputs},
        "slab finishing slices' backward": {**slab_whole, **finish, **_scaled(grads, kept), **held},
        "slab attention backward": {**slab_whole, **_scaled({f"{name} attention backward": attend.backward,
                                                             **grads}, tokens), **scratch(tokens), **held},
        "slab input gradient summed in": {**_scaled({"dL/d(slab input)": r * D}, tokens), **held,
                                          "its full-size share, the sum": 2 * wide},
        "forward end": {"slab outputs and their concatenation": 2 * wide},
    }
    moment, peak = _largest(slab_moments)
    forward = max([{**forward, **outputs}, slab_moments["forward end"]], key=lambda m: sum(m.values()))
    return BlockMemory(outputs, peak, moment, forward)
