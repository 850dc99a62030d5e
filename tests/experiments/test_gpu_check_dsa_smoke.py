from tests.experiments.runner import load_result, run_script


def test_gpu_check_dsa_smoke(tmp_path):
    run_script(["experiments/gpu_check_dsa.py", "--smoke"], tmp_path, PYTHONPATH=".")
    data = load_result(tmp_path, "attention", "dsa_gpu_check_smoke")
    assert data["passed"] is True and data["rows"]
