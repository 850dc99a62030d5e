"""experiments/bench_cross_attention.py: the query-grouped cross-attention equals plain SDPA (output and the q, k, v
gradients, odd sizes, with and without the caption mask), its check catches a grouping that mixes queries up, and
the smoke run on CPU checks it and times every group count."""
import pytest
import torch
import torch.nn.functional as F

from experiments import bench_cross_attention as bench
from tests.experiments.runner import load_result, run_script


@pytest.mark.parametrize("groups,masked", [(3, 2), (5, 0), (15, 4)])
def test_grouped_equals_plain_sdpa_in_float64(groups, masked):
    q, k, v, mask, grad = bench.make_inputs(2, 15, 3, 7, 9, masked, "cpu", torch.float64, seed=groups)
    got, want = (bench.output_and_grads(q, k, v, mask, grad, g, torch.float64) for g in (groups, 1))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)   # groups = 1 is SDPA itself
    assert torch.equal(want[0], plain)


def test_the_check_fails_a_grouping_that_mixes_queries(monkeypatch):
    def mixed(q, k, v, mask, groups):   # groups taken along the wrong axis: queries meet other groups' rows
        B, h, N, d = q.shape
        qg = q.reshape(B * groups, h, N // groups, d)
        kg, vg = (t.repeat_interleave(groups, 0) for t in (k, v))
        mg = None if mask is None else mask.repeat_interleave(groups, 0)
        return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mg).reshape(B, h, N, d).transpose(1, 2)

    assert bench.check((1, 12, 2, 4, 5, 1), 3, torch.float32, torch.device("cpu"))["passed"]
    monkeypatch.setattr(bench, "grouped_cross_attention", mixed)
    assert not bench.check((1, 12, 2, 4, 5, 1), 3, torch.float32, torch.device("cpu"))["passed"]


def test_bench_cross_attention_smoke(tmp_path):
    run_script(["-m", "experiments.bench_cross_attention", "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "cross_attention", "cross_attention_smoke")
    assert data["passed"] is True and {c["dtype"] for c in data["checks"]} == {"float32", "bfloat16"}
    assert {c["groups"] for c in data["checks"]} == {1, 2, 3}
    assert all(list(c["errors"]) == ["out", "dq", "dk", "dv"] and c["passed"] for c in data["checks"])
    rows = data["tables"]["cells"]
    assert [(r["heads"], r["head_dim"], r["tokens"], r["groups"]) for r in rows] == [(2, 8, 12, g) for g in (1, 2, 3)]
    for r in rows:
        for key in ("fwd", "fwdbwd"):
            assert r[f"{key}_status"] == "ok" and 0 < r[f"{key}_ms_min"] <= r[f"{key}_ms"] <= r[f"{key}_ms_max"]
    best = data["summary"]["2x8_n12"]
    assert best["best_groups"] in (1, 2, 3) and best["whole_over_best"] >= 1
