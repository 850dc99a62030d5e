"""The planner: exact host bytes, the step-time estimate, and clear errors before allocating."""
import dataclasses
import json
import resource
from pathlib import Path

import pytest
import torch

from megaslide.config import AttentionConfig, ExecutionConfig, OffloadConfig
from megaslide.models.dit import DIT_PRESETS, VideoDiT, count_params
from megaslide.offload import engine as engine_module
from megaslide.offload.host_state import BlockLayout, HostState
from megaslide.perf.stream_schedule import weight_loads
from megaslide.perf import planner
from megaslide.perf.activation_memory import ActivationDtypes, block_memory
from megaslide.perf.flops import dit_flops
from megaslide.perf.host_memory import ARENA_ALIGN, StateFormat, round_up
from megaslide.perf.planner import (
    HBM_MARGIN,
    AttentionRate,
    Ceilings,
    check_fits,
    grid_run,
    largest_depth,
    phase_over,
    plan_offload,
    plan_resident,
)
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

GB = 1e9


@pytest.mark.parametrize("dtype,optimizer_device", [(torch.bfloat16, "cpu"), (torch.bfloat16, "gpu"),
                                                    (torch.float32, "cpu")])
def test_host_bytes_are_exactly_what_the_host_state_allocates(dtype, optimizer_device):
    cfg = dataclasses.replace(tiny_model_cfg("dsa"), depth=3)
    plan = _plan(cfg, (4, 8, 8), batch=2, param_dtype=dtype, optimizer_device=optimizer_device)
    layout = BlockLayout.from_module(VideoDiT(cfg).blocks[0])
    host = HostState(layout, 3, StateFormat(dtype), pin=False, pin_optimizer_state=optimizer_device == "gpu")
    arenas = plan.host["block state, pinned arena"] + plan.host["block state, pageable arena"]
    assert arenas == host.total_bytes
    assert plan.block_params == 3 * layout.param_count
    assert plan.as_dict()["host_bytes_per_block_param"] == host.bytes_report()["bytes_per_param"]


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("master_dtype,moments", [("bf16", "fp32"), ("fp32", "int8"), ("bf16", "int8")])
def test_compact_host_bytes_equal_the_buffers_the_host_state_holds(param_dtype, master_dtype, moments):
    """Allocate the compact host state, sum the bytes of every buffer it holds (each arena buffer starts on a page)
    and compare with the planner's arenas and its bytes per parameter."""
    cfg = dataclasses.replace(tiny_model_cfg("dense"), depth=3, dim=40, num_heads=4)  # a layout that is not 64k
    plan = _plan(cfg, (2, 4, 4), param_dtype=param_dtype, master_dtype=master_dtype, moments=moments)
    layout = BlockLayout.from_module(VideoDiT(cfg).blocks[0])
    host = HostState(layout, 3, StateFormat.of(param_dtype, OffloadConfig(master_dtype=master_dtype, moments=moments,
                                                                           enabled=True)), pin=False)
    buffers = [t for block in host.blocks for t in block.tensors().values()]
    assert len({t.data_ptr() for t in buffers}) == len(buffers)   # no two buffers share storage
    held = sum(round_up(t.nbytes, ARENA_ALIGN) for t in buffers)
    assert held == plan.host["block state, pinned arena"] + plan.host["block state, pageable arena"]
    assert sum(t.nbytes for t in buffers) == plan.host_bytes_per_param * 3 * layout.numel
    aliased = (master_dtype == "bf16") == (param_dtype == torch.bfloat16)
    assert (host.blocks[0].master is host.blocks[0].weights) == aliased
    expected = (2 * param_dtype.itemsize + (0 if aliased else (2 if master_dtype == "bf16" else 4))
                + (8 if moments == "fp32" else 2 * (1 + 4 / 64)))
    assert plan.host_bytes_per_param == expected
    assert f"host RAM: {expected:g} bytes per block parameter" in plan.table()


