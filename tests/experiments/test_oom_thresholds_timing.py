"""oom_thresholds' step-time accounting on CPU: the attention op's timer, the timing rule, the summary's
transfers-hide verdict, the step-time figures' cell ceilings and the headline preset."""
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.attention_time import AttendTimer
from experiments.hydra_config import script_config
from experiments.oom_thresholds import OOMConfig, RowSpec, cell_ceilings, cells_of_row, over_time, summary, with_timing
from megaslide.perf import planner
from tests.experiments.runner import load_result, run_script

CONF = Path(__file__).resolve().parents[2] / "experiments" / "conf"
FORWARD_S, BACKWARD_S, OTHER_S = 0.03, 0.05, 0.1


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `forward_s` in its forward and `backward_s` in its backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SlowAttention(torch.nn.Module):
    def attend(self, q, k, v, x, grid):
        return _Sleep.apply(q + k + v, FORWARD_S, BACKWARD_S)


def test_attend_timer_counts_forward_and_backward_of_attend_only():
    module = SlowAttention()
    q, k, v = (torch.randn(2, 3, requires_grad=True) for _ in range(3))
    with AttendTimer([module], torch.device("cpu")) as timer:
        with torch.no_grad():
            module.attend(q, k, v, None, (1, 1, 2))              # a streamed forward: forward only
        out = module.attend(q, k, v, None, (1, 1, 2))            # the recompute: forward and backward
        _Sleep.apply(out, OTHER_S, OTHER_S).sum().backward()    # work around attend is not counted
        seconds = timer.seconds()
    expected = 2 * FORWARD_S + BACKWARD_S
    assert expected <= seconds < expected + 0.5 * OTHER_S
    assert "attend" not in vars(module) and q.grad is not None   # the method is back; gradients flow through
    assert timer.seconds() == 0.0                                 # seconds() starts over


def script_cfg(**overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("oom_thresholds", overrides=[f"{k}={v}" for k, v in overrides.items()])


def table_config(**overrides) -> OOMConfig:
    return script_config(OOMConfig, script_cfg(**overrides))


def test_long_cells_take_the_long_timing_rule_and_record_it():
    base = script_cfg(long_step_s=20, long_warmup_steps=0, long_timed_steps=1)
    cfg = script_config(OOMConfig, base)
    cell = cells_of_row(cfg, base, "1B", ["model=1B"], RowSpec("dsa", ["chunked_offload"], [8]), "chunked_offload")[0]
    short = with_timing(cell, 19.0, cfg)
    assert (short.warmup_steps, short.timed_steps, short.timing_rule) == (1, 5, "1 warm-up, 5 timed")
    long = with_timing(cell, 21.0, cfg)
    assert (long.warmup_steps, long.timed_steps) == (0, 1)
    assert long.timing_rule.startswith("estimate 21.0 s > long_step_s")
    execution = cell.run.execution
    assert execution.chunk_tokens == base.execution.chunk_tokens and execution.slab_frames == base.execution.slab_frames
    # a cell whose warm-up and first timed step the estimate puts over the limit is not started
    assert over_time(short, 10.0, 19.9) and not over_time(short, 10.0, 20.0) and not over_time(long, 10.0, 10.0)


def test_cell_ceilings_take_this_runs_measurements():
    measured = {"matmul_TFLOPs": 700.0, "pcie": {"h2d_GBps": 54.0, "d2h_GBps": 55.0},
                "attention": [{"model": "1B", "attention": "dsa", "chunked": True, "forward_tflops": 0.9,
                               "backward_tflops": 0.3},
                              {"model": "1B", "attention": "dense", "chunked": True, "error": "OutOfMemoryError"}]}
    c = cell_ceilings(measured, "1B", "dsa", True)
    assert (c.tflops, c.h2d_GBps, c.d2h_GBps) == (700.0, 54.0, 55.0)
    assert c.attention == planner.AttentionRate(0.9, 0.3)
    assert cell_ceilings(measured, "1B", "dense", True).attention is None     # a failed probe: the default
    assert cell_ceilings(measured, "1B", "dsa", False).attention is None      # not probed
    assert cell_ceilings(None, "1B", "dsa", True) == planner.Ceilings()        # plan_only


def test_summary_says_whether_the_transfers_hide_on_long_clips():
    def cell(frames, tokens, status="fits", ratio=None, mode="chunked_offload"):
        return {"model": "1B", "attention": "dsa", "mode": mode, "frames": frames, "tokens": tokens,
                "status": status, "step_s": 1.0, "step_over_compute": ratio, "attention_share": 0.5}
    rows = [cell(64, 500_000, ratio=1.5), cell(128, 1_000_000, ratio=1.05), cell(256, 2_000_000, ratio=1.08),
            cell(8, 60_000, ratio=1.0, mode="offload"), cell(128, 1_000_000, ratio=1.2, mode="offload"),
            cell(8, 60_000, mode="resident"), cell(128, 1_000_000, status="OOM", mode="resident")]
    by_mode = {s["mode"]: s for s in summary(rows, hide_min_tokens=1_000_000, hide_ratio=1.1)}
    chunked, offload, resident = by_mode["chunked_offload"], by_mode["offload"], by_mode["resident"]
    assert chunked["transfers_hide"] is True and chunked["long_clip_step_over_compute"] == 1.08
    assert chunked["max_frames"] == 256 and chunked["step_over_compute_at_max"] == 1.08
    assert offload["transfers_hide"] is False and offload["long_clip_step_over_compute"] == 1.2
    assert resident["transfers_hide"] is None and resident["stopped_by"].startswith("OOM at 128")


def test_headline_preset_and_command_line_keys_over_it():
    base = script_cfg(oom_preset="headline", **{"execution.slab_frames": 16})
    cfg = script_config(OOMConfig, base)
    assert cfg.models == ["1B"] and cfg.host_depth == [] and base.execution.slab_frames == 16
    assert [(r.attention, r.modes, r.frames) for r in cfg.row_specs()] == [
        ("dsa", ["chunked_offload"], [64, 128, 256]), ("dense", ["chunked_offload"], [16, 32])]
    assert cfg.timed_steps == 5 and cfg.time_budget_s <= 480
    plain = table_config()
    assert len(plain.row_specs()) == len(plain.attentions) and plain.timed_steps >= 5
    with pytest.raises(ValueError, match="modes has unknown"):
        table_config(**{"rows": "[{attention: dsa, modes: [fast], frames: [8]}]"})


def test_headline_cells_record_the_slabs_the_planner_chose(tmp_path):
    """The headline preset leaves the slabs to the planner (execution.slab_frames=auto): within an H200's free
    HBM it runs 256 frames in 3 slabs of 86 and the shorter clips whole, and each cell records the number."""
    run_script(["-m", "experiments.oom_thresholds", "oom_preset=headline", "plan_only=true", "hbm_budget_GB=140.6",
                "host_budget_GB=125", "name=auto", f"wandb.dir={tmp_path}/runs"], tmp_path)
    cells = load_result(tmp_path, "oom_thresholds", "auto")["tables"]["cells"]
    slabs = {(c["attention"], c["frames"]): c["slab_frames"] for c in cells}
    assert slabs == {("dsa", 64): 0, ("dsa", 128): 0, ("dsa", 256): 86, ("dense", 16): 0, ("dense", 32): 0}
    top = next(c for c in cells if c["frames"] == 256)
    assert top["predicted_peak_GB"] <= planner.usable_hbm(int(140.6e9)) / 1e9 and top["status"] == "fits (predicted)"
