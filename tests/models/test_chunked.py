"""Blocks run token-chunked (`execution.chunk_tokens`) and over frame slabs (`execution.slab_frames`) by the
chunk runner: the same outputs and gradients as whole ones, less saved for backward, and a clear error for a
bad chunk size."""

import pytest
import torch

from megaslide.attention import build_attention
from megaslide.config import DiTConfig, ExecutionConfig
from megaslide.models.chunking import BlockRunner, frame_slabs, read_over_frame_runs
from megaslide.models.dit import MOD_ROWS, DiTBlock, build_dit
from megaslide.nn import RopeTable
from megaslide.parallel.apply import parallelize_dit

GRID = (3, 3, 4)   # N = 36 tokens
CHUNKS = [1, 7, 12, 36, 50]  # one token, a chunk that does not divide N, a divisor, N, more than N
OPTIONS = {"swin": {"window": (3, 3, 2)}}  # windows that divide GRID, shifted along w in odd blocks


def _randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """Non-zero weights everywhere (the zero-init gates and DSA offsets would hide most of the block)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.1)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 sums over tokens in another order: agree to 1e-4 of the tensor's scale."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale + 1e-7)


class Executed(torch.nn.Module):
    """`block` run by a `BlockRunner` of `execution`, called as the block is."""

    def __init__(self, block: DiTBlock, **execution):
        super().__init__()
        self.block, self.runner = block, BlockRunner(ExecutionConfig(**execution))

    def forward(self, *inputs):
        return self.runner.block(self.block, *inputs)


def _block_pair(attention: str, chunk: int) -> tuple[DiTBlock, Executed, DiTConfig]:
    cfg = DiTConfig(dim=32, num_heads=2, ffn_dim=64, attention={"name": attention, **OPTIONS.get(attention, {})})
    plain = DiTBlock(cfg, layer_idx=1)  # an odd block: swin shifts its windows
    _randomise(plain)
    chunked = DiTBlock(cfg, layer_idx=1)
    chunked.load_state_dict(plain.state_dict())
    return plain, Executed(chunked, chunk_tokens=chunk), cfg


def _block_inputs(cfg: DiTConfig, grid=GRID, seed: int = 1):
    torch.manual_seed(seed)
    B, L, N = 2, 5, grid[0] * grid[1] * grid[2]
    x = torch.randn(B, N, cfg.dim, requires_grad=True)
    t_mod = torch.randn(B, MOD_ROWS[cfg.block], cfg.dim, requires_grad=True)
    ctx = torch.randn(B, L, cfg.dim, requires_grad=True)
    ctx_mask = torch.tensor([[True] * L, [True, True, True, False, False]])  # one padded caption
    rope = RopeTable(cfg.head_dim, *grid).grid(grid)
    return x, t_mod, ctx, ctx_mask, rope, grid


def _run(block: DiTBlock, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the gradients of every input and parameter for a random-projection loss."""
    x, t_mod, ctx = inputs[:3]
    for t in (x, t_mod, ctx):
        t.grad = None
    block.zero_grad(set_to_none=True)
    out = block(*inputs)
    out.mul(torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [x.grad, t_mod.grad, ctx.grad] + [p.grad for p in block.parameters()]


def _assert_same_block(plain: DiTBlock, other: DiTBlock, inputs) -> None:
    """`other` gives `plain`'s output and every gradient (inputs and parameters), each non-trivial."""
    want_out, want_grads = _run(plain, inputs)
    got_out, got_grads = _run(other, inputs)
    _assert_close(got_out, want_out)
    names = ["x", "t_mod", "ctx"] + [n for n, _ in plain.named_parameters()]
    for name, got, want in zip(names, got_grads, want_grads):
        if want is None:                                  # dsa_zero: the inert offset net
            assert got is None, name
            continue
        assert want.abs().max() > 0, name                 # every compared gradient is non-trivial
        _assert_close(got, want)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("attention", ["dense", "swin", "dsa", "dsa_zero"])
def test_chunked_block_equals_unchunked(attention, chunk):
    plain, chunked, cfg = _block_pair(attention, chunk)
    inputs = _block_inputs(cfg)
    _assert_same_block(plain, chunked, inputs)


@pytest.mark.parametrize("execution", [{"chunk_tokens": 7}, {"slab_frames": 1, "chunk_tokens": 5}])
def test_wan_block_chunked_and_slabbed_equals_whole(execution):
    """The wan family's block (6 rows, unmodulated cross-attention) runs through the same chunk and slab runner."""
    cfg = DiTConfig(dim=32, num_heads=2, ffn_dim=64, block="wan", attention={"name": "dsa", "max_offset": 0.5})
    plain = DiTBlock(cfg, layer_idx=1)
    _randomise(plain)
    other = DiTBlock(cfg, layer_idx=1)
    other.load_state_dict(plain.state_dict())
    _assert_same_block(plain, Executed(other, **execution), _block_inputs(cfg))


@pytest.mark.parametrize("chunk_tokens", [5, 16, 17, 33, 200])  # 1, 1, 1, 2 frames, the whole clip
def test_dsa_offset_net_over_frame_runs_equals_whole(chunk_tokens):
    """The depthwise 3x3x3 conv over runs of frames with a one-frame halo = over the whole grid."""
    grid = (5, 4, 4)
    attn = build_attention("dsa", 32, 2)
    _randomise(attn)
    x = torch.randn(2, 80, 32, requires_grad=True)
    want = attn.offsets(x, grid)
    (gx_want,) = torch.autograd.grad(want.sin().sum(), x)
    got = read_over_frame_runs(attn, x, grid, chunk_tokens)
    (gx_got,) = torch.autograd.grad(got.sin().sum(), x)
    _assert_close(got, want)
    _assert_close(gx_got, gx_want)


@pytest.mark.parametrize("attention", ["dense", "dsa"])
@pytest.mark.parametrize("checkpoint_blocks", [False, True])
def test_chunked_video_dit_forward_backward_equals_unchunked(attention, checkpoint_blocks):
    plain = build_dit("tiny", attention=attention, checkpoint_blocks=checkpoint_blocks)
    _randomise(plain)
    chunked = build_dit("tiny", attention=attention, checkpoint_blocks=checkpoint_blocks, chunk_tokens=11)
    chunked.load_state_dict(plain.state_dict())
    torch.manual_seed(2)
    x = torch.randn(2, 3, 4, 8, 6)                        # token grid (4, 4, 3): 48 tokens, 11 does not divide it
    t, ids = torch.tensor([100.0, 700.0]), plain.tokenizer(["a red circle", "a blue square moving"])
    results = []
    for model in (plain, chunked):
        xr = x.clone().requires_grad_()
        out = model(xr, t, ids)
        out.square().sum().backward()
        results.append((out.detach(), [xr.grad] + [p.grad for p in model.parameters()]))
    (want_out, want_grads), (got_out, got_grads) = results
    _assert_close(got_out, want_out)
    for got, want in zip(got_grads, want_grads):
        _assert_close(got, want)


def _saved_bytes(block: DiTBlock, inputs) -> int:
    """Bytes of the distinct storages that autograd saves for backward of one block forward
    (views count once, with their base; the block's parameters are not counted)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}  # Executed: the block's own
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(*inputs)
    return sum(storages.values())


def test_chunked_block_saves_only_what_attention_needs():
    """Unchunked, backward keeps the MLP's ffn-wide hidden of all N tokens (> N * ffn elements);
    chunked, it keeps x, q, k, v, the attention output and lse over N tokens (about 5 N D) and
    only the chunk inputs of the token-wise work: below 8 N D + chunk * ffn elements."""
    chunk = 32
    cfg = DiTConfig(dim=32, num_heads=2, ffn_dim=1024)
    plain = DiTBlock(cfg, 0)
    chunked = Executed(plain, chunk_tokens=chunk)
    inputs = _block_inputs(cfg, grid=(4, 8, 8))
    B, N, D = inputs[0].shape
    elements = 4 * B                                      # fp32 bytes, per sample
    assert _saved_bytes(plain, inputs) > N * cfg.ffn_dim * elements
    assert _saved_bytes(chunked, inputs) < (8 * N * D + chunk * cfg.ffn_dim) * elements


def test_attention_override_and_parallelized_model_run_unchunked():
    """The `attn=` override path and the sequence-parallel form stay unchunked and still agree."""
    plain = build_dit("tiny")
    _randomise(plain)
    chunked = build_dit("tiny", chunk_tokens=5)
    chunked.load_state_dict(plain.state_dict())
    torch.manual_seed(3)
    x = torch.randn(1, 3, 2, 4, 4)
    t, ids = torch.tensor([400.0]), plain.tokenizer(["a green triangle"])
    with torch.no_grad():
        want = plain(x, t, ids)
        e = chunked.embed(x, t, ids)
        override = chunked.run_block(0, e.x, e, attn=chunked.blocks[0].attn)
        _assert_close(override, plain.blocks[0](e.x, e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid))
        _assert_close(parallelize_dit(chunked, None)(x, t, ids), want)


@pytest.mark.parametrize("chunk_tokens", [-1, -64])
def test_negative_chunk_tokens_is_a_clear_error(chunk_tokens):
    with pytest.raises(ValueError, match=r"execution\.chunk_tokens=-\d+ must be >= 0.*set 0"):
        ExecutionConfig(chunk_tokens=chunk_tokens).validate()
    with pytest.raises(ValueError, match=r"execution\.chunk_tokens"):
        build_dit("tiny", chunk_tokens=chunk_tokens)


SLAB_GRID = (19, 3, 4)   # 228 tokens; 19 frames: slabs with a halo cut at both ends and ones cut at neither


@pytest.mark.parametrize("attention,max_offset,weight_std", [
    ("dsa", 1.5, 0.3),    # reach 5: offsets mostly inside the bound
    ("dsa", 4.0, 3.0),    # reach 7: saturated tanh, offsets at exactly +-max_offset, clamped at the clip's ends
    ("dsa_zero", 4.0, 0.1),
])
@pytest.mark.parametrize("slab,chunk", [(1, 0), (3, 0), (4, 17), (7, 40), (19, 0)])
def test_slab_block_equals_unslabbed(attention, max_offset, weight_std, slab, chunk):
    """A block over slabs of frames padded by the attention's temporal reach = the block over the whole clip:
    output and every gradient, for learned offsets up to their bound (which reach the halo's far edge)."""
    cfg = DiTConfig(dim=32, num_heads=2, ffn_dim=64, attention={"name": attention, "max_offset": max_offset})
    plain = DiTBlock(cfg, layer_idx=0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.normal_(std=weight_std if name.startswith("attn.offset") else 0.1)
    slabbed = DiTBlock(cfg, layer_idx=0)
    slabbed.load_state_dict(plain.state_dict())
    slabbed = Executed(slabbed, slab_frames=slab, chunk_tokens=chunk)
    inputs = _block_inputs(cfg, grid=SLAB_GRID)
    if attention == "dsa":
        offsets = plain.attn.offsets(torch.randn(1, 228, 32), SLAB_GRID)
        assert offsets.abs().max() > (0.99 if weight_std > 1 else 0.5) * max_offset  # saturated: the halo's far edge
    _assert_same_block(plain, slabbed, inputs)


def test_frame_slabs_cover_the_clip_once():
    assert frame_slabs(10, 0, 3) == [(0, 0, 10, 10)]
    assert frame_slabs(10, 10, 3) == [(0, 0, 10, 10)]
    assert frame_slabs(10, 4, 3) == [(0, 0, 4, 7), (1, 4, 8, 10), (5, 8, 10, 10)]


@pytest.mark.parametrize("attention", ["dense", "swin"])
def test_slab_frames_needs_a_bounded_attention(attention):
    with pytest.raises(ValueError, match=r"execution\.slab_frames=4 needs a self-attention.*set execution\.slab_"):
        ExecutionConfig(slab_frames=4).validate(DiTConfig(attention={"name": attention}).attention)
    with pytest.raises(ValueError, match=r"execution\.slab_frames=4 needs"):
        build_dit("tiny", attention=attention, slab_frames=4)
    with pytest.raises(ValueError, match=r"execution\.slab_frames=-1 must be >= 0"):
        ExecutionConfig(slab_frames=-1).validate()
