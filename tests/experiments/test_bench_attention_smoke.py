from tests.experiments.runner import load_result, run_script


def test_bench_attention_smoke(tmp_path):
    run_script(["-m", "experiments.bench_attention", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "attention", "smoke")
    rows = data["tables"]["sweep"]
    ok = {r["variant"] for r in rows if r.get("status") == "ok"}
    assert {"dense", "swin2x4x4", "dsa_reference"} <= ok
    assert all(0 < r["ms_min"] <= r["ms"] <= r["ms_max"] for r in rows if r.get("status") == "ok")
    assert data["wandb_dir"] is None  # WANDB_MODE=disabled
