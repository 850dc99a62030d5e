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


def test_cuda_cell_on_cpu_runs_the_emulation_and_records_a_refusal(monkeypatch):
    """The benchmark's halo_cuda cell (a GPU-only row of the run) on CPU tensors, where dsa_halo_forward_cuda runs
    its torch emulation: a timed row with paths and its error against the gather forward; fp32 inputs, which the
    kernel refuses, give a row with status error and the refusal, not a crash."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # as the smoke run sets it (the gather forward, interpreted)
    from experiments.bench_dsa_halo import KERNEL, cuda_cell
    from megaslide.attention.dsa.forward import dsa_forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 4, 8, 1, 16, generator=g).bfloat16() for _ in range(3))
    offsets = 2 * torch.rand(1, 3, 4, 8, 1, 27, 3, generator=g) - 1    # inside +-1: every tile on the halo
    want = dsa_forward(q, k, v, offsets, KERNEL, 0.25)[0].float()
    base = {"bound": 1.0, "reach": 1}
    row = cuda_cell(q, k, v, offsets, 0.25, 1, (1, 4, 4), want, 5, torch.device("cpu"), base)
    assert row["kernel"] == "halo_cuda" and row["status"] == "ok" and row["paths"] == {"halo": 6, "gather": 0}
    assert row["max_err"] < 0.05 and 0 < row["ms_min"] <= row["ms"] <= row["ms_max"]   # bf16 out, W hi + lo
    refused = cuda_cell(q.float(), k.float(), v.float(), offsets, 0.25, 1, (1, 4, 4), want, 5,
                        torch.device("cpu"), base)
    assert refused["status"] == "error" and "bf16" in refused["error"]