def test_step_estimate_is_the_max_of_compute_pcie_and_optimizer():
    cfg = DIT_PRESETS["7B"]
    c = Ceilings(tflops=500.0, h2d_GBps=40.0, d2h_GBps=20.0, cpu_adam_gparams=2.0)
    plan = _plan(cfg, (16, 32, 64), ceilings=c)
    n = planner.block_layout(cfg).numel
    assert plan.h2d_bytes == 2 * n * (2 * cfg.depth - 2)
    assert plan.d2h_bytes == 2 * n * cfg.depth
    assert plan.seconds["h2d"] == pytest.approx(plan.h2d_bytes / 40e9)
    assert plan.seconds["optimizer"] == pytest.approx(plan.block_params / 2e9)
    elementwise = planner.FITTED.elementwise_bytes * 32768 * cfg.dim * cfg.depth * 4 / 4.3e12   # 4 passes at 4.3 TB/s
    assert plan.seconds["compute"] == pytest.approx(dit_flops(cfg, 1, (16, 32, 64)).executed / 500e12 + elementwise)
    assert plan.estimate_s == max(plan.seconds.values()) and plan.serial_s == pytest.approx(sum(plan.seconds.values()))
    assert plan.bound == "compute"
    # the ablation moves master + moments both ways: more PCIe, and no CPU optimizer
    gpu = _plan(cfg, (16, 32, 64), optimizer_device="gpu", ceilings=c)
    assert gpu.h2d_bytes == plan.h2d_bytes + cfg.depth * n * (12 + 2)
    assert gpu.d2h_bytes == plan.d2h_bytes + cfg.depth * n * (12 + 2)
    assert gpu.seconds["optimizer"] < plan.seconds["optimizer"] / 50
    assert "GPU optimizer slots (2) + AdamW temporaries" in gpu.hbm


def test_compute_estimate_runs_attention_at_its_own_rate():
    """7B width, 4 blocks, DSA 3x3x3 (32 heads x 128), 16 x 32 x 64 tokens: attend at its measured rate (offset net
    included), everything else at the matmul ceiling; the default DSA rate is the op's alone."""
    cfg = dataclasses.replace(DIT_PRESETS["7B"], depth=4, attention=AttentionConfig("dsa"))
    grid, tokens, D = (16, 32, 64), 32768, 4096
    counted = 4 * tokens * 27 * D * 4                   # QK^T and PV over 27 samples per query, 4 blocks
    own = 2 * tokens * (27 * D + D * 32 * 27 * 3) * 4   # offset net: depthwise 3^3 conv, Linear to heads * 27 * 3
    assert counted == 57_982_058_496 and own == 2_812_129_837_056
    measured = Ceilings(tflops=500.0, attention=AttentionRate(forward_tflops=2.0, backward_tflops=0.5))
    executed, parts = planner.compute_seconds(cfg, 1, grid, recomputed=4, ceilings=measured)
    assert executed == pytest.approx(dit_flops(cfg, 1, grid).executed)
    # forward in the streamed pass and again in the recompute, backward (2x the forward's FLOPs) once
    assert parts["attention"] == pytest.approx(2 * counted / 2e12 + 2 * counted / 0.5e12)
    assert parts["attention"] == pytest.approx(0.289910292)
    assert parts["matmul"] == pytest.approx((executed - 4 * (counted + own)) / 500e12)
    plan = _plan(cfg, grid, ceilings=measured)
    # memory-bound work: FITTED.elementwise_bytes per token and width element per block pass, 4 passes, at 4.3 TB/s
    assert parts["elementwise"] == pytest.approx(planner.FITTED.elementwise_bytes * tokens * D * 4 * 4 / 4.3e12)
    assert plan.seconds["compute"] == pytest.approx(sum(parts.values()))
    # two resident blocks are not recomputed: 1.5 forwards per block on average
    _, tail = planner.compute_seconds(cfg, 1, grid, recomputed=2, ceilings=measured)
    assert tail["attention"] == pytest.approx(1.5 * counted / 2e12 + 2 * counted / 0.5e12)
    # the default DSA rate (the op alone, no offset net): the offset net stays in the matmul term
    _, default = planner.compute_seconds(cfg, 1, grid, recomputed=4, ceilings=Ceilings(tflops=500.0))
    assert default["attention"] == pytest.approx(2 * counted / 1.47e12 + 2 * counted / 0.93e12)
    assert default["matmul"] == pytest.approx((executed - 4 * counted) / 500e12)
    # slabs of 4 frames, each padded by DSA's reach of 3 + 4 frames: frames [0, 11), [0, 15), [1, 16), [5, 16)
    # read, 52 for 16 kept; every block's backward re-runs its slabs (a third forward) and its slices
    slabs = ExecutionConfig(slab_frames=4)
    slab_executed, slab = planner.compute_seconds(cfg, 1, grid, recomputed=4, ceilings=measured, execution=slabs)
    halo, qkv = 52 / 16, 2 * tokens * 3 * D * D * 4
    assert slab["attention"] == pytest.approx(halo * (3 * counted / 2e12 + 2 * counted / 0.5e12))
    f = dit_flops(cfg, 1, grid)
    assert slab_executed == pytest.approx(5 * f.forward + f.weights + (halo - 1) * (qkv + counted + own) * 5
                                          + (halo - 1) * qkv)
    assert slab["matmul"] == pytest.approx((slab_executed - halo * (counted + own) * 5) / 500e12)
    # the offload engine's streamed blocks, by `BlockRunner.block_grad`: no slab re-run (two forwards), and of the
    # slices only the pre-attention ones (the QKV projection over slab and halo) re-run
    by_slab, grad = planner.compute_seconds(cfg, 1, grid, recomputed=4, ceilings=measured, execution=slabs,
                                            block_grads=4)
    assert by_slab == pytest.approx(4 * f.forward + halo * qkv + (halo - 1) * (qkv + counted + own) * 4)
    assert grad["attention"] == pytest.approx(halo * (2 * counted / 2e12 + 2 * counted / 0.5e12))
    # one forward pass (no grad): attend's forward once, nothing re-runs, even with slabs and chunks
    one_executed, one = planner.compute_seconds(cfg, 1, grid, recomputed=4, ceilings=measured, backward=False,
                                                execution=slabs)
    assert one_executed == pytest.approx(f.forward + (halo - 1) * (qkv + counted + own))
    assert one["attention"] == pytest.approx(halo * counted / 2e12)
    assert one["matmul"] == pytest.approx((one_executed - halo * (counted + own)) / 500e12)
    # an attention without a rate (dense) runs at the matmul ceiling: compute = executed FLOPs / ceiling
    dense = dataclasses.replace(cfg, attention=AttentionConfig("dense"))
    dense_executed, dense_parts = planner.compute_seconds(dense, 1, grid, recomputed=4, ceilings=Ceilings(tflops=500.0))
    assert dense_parts["matmul"] + dense_parts["attention"] == pytest.approx(dense_executed / 500e12)


