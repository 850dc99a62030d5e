"""The block activation model: figures derived by hand from the shapes, and fp32 blocks measured on CPU."""
import dataclasses

import pytest
import torch

from megaslide.config import AttentionConfig, DiTConfig, ExecutionConfig
from megaslide.models.chunking import BlockRunner
from megaslide.models.dit import DIT_PRESETS, MOD_ROWS, DiTBlock
from megaslide.nn import RopeTable
from megaslide.perf.activation_memory import ActivationDtypes, block_memory
from megaslide.perf.live_bytes import LiveTensorBytes

BF16_SHELLS = ActivationDtypes(act=2, residual=2)   # the offload engine: bf16 weights, bf16 autocast
D, F, H = 4096, 16384, 32                           # the 7B width
K3 = 27 * 3                                          # DSA 3x3x3: samples x (dt, dy, dx)


def _seven_b(attention: str, **kw) -> DiTConfig:
    return dataclasses.replace(DIT_PRESETS["7B"], attention=AttentionConfig(attention), **kw)


def test_unchunked_bf16_block_by_hand():
    """Bytes per token kept by an unchunked block of the 7B width under bf16 autocast (dense):
    norms 4D+4D+8 (bf16 input copied to fp32, output) and 2 x (8D+8), qkv/cross-q/fc1 inputs 3 x 2D,
    qkv output 6D, rotated q and k 4D, QK-norm statistics 8 + 4, flash output 2D + lse 4h, cross q
    before/after norm 4D, its output 2D + lse 4h, three gated outputs 6D, MLP hidden 4F, output 2D."""
    tokens = 65536
    dense = block_memory(_seven_b("dense"), tokens, BF16_SHELLS)
    per_token = 56 * D + 4 * F + (8 + 16) + 12 + 8 * H
    assert dense.kept_total == tokens * per_token
    assert dense.moment == "MLP backward"
    assert dense.peak_total == tokens * (per_token + 2 * F)          # + dL/d(GELU output) in bf16
    # DSA adds its contiguous v (2D), the offset net's conv input (the fp32 attention input, 4D), GELU and
    # Linear inputs (2 x 2D) and the fp32 offsets (4 h K3), which the bound and the op share
    dsa = block_memory(_seven_b("dsa"), tokens, BF16_SHELLS)
    assert dsa.kept_total - dense.kept_total == tokens * (10 * D + 4 * H * K3)
    # Swin keeps none of q, k, v but the qkv output; its math-path SDPA keeps fp32 scaled q, k, v (3 x 4D),
    # each window's fp32 softmax (4 h window) and the output in token order (2D)
    swin = block_memory(_seven_b("swin"), tokens, BF16_SHELLS)
    window = 2 * 4 * 4
    assert swin.kept_total - dense.kept_total == tokens * (12 * D + 4 * H * window + 2 * D - 4 * D - 2 * D - 4 * H)


def test_chunked_bf16_block_by_hand():
    """Chunked, the whole sequence keeps q, k, v (6D), flash's output and lse (2D + 4h), the output (2D);
    the peak is the attention backward: + dq, dk, dv (6D), flash's fp32 dq accumulator (4D) and row sums
    (4h), dL/d(attention output) and the accumulated dL/d(block input) (2 x 2D)."""
    tokens, chunk = 522240, 16320
    chunked = ExecutionConfig(chunk_tokens=chunk)
    dense = block_memory(_seven_b("dense"), tokens, BF16_SHELLS, execution=chunked)
    assert dense.kept_total == tokens * (10 * D + 4 * H)
    assert dense.moment == "attention backward"
    assert dense.peak_total == tokens * (24 * D + 8 * H)
    # DSA also keeps its fp32 input (the offset net's runs are checkpointed on it) and the offsets;
    # its backward makes dq, dk, dv (6D), fp32 d(offsets) and a scratch, head group by group within 1 GiB:
    # per (query, sample) an entry of 8 fp32 words (ds, p, position, padding) and room for 8 int32 key-tile
    # records, per key tile an int32 cursor, start and fill cursor (at most one tile per token): one head's is
    # tokens x (64 x 27 + 12) bytes = 908 MB, so 1 at a time
    dsa = block_memory(_seven_b("dsa"), tokens, BF16_SHELLS, execution=chunked)
    assert dsa.kept_total == tokens * (10 * D + 4 * H + 4 * D + 4 * H * K3)
    scratch = tokens * (64 * 27 + 12)
    assert scratch <= 2 ** 30 < 2 * scratch
    assert dsa.peak_total == tokens * (10 * D + 4 * H + 4 * D + 4 * H * K3 + 6 * D + 4 * H * K3 + 4 * D) + scratch
    unchunked = block_memory(_seven_b("dsa"), tokens, BF16_SHELLS)
    assert dsa.peak_total < unchunked.peak_total / 2.5


