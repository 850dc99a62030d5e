"""The pieces of the sharded (data-parallel) offload engine that need no process group: a rank's shard of a
block, sharded checkpoint parts read back on another number of ranks (fp32 and compact state), the compact
state's sharded update equal to the whole block's bit for bit, a rank's share of the global batch, and the
planner's and the engine's host RAM per rank and per node (a P that does not fit is refused, naming it)."""
import dataclasses

import pytest
import torch

from megaslide.checkpoint import block_shard, block_weights, flat_layout, read_block, save_checkpoint
from megaslide.config import AttentionConfig, OffloadConfig, ParallelConfig
from megaslide.data.build import build_dataset
from megaslide.diffusion.batches import make_batch
from megaslide.models.dit import DIT_PRESETS, VideoDiT
from megaslide.offload import engine as engine_module
from megaslide.offload.compact import SIGNED, QuantizedMoment, rounding_key
from megaslide.offload.cpu_adam import adamw_step_
from megaslide.offload.host_state import BlockLayout, HostState, Shard
from megaslide.offload.streamer import DoneEvent
from megaslide.offload.updaters import AdamHyper, CpuUpdater, UpdateJob
from megaslide.parallel.data_parallel import DataParallel
from megaslide.perf.host_memory import MOMENT_BLOCK, PARAM_ALIGN, StateFormat, shard_numel
from megaslide.perf.planner import Ceilings, check_fits, grid_run, plan_offload
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

GB = 1e9


@pytest.mark.parametrize("numel, ranks", [(64, 1), (640, 3), (1000, 4), (65, 2), (7 * 64, 7)])
def test_shards_cover_the_block_once_padded_with_zeros(numel, ranks):
    flat = torch.randn(numel)
    shards = [Shard.of(numel, rank, ranks) for rank in range(ranks)]
    assert shards[0].numel % PARAM_ALIGN == 0 and shards[0].padded >= numel and shards[0].numel == shard_numel(
        numel, ranks)
    joined = torch.cat([shard.take(flat) for shard in shards])                    # (padded,)
    assert torch.equal(joined[:numel], flat) and not joined[numel:].any()
    spans = [(3, 70), (100, min(numel, 400))]
    covered = torch.zeros(shards[0].padded, dtype=torch.bool)
    for shard in shards:
        for lo, hi in shard.spans(spans):
            assert 0 <= lo < hi <= shard.numel
            covered[shard.start + lo:shard.start + hi] = True
    expect = torch.zeros_like(covered)
    for lo, hi in spans:
        expect[lo:hi] = lo < hi
    assert torch.equal(covered, expect)


def test_host_state_holds_a_shard_and_its_bytes_fall_by_the_ranks():
    layout = BlockLayout.from_module(VideoDiT(tiny_model_cfg()).blocks[0])
    whole = HostState(layout, 2, StateFormat(torch.bfloat16), pin=False)
    flat = torch.randn(layout.numel)
    parts = []
    for rank in range(3):
        host = HostState(layout, 2, StateFormat(torch.bfloat16), pin=False, shard=Shard.of(layout.numel, rank, 3))
        host.load_block_(1, flat)
        parts.append(host.block_state(1)["master"])
        assert host.total_bytes <= whole.total_bytes / 3 + 8 * 4096    # each buffer rounds up to a page
    assert torch.equal(torch.cat(parts)[:layout.numel], flat)