def test_elementwise_bytes_are_re_derived_from_the_cell_they_were_fitted_on():
    """FITTED.elementwise_bytes from the committed cell FITTED names: (step - matmul - attention as its run planned
    them) x HBM ceiling / (tokens x width x blocks x 4 passes: forward, recompute, 2 for the backward). Its error
    on the other cells is experiments/planner_error.py's (tests/experiments/test_planner_error.py)."""
    results = Path(__file__).resolve().parents[2] / "results"
    (fitted,) = planner.FITTED.elementwise_fitted_on
    cells = json.loads((results / fitted.file).read_text())["tables"]["cells"]
    (calib,) = [c for c in cells if fitted.matches(fitted.file, c)]
    cfg = DIT_PRESETS[calib["model"]]
    passes = calib["tokens"] * cfg.dim * cfg.depth * 4
    assert planner.elementwise_seconds(cfg, calib["tokens"], 4, Ceilings()) == pytest.approx(
        planner.FITTED.elementwise_bytes * passes / 4.3e12)
    implied = (calib["step_s"] - calib["predicted_matmul_s"] - calib["predicted_attention_s"]) * 4.3e12 / passes
    assert implied == pytest.approx(planner.FITTED.elementwise_bytes, rel=0.01)
    assert planner.DEFAULT_ATTENTION_RATES["dsa"] is planner.FITTED.dsa_rate


def test_dsa_default_rate_is_the_kernel_timing_it_names():
    """FITTED.dsa_rate from the committed kernel timings FITTED names: counted forward FLOPs of the fused op over
    its forward's time, and twice them over fwd+bwd less the forward."""
    results = Path(__file__).resolve().parents[2] / "results"
    rows = {}
    for where in planner.FITTED.dsa_rate_measured_on:
        data = json.loads((results / where.file).read_text())
        (row,) = [r for r in data["tables"]["target"] if where.matches(where.file, r)]
        rows[row["variant"]] = row
    forward, both = rows["dsa_fused_fwd"], rows["dsa_fused"]
    counted = 4.0 * forward["tokens"] * forward["keys_per_query"] * 16 * 64   # 16 heads x 64
    rate = planner.FITTED.dsa_rate
    assert rate.forward_tflops == pytest.approx(counted / (forward["ms"] * 1e-3) / 1e12, rel=0.01)
    assert rate.backward_tflops == pytest.approx(2 * counted / ((both["ms"] - forward["ms"]) * 1e-3) / 1e12, rel=0.01)


