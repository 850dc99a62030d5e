"""The planner: exact host bytes, the step-time floor, and clear errors before allocating."""
import dataclasses
import time

import pytest
import torch

from megaslide.config import OffloadConfig
from megaslide.metrics.flops import dit_flops
from megaslide.models.dit import DIT_PRESETS, VideoDiT
from megaslide.offload import planner
from megaslide.offload.host_state import BlockLayout, HostState
from megaslide.offload.planner import Ceilings, check_fits, largest_depth, plan_offload
from megaslide.offload import engine as engine_module
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

GB = 1e9


@pytest.mark.parametrize("dtype,optimizer_device", [(torch.bfloat16, "cpu"), (torch.bfloat16, "gpu"),
                                                    (torch.float32, "cpu")])
def test_host_bytes_are_exactly_what_the_host_state_allocates(dtype, optimizer_device):
    cfg = dataclasses.replace(tiny_model_cfg("dsa"), depth=3)
    plan = plan_offload(cfg, batch=2, grid=(4, 8, 8), param_dtype=dtype, optimizer_device=optimizer_device)
    layout = BlockLayout.from_module(VideoDiT(cfg).blocks[0])
    host = HostState(layout, 3, dtype, pin=False, pin_optimizer_state=optimizer_device == "gpu")
    arenas = plan.host["block state, pinned arena"] + plan.host["block state, pageable arena"]
    assert arenas == host.total_bytes
    assert plan.block_params == 3 * layout.param_count
    assert plan.as_dict()["host_bytes_per_block_param"] == host.bytes_report()["bytes_per_param"]


def test_step_floor_is_the_max_of_compute_pcie_and_optimizer():
    cfg = DIT_PRESETS["7B"]
    c = Ceilings(tflops=500.0, h2d_GBps=40.0, d2h_GBps=20.0, cpu_adam_gparams=2.0)
    plan = plan_offload(cfg, batch=1, grid=(16, 32, 64), param_dtype=torch.bfloat16, ceilings=c)
    n = planner.block_layout(cfg).numel
    assert plan.h2d_bytes == 2 * n * (2 * cfg.depth - 2)
    assert plan.d2h_bytes == 2 * n * cfg.depth
    assert plan.seconds["h2d"] == pytest.approx(plan.h2d_bytes / 40e9)
    assert plan.seconds["optimizer"] == pytest.approx(plan.block_params / 2e9)
    assert plan.seconds["compute"] == pytest.approx(dit_flops(cfg, 1, (16, 32, 64)).executed / 500e12)
    assert plan.floor_s == max(plan.seconds.values()) and plan.serial_s == pytest.approx(sum(plan.seconds.values()))
    assert plan.bound == "compute"
    # the ablation moves master + moments both ways: more PCIe, and no CPU optimizer
    gpu = plan_offload(cfg, batch=1, grid=(16, 32, 64), param_dtype=torch.bfloat16, optimizer_device="gpu", ceilings=c)
    assert gpu.h2d_bytes == plan.h2d_bytes + cfg.depth * n * (12 + 2)
    assert gpu.d2h_bytes == plan.d2h_bytes + cfg.depth * n * (12 + 2)
    assert gpu.seconds["optimizer"] < plan.seconds["optimizer"] / 50
    assert "GPU optimizer slots (2) + AdamW temporaries" in gpu.hbm


def test_resident_tail_trades_hbm_for_recompute_and_pcie():
    cfg, grid = DIT_PRESETS["7B"], (16, 32, 64)
    base = plan_offload(cfg, batch=1, grid=grid, param_dtype=torch.bfloat16)
    k = 4
    kept = plan_offload(cfg, batch=1, grid=grid, param_dtype=torch.bfloat16, resident_blocks=k)
    n, tokens, f = planner.block_layout(cfg).numel, 16 * 32 * 64, dit_flops(cfg, 1, grid)
    acts = tokens * (65 * cfg.dim + 4 * cfg.ffn_dim)                       # bf16 bytes per token, one block
    assert kept.hbm_total - base.hbm_total == k * (2 * n * 2) + k * acts - k * tokens * cfg.dim * 2
    assert kept.h2d_bytes == base.h2d_bytes - k * n * 2
    assert kept.executed_flops == pytest.approx(f.train + f.forward * (cfg.depth - k) / cfg.depth)
    assert kept.seconds["compute"] < base.seconds["compute"] and base.executed_flops == pytest.approx(f.executed)
    with pytest.raises(ValueError, match="resident_blocks"):
        plan_offload(cfg, batch=1, grid=grid, param_dtype=torch.bfloat16, resident_blocks=cfg.depth + 1)


def test_host_ram_error_gives_the_numbers_and_a_depth_that_fits():
    cfg = DIT_PRESETS["7B"]
    plan = plan_offload(cfg, batch=1, grid=(16, 32, 64), param_dtype=torch.bfloat16)
    available = int(60 * GB)
    with pytest.raises(ValueError, match=r"does not fit host RAM: it needs 1\d\d\.\d GB") as err:
        check_fits(plan, host_available=available, hbm_available=None)
    depth = int(str(err.value).split("model.depth=")[1].split()[0])
    assert depth == largest_depth(cfg, host_budget=available, param_dtype=torch.bfloat16, pin_optimizer_state=False)
    smaller = plan_offload(dataclasses.replace(cfg, depth=depth), batch=1, grid=(16, 32, 64),
                           param_dtype=torch.bfloat16)
    check_fits(smaller, host_available=available, hbm_available=None)      # the suggestion fits
    bigger = plan_offload(dataclasses.replace(cfg, depth=depth + 1), batch=1, grid=(16, 32, 64),
                          param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="host RAM"):
        check_fits(bigger, host_available=available, hbm_available=None)   # and it is the largest


def test_hbm_error_names_the_items():
    plan = plan_offload(DIT_PRESETS["7B"], batch=4, grid=(16, 64, 64), param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"does not fit device memory.*saved block inputs.*fewer tokens"):
        check_fits(plan, host_available=10 ** 13, hbm_available=int(40 * GB))
    check_fits(plan, host_available=10 ** 13, hbm_available=None)  # no HBM figure on CPU: no check


def test_trainer_refuses_a_model_this_machine_cannot_hold_before_allocating(tmp_path):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="does not fit host RAM"):
        Trainer(DIT_PRESETS["105B"], tiny_data_cfg(), tiny_train_cfg(), tmp_path, offload_cfg=OffloadConfig(enabled=True))
    assert time.perf_counter() - start < 10  # nothing of the 105B model was built


def test_engine_checks_host_ram_itself(monkeypatch):
    """The engine, given a built model, refuses before it allocates its arenas."""
    monkeypatch.setattr(engine_module, "host_available_bytes", lambda: 2 ** 30)
    model = VideoDiT(dataclasses.replace(tiny_model_cfg(), depth=5))
    with pytest.raises(ValueError, match=r"host state of 5 blocks needs \d+\.\d GB.*only 1.1 GB is available"):
        engine_module.OffloadEngine(model, device=torch.device("cpu"), train_cfg=tiny_train_cfg(),
                                    offload_cfg=OffloadConfig(enabled=True))