def test_a_checkpoint_sharded_over_three_ranks_reads_back_on_two(tmp_path):
    numel = 1000
    states = {key: torch.randn(numel) for key in ("master", "exp_avg", "exp_avg_sq")}
    for rank in range(3):
        shard = Shard.of(numel, rank, 3)
        save_checkpoint(block_shard(tmp_path, 0, rank, 3), {k: shard.take(v) for k, v in states.items()})
    whole = read_block(tmp_path, 0, 3, numel)
    assert all(torch.equal(whole[k], states[k]) for k in states)
    two = [Shard.of(numel, rank, 2).take(whole["master"]) for rank in range(2)]
    assert torch.equal(torch.cat(two)[:numel], states["master"])
    layout = flat_layout([("w", (10, 10)), ("b", (7,))], 64)              # w at 0, b at 128; 192 elements
    for rank in range(2):
        save_checkpoint(block_shard(tmp_path / "small", 0, rank, 2), {"master": torch.arange(96.0) + 96 * rank})
    weights = block_weights(tmp_path / "small", layout, 1, ranks=2)
    assert torch.equal(weights["blocks.0.w"], torch.arange(100.0).view(10, 10))
    assert torch.equal(weights["blocks.0.b"], torch.arange(128.0, 135.0))
    with pytest.raises(ValueError, match="mixes checkpoints of different models"):
        read_block(tmp_path / "small", 0, 2, 200)


def test_a_rank_share_of_the_global_batch_is_those_rows_of_it():
    dataset = build_dataset(tiny_data_cfg(num_videos=8), in_channels=3)
    tokenizer = VideoDiT(tiny_model_cfg()).tokenizer
    cfg = tiny_train_cfg(batch_size=6, caption_dropout=0.5)
    whole = make_batch(dataset, tokenizer, cfg, step=3)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        part = make_batch(dataset, tokenizer, cfg, step=3, rows=rows)
        for name in ("x0", "context", "t", "noise"):
            assert torch.equal(getattr(part, name), getattr(whole, name)[rows]), name
        assert part.captions == whole.captions[rows]


def _plan(ranks: int, ranks_per_node: int | None = None, **offload):
    run = grid_run(DIT_PRESETS["14B"], (16, 32, 64), batch=ranks, offload=OffloadConfig(enabled=True, **offload),
                   parallel=ParallelConfig(dp=ranks))
    return plan_offload(run, param_dtype=torch.bfloat16, ceilings=Ceilings(), ranks_per_node=ranks_per_node)


def test_planner_gives_host_bytes_per_rank_and_per_node():
    one, two, four = _plan(1), _plan(2), _plan(4, ranks_per_node=2)
    arenas = [p.host["block state, pinned arena"] + p.host["block state, pageable arena"] for p in (one, two, four)]
    assert arenas[1] == pytest.approx(arenas[0] / 2, rel=1e-3) and arenas[2] == pytest.approx(arenas[0] / 4, rel=1e-3)
    assert two.node_host_total == 2 * two.host_total and four.node_host_total == 2 * four.host_total
    assert (one.batch, two.batch, two.tokens) == (1, 1, one.tokens)         # the global batch split over ranks
    assert two.h2d_bytes == pytest.approx(one.h2d_bytes / 2, rel=1e-3)
    gathered = two.h2d_bytes * 1 / Ceilings().collective_GBps / 1e9   # (P-1) x the shard each load: its bytes again
    assert two.seconds["h2d"] == pytest.approx(two.h2d_bytes / Ceilings().h2d_GBps / 1e9 + gathered)
    assert two.seconds["optimizer"] == pytest.approx(one.seconds["optimizer"] / 2)
    assert "per rank" in two.table() and "per node (2 ranks)" in two.table()