def test_resident_tail_trades_hbm_for_recompute_and_pcie():
    cfg, grid = DIT_PRESETS["7B"], (16, 32, 64)
    base = _plan(cfg, grid)
    k = 4
    kept = _plan(cfg, grid, resident_blocks=k)
    n, tokens, f = planner.block_layout(cfg).numel, 16 * 32 * 64, dit_flops(cfg, 1, grid)
    x, D, F = tokens * cfg.dim * 2, cfg.dim, cfg.ffn_dim                   # x: one bf16 block input
    graph = block_memory(cfg, tokens, ActivationDtypes(2, 2)).kept_total  # one kept block graph (output included)
    # the peak moves from the second block's backward to the loss, where the k graphs are all kept
    tail = k * 2 * n * 2 + k * graph + x            # k more shells (weights, flat gradients), graphs, tail input
    streamed = -(k - 1) * x                         # L - k streamed inputs on the device instead of L - 1
    outputs = x - 3 * x                             # dL/d(last output) instead of last output and two gradients
    block = -(graph + tokens * 2 * F) - n * 2 - F * D * 2   # no block backward: graph, dL/d(GELU), gradients
    final = tokens * 16 * D                         # final layer: fp32 norm input and output, two fp32 gradients
    assert base.peak_phase == "backward" and kept.peak_phase == "loss"
    assert kept.hbm_total - base.hbm_total == tail + streamed + outputs + block + final
    assert kept.h2d_bytes == base.h2d_bytes - k * n * 2
    assert kept.executed_flops == pytest.approx(f.train + f.forward * (cfg.depth - k) / cfg.depth)
    assert kept.seconds["compute"] < base.seconds["compute"] and base.executed_flops == pytest.approx(f.executed)
    with pytest.raises(ValueError, match="resident_blocks"):
        _plan(cfg, grid, resident_blocks=cfg.depth + 1)


def test_host_ram_error_gives_the_numbers_and_a_depth_that_fits():
    cfg = DIT_PRESETS["7B"]
    plan = _plan(cfg, (16, 32, 64))
    available = int(60 * GB)
    with pytest.raises(ValueError, match=r"does not fit host RAM: it needs 1\d\d\.\d GB") as err:
        check_fits(plan, host_available=available, hbm_available=None)
    depth = int(str(err.value).split("model.depth=")[1].split()[0])
    assert depth == largest_depth(cfg, host_budget=available, state_format=StateFormat(torch.bfloat16),
                                  pin_optimizer_state=False)
    smaller = _plan(dataclasses.replace(cfg, depth=depth), (16, 32, 64))
    check_fits(smaller, host_available=available, hbm_available=None)      # the suggestion fits
    bigger = _plan(dataclasses.replace(cfg, depth=depth + 1), (16, 32, 64))
    with pytest.raises(ValueError, match="host RAM"):
        check_fits(bigger, host_available=available, hbm_available=None)   # and it is the largest


def test_host_ram_error_when_not_one_block_fits_names_a_smaller_width_not_depth_0():
    cfg = DIT_PRESETS["105B"]
    plan = _plan(cfg, (4, 8, 8))
    available = int(5 * GB)                # less than one block's host state at dim 12288
    assert largest_depth(cfg, host_budget=available, state_format=StateFormat(torch.bfloat16),
                         pin_optimizer_state=False) == 0
    with pytest.raises(ValueError, match=r"Not even one block of this width \(model.dim=12288\) fits: use a "
                                         r"smaller preset or model.dim.*more RAM") as err:
        check_fits(plan, host_available=available, hbm_available=None)
    assert "model.depth=" not in str(err.value)


def test_hbm_error_names_the_items():
    plan = _plan(DIT_PRESETS["7B"], (16, 64, 64), batch=4)
    with pytest.raises(ValueError, match=r"does not fit device memory.*saved block inputs.*fewer tokens"):
        check_fits(plan, host_available=10 ** 13, hbm_available=int(40 * GB))
    check_fits(plan, host_available=10 ** 13, hbm_available=None)  # no HBM figure on CPU: no check