def _measured(cfg: DiTConfig, grid, dtype=torch.float32, layer_idx=0, **execution) -> tuple[int, int]:
    """(bytes kept after the forward, peak over forward and backward) of one block on CPU (bf16: bf16
    weights under CPU autocast) run as `execution` says, beside its input, the incoming gradient and its
    parameters."""
    torch.manual_seed(0)
    block = DiTBlock(cfg, layer_idx).to(dtype)
    tokens = grid[0] * grid[1] * grid[2]
    x = torch.randn(1, tokens, cfg.dim, dtype=dtype, requires_grad=True)
    t_mod = torch.randn(1, MOD_ROWS[cfg.block], cfg.dim, dtype=dtype, requires_grad=True)
    ctx = torch.randn(1, 8, cfg.dim, dtype=dtype, requires_grad=True)
    rope, grad = RopeTable(cfg.head_dim, *grid).grid(grid), torch.randn(1, tokens, cfg.dim, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), LiveTensorBytes() as live:
        out = BlockRunner(ExecutionConfig(**execution)).block(block, x, t_mod, ctx, torch.ones(1, 8, dtype=torch.bool),
                                                              rope, grid)
        kept = live.current
        torch.autograd.grad(out, [x, t_mod, ctx, *block.parameters()], grad, allow_unused=True)
    return kept, live.peak


@pytest.mark.parametrize("attention,options,block", [("dense", {}, "dit"), ("swin", {"window": (2, 4, 4)}, "dit"),
                                                     ("dense", {}, "wan")])
@pytest.mark.parametrize("chunk", [0, 512])
def test_fp32_block_matches_a_block_measured_on_cpu(attention, options, block, chunk):
    """fp32 runs the same ops on CPU as on CUDA but for the kernels (QK-norm is unfused on CPU, so
    it is off here); parameters are small beside 2048 tokens, so their gradients hardly count. Both block
    families."""
    cfg = DiTConfig(dim=64, num_heads=4, ffn_dim=256, qk_norm=False, block=block,
                    attention=AttentionConfig(attention, options))
    grid = (8, 16, 16)
    kept, peak = _measured(cfg, grid, chunk_tokens=chunk)
    model = block_memory(cfg, 2048, ActivationDtypes(act=4, residual=4), execution=ExecutionConfig(chunk_tokens=chunk))
    assert model.kept_total == pytest.approx(kept, rel=0.01)
    assert model.peak_total == pytest.approx(peak, rel=0.06)


