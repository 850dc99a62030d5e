"""Selective recompute (offload.keep_attention): the offload engine keeps its streamed blocks' attention output
and lse, on the device and in (pinned) host RAM as the planner places them, and its backward runs no attention
forward for them. In fp32 losses, gradient norms and every weight equal the full recompute's bit for bit: dense
and DSA / dsa_zero (the gather backend, split at its lse like the fused kernels), whole, token-chunked and over
frame slabs, with and without activation offload, both block families, on an odd token grid."""
import dataclasses

import pytest
import torch

import megaslide.offload.engine as engine_module
from megaslide.attention.dsa import gather
from megaslide.config import ExecutionConfig, OffloadConfig, ParallelConfig
from megaslide.perf import planner
from megaslide.perf.kept_attention import STAGING_BLOCKS
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

pytestmark = pytest.mark.usefixtures("torch_adamw")

STEPS = 2
DATA = {"frames": 7, "height": 6, "width": 10, "shape_size": 3}   # token grid (7, 3, 5): odd along every axis


def _model_cfg(attention, block="dit"):
    options = {"backend": "gather", "max_offset": 1.0} if attention.startswith("dsa") else {}
    return dataclasses.replace(tiny_model_cfg(attention, **options), depth=4, block=block)


def _trainer(tmp_path, name, attention, keep, activation_offload=False, block="dit", **execution):
    offload = OffloadConfig(enabled=True, activation_offload=activation_offload, keep_attention=keep)
    trainer = Trainer(_model_cfg(attention, block), tiny_data_cfg(**DATA), tiny_train_cfg(steps=STEPS, grad_clip=0.05),
                      tmp_path / name, offload_cfg=offload, execution=ExecutionConfig(**execution))
    _wake(trainer.engine)
    return trainer


