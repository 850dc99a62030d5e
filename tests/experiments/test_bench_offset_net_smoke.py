"""experiments/bench_offset_net.py: the smoke run on CPU (the Triton interpreter) checks the Triton conv (alone
and with GELU) and the whole offset net, times both backends inside the offset net, and skips the module and split
rows (the op's Triton kernels need CUDA)."""
from tests.experiments.runner import load_result, run_script


def test_bench_offset_net_smoke(tmp_path):
    run_script(["-m", "experiments.bench_offset_net", "smoke=true", "sweep=true", f"wandb.dir={tmp_path}/runs"],
               tmp_path)
    data = load_result(tmp_path, "attention", "offset_net_smoke")
    assert data["passed"] is True and {c["dtype"] for c in data["checks"]} == {"float32", "bfloat16"}
    assert {c.get("gelu") for c in data["checks"]} == {False, True, None}   # None: the whole-net checks
    assert all(e["ok"] and e["err"] >= 0 for c in data["checks"] for e in c["errors"].values())
    for table in ("conv", "offset_net"):
        rows = data["tables"][table]
        assert [(r["backend"], r["head_dim"], r["channels"]) for r in rows] == [("triton", 4, 8), ("torch", 4, 8)]
        assert all(r["status"] == "ok" and 0 < r["ms_min"] <= r["ms"] <= r["ms_max"] for r in rows)
    assert all(r["hbm_ms"] > 0 and r["hbm_fraction"] > 0 for r in data["tables"]["conv"])
    assert data["summary"]["offset_net_speedup_d4"] > 0
    tiles = data["tables"]["tiles"]   # sweep=true: each launch once per (smoke) candidate, none the default
    assert [r["launch"] for r in tiles] == ["forward", "forward_gelu", "input_grad", "weight_grad"]
    assert all(r["ms"] > 0 and r["default"] is False for r in tiles)
    modules = data["tables"]["module"]
    assert [(r["variant"], r["net_backend"]) for r in modules] == [("dsa", "triton"), ("dsa", "torch"),
                                                                   ("dsa_zero", "none")]
    assert all(r["status"].startswith("skipped") for r in modules)
    assert [r["stage"] for r in data["tables"]["split"]] == ["conv_gelu", "linear", "bound", "op"]
    assert all(r["status"].startswith("skipped") for r in data["tables"]["split"])
    assert [t["measured"] for t in data["summary"]["targets"]] == [None, None]