def test_sequence_parallel_ranks_share_their_replica_rows_and_the_host_state_of_every_rank():
    ranks = [DataParallel(None, rank, 4, sp=2) for rank in range(4)]   # 2 replicas of 2 SP ranks
    assert [dp.rows(6) for dp in ranks] == [slice(0, 3), slice(0, 3), slice(3, 6), slice(3, 6)]
    assert ranks[0].replicas == 2 and ranks[0].key == "parallel.dp=2 x parallel.sp=2"
    dsa = dataclasses.replace(DIT_PRESETS["14B"], attention=AttentionConfig("dsa"))
    reach = dsa.attention.variant.temporal_reach(dsa.attention.options)
    plans = {(dp, sp): plan_offload(grid_run(model, (16, 32, 64), batch=2, parallel=ParallelConfig(dp=dp, sp=sp)),
                                    param_dtype=torch.bfloat16, ceilings=Ceilings())
             for model in (dsa,) for dp, sp in ((1, 1), (2, 1), (1, 2), (2, 2))}
    arenas = {key: p.host["block state, pinned arena"] + p.host["block state, pageable arena"]
              for key, p in plans.items()}
    assert arenas[1, 2] == arenas[2, 1] and arenas[2, 2] == pytest.approx(arenas[1, 1] / 4, rel=1e-3)
    assert (plans[1, 2].batch, plans[2, 2].batch) == (2, 1)                    # a replica's rows, whole clips
    assert plans[1, 2].grid == (min(16, 8 + 2 * reach), 32, 64)                 # a rank's frames and their halo
    dense = plan_offload(grid_run(DIT_PRESETS["14B"], (16, 32, 64), parallel=ParallelConfig(sp=2)),
                         param_dtype=torch.bfloat16, ceilings=Ceilings())
    assert dense.grid == (16, 32, 64) and "2 ranks (2 per node)" in dense.table()   # dense: the whole clip
    with pytest.raises(ValueError, match=r"ranks_per_node=5 must be in \[1, parallel.dp=2 x parallel.sp=2\]"):
        plan_offload(grid_run(dsa, (16, 32, 64), batch=2, parallel=ParallelConfig(dp=2, sp=2)),
                     param_dtype=torch.bfloat16, ranks_per_node=5)


def test_planner_counts_a_rank_shard_in_the_compact_state_format():
    compact = {"master_dtype": "bf16", "moments": "int8"}
    one, two, full = _plan(1, **compact), _plan(2, **compact), _plan(2)
    arenas = [p.host["block state, pinned arena"] + p.host["block state, pageable arena"] for p in (one, two, full)]
    assert arenas[1] == pytest.approx(arenas[0] / 2, rel=1e-3)
    assert arenas[1] == pytest.approx(arenas[2] * 6.125 / 16, rel=1e-3)   # bf16 master, int8 moments vs 16 B
    assert "host RAM per rank: 6.125 bytes per block parameter" in two.table()


def test_planner_refuses_a_data_parallel_run_a_node_cannot_hold_naming_it():
    available = int(150 * GB)                  # 14B: about 221 GB of host state in one process
    with pytest.raises(ValueError, match=r"parallel.dp=2 with 2 ranks on a node needs 2\d\d\.\d GB there"):
        check_fits(_plan(2), host_available=available, hbm_available=None)
    check_fits(_plan(2, ranks_per_node=1), host_available=available, hbm_available=None)   # one rank per node fits
    with pytest.raises(ValueError, match=r"ranks_per_node=3 must be in \[1, parallel.dp=2\]"):
        _plan(2, ranks_per_node=3)


