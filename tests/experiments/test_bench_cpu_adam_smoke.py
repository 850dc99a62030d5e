"""Smoke run of experiments/bench_cpu_adam.py at its tiny size."""
from tests.experiments.runner import load_result, run_script


def test_bench_cpu_adam_tiny_writes_a_complete_result(tmp_path):
    stdout = run_script(["-m", "experiments.bench_cpu_adam", "tiny=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    record = load_result(tmp_path, "cpu_adam", "tiny")
    assert {"command", "commit", "hardware", "date"} <= record.keys()
    assert all(c["passed"] and c["moments_and_bf16_exact"] for c in record["correctness"])
    assert record["bandwidth"]["copy_GBps"] > 0 and record["bandwidth"]["inplace_add_GBps"] > 0
    rows = record["results"]
    workloads = {r["workload"] for r in rows}
    assert workloads == {"fp32 grad", "bf16 grad", "bf16 grad + bf16 out"}
    ours = [r for r in rows if r["variant"] == "megaslide"]
    assert len(ours) == 3 and all(r["gparams_per_s"] > 0 and r["GBps"] > 0 for r in ours)
    assert {r["bytes_per_param"] for r in ours} == {28, 26}
    assert all(r["best_s"] <= r["median_s"] <= r["worst_s"] for r in ours)
    assert "wandb_dir" in record
    fused = [r for r in rows if r["variant"] == "torch-fused"]
    assert all(("error" in r) or r["speedup_vs_torch_fused"] == 1.0 for r in fused)
    states = record["compact_states"]                              # every host state, after the fp32 one
    assert [r["state"] for r in states] == ["fp32 state", "bf16 master", "int8 moments", "bf16 master + int8 moments"]
    assert record["compact_check"][0]["passed"] and states[0]["vs_fp32_state"] == 1.0
    assert [r["bytes_per_param"] for r in states] == [28, 22, 16.25, 10.25]
    lines = stdout.splitlines()                                    # the two tables are printed last
    assert "Gparam/s" in lines[-len(rows) - len(states) - 3] and "host state" in lines[-len(states) - 1]
