"""experiments/bench_attention.py: the smoke run on CPU, and its roofline and summary code on
known inputs (on CPU the fused rows are skipped, so the smoke run alone never reaches them)."""
import math

import pytest
import torch

from experiments.bench_attention import dsa_roofline, summarise
from tests.experiments.runner import load_result, run_script

K = 27  # 3 x 3 x 3 samples
CEIL = {"hbm_gbps": 1000.0, "matmul_tflops": 500.0}


def test_bench_attention_smoke(tmp_path):
    run_script(["-m", "experiments.bench_attention", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "attention", "smoke")
    rows, target = data["tables"]["sweep"], data["tables"]["target"]
    assert [r["grid"] for r in target] == [[4, 8, 8]] * 5 and sorted({tuple(r["grid"]) for r in rows}) == [
        (4, 4, 8), (8, 4, 8)]
    for r in rows + target:
        assert r["tokens"] == math.prod(r["grid"])
        window = [min(2, r["grid"][0]), 4, 4]
        assert r["keys_per_query"] == {"dense": r["tokens"], "swin2x4x4": math.prod(window)}.get(r["variant"], K)
        if "fused" in r["variant"]:
            assert r["status"] == "skipped: Triton kernels need CUDA"
        else:
            assert r["status"] == "ok" and 0 < r["ms_min"] <= r["ms"] <= r["ms_max"]
    summary = data["summary"]
    # 256 query tokens x 2 heads, d = 16, fp32: per query and head 584 B forward (q, k, v 192; fp32 offsets
    # 324; out 64; lse 4) and 1164 B backward (q, k, v, out, dout 320; offsets 324; lse 4; dq, dk, dv 192;
    # doffsets 324); 2432 FLOPs per sample (forward 36 d, backward 36 d + 32 d + 48 d).
    assert summary["target_tokens"] == 256
    assert summary["roofline"] == {"bytes": 512 * (584 + 1164), "flops_cuda_core": 512 * K * 2432}
    assert not any(k.startswith("fused_speedup") for k in summary)  # no fused rows on CPU
    assert summary["fused_loglog_slope"] is None and summary["dense_loglog_slope"] is None  # < 3 sizes
    assert data["wandb_dir"] is None  # WANDB_MODE=disabled


def test_roofline_of_a_known_shape():
    # 1000 tokens x 2 heads, d = 16, bf16: per query and head 456 B forward (q, k, v 96; offsets 324; out 32;
    # lse 4) and 908 B backward (160 + 324 + 4 + 96 + 324).
    roof = dsa_roofline(1000, 2, 16, K, 2, CEIL)
    assert roof["bytes"] == 2000 * (456 + 908) and roof["flops_cuda_core"] == 2000 * K * 2432
    assert roof["t_bytes_ms"] == pytest.approx(2.728e6 / 1e12 * 1e3)
    assert roof["t_flops_ms"] == pytest.approx(2000 * K * 2432 / 67e12 * 1e3)
    assert roof["roofline_ms"] == roof["t_bytes_ms"]  # memory-bound
    assert dsa_roofline(1000, 2, 16, K, 2, {}).keys() == {"bytes", "flops_cuda_core"}


def row(variant, tokens, ms, status="ok", **kw):
    return {"variant": variant, "tokens": tokens, "ms": ms, "status": status, **kw}


def test_summary_of_known_rows():
    grid = (10, 10, 10)
    target = [row("dense", 1000, 40.0, peak_gb=2.0), row("swin2x4x4", 1000, 10.0),
              row("dsa_reference", 1000, 30.0, peak_gb=8.0), row("dsa_fused", 1000, 5.0, peak_gb=1.0)]
    sizes = (1000, 2000, 4000)
    sweep = ([row("dsa_fused", n, 3e-3 * n) for n in sizes] + [row("dense", n, 1e-6 * n ** 2) for n in sizes]
             + [row("dsa_reference", n, 0.03 * n) for n in sizes[:2]] + [row("dsa_reference", 4000, None, "OOM")]
             + [row("swin2x4x4", n, 0.01 * n) for n in sizes[:2]])
    s = summarise(target, sweep, grid, 2, 16, (3, 3, 3), torch.bfloat16, CEIL)
    assert s["target_tokens"] == 1000 and s["roofline"] == dsa_roofline(1000, 2, 16, K, 2, CEIL)
    assert s["fused_speedup_vs_dsa_reference"] == 6.0 and s["fused_speedup_vs_dense"] == 8.0
    assert s["fused_speedup_vs_swin2x4x4"] == 2.0 and s["fused_memory_fraction_of_reference"] == 1 / 8
    assert s["fused_fraction_of_roofline"] == pytest.approx(s["roofline"]["roofline_ms"] / 5.0)
    assert s["fused_speedup_vs_reference_at_largest_common_n"] == {"tokens": 2000, "speedup": pytest.approx(10.0)}
    assert s["fused_loglog_slope"] == pytest.approx(1.0) and s["dense_loglog_slope"] == pytest.approx(2.0)
    assert s["swin_loglog_slope"] is None  # two sizes only
    assert "reference_oom_at_target_hbm_gb" not in s


def test_summary_bounds_the_reference_by_the_device_memory_where_it_ran_out():
    target = [row("dsa_reference", 1000, None, "OOM"), row("dsa_fused", 1000, 5.0, peak_gb=1.41)]
    s = summarise(target, [], (10, 10, 10), 2, 16, (3, 3, 3), torch.bfloat16, {}, hbm_gb=141.0)
    assert s["reference_oom_at_target_hbm_gb"] == 141.0
    assert s["fused_memory_fraction_of_reference_upper_bound"] == pytest.approx(0.01)
    assert "fused_fraction_of_roofline" not in s and "fused_speedup_vs_dsa_reference" not in s