def test_trainer_refuses_a_model_this_machine_cannot_hold_before_allocating(tmp_path):
    before = _peak_rss_bytes()
    with pytest.raises(ValueError, match="does not fit host RAM"):
        Trainer(dataclasses.replace(DIT_PRESETS["105B"], in_channels=3), tiny_data_cfg(), tiny_train_cfg(), tmp_path,
                offload_cfg=OffloadConfig(enabled=True))   # in_channels: the tiny data are RGB pixels
    assert _peak_rss_bytes() - before < 2 * GB  # nothing of the 105B model (1.5 TB of state) was allocated


def test_a_resident_run_on_the_cpu_that_ram_cannot_hold_is_refused_before_allocating(tmp_path):
    """On the CPU the resident trainer's activations live in host RAM, where an overshoot is an OOM kill without a
    message: a step the plan puts past MemAvailable is refused first, naming the keys that shrink it."""
    before = _peak_rss_bytes()
    data = dataclasses.replace(tiny_data_cfg(), frames=64, height=256, width=256)
    with pytest.raises(ValueError, match=r"does not fit this machine's RAM.*train.batch_size, data.frames"):
        Trainer(dataclasses.replace(DIT_PRESETS["1B"], in_channels=3), data, tiny_train_cfg(), tmp_path)
    assert _peak_rss_bytes() - before < 2 * GB   # nothing of the 1B model or its 1M-token step was allocated


def test_engine_checks_host_ram_itself(monkeypatch):
    """The engine, given a built model, refuses before it allocates its arenas."""
    monkeypatch.setattr(engine_module, "host_available_bytes", lambda: 2 ** 30)
    model = VideoDiT(dataclasses.replace(tiny_model_cfg(), depth=5))
    with pytest.raises(ValueError, match=r"host state of 5 blocks needs \d+\.\d GB.*only 1.1 GB is available"):
        engine_module.OffloadEngine(model, device=torch.device("cpu"), train_cfg=tiny_train_cfg(),
                                    offload_cfg=OffloadConfig(enabled=True))


# Peaks of torch.cuda.max_memory_allocated measured on an H200 (bf16, batch 1, offload engine, 7B width:
# dim 4096, 32 heads, ffn 16384): `python -m experiments.mfu_overlap attention=dsa model.depth=4
# data.frames=<f> offload.gpu_memory_fraction=0 model.in_channels=16` (latents 64 x 128) and
# results/mfu_overlap/h200_7Bwidth_d20.json
H200_PEAKS = [("dsa", 4, 32, 34.9e9), ("dsa", 4, 64, 63.4e9), ("dense", 20, 16, 23.184e9)]


@pytest.mark.parametrize("attention,depth,frames,measured", H200_PEAKS)
def test_hbm_prediction_is_within_ten_percent_of_h200_peaks(attention, depth, frames, measured):
    cfg = dataclasses.replace(DIT_PRESETS["7B"], depth=depth, attention=AttentionConfig(attention))
    plan = _plan(cfg, cfg.token_grid(frames, 64, 128))
    assert plan.peak_phase == "backward"
    assert plan.hbm_total == pytest.approx(measured, rel=0.10)
    assert plan.hbm_total == pytest.approx(measured, rel=0.04)   # today's model: 1-3% below


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _plan(cfg, grid, *, batch=1, param_dtype=torch.bfloat16, ceilings=None, execution=None, **offload):
    """plan_offload of `batch` clips of token grid `grid` on the engine with the `offload` settings."""
    run = grid_run(cfg, grid, batch=batch, execution=execution, offload=OffloadConfig(enabled=True, **offload))
    return plan_offload(run, param_dtype=param_dtype, ceilings=ceilings or Ceilings())


def test_activation_offload_parks_inputs_on_the_host():
    """Hand-derived: depth 12, 16 x 32 x 64 tokens. The host parks depth - 2 block inputs (bf16); the
    backward's peak block then has 3 inputs on the device (two saved ones and the stem's output) instead
    of depth - 1; each parked input crosses PCIe once each way."""
    cfg, grid = dataclasses.replace(DIT_PRESETS["7B"], depth=12), (16, 32, 64)
    x = 16 * 32 * 64 * cfg.dim * 2
    base, parked = _plan(cfg, grid), _plan(cfg, grid, activation_offload=True)
    assert parked.host_total - base.host_total == 10 * x
    assert parked.pinned_bytes - base.pinned_bytes == 10 * x
    assert base.hbm_total - parked.hbm_total == (11 - 3) * x
    assert parked.h2d_bytes - base.h2d_bytes == 10 * x and parked.d2h_bytes - base.d2h_bytes == 10 * x
    few = dataclasses.replace(cfg, depth=2)                  # nothing to park: the last two stay on the device
    assert _plan(few, grid, activation_offload=True).host_total == _plan(few, grid).host_total