def _wake(engine, scale=0.05):
    """The same random weights in place of the zero ones (adaLN-Zero gates and final layer, DSA's offset
    Linear), so that the attention gets an output gradient and DSA's samples move from the first step."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in [engine.model.t_proj[1].weight, engine.model.final.linear.weight]:
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
        for block in engine.host.blocks:                               # fp32: the weights are the master
            block.weights.add_(torch.randn(block.weights.shape, generator=generator) * scale)
    engine.streamer.invalidate()


def _two_on_device(monkeypatch, attention, execution, block="dit"):
    """Free "HBM" (the CPU engine's device memory) for two and a half kept blocks beside the step's peak: the
    planner then keeps blocks 2 and 3 there and blocks 0 and 1 in host RAM (which pass through the device two at a
    time, before block 2 is made and after block 2 is freed)."""
    run = planner.grid_run(_model_cfg(attention, block), (7, 3, 5), batch=2, grad_clip=0.05,
                           execution=ExecutionConfig(**execution), offload=OffloadConfig(enabled=True))
    base = planner.plan_offload(run, param_dtype=torch.float32)
    block = 2 * 105 * (64 * 4 + 4 * 4)                             # tokens x (dim x fp32 + heads x fp32 lse)
    free = base.hbm_total + STAGING_BLOCKS * block + block // 2
    monkeypatch.setattr(engine_module, "hbm_available_bytes", lambda *a: int(free / (1 - planner.HBM_MARGIN)) + 1)


CASES = [("dense", False, {}, "dit"), ("dense", True, {"chunk_tokens": 24}, "dit"),
         ("dsa", True, {}, "dit"), ("dsa", True, {"slab_frames": 2, "chunk_tokens": 40}, "dit"),
         ("dsa_zero", False, {"slab_frames": 3}, "dit"), ("dsa_zero", True, {"chunk_tokens": 40}, "wan")]


@pytest.mark.parametrize("attention, parked, execution, block", CASES)
def test_kept_attention_is_bit_identical_to_full_recompute(tmp_path, monkeypatch, attention, parked, execution,
                                                           block):
    _two_on_device(monkeypatch, attention, execution, block)
    full = _trainer(tmp_path, "full", attention, "off", parked, block, **execution)
    kept = _trainer(tmp_path, "kept", attention, "auto", parked, block, **execution)
    plan = kept.engine.kept_attention
    assert (plan.gpu, plan.host, plan.recompute) == ((2, 3), (0, 1), ())
    for _ in range(STEPS):
        a, b = full.train_step(), kept.train_step()
        assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["grad_norm"], b["grad_norm"])
    theirs, mine = full.engine.model_state_dict(), kept.engine.model_state_dict()
    for name, p in theirs.items():
        assert torch.equal(mine[name], p), name


def test_the_engine_holds_what_the_planner_kept(tmp_path, monkeypatch):
    """The bytes the engine keeps on the device and in host RAM are the plan's, and so is the most it holds on
    the device at once; its backward runs no attention forward: per step the gathers' forward runs once per
    block and slab (the streamed forward)."""
    execution = {"slab_frames": 2, "chunk_tokens": 40}
    _two_on_device(monkeypatch, "dsa", execution)
    forwards = []
    forward = gather.gather_forward
    monkeypatch.setattr(gather, "gather_forward", lambda *a, **k: forwards.append(k.get("lse")) or forward(*a, **k))
    trainer = _trainer(tmp_path, "kept", "dsa", "auto", True, **execution)
    plan = trainer.engine.kept_attention
    trainer.train_step()
    store = trainer.engine.streamer.kept
    assert store.stored == {"gpu": plan.gpu_bytes, "host": plan.host_bytes}
    assert store.device_peak == plan.device_blocks * plan.block_bytes
    assert plan.gpu_bytes == 2 * plan.block_bytes and plan.host_bytes == 2 * plan.block_bytes
    slabs = 4                                                      # 7 frames in slabs of 2
    assert sum(lse is None for lse in forwards) == 4 * slabs       # the streamed forward's, no recompute's
    assert sum(lse is not None for lse in forwards) == 4 * slabs   # the backward's state, from the kept lse


def test_on_refuses_what_does_not_fit_and_auto_recomputes_the_rest():
    run = planner.grid_run(_model_cfg("dense"), (7, 3, 5), offload=OffloadConfig(enabled=True, keep_attention="on"))
    base = planner.plan_offload(dataclasses.replace(run, offload=OffloadConfig(enabled=True)),
                                param_dtype=torch.float32)
    tight = planner.Budgets(base.hbm_total, base.host_total, "cpu")   # no room beside the step
    with pytest.raises(ValueError, match="offload.keep_attention=on"):
        planner.plan_offload(run, param_dtype=torch.float32, budgets=tight)
    auto = dataclasses.replace(run, offload=OffloadConfig(enabled=True, keep_attention="auto"))
    plan = planner.plan_offload(auto, param_dtype=torch.float32, budgets=tight)
    assert plan.kept.recompute == (0, 1, 2, 3) and plan.kept.reason
    assert plan.hbm_total == base.hbm_total and plan.host_total == base.host_total


def test_a_variant_that_cannot_keep_is_named_in_the_plan():
    """DSA on the CPU's size-picked backend (auto) keeps no lse: auto re-runs every block and says why."""
    cfg = tiny_model_cfg("dsa")
    run = planner.grid_run(cfg, (7, 3, 5), offload=OffloadConfig(enabled=True, keep_attention="auto"))
    plan = planner.plan_offload(run, param_dtype=torch.float32, budgets=planner.Budgets(10 ** 12, 10 ** 12, "cpu"))
    assert plan.kept.recompute == tuple(range(cfg.depth)) and "attention.backend='auto' on cpu" in plan.kept.reason
    cuda = planner.plan_offload(run, param_dtype=torch.bfloat16, budgets=planner.Budgets(10 ** 12, 10 ** 12))
    assert cuda.kept.gpu == tuple(range(cfg.depth)) and cuda.as_dict()["kept_attention"]["gpu_bytes"] > 0



def test_data_parallel_keeps_each_ranks_own_attention_within_its_share_of_the_node():
    """Kept attention is a rank's activations: with parallel.dp=2 a block's kept bytes are those of the rank's
    batch share (half the global batch), and the node's host budget is split between its ranks."""
    cfg = _model_cfg("dense")
    offload = OffloadConfig(enabled=True, keep_attention="auto")
    one = planner.grid_run(cfg, (7, 3, 5), batch=1, offload=offload)
    two = dataclasses.replace(planner.grid_run(cfg, (7, 3, 5), batch=2, offload=offload),
                              parallel=ParallelConfig(dp=2))
    roomy = planner.Budgets(10 ** 12, 10 ** 12, "cpu")
    single, ranked = (planner.plan_offload(r, param_dtype=torch.float32, budgets=roomy) for r in (one, two))
    assert ranked.kept.block_bytes == single.kept.block_bytes == 105 * (64 * 4 + 4 * 4)
    assert ranked.kept.gpu == single.kept.gpu == tuple(range(4)) and ranked.ranks == 2
    assert ranked.as_dict()["kept_attention"] == single.as_dict()["kept_attention"]
    base = planner.plan_offload(dataclasses.replace(two, offload=OffloadConfig(enabled=True)),
                                param_dtype=torch.float32)
    block = single.kept.block_bytes
    hbm = int((base.hbm_total + STAGING_BLOCKS * block + block // 2) / (1 - planner.HBM_MARGIN)) + 1
    rest = tuple(i for i in range(4) if i not in planner.plan_offload(two, param_dtype=torch.float32,
                                                                      budgets=planner.Budgets(hbm, 0, "cpu")).kept.gpu)
    per_rank = base.host_total + len(rest) * block           # one rank's host RAM with the rest kept there
    assert rest
    for node, kept in ((per_rank, ()), (2 * per_rank, rest)):  # the node's RAM is its 2 ranks'
        plan = planner.plan_offload(two, param_dtype=torch.float32, budgets=planner.Budgets(hbm, node, "cpu"))
        assert plan.kept.host == kept


def test_keep_attention_is_validated():
    with pytest.raises(ValueError, match="offload.keep_attention='yes'.*choose off"):
        OffloadConfig(enabled=True, keep_attention="yes").validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels' split on CUDA")
@pytest.mark.parametrize("attention", ["dense", "dsa", "dsa_zero"])
def test_cuda_kept_attention_matches_full_recompute(tmp_path, attention):
    """On CUDA (SDPA's flash / memory-efficient kernels, DSA's fused kernels) in fp32: the same losses, gradient
    norms and weights as the full recompute, up to the kernels' atomics (the fused DSA backward sums with them)."""
    cfg = dataclasses.replace(tiny_model_cfg(attention), depth=4)
    runs = {}
    for keep in ("off", "on"):
        offload = OffloadConfig(enabled=True, activation_offload=True, keep_attention=keep)
        train = tiny_train_cfg(steps=STEPS, device="cuda", precision="fp32")
        trainer = Trainer(cfg, tiny_data_cfg(**DATA), train, tmp_path / keep, offload_cfg=offload,
                          execution=ExecutionConfig(chunk_tokens=40))
        _wake(trainer.engine)
        runs[keep] = ([trainer.train_step()["loss"].item() for _ in range(STEPS)], trainer.engine.model_state_dict())
    torch.testing.assert_close(runs["on"][0], runs["off"][0], rtol=1e-5, atol=0)
    for name, p in runs["off"][1].items():
        torch.testing.assert_close(runs["on"][1][name], p, rtol=1e-4, atol=1e-6, msg=name)
