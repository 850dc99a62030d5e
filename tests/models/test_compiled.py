"""Blocks run compiled (`compile_blocks`, train.compile): the same output and every gradient as eager, whole
and token-chunked, for every attention; a fixed number of graphs however many blocks and slices run; and a
clear error where a block has no compiled form. Inductor generates C++ on the CPU, so these are slow."""

import pytest
import torch
from torch._dynamo.utils import counters

from megaslide.config import DiTConfig, ExecutionConfig
from megaslide.models import layers
from megaslide.models.chunking import BlockRunner, compile_blocks
from megaslide.models.dit import DiTBlock, build_dit
from megaslide.parallel.apply import parallelize_dit
from megaslide.testing import rounding_floor, within_tolerance
from tests.helpers import needs_inductor
from tests.models.test_chunked import OPTIONS, _block_inputs, _randomise, _run

GRID = (3, 3, 4)  # N = 36 tokens; chunks of 10: slices of 10, 10, 10 and a shorter last one of 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and counts its own graphs (torch.compile keeps graphs per function,
    process-wide, up to its recompile limit)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    """Graphs torch.compile has produced since the last reset."""
    return counters["stats"]["unique_graphs"]


class Runs(torch.nn.Module):
    """`block` run by `runner`, called as the block is."""

    def __init__(self, block: DiTBlock, runner: BlockRunner):
        super().__init__()
        self.block, self.runner = block, runner

    def forward(self, *inputs):
        return self.runner.block(self.block, *inputs)


def _block(attention: str, dtype=torch.float32) -> tuple[DiTBlock, DiTConfig]:
    cfg = DiTConfig(dim=32, num_heads=2, ffn_dim=64, attention={"name": attention, **OPTIONS.get(attention, {})})
    block = DiTBlock(cfg, layer_idx=1)  # an odd block: swin shifts its windows
    _randomise(block)
    return block.to(dtype), cfg


def _assert_fp32_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Inductor fuses and may reorder the reductions of the norms (sums over 32 features, and over tokens
    in the weight gradients), so compiled and eager fp32 differ by rounding only: a few fp32 ulps of the
    tensor's scale (1e-5 relative is ~80 ulps; a wrong op or a dropped term is orders of magnitude off)."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale + 1e-8, msg=name)


@needs_inductor
@pytest.mark.slow
@pytest.mark.parametrize("attention", ["dense", "swin", "dsa", "dsa_zero"])
def test_compiled_block_equals_eager(attention, monkeypatch):
    """fp32, in slices of 10 of 36 tokens, then whole: output and the gradients of x, t_mod, ctx and every
    parameter. Graphs: in slices, two per function (the first slice length, then a symbolic one for the short
    last slice); whole, one more per function (a whole sequence is contiguous, a slice of it a strided view);
    a second step compiles nothing. The cross-attention runs query groups of at most 5 (slices of 10 and 6 in
    2 groups, the whole 36 in 9), so the group count is taken on a symbolic token count too
    (tests/models/test_cross_attention.py checks the groups against whole queries)."""
    monkeypatch.setattr(layers, "QUERY_GROUP_MAX", 5)
    assert [layers.query_groups(n) for n in (10, 6, 36)] == [2, 2, 9]
    block, cfg = _block(attention)
    inputs = _block_inputs(cfg, grid=GRID)
    want_out, want_grads = _run(block, inputs)
    names = ["x", "t_mod", "ctx"] + [n for n, _ in block.named_parameters()]
    for execution, expected_graphs in ((ExecutionConfig(chunk_tokens=10), 4), (ExecutionConfig(), 6)):
        compiled = Runs(block, BlockRunner(execution, compiled=True))
        for _ in range(2):
            got_out, got_grads = _run(compiled, inputs)
            assert graphs() == expected_graphs
        _assert_fp32_close(got_out, want_out, "out")
        for name, got, want in zip(names, got_grads, want_grads):
            if want is None:                                  # dsa_zero: the inert offset net
                assert got is None, name
                continue
            assert want.abs().max() > 0, name
            _assert_fp32_close(got, want, name)


@needs_inductor
@pytest.mark.slow
def test_compiled_bf16_block_within_the_kernel_rule():
    """bf16 weights and inputs, DSA in slices of 10: the compiled block's error against a float64 truth is
    within `within_tolerance` of the eager bf16 block's, for the output and every gradient."""
    block, cfg = _block("dsa")
    inputs = _block_inputs(cfg, grid=GRID)

    def cast(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs[:3]]
        rope = tuple(r.to(dtype) for r in inputs[4])
        return (*leaves, inputs[3], rope, inputs[5])

    truth = _run(_block("dsa", torch.float64)[0], cast(torch.float64))
    chunked = ExecutionConfig(chunk_tokens=10)
    bf16 = _block("dsa", torch.bfloat16)[0]
    eager = _run(Runs(bf16, BlockRunner(chunked)), cast(torch.bfloat16))
    compiled = _run(Runs(bf16, BlockRunner(chunked, compiled=True)), cast(torch.bfloat16))
    pairs = zip([truth[0], *truth[1]], [eager[0], *eager[1]], [compiled[0], *compiled[1]])
    for i, (want, ref, got) in enumerate(pairs):
        if want is None:
            continue
        err, ref_err = (got.double() - want).abs().max().item(), (ref.double() - want).abs().max().item()
        assert within_tolerance(err, ref_err, rounding_floor(torch.bfloat16, want)), (i, err, ref_err)


@needs_inductor
@pytest.mark.slow
def test_compiled_model_compiles_once_for_all_blocks_and_slices():
    """A 3-block model over 256 tokens in slices of 40 (six of 40, one of 16): four graphs with grad (two per
    function), two more without (the no-grad forward of the offload engine and of sampling: the token count
    is symbolic from the start now), none in later steps."""
    model = compile_blocks(build_dit("tiny", attention="dense", depth=3, chunk_tokens=40))
    torch.manual_seed(0)
    x, t, ids = torch.randn(2, 3, 4, 16, 16), torch.tensor([100.0, 700.0]), model.tokenizer(["a", "b c"])
    for step in range(2):
        model(x, t, ids).square().mean().backward()
        assert graphs() == 4, step
    for step in range(2):
        with torch.no_grad():
            model(x, t, ids)
        assert graphs() == 6, step


def test_compiled_runner_refuses_what_it_cannot_compile():
    """An `attn=` override (KV-cached and sequence-parallel inference) and a self-attention replaced by
    parallelize_dit have no compiled form: a ValueError that names train.compile, never a silent eager run."""
    model = compile_blocks(build_dit("tiny", chunk_tokens=5))
    x, t, ids = torch.randn(1, 3, 2, 4, 4), torch.tensor([400.0]), model.tokenizer(["a green triangle"])
    with torch.no_grad():
        e = model.embed(x, t, ids)
        with pytest.raises(ValueError, match=r"compiled block runner \(train.compile=true\).*attn= override"):
            model.run_block(0, e.x, e, attn=model.blocks[0].attn)
        with pytest.raises(ValueError, match=r"parallelize_dit.*train.compile=false"):
            parallelize_dit(model, None)(x, t, ids)


def test_compile_blocks_keeps_the_execution_and_the_weights():
    model = build_dit("tiny", chunk_tokens=40, slab_frames=0)
    names = list(model.state_dict())
    assert compile_blocks(model).runner.compiled
    assert model.runner.execution == ExecutionConfig(chunk_tokens=40) and list(model.state_dict()) == names
