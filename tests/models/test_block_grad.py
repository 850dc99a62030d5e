"""`BlockRunner.block_grad`, the offload engine's block gradient: for chunked and slabbed blocks the same
gradients as autograd through the recomputed block (fp32: to summation order; bf16: by the tolerance rule
against float64), with fewer forwards of the token-wise work and the attention, counted."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaslide.config import DiTConfig, ExecutionConfig
from megaslide.models import chunking
from megaslide.models.block_grad import autograd_block_grad
from megaslide.models.chunking import BlockRunner
from megaslide.models.dit import DiTBlock
from megaslide.testing import rounding_floor, within_tolerance
from tests.helpers import needs_inductor
from tests.models.test_chunked import OPTIONS, _block_inputs, _randomise

SLAB_GRID = (13, 3, 3)   # 117 tokens; DSA's reach 4: slabs of 3 frames cut at the start, at neither end, at the end
CASES = [                # (attention, grid, execution): token counts no chunk divides, a last slab of one frame
    ("dense", (3, 3, 4), {"chunk_tokens": 7}),
    ("swin", (3, 3, 4), {"chunk_tokens": 7}),
    ("dsa", SLAB_GRID, {"chunk_tokens": 17}),
    ("dsa", SLAB_GRID, {"slab_frames": 3}),
    ("dsa", SLAB_GRID, {"slab_frames": 3, "chunk_tokens": 17}),
    ("dsa_zero", SLAB_GRID, {"slab_frames": 5, "chunk_tokens": 10}),
]


def _block(attention: str) -> tuple[DiTBlock, DiTConfig]:
    options = {"max_offset": 0.5} if attention.startswith("dsa") else OPTIONS.get(attention, {})
    cfg = DiTConfig(dim=32, num_heads=2, ffn_dim=64, attention={"name": attention, **options})
    block = DiTBlock(cfg, layer_idx=1)  # an odd block: swin shifts its windows
    _randomise(block)
    return block, cfg


def _grads(runner: BlockRunner, block: DiTBlock, inputs, grad_out, *, autograd: bool = False) -> list:
    """[grad x, grad t_mod, grad ctx, one per parameter] by `block_grad`, or by autograd through `runner.block`."""
    params = list(block.parameters())
    if autograd:
        grad_x, grad_t_mod, grad_ctx, param_grads = autograd_block_grad(runner.block, block, *inputs, grad_out, params)
    else:
        grad_x, grad_t_mod, grad_ctx, param_grads = runner.block_grad(block, *inputs, grad_out, params)
    return [grad_x, grad_t_mod, grad_ctx, *param_grads]


def _assert_same(got: list, want: list, names: list[str]) -> None:
    """Each gradient equal up to fp32 summation order: the same products, their sums over slices, slabs and a
    halo row's two slabs taken in another order (tens of terms: a few ulps of the tensor's scale; 1e-5 of it is
    ~80 ulps, and a dropped or doubled term is orders of magnitude off)."""
    for name, g, w in zip(names, got, want, strict=True):
        if w is None:                                    # dsa_zero: the inert offset net
            assert g is None, name
            continue
        assert w.abs().max() > 0, name                   # every compared gradient is non-trivial
        scale = w.abs().max().item()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("attention,grid,execution", CASES)
def test_block_grad_equals_autograd(attention, grid, execution):
    block, cfg = _block(attention)
    runner = BlockRunner(ExecutionConfig(**execution))
    inputs = _block_inputs(cfg, grid=grid)
    grad_out = torch.randn_like(inputs[0])
    names = ["x", "t_mod", "ctx"] + [n for n, _ in block.named_parameters()]
    held = torch.randn(cfg.dim)                          # a .grad already there is left as it was
    block.modulation.grad = held.expand(9, -1).clone()
    got = _grads(runner, block, inputs, grad_out)
    assert torch.equal(block.modulation.grad, held.expand(9, -1))
    block.modulation.grad = None
    _assert_same(got, _grads(runner, block, inputs, grad_out, autograd=True), names)


def test_block_grad_of_a_wan_block_equals_autograd():
    """The wan family's block (6 modulation rows, unmodulated cross-attention), slab by slab."""
    cfg = DiTConfig(dim=32, num_heads=2, ffn_dim=64, block="wan", attention={"name": "dsa_zero"})
    block = DiTBlock(cfg, layer_idx=1)
    _randomise(block)
    runner = BlockRunner(ExecutionConfig(slab_frames=2, chunk_tokens=5))
    inputs = _block_inputs(cfg, grid=(5, 3, 3))      # slabs of 2, 2 and 1 frames with halos of up to 3
    grad_out = torch.randn_like(inputs[0])
    names = ["x", "t_mod", "ctx"] + [n for n, _ in block.named_parameters()]
    _assert_same(_grads(runner, block, inputs, grad_out), _grads(runner, block, inputs, grad_out, autograd=True), names)


def test_block_grad_of_an_unchunked_block_is_autograd():
    """Neither chunked nor slabbed: `block_grad` is autograd through the whole block, bit for bit."""
    block, cfg = _block("dsa")
    runner = BlockRunner(ExecutionConfig())
    inputs = _block_inputs(cfg)
    grad_out = torch.randn_like(inputs[0])
    got, want = _grads(runner, block, inputs, grad_out), _grads(runner, block, inputs, grad_out, autograd=True)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("attention,grid,execution", [CASES[0], CASES[4]])