@pytest.mark.parametrize("stride,parked,after,segment", [(1, 10, 2, 2), (2, 4, 3, 2), (3, 2, 4, 3), (5, 1, 3, 5),
                                                          (12, 0, 12, 0)])
def test_boundary_stride_parks_every_kth_input(stride, parked, after, segment):
    """Hand-derived: depth 12, 16 x 32 x 64 tokens, activation offload. Stride k parks the inputs of
    blocks 0, k, 2k, ... but the last two segments' (ceil(12 / k) - 2); after the forward the device
    holds the last segment's inputs and the boundary before it (with the stem's output), at the peak
    block a segment's k or the second block's; every re-run block (k - 1 per segment but the last)
    adds one forward and one weight H2D."""
    cfg, grid = dataclasses.replace(DIT_PRESETS["7B"], depth=12), (16, 32, 64)
    x, n = 16 * 32 * 64 * cfg.dim * 2, planner.block_layout(cfg).numel
    one, plan = _plan(cfg, grid, activation_offload=True), _plan(cfg, grid, activation_offload=True,
                                                                 boundary_stride=stride)
    assert plan.host_total - one.host_total == (parked - 10) * x
    assert plan.pinned_bytes - one.pinned_bytes == (parked - 10) * x
    stem = parked > 0
    assert plan.hbm_phases["loss"] - one.hbm_phases["loss"] == (after + stem - 3) * x
    assert plan.hbm_phases["backward"] - one.hbm_phases["backward"] == (max(after - 1, segment) + stem - 3) * x
    reruns = (-(-12 // stride) - 1) * (stride - 1)
    f = dit_flops(cfg, 1, grid)
    assert plan.executed_flops == pytest.approx(one.executed_flops + f.forward * reruns / 12)
    loads = weight_loads(12, 0, stride)
    assert plan.h2d_bytes == 2 * n * loads + parked * x and plan.d2h_bytes == 2 * n * 12 + parked * x
    assert plan.as_dict()["boundary_stride"] == stride and f"boundary stride {stride}" in plan.table()


def test_boundary_stride_without_activation_offload_keeps_fewer_inputs_on_the_device():
    """Depth 12, stride 3, nothing parked: after the forward the device holds boundaries 0, 3, 6 and the
    last segment's 3 inputs (6, not 12); the peak block, re-run segment 6..8's first, its 3 beside
    boundaries 0 and 3 (5, not 11)."""
    cfg, grid = dataclasses.replace(DIT_PRESETS["7B"], depth=12), (16, 32, 64)
    x = 16 * 32 * 64 * cfg.dim * 2
    one, plan = _plan(cfg, grid), _plan(cfg, grid, boundary_stride=3)
    assert one.hbm_phases["loss"] - plan.hbm_phases["loss"] == (12 - 6) * x
    assert one.hbm_phases["backward"] - plan.hbm_phases["backward"] == (11 - 5) * x
    assert plan.host_total == one.host_total


def test_chunking_plans_the_chunked_block_and_its_recompute():
    """Hand-derived per token (7B width, bf16, dense, chunk of 8160 tokens): the peak block is the
    chunked one's attention backward, 24 D + 8 heads bytes instead of 56 D + 6 F + 36 + 8 heads unchunked;
    the chunked block's gradients so far (all of it, n x 2 bytes) replace fc2's (F x D x 2). The streamed
    blocks' gradient (`BlockRunner.block_grad`) re-runs only their pre-attention slices: the QKV projection."""
    cfg, grid = dataclasses.replace(DIT_PRESETS["7B"], depth=6), (32, 34, 60)
    tokens, D, F, heads = 32 * 34 * 60, cfg.dim, cfg.ffn_dim, cfg.num_heads
    n = planner.block_layout(cfg).numel
    plain, chunked = _plan(cfg, grid), _plan(cfg, grid, execution=ExecutionConfig(chunk_tokens=8160))
    unchunked_block = tokens * (56 * D + 6 * F + 36 + 8 * heads)
    chunked_block = tokens * (24 * D + 8 * heads)
    assert plain.hbm_total - chunked.hbm_total == unchunked_block - chunked_block + F * D * 2 - n * 2
    assert "block (attention backward): dense attention backward" in chunked.hbm
    f = dit_flops(cfg, 1, grid)
    assert chunked.executed_flops == pytest.approx(plain.executed_flops + 2 * tokens * 3 * D * D * 6)
    assert f.weights > 4 * 2 * tokens * 3 * D * D * 6                 # the QKV projection: under a quarter


def test_a_clip_longer_than_host_ram_holds_is_refused_before_allocating():
    """With activation offload the parked inputs grow with the clip: 256 latent frames of 1080p at the
    7B width need ~0.4 TB of parked inputs; the host check says so (and suggests a shorter clip)."""
    cfg = dataclasses.replace(DIT_PRESETS["7B"], depth=27, attention=AttentionConfig("dsa"))
    chunked = ExecutionConfig(chunk_tokens=16320)
    grid = cfg.token_grid(256, 136, 240)
    before = _peak_rss_bytes()
    plan = _plan(cfg, grid, activation_offload=True, execution=chunked)
    with pytest.raises(ValueError, match=r"does not fit host RAM.*parked block inputs.*shorter clip"):
        check_fits(plan, host_available=128 * 2 ** 30, hbm_available=None)
    short = _plan(cfg, cfg.token_grid(4, 136, 240), activation_offload=True, execution=chunked)
    check_fits(short, host_available=128 * 2 ** 30, hbm_available=None)
    assert _peak_rss_bytes() - before < 2 * GB  # planned, not allocated


def test_hbm_check_keeps_the_allocator_margin():
    plan = _plan(dataclasses.replace(DIT_PRESETS["1B"], depth=2), (8, 32, 64))
    room = int(plan.hbm_total / (1 - HBM_MARGIN)) + 1
    check_fits(plan, host_available=10 ** 13, hbm_available=room)
    with pytest.raises(ValueError, match=r"5% kept for the allocator"):
        check_fits(plan, host_available=10 ** 13, hbm_available=int(plan.hbm_total * 1.02))


def test_resident_plan_phases_by_hand():
    """fp32 weights and AdamW moments (12 B/param) always; the optimizer step adds the gradients and
    foreach AdamW's sqrt temporary (4 + 4 B/param); the forward adds the previous step's gradients (4),
    autocast's bf16 weight cache (2) and the checkpointed block inputs (fp32: the gates are fp32)."""
    cfg, grid = dataclasses.replace(DIT_PRESETS["1B"], depth=4), (8, 34, 60)
    tokens, p = 8 * 34 * 60, count_params(cfg)
    clip = tokens * 16 * 4 * (3 * 4 + 2) + tokens * cfg.head_dim * 4    # x0, noise, x_t, bf16 patches; RoPE
    plan = plan_resident(grid_run(cfg, grid))
    assert plan.hbm_phases["optimizer"] == 20 * p + clip
    block = block_memory(cfg, tokens, ActivationDtypes(act=2, residual=4)).forward_total
    assert plan.hbm_phases["forward"] == 18 * p + clip + 4 * tokens * cfg.dim * 4 + block
    assert list(plan.hbm_phases) == ["forward", "backward", "optimizer"]
    assert phase_over(plan.hbm_phases, plan.hbm_total) is None
    assert phase_over(plan.hbm_phases, min(plan.hbm_phases.values()) - 1) == "forward"
    assert phase_over(plan.hbm_phases, plan.hbm_phases["forward"]) == (
        "backward" if plan.hbm_phases["backward"] > plan.hbm_phases["forward"] else "optimizer")


def test_chunked_final_layer_holds_one_slice_and_a_full_size_gradient_share():
    """With chunk_tokens the final layer runs over slices: the loss phase holds one slice's fp32 norm input
    copy, output and two gradients (16 D bytes a token) and one bf16 full-size input-gradient share."""
    cfg, grid = DIT_PRESETS["1B"], (64, 68, 120)
    tokens, chunk, D = 64 * 68 * 120, 16320, DIT_PRESETS["1B"].dim
    whole = _plan(cfg, grid)
    sliced = _plan(cfg, grid, execution=ExecutionConfig(chunk_tokens=chunk))
    assert whole.hbm_phases["loss"] - sliced.hbm_phases["loss"] == tokens * 16 * D - (chunk * 16 * D + tokens * 2 * D)
