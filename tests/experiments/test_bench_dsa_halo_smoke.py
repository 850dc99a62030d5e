"""experiments/bench_dsa_halo.py: the smoke run on CPU (the Triton interpreter) checks the halo forward against
float64 and times it beside the gather forward, at one offset bound inside the halo."""
from tests.experiments.runner import load_result, run_script


def test_bench_dsa_halo_smoke(tmp_path):
    run_script(["-m", "experiments.bench_dsa_halo", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "attention", "dsa_halo_smoke")
    assert data["passed"] is True and data["device"] == "cpu (triton interpreter)"
    assert [c["passed"] for c in data["checks"]] == [True, True]   # fp32 and bf16 of the one smoke case
    rows = data["tables"]["cells"]
    assert [r["kernel"] for r in rows] == ["gather", "halo"]
    gather, halo = rows
    assert halo["tile"] == [4, 4, 4] and halo["reach"] == 1 and halo["bound"] == 1
    assert halo["max_err"] < 1e-5                        # fp32 in the interpreter: the same sums, another order
    assert sum(halo["paths"].values()) > 0
    for r in rows:
        assert 0 < r["ms_min"] <= r["ms"] <= r["ms_max"]
    assert data["summary"]["halo_speedup_pm1"] == gather["ms"] / halo["ms"]