def test_block_grad_in_bf16_within_the_tolerance_rule(attention, grid, execution):
    """bf16 block_grad against float64 truth (autograd through the whole block): at most 2x the error of the path
    it replaces (bf16 autograd through the same chunked runner), plus a rounding floor."""
    block, cfg = _block(attention)
    inputs = _block_inputs(cfg, grid=grid)
    grad_out = torch.randn_like(inputs[0])
    results, runner = {}, BlockRunner(ExecutionConfig(**execution))
    for key, dtype, runner in [("truth", torch.float64, BlockRunner()), ("ref", torch.bfloat16, runner),
                               ("got", torch.bfloat16, runner)]:
        cast = block.to(dtype)
        args = [t.to(dtype) if t.is_floating_point() else t for t in inputs[:4]] + list(inputs[4:])
        args[4] = tuple(t.to(dtype) for t in inputs[4])
        results[key] = _grads(runner, cast, args, grad_out.to(dtype), autograd=key != "got")
    for i, (truth, ref, got) in enumerate(zip(results["truth"], results["ref"], results["got"], strict=True)):
        if truth is None:
            continue
        err, ref_err = ((t.double() - truth).abs().max().item() for t in (got, ref))
        assert within_tolerance(err, ref_err, rounding_floor(torch.bfloat16, truth)), (i, err, ref_err)


def _counted(monkeypatch, block: DiTBlock) -> collections.Counter:
    """Counts of `_project_slice`, `_finish_slice` and `block.attn.attend` calls (runners built after this)."""
    calls = collections.Counter()

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(chunking, "_project_slice", counting("project", chunking._project_slice))
    monkeypatch.setattr(chunking, "_finish_slice", counting("finish", chunking._finish_slice))
    monkeypatch.setattr(block.attn, "attend", counting("attend", block.attn.attend))
    return calls


@pytest.mark.parametrize("execution,slabs", [({"chunk_tokens": 17}, 1), ({"slab_frames": 3, "chunk_tokens": 17}, 5)])
def test_block_grad_runs_fewer_forwards(monkeypatch, execution, slabs):
    """Per streamed block and step, in calls of one pass (the streamed no-grad forward: P project and F finish
    slices, A attends, one per slab): before, the recompute with grad, a slab checkpoint's re-run (with slabs)
    and the slice checkpoints' re-run; now one slab pass and the pre-attention slices' checkpoint re-run."""
    block, cfg = _block("dsa")
    calls = _counted(monkeypatch, block)
    runner = BlockRunner(ExecutionConfig(**execution))
    inputs = _block_inputs(cfg, grid=SLAB_GRID)
    with torch.no_grad():
        runner.block(block, *inputs)                     # the streamed forward
    one = dict(calls)
    assert one["attend"] == slabs
    params = list(block.parameters())
    autograd_block_grad(runner.block, block, *inputs, torch.randn_like(inputs[0]), params)
    P, F, A = one["project"], one["finish"], one["attend"]
    if slabs > 1:  # the slab checkpoint's re-run stops early, before its last finish slice (nothing it keeps)
        assert dict(calls) == {"project": 4 * P, "finish": 4 * F - A, "attend": 3 * A}
    else:
        assert dict(calls) == {"project": 3 * P, "finish": 3 * F, "attend": 2 * A}
    calls.clear()
    runner.block_grad(block, *inputs, torch.randn_like(inputs[0]), params)
    assert dict(calls) == {"project": 2 * P, "finish": F, "attend": A}     # with the forward: 3 P, 2 F, 2 A


@needs_inductor
@pytest.mark.slow
def test_compiled_block_grad_uses_the_compiled_slices():
    """A compiled runner's block_grad runs its compiled slice functions and gives eager autograd's gradients
    (fp32: Inductor may reorder the norms' sums too, same bound)."""
    torch._dynamo.reset()
    block, cfg = _block("dsa")
    inputs = _block_inputs(cfg, grid=SLAB_GRID)
    grad_out = torch.randn_like(inputs[0])
    execution = ExecutionConfig(slab_frames=5, chunk_tokens=40)
    want = _grads(BlockRunner(execution), block, inputs, grad_out, autograd=True)
    runner, calls = BlockRunner(execution, compiled=True), collections.Counter()
    project, finish = runner.project, runner.finish
    runner.project = lambda *a: calls.update(["project"]) or project(*a)
    runner.finish = lambda *a: calls.update(["finish"]) or finish(*a)
    got = _grads(runner, block, inputs, grad_out)
    assert calls["project"] > 0 and calls["finish"] > 0
    _assert_same(got, want, ["x", "t_mod", "ctx"] + [n for n, _ in block.named_parameters()])
    torch._dynamo.reset()


class _FullSizeAdds(TorchDispatchMode):
    """Counts additions whose result has `shape`: the gradient sums over a whole slab."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and tuple(out.shape) == self.shape:
            self.count += 1
        return out


@pytest.mark.parametrize("execution", [{"chunk_tokens": 10}, {"slab_frames": 5, "chunk_tokens": 10}])
def test_block_grad_sums_no_full_size_gradient_per_slice(execution):
    """The slices of a slab join their gradients once (chunking.token_slices): the backward adds whole-slab
    tensors once per slab (grad x += the slab's), not once per slice, as indexing each slice would."""
    block, cfg = _block("dsa")
    inputs = _block_inputs(cfg, SLAB_GRID)
    runner = BlockRunner(ExecutionConfig(**execution))
    slabs = runner.slabs(block, SLAB_GRID)
    grad_out = torch.randn(2, inputs[0].shape[1], cfg.dim)
    assert len(runner.spans(inputs[0].shape[1])) >= 10          # many slices
    shapes = {(2, (b - a) * 9, cfg.dim) for a, _, _, b in slabs}
    for shape in shapes:
        with _FullSizeAdds(shape) as adds:
            runner.block_grad(block, *inputs, grad_out, list(block.parameters()))
        assert adds.count <= sum((2, (b - a) * 9, cfg.dim) == shape for a, _, _, b in slabs), shape