def _swin_attend_measured(dim, heads, grid, layer_idx):
    """(bytes kept after the forward, forward peak, backward peak beyond the kept bytes and the output
    gradient) of Swin's `attend` on bf16 q, k, v on CPU."""
    from baselines.swin_attention import SwinAttention
    torch.manual_seed(0)
    attn = SwinAttention(dim, heads, layer_idx=layer_idx)
    tokens = grid[0] * grid[1] * grid[2]
    q, k, v = (torch.randn(1, tokens, heads, dim // heads, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with LiveTensorBytes() as live:
        o = attn.attend(q, k, v, None, grid)
        kept, forward = live.current, live.peak
        live.reset_peak()
        grad = torch.randn_like(o)
        torch.autograd.grad(o, [q, k, v], grad)
    return kept, forward, live.peak - kept - grad.nbytes


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_swin_bf16_attend_matches_cpu_measurement(heads):
    """SDPA's math path computes bf16 windows in fp32 (the terms the planner used to miss, see
    SwinAttention.attend_memory); a shifted layer's forward also holds the rolled copies and masks."""
    from baselines.swin_attention import SwinAttention, SwinOptions
    dim, grid = 512, (8, 16, 16)
    tokens = 2048
    kept, forward, backward = _swin_attend_measured(dim, heads, grid, layer_idx=1)
    model = SwinAttention.attend_memory(SwinOptions(), dim, heads, act=2, chunked=True)
    assert kept == tokens * model.saved
    assert forward == pytest.approx(tokens * (model.saved + model.forward), abs=512)
    assert backward == pytest.approx(tokens * model.backward, abs=512)


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_chunked_bf16_swin_block_matches_cpu_measurement(layer_idx):
    """A token-chunked Swin block in bf16 (bf16 weights, CPU autocast) measured with LiveTensorBytes: the
    whole-sequence attention sets its peak. The model counts the shifted layer's rolled copies and masks for
    every layer (the planner takes the largest block); the unshifted layer has neither, and since the slices'
    gradients join once its backward no longer peaks above its forward: it peaks up to 15% lower."""
    cfg = DiTConfig(dim=512, num_heads=4, ffn_dim=2048, qk_norm=False,
                    attention=AttentionConfig("swin", {"window": (2, 4, 4)}))
    kept, peak = _measured(cfg, (8, 16, 16), dtype=torch.bfloat16, layer_idx=layer_idx, chunk_tokens=512)
    model = block_memory(cfg, 2048, BF16_SHELLS, execution=ExecutionConfig(chunk_tokens=512))
    assert model.kept_total == pytest.approx(kept, rel=0.01)
    assert model.peak_total == pytest.approx(peak, rel=0.02 if layer_idx else 0.15)
    assert model.peak_total >= peak * 0.99


@pytest.mark.parametrize("chunk,slab,ffn", [(0, 2, 256), (512, 2, 256), (0, 1, 64), (128, 1, 64), (256, 3, 64)])
def test_fp32_slab_block_matches_a_block_measured_on_cpu(monkeypatch, chunk, slab, ffn):
    """A block over frame slabs (`execution.slab_frames`), measured: dense attention made to declare a reach of 2
    frames (its memory is what the model knows for CPU; its outputs do not matter here) on 8 x 16 x 16,
    beside the whole clip's slab outputs and input gradient. A wide MLP puts the peak in the finishing
    slices' backward, a narrow one in the slab's attention backward."""
    from megaslide import attention as registry
    from megaslide.attention.dense import DenseAttention

    class ReachTwo(DenseAttention):
        name = "dense_reach_two"

        @classmethod
        def temporal_reach(cls, options) -> int:
            return 2

    monkeypatch.setitem(registry._REGISTRY, ReachTwo.name, ReachTwo)
    cfg = DiTConfig(dim=64, num_heads=4, ffn_dim=ffn, qk_norm=False, attention=AttentionConfig(ReachTwo.name))
    kept, peak = _measured(cfg, (8, 16, 16), chunk_tokens=chunk, slab_frames=slab)
    fp32 = ActivationDtypes(act=4, residual=4)
    model = block_memory(cfg, 2048, fp32, frames=8, execution=ExecutionConfig(chunk_tokens=chunk, slab_frames=slab))
    whole = block_memory(cfg, 2048, fp32, frames=8, execution=ExecutionConfig(chunk_tokens=chunk or 2048))
    assert model.kept_total == pytest.approx(kept, rel=0.01)
    assert model.peak_total == pytest.approx(peak, rel=0.05)
    assert model.moment == ("slab attention backward" if ffn == 64 else "slab finishing slices' backward")
    assert model.peak_total < whole.peak_total