def test_engine_refuses_host_state_of_its_node_ranks_naming_parallel_dp(monkeypatch):
    monkeypatch.setattr(engine_module, "host_available_bytes", lambda: 2 ** 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = VideoDiT(dataclasses.replace(tiny_model_cfg(), depth=5))
    dp = engine_module.DataParallel(None, 1, 4)   # rank 1 of 4 (no group: refused before one is needed)
    with pytest.raises(ValueError, match=r"1/4 of it per rank\) needs \d+\.\d GB of host RAM \(4 ranks x .*parallel.dp "
                                         r"\(now 4\)"):
        engine_module.OffloadEngine(model, device=torch.device("cpu"), train_cfg=tiny_train_cfg(),
                                    offload_cfg=OffloadConfig(enabled=True), dp=dp)
    with pytest.raises(ValueError, match=r"offload.optimizer_device='gpu' with parallel.dp=4.*optimizer_device=cpu"):
        engine_module.OffloadEngine(model, device=torch.device("cpu"), train_cfg=tiny_train_cfg(),
                                    offload_cfg=OffloadConfig(enabled=True, optimizer_device="gpu"), dp=dp)


@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_compact_updates_equal_the_whole_block_bit_for_bit(ranks):
    """A bf16 master with 8-bit moments, updated shard by shard on `ranks` ranks from the same gradients, equals the
    one-process update bit for bit: shards hold whole quantisation blocks, and the stochastic rounding draws each
    element's bits by its index in the whole block."""
    layout = BlockLayout.from_module(VideoDiT(tiny_model_cfg()).blocks[0])
    fmt = StateFormat(torch.bfloat16, torch.bfloat16, "int8")
    assert all(shard_numel(layout.numel, p) % MOMENT_BLOCK == 0 for p in (2, 3, 5, 7))
    whole = HostState(layout, 1, fmt, pin=False)
    shards = [HostState(layout, 1, fmt, pin=False, shard=Shard.of(layout.numel, rank, ranks))
              for rank in range(ranks)]
    flat = torch.randn(layout.numel)
    for host in (whole, *shards):
        host.load_block_(0, flat)
    updaters = [CpuUpdater(host, AdamHyper(0.9, 0.999, 1e-8, 0.01), adamw_step_, serial=True)
                for host in (whole, *shards)]
    spans = layout.spans([True] * len(layout.slots))
    for step in (1, 2, 3):
        grad = torch.randn(layout.numel) * 1e-3
        for updater in updaters:
            shard = updater.host.shard
            updater.host.blocks[0].grads.copy_(shard.take(grad))
            updater.submit(UpdateJob(0, step, 1e-2, shard.spans(spans), step, DoneEvent(),
                                     rounding_key=rounding_key(7, 0, step)))
            updater.before_load(0)
    for key, value in whole.block_state(0).items():
        parts = [host.block_state(0)[key] for host in shards]
        if isinstance(value, dict):
            assert torch.equal(torch.cat([p["codes"] for p in parts])[:layout.numel], value["codes"]), key
            assert torch.equal(torch.cat([p["scales"] for p in parts])[:len(value["scales"])], value["scales"]), key
        else:
            assert torch.equal(torch.cat(parts)[:layout.numel], value), key
    assert not torch.equal(whole.blocks[0].master, flat.bfloat16())      # the steps moved the weights
    for updater in updaters:
        updater.close()


def test_a_compact_checkpoint_sharded_over_three_ranks_reads_back_on_two(tmp_path):
    """8-bit moments' codes and scales of whole quantisation blocks join exactly and cut into another P's shards;
    parts that are not whole blocks are refused naming the fix."""
    numel = 1000
    values = torch.randn(numel)
    moment = QuantizedMoment.zeros(numel, SIGNED)
    moment.store_(values)
    state = {"master": values.bfloat16(), "exp_avg": moment.state()}
    for rank in range(3):
        shard = Shard.of(numel, rank, 3)
        save_checkpoint(block_shard(tmp_path, 0, rank, 3), {k: shard.take_state(v) for k, v in state.items()})
    whole = read_block(tmp_path, 0, 3, numel, moment_block=MOMENT_BLOCK)
    assert torch.equal(whole["master"], state["master"])
    assert all(torch.equal(whole["exp_avg"][k], state["exp_avg"][k]) for k in ("codes", "scales"))
    two = [Shard.of(numel, rank, 2).take_state(whole["exp_avg"]) for rank in range(2)]
    joined = QuantizedMoment(torch.cat([p["codes"] for p in two]), torch.cat([p["scales"] for p in two]), SIGNED)
    assert torch.equal(joined.values()[:numel], moment.values())
    for rank in range(2):   # parts of 500 elements: not whole blocks of 64
        save_checkpoint(block_shard(tmp_path / "odd", 0, rank, 2),
                        {"exp_avg": {"codes": moment.codes[500 * rank:500 * (rank + 1)], "scales": moment.scales}})
    with pytest.raises(ValueError, match="not whole quantisation blocks of 64 elements.*parallel.dp=2"):
        read_block(tmp_path / "odd", 0, 2, numel, moment_block=MOMENT_BLOCK)
