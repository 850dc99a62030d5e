from tests.experiments.runner import load_result, run_script


def test_bench_attention_smoke(tmp_path):
    run_script(["experiments/bench_attention.py", "--smoke"], tmp_path)
    data = load_result(tmp_path, "attention", "smoke")
    rows = data["tables"]["sweep"]
    ok = {r["variant"] for r in rows if r.get("status") == "ok"}
    assert {"dense", "swin2x4x4", "dsa_reference"} <= ok
    assert all(r["ms"] > 0 for r in rows if r.get("status") == "ok")
