from tests.experiments.runner import load_result, run_script


def test_gpu_check_dsa_smoke(tmp_path):
    run_script(["-m", "experiments.gpu_check_dsa", "smoke=true", "sweep=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "attention", "dsa_gpu_check_smoke")
    assert data["passed"] is True and data["rows"]
    zero = [r for r in data["rows"] if r["op"] == "dsa_zero"]
    assert zero and all(r["deterministic"] and "doffsets" not in r["errors"] for r in zero)
    general = [r for r in data["rows"] if r["op"] == "dsa" and "_keys_" not in r["case"]]
    assert general and all(r["deterministic"] for r in general)  # sorted key-tile lists, run twice
    assert all(c["fwd_ms"] > 0 and c["bwd_ms"] > 0 and c["zero_fwd_ms"] > 0 and c["zero_bwd_ms"] > 0
               for c in data["sweep"]["configs"])
