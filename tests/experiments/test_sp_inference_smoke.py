"""Smoke run of experiments/sp_inference.py at its tiny size: torchrun, 2 gloo ranks on CPU."""
from tests.experiments.runner import load_result, run_script

LADDER = ["causal: none", "causal: +precomputed RoPE", "causal: +no host sync", "causal: +fused QK-norm+RoPE",
          "causal: +CUDA graphs (all)"]


def test_sp_inference_tiny_on_two_ranks_writes_a_complete_result(tmp_path):
    stdout = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         "-m", "experiments.sp_inference", "tiny=true"], tmp_path, OMP_NUM_THREADS="1")
    record = load_result(tmp_path, "sp_inference", "tiny_P2")
    assert {"command", "commit", "hardware", "date", "note", "wandb_dir"} <= record.keys()
    assert record["wandb_dir"] is None  # WANDB_MODE=disabled: no W&B run
    check = record["tables"]["correctness"][0]
    assert check["sp_within_2x_bf16_noise"] and check["bf16_noise_max_abs_diff_vs_fp32_first_2_chunks"] > 0
    assert record["tables"]["ceilings"][0]["tflops"] > 0
    rows = record["rows"]
    assert [r["variant"] for r in rows if r["ranks"] == 2] == LADDER + ["full-sequence (ulysses SP)"]
    assert [r["variant"] for r in rows if r["ranks"] == 1] == LADDER[-1:] + ["full-sequence (ulysses SP)"]
    assert all(0 < r["ttff_ms"] <= 1e3 * r["total_s"] * (1 + 1e-6) and r["video_fps"] > 0 for r in rows)
    assert all(r["ttff_ms_min"] <= r["ttff_ms"] <= r["ttff_ms_max"] and r["total_ms_std"] >= 0 for r in rows)
    assert [r["cuda_graphs_status"] for r in rows if "cuda_graphs_status" in r] == ["off"] * 6  # CPU: no graphs
    summary = record["summary"]
    assert {"speedup_vs_1gpu_total", "speedup_vs_full_sequence_total", "ttff_1gpu_below_1s"} <= summary.keys()
    lines = stdout.strip().splitlines()
    assert lines[-len(rows) - 1].startswith("variant") and lines[-1].startswith("full-sequence")  # table last
