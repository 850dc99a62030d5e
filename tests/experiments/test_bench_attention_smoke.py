"""experiments/bench_attention.py: the smoke run on CPU, and its bounds, summary and target lines on
known inputs (on CPU the fused rows are skipped, so the smoke run alone never reaches them)."""
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from experiments.bench_attention import (QUICK, SLOPE_TOKENS, BenchAttentionConfig, dsa_roofline, gather_bound,
                                         summarise, target_row, targets, tile_rows, tiles_touched)
from experiments.results_io import RESULTS_DIR
from tests.experiments.runner import load_result, run_script

K = 27  # 3 x 3 x 3 samples
CEIL = {"hbm_gbps": 1000.0, "l2_gbps": 5000.0, "matmul_tflops": 500.0}
TARGET_LINES = ["dsa_fused fwd+bwd ms, offsets +-1 <= 25", "dsa_fused fwd+bwd ms, offsets +-1 <= 15 (moonshot)",
                "dsa_fused fwd+bwd ms, offsets +-4 <= 40", "dsa_fused forward ms, offsets +-1 <= 6",
                "module dsa / dsa_zero at d=16 <= 2 (issue: d=128)",
                "dsa_fused log-log slope of ms over 65,000-1,100,000 tokens <= 1.05",
                "deterministic mode: dsa_fused_deterministic / dsa_fused ms <= 1.3",
                "dsa_fused peak GB <= baseline's", "dsa_zero_fused peak GB <= baseline's"]


