"""experiments/bench_qk_rope.py: the smoke run on CPU (the Triton interpreter) checks the fused QK-norm + RoPE
against float64 and times it beside the eager reference, forward and forward+backward."""
import pytest

from tests.experiments.runner import load_result, run_script


def test_bench_qk_rope_smoke(tmp_path):
    run_script(["-m", "experiments.bench_qk_rope", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "qk_rope", "qk_rope_smoke")
    assert data["passed"] is True and {c["dtype"] for c in data["checks"]} == {"float32", "bfloat16"}
    assert all(list(c["errors"]) == ["q", "k", "dq", "dk", "dq_weight", "dk_weight"] for c in data["checks"])
    assert all(e["ok"] and e["err"] >= 0 for c in data["checks"] for e in c["errors"].values())
    assert data["choice"]["auto"] == "reference" and "needs CUDA" in data["choice"]["not_taken"]["triton"]
    assert data["ceilings"]["hbm_gbps"] > 0
    rows = data["tables"]["cells"]
    assert [(r["backend"], r["heads"], r["head_dim"], r["tokens"]) for r in rows] == [("triton", 2, 8, 7),
                                                                                    ("reference", 2, 8, 7)]
    for r in rows:
        for key in ("fwd", "fwdbwd"):
            assert r[f"{key}_status"] == "ok" and 0 < r[f"{key}_ms_min"] <= r[f"{key}_ms"] <= r[f"{key}_ms_max"]
            assert r[f"{key}_hbm_ms"] > 0 and r[f"{key}_hbm_fraction"] > 0
        assert r["fwdbwd_hbm_ms"] == pytest.approx(2.5 * r["fwd_hbm_ms"], rel=1e-12)
    assert data["summary"]["speedup_2x8_n7"] > 0