def test_bench_attention_smoke(tmp_path):
    run_script(["-m", "experiments.bench_attention", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "attention", "smoke")
    rows, target, modules = data["tables"]["sweep"], data["tables"]["target"], data["tables"]["module"]
    assert [r["variant"] for r in target] == ["dense", "swin2x4x4", "dsa_reference", "dsa_fused", "dsa_fused_fwd",
                                              "dsa_fused_deterministic", "dsa_zero_fused"]
    assert {r["variant"] for r in rows} == {"dense", "swin2x4x4", "dsa_reference", "dsa_fused", "dsa_zero_fused"}
    assert [r["grid"] for r in target] == [[4, 8, 8]] * 7 and sorted({tuple(r["grid"]) for r in rows}) == [
        (4, 4, 8), (8, 4, 8)]
    for r in rows + target:
        assert r["tokens"] == math.prod(r["grid"])
        window = [min(2, r["grid"][0]), 4, 4]
        assert r["keys_per_query"] == {"dense": r["tokens"], "swin2x4x4": math.prod(window)}.get(r["variant"], K)
        if "fused" in r["variant"]:
            assert r["status"] == "skipped: Triton kernels need CUDA"
        else:
            assert r["status"] == "ok" and 0 < r["ms_min"] <= r["ms"] <= r["ms_max"] and r["ms_std"] >= 0
    # the offset-spread rows: both fused variants at each bound of the config, skipped on CPU
    assert [(r["variant"], r["max_offset"], r["status"]) for r in data["tables"]["offsets"]] == [
        (v, b, "skipped: Triton kernels need CUDA") for b in (0.5, 1.0, 2.0) for v in ("dsa_fused", "dsa_fused_fwd")]
    # the gather floor needs CUDA: one skipped row, and no GPU check
    assert [(r["variant"], r["status"]) for r in data["tables"]["gather"]] == [
        ("gather", "skipped: Triton kernels need CUDA")]
    assert "gather_check" not in data and len(data["summary"]["bounds"]) == 2
    # the modules' attend (offset net + op) at the target grid, CPU backends
    assert [(r["variant"], r["head_dim"], r["heads"], r["backend"]) for r in modules] == [
        ("dsa", 16, 2, "auto"), ("dsa_zero", 16, 2, "auto")]
    assert all(r["status"] == "ok" and 0 < r["ms_min"] <= r["ms"] <= r["ms_max"] for r in modules)
    assert "tiles" not in data["tables"]  # the fused kernels' tiles are recorded on CUDA only
    summary = data["summary"]
    # 256 query tokens x 2 heads, d = 16, fp32: per query and head 584 B forward (q, k, v 192; fp32 offsets
    # 324; out 64; lse 4) and 1164 B backward (q, k, v, out, dout 320; offsets 324; lse 4; dq, dk, dv 192;
    # doffsets 324); 2432 FLOPs per sample (forward 36 d, backward 36 d + 32 d + 48 d).
    assert summary["target_tokens"] == 256
    ideal, gathers = summary["bounds"]
    assert ideal == {"bound": "idealised roofline", "hbm_bytes": 512 * (584 + 1164), "flops_cuda_core": 512 * K * 2432}
    assert gathers["bound"] == "gather bound" and gathers["gather_bytes"] == 512 * 2 * K * 8 * 2 * 16 * 4
    assert not any(k.startswith("fused_speedup") for k in summary)  # no fused rows on CPU
    assert summary["fused_loglog_slope"] is None and summary["dense_loglog_slope"] is None  # < 3 sizes
    lines = summary["targets"]
    assert [line["target"] for line in lines] == TARGET_LINES
    ratio = modules[0]["ms"] / modules[1]["ms"]
    assert lines[4] == {"target": TARGET_LINES[4], "bound": 2.0, "measured": pytest.approx(ratio), "met": ratio <= 2.0}
    assert all(line["measured"] is None and line["met"] is None for i, line in enumerate(lines) if i != 4)
    # the memory bounds come from the repository's baseline result, not from this run's results folder
    baseline = {r["variant"]: r for r in load_result(RESULTS_DIR, "attention", "h200_kernels_v18")["tables"]["target"]}
    assert [line["bound"] for line in lines[7:]] == [baseline["dsa_fused"]["peak_gb"],
                                                     baseline["dsa_zero_fused"]["peak_gb"]]
    assert "rank_blocks" not in data["tables"]  # none listed: no rank-block rows
    assert data["wandb_dir"] is None  # WANDB_MODE=disabled


def test_bench_attention_smoke_rank_blocks(tmp_path):
    """Each listed rank block adds a dsa_fused_deterministic row at the target grid, skipped on CPU."""
    run_script(["-m", "experiments.bench_attention", "smoke=true", "rank_blocks=[16,32]", "variants=[dsa_fused]",
                "sweep_variants=[dsa_fused]", f"wandb.dir={tmp_path}/runs"], tmp_path)
    rows = load_result(tmp_path, "attention", "smoke")["tables"]["rank_blocks"]
    assert [(r["variant"], r["rank_block"], r["grid"], r["status"]) for r in rows] == [
        ("dsa_fused_deterministic", b, [4, 8, 8], "skipped: Triton kernels need CUDA") for b in (16, 32)]


def test_roofline_of_a_known_shape():
    # 1000 tokens x 2 heads, d = 16, bf16: per query and head 456 B forward (q, k, v 96; offsets 324; out 32;
    # lse 4) and 908 B backward (160 + 324 + 4 + 96 + 324).
    roof = dsa_roofline(1000, 2, 16, K, 2, CEIL)
    assert roof["hbm_bytes"] == 2000 * (456 + 908) and roof["flops_cuda_core"] == 2000 * K * 2432
    assert roof["t_hbm_ms"] == pytest.approx(2.728e6 / 1e12 * 1e3)
    assert roof["t_flops_ms"] == pytest.approx(2000 * K * 2432 / 67e12 * 1e3)
    assert roof["ms"] == roof["t_hbm_ms"]  # memory-bound
    assert dsa_roofline(1000, 2, 16, K, 2, {}).keys() == {"hbm_bytes", "flops_cuda_core"}


def test_gather_bound_of_a_known_shape():
    # per query and head, bf16, d = 16: the forward and the backward's query pass gather 8 corners x 27 samples
    # of K and V rows (2 x 27 x 8 x 2 x 32 B = 27,648 B). 2 x 4 x 8 key tiles: each sample is listed in
    # 1.5 x 1.25 x 1.125 = 2.109375 tiles, and the key pass reads q and dO per record (27 x 2.109375 x 64 B =
    # 3,645 B); scratch per sample: a 32-byte entry written once, read by the binning pass and per record, and
    # records 12 B per record (2 x 32 + 2.109375 x 44 = 156.8125 B, x 27 = 4,233.9375 B).
    b = gather_bound(1000, 2, 16, K, 2, CEIL, tile=(2, 4, 8))
    assert b["records_per_sample"] == 2.109375 and b["gather_bytes"] == 2000 * 27_648
    assert b["key_row_bytes"] == 2000 * 3_645 and b["scratch_bytes"] == round(2000 * 4_233.9375)
    assert b["hbm_bytes"] == 2000 * (456 + 908)
    assert b["l2_bytes"] == 2000 * (456 + 908) + 2000 * 27_648 + 2000 * 3_645 + round(2000 * 4_233.9375)
    assert b["t_l2_ms"] == pytest.approx(b["l2_bytes"] / 5e12 * 1e3)
    assert b["ms"] == b["t_l2_ms"]  # L2-bound
    assert tiles_touched((1, 1, 1)) == 8 and tiles_touched((4, 4, 4)) == pytest.approx(1.953125)
    assert "ms" not in gather_bound(1000, 2, 16, K, 2, {})


def row(variant, tokens, ms, status="ok", **kw):
    return {"variant": variant, "tokens": tokens, "ms": ms, "status": status, **kw}


def test_summary_of_known_rows():
    grid = (10, 10, 10)
    target = [row("dense", 1000, 40.0, peak_gb=2.0), row("swin2x4x4", 1000, 10.0),
              row("dsa_reference", 1000, 30.0, peak_gb=8.0), row("dsa_fused", 1000, 5.0, peak_gb=1.0),
              row("dsa_fused_deterministic", 1000, 6.0)]
    sizes = (1000, 2000, 4000)
    sweep = ([row("dsa_fused", n, 3e-3 * n) for n in sizes] + [row("dense", n, 1e-6 * n ** 2) for n in sizes]
             + [row("dsa_reference", n, 0.03 * n) for n in sizes[:2]] + [row("dsa_reference", 4000, None, "OOM")]
             + [row("swin2x4x4", n, 0.01 * n) for n in sizes[:2]])
    s = summarise(target, sweep, grid, 2, 16, torch.bfloat16, CEIL)
    ideal, gathers = s["bounds"]
    assert s["target_tokens"] == 1000
    assert ideal == {"bound": "idealised roofline", **dsa_roofline(1000, 2, 16, K, 2, CEIL),
                     "fused_fraction": pytest.approx(ideal["ms"] / 5.0)}
    assert gathers["ms"] == gather_bound(1000, 2, 16, K, 2, CEIL, tile=(4, 4, 4))["ms"]   # 10^3 grid: 4 x 4 x 4 keys
    assert gathers["fused_fraction"] == pytest.approx(gathers["ms"] / 5.0)
    assert s["fused_speedup_vs_dsa_reference"] == 6.0 and s["fused_speedup_vs_dense"] == 8.0
    assert s["deterministic_cost"] == pytest.approx(1.2)
    assert s["fused_speedup_vs_swin2x4x4"] == 2.0 and s["fused_memory_fraction_of_reference"] == 1 / 8
    assert s["fused_speedup_vs_reference_at_largest_common_n"] == {"tokens": 2000, "speedup": pytest.approx(10.0)}
    assert s["fused_loglog_slope"] == pytest.approx(1.0) and s["dense_loglog_slope"] == pytest.approx(2.0)
    assert s["swin_loglog_slope"] is None  # two sizes only
    assert "reference_oom_at_target_hbm_gb" not in s


def test_summary_gather_floor_is_the_fastest_gather_at_the_targets_offsets():
    target = [row("dsa_fused", 1000, 40.0), row("dsa_fused_fwd", 1000, 12.0)]
    gather = [row("gather_split", 1000, 9.0, max_offset=4.0), row("gather_full", 1000, 6.0, max_offset=4.0),
              row("gather_split", 1000, 7.0, max_offset=0.5)]
    floor = summarise(target, [], (10, 10, 10), 2, 16, torch.bfloat16, CEIL, gather=gather)["bounds"][2]
    # the fastest row at +-4, whatever its layout (the +-0.5 row is faster but not the targets' offsets)
    assert floor == {"bound": "gather floor (measured)", "layout": "full", "launch": None, "forward_ms": 6.0,
                     "ms": 12.0, "forward_fraction": 0.5, "fused_fraction": 12.0 / 40.0}
    skipped = [row("gather_split", 1000, None, "skipped: Triton kernels need CUDA", max_offset=4.0)]
    assert len(summarise(target, [], (10, 10, 10), 2, 16, torch.bfloat16, CEIL, gather=skipped)["bounds"]) == 2


def test_summary_bounds_the_reference_by_the_device_memory_where_it_ran_out():
    target = [row("dsa_reference", 1000, None, "OOM"), row("dsa_fused", 1000, 5.0, peak_gb=1.41)]
    s = summarise(target, [], (10, 10, 10), 2, 16, torch.bfloat16, {}, hbm_gb=141.0)
    assert s["reference_oom_at_target_hbm_gb"] == 141.0
    assert s["fused_memory_fraction_of_reference_upper_bound"] == pytest.approx(0.01)
    assert "fused_speedup_vs_dsa_reference" not in s
    assert all("fused_fraction" not in b for b in s["bounds"])  # no ceilings measured


def test_target_lines_computed_from_the_rows():
    target = [row("dsa_fused", 262144, 38.0, peak_gb=10.0), row("dsa_fused_fwd", 262144, 12.0),
              row("dsa_fused_deterministic", 262144, 51.3), row("dsa_zero_fused", 262144, 31.0, peak_gb=13.0)]
    # the +-1 lines read the max_offset 1.0 rows: the +-4 and +-0.5 rows would give other verdicts
    spread = [row("dsa_fused", 262144, 14.0, max_offset=0.5), row("dsa_fused_fwd", 262144, 5.0, max_offset=0.5),
              row("dsa_fused", 262144, 24.0, max_offset=1.0), row("dsa_fused_fwd", 262144, 7.0, max_offset=1.0),
              row("dsa_fused", 262144, 38.0, max_offset=4.0), row("dsa_fused_fwd", 262144, 9.0, max_offset=4.0)]
    modules = [row("dsa", 262144, 60.0, head_dim=64), row("dsa_zero", 262144, 50.0, head_dim=64),
               row("dsa", 262144, 210.0, head_dim=128), row("dsa_zero", 262144, 100.0, head_dim=128)]
    sweep = [row("dsa_fused", n, 1e-4 * n ** 1.04) for n in (65280, 261120, 1044480)]
    sweep += [row("dsa_fused", 16320, 1e3), row("dsa_fused", 32640, 1e3)]  # below the slope's token range: left out
    baseline = {"tables": {"target": [row("dsa_fused", 262144, 153.0, peak_gb=12.15),
                                      row("dsa_zero_fused", 262144, 87.0, peak_gb=12.15)]}}
    lines = {line["target"]: line for line in targets(target, modules, sweep, baseline, spread)}
    verdicts = {name: (line["measured"], line["met"]) for name, line in lines.items()}
    assert verdicts == {
        "dsa_fused fwd+bwd ms, offsets +-1 <= 25": (24.0, True),
        "dsa_fused fwd+bwd ms, offsets +-1 <= 15 (moonshot)": (24.0, False),
        "dsa_fused fwd+bwd ms, offsets +-4 <= 40": (38.0, True),
        "dsa_fused forward ms, offsets +-1 <= 6": (7.0, False),
        "module dsa / dsa_zero at d=64 <= 2 (issue: d=128)": (pytest.approx(1.2), True),
        "module dsa / dsa_zero at d=128 <= 2 (issue: d=128)": (pytest.approx(2.1), False),
        "dsa_fused log-log slope of ms over 65,000-1,100,000 tokens <= 1.05": (pytest.approx(1.04), True),
        "deterministic mode: dsa_fused_deterministic / dsa_fused ms <= 1.3": (pytest.approx(1.35), False),
        "dsa_fused peak GB <= baseline's": (10.0, True), "dsa_zero_fused peak GB <= baseline's": (13.0, False)}
    assert lines["dsa_fused peak GB <= baseline's"]["bound"] == 12.15
    assert [line["bound"] for line in lines.values()] == [25.0, 15.0, 40.0, 6.0, 2.0, 2.0, 1.05, 1.3, 12.15, 12.15]
    # the summary's deterministic cost is the target line's figure
    s = summarise(target, sweep, (16, 128, 128), 16, 64, torch.bfloat16, {}, modules=modules, baseline=baseline,
                  spread=spread)
    assert s["deterministic_cost"] == pytest.approx(1.35) and s["targets"] == list(lines.values())
    no_baseline = targets(target, modules, sweep, None, spread)[-1]
    assert no_baseline["bound"] is None and no_baseline["met"] is None


def test_target_lines_not_measured_are_none():
    """No offsets rows (or only skipped ones) and no deterministic variant: those lines measure None, met None."""
    target = [row("dsa_fused", 262144, 38.0)]
    skipped = [row("dsa_fused", 262144, None, "skipped: Triton kernels need CUDA", max_offset=1.0)]
    for spread in ((), skipped):
        lines = {line["target"]: line for line in targets(target, [], [], None, spread)}
        unmeasured = [name for name, line in lines.items() if line["measured"] is None and line["met"] is None]
        assert unmeasured == [name for name in TARGET_LINES if "+-4" not in name and "module" not in name]
        assert lines["dsa_fused fwd+bwd ms, offsets +-4 <= 40"]["met"] is True


def test_target_lines_of_the_cuda_halo_forward_where_measured():
    """Where a run measured the op with the CUDA halo forward (variants dsa_fused_halo_cuda[_fwd]), three lines of
    its own follow the dsa_fused ones, read the same way (+-1 from the offsets rows, +-4 from the target table)."""
    target = [row("dsa_fused", 262144, 38.0), row("dsa_fused_halo_cuda", 262144, 35.0)]
    spread = [row("dsa_fused_halo_cuda", 262144, 26.0, max_offset=1.0),
              row("dsa_fused_halo_cuda_fwd", 262144, 5.5, max_offset=1.0),
              row("dsa_fused_halo_cuda_fwd", 262144, 3.0, max_offset=0.5)]
    lines = [(line["target"], line["measured"], line["met"]) for line in targets(target, [], [], None, spread)]
    assert lines[4:7] == [("dsa_fused_halo_cuda fwd+bwd ms, offsets +-1 <= 25", 26.0, False),
                          ("dsa_fused_halo_cuda fwd+bwd ms, offsets +-4 <= 40", 35.0, True),
                          ("dsa_fused_halo_cuda_fwd forward ms, offsets +-1 <= 6", 5.5, True)]
    assert not any("halo_cuda" in line["target"] for line in targets(target[:1], [], [], None, spread))


def test_target_row_rule():
    assert target_row("x", 50.0, 50.0)["met"] is True  # at the bound
    assert target_row("x", float("nan"), 50.0)["met"] is False  # NaN fails
    assert target_row("x", None, 50.0)["met"] is None  # not measured


def test_quick_preset_sweeps_dsa_fused_over_the_slope_range():
    tokens = [f * 68 * 120 for f in QUICK["frames"]]
    assert QUICK["sweep_variants"] == ["dsa_fused"] and "dsa_reference" not in QUICK["variants"]
    in_range = [n for n in tokens if SLOPE_TOKENS[0] <= n <= SLOPE_TOKENS[1]]
    assert in_range == [65_280, 261_120, 1_044_480]  # 8, 32, 128 frames: "65K to 1M tokens", 3 points for a slope


def test_slope_range_holds_the_sweep_from_8_to_128_frames():
    """The default sweep's frames within SLOPE_TOKENS: exactly 8 to 128 (65,280 to 1,044,480 tokens)."""
    frames = OmegaConf.load(Path(__file__).parents[2] / "experiments/conf/bench_attention.yaml").frames
    assert [f for f in frames if SLOPE_TOKENS[0] <= f * 68 * 120 <= SLOPE_TOKENS[1]] == [8, 16, 32, 64, 128]


def test_config_refuses_unknown_variants_and_few_repeats():
    ok = dict(name="", smoke=False, quick=False, heads=16, head_dim=64, module_head_dims=[64], offset_bounds=[1.0],
              gather_launches=[[16, 2]],
              frames=[1],
              variants=["dsa_fused"], sweep_variants=["dense"], repeats=5, baseline="", wandb_dir="runs",
              wandb_project="p", rank_blocks=[16, 128])
    BenchAttentionConfig(**ok).validate()
    with pytest.raises(ValueError, match="sweep_variants=\\['flash'\\] unknown"):
        BenchAttentionConfig(**{**ok, "sweep_variants": ["flash"]}).validate()
    with pytest.raises(ValueError, match="repeats=4"):
        BenchAttentionConfig(**{**ok, "repeats": 4}).validate()
    with pytest.raises(ValueError, match="offset_bounds=\\[0.0\\]"):
        BenchAttentionConfig(**{**ok, "offset_bounds": [0.0]}).validate()
    with pytest.raises(ValueError, match="module_head_dims=\\[\\] must list at least one value"):
        BenchAttentionConfig(**{**ok, "module_head_dims": []}).validate()
    with pytest.raises(ValueError, match=r"rank_blocks=\[16, 12\]: each must be one of \[16, 32, 64, 128\]"):
        BenchAttentionConfig(**{**ok, "rank_blocks": [16, 12]}).validate()


def test_tiles_at_the_target_grid():
    tiles = tile_rows((16, 128, 128), 16, [64, 128, 64])
    assert [t["head_dim"] for t in tiles] == [64, 128]
    # the backward's scratch within 1 GiB: 262144 x (64 x 27 + 12) bytes = 456 MB per head, whatever d
    assert [t["bwd_heads_per_launch"] for t in tiles] == [2, 2]
    assert all(t["key_pass"]["tile"] == (4, 4, 4) for t in tiles)
    assert all({"block_q", "block_d", "num_warps", "block_y", "maxnreg"} <= t[launch].keys()
               for t in tiles for launch in ("forward", "query_pass", "zero_offset"))
    # registers capped at block_d 64 only (launch.capped_registers)
    assert [(t["query_pass"]["maxnreg"], t["key_pass"]["maxnreg"]) for t in tiles] == [(128, 128), (None, None)]


def test_a_malformed_gather_launch_is_refused_naming_its_key():
    """main parses `gather_launches` first on CUDA, through gpu_check_dsa's launch_of, naming the key."""
    from experiments.gpu_check_dsa import launch_of
    with pytest.raises(ValueError, match=r"gather_launches: candidate \[16\] needs 2 to 4 integers"):
        launch_of([16], 64, "gather_launches")
