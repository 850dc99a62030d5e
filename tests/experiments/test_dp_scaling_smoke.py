"""Smoke run of experiments/dp_scaling.py under torchrun on 2 CPU processes (gloo): the measured 1- and 2-rank rows,
the collectives' bandwidth, and the cost model's predicted rows, each marked."""
import math

import pytest

from tests.experiments.runner import load_result, run_script

REFERENCE = "results/mfu_overlap/h200_7Bwidth_d20_5steps.json"   # a committed one-GPU step: 7B width, 20 blocks


def test_dp_scaling_smoke_measures_one_and_two_ranks_and_predicts_more(tmp_path):
    run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "experiments/dp_scaling.py",
                "smoke=true", f"wandb.dir={tmp_path}/runs"], tmp_path, OMP_NUM_THREADS="1")
    data = load_result(tmp_path, "dp_scaling", "smoke")
    rows = data["tables"]["rows"]
    assert [(r["gpus"], r["nodes"], r["measured"]) for r in rows] == [
        (1, 1, "run"), (2, 1, "run"), (4, 1, "predicted"), (8, 1, "predicted"), (4, 2, "predicted")]
    one, two = rows[0], rows[1]
    assert math.isclose(one["losses"][0], two["losses"][0], rel_tol=1e-5)   # the same clips, before any update
    assert 0.45 < two["host_state_GB_per_rank"] / one["host_state_GB_per_rank"] < 0.55   # 1/2 of the blocks' state
    assert all(v > 0 for v in data["ceilings"]["collectives"].values()) and set(data["ceilings"]["collectives"]) == {
        "all_gather_GBps", "reduce_scatter_GBps"}
    for r in rows:
        assert r["predicted_step_s"] > 0 and r["predicted_speedup_vs_1"] > 0 and ("tokens_per_s" in r) == (
            r["measured"] == "run")
    assert rows[3]["predicted_host_GB_per_node"] == 8 * rows[3]["predicted_host_GB_per_rank"]
    assert data["ceilings"]["model_inter_node"]["collective_GBps"] <= data["config"]["inter_node_GBps"]


def test_dp_scaling_predicts_from_a_reference_step_without_running(tmp_path):
    """reference=: one process, no GPU: the committed one-GPU step calibrates the model, every other row is
    predicted, and the data-parallel ranks share the host state."""
    run_script(["experiments/dp_scaling.py", "model.depth=20", f"reference={REFERENCE}", "collective_GBps=200",
                "name=ref", f"wandb.dir={tmp_path}/runs"], tmp_path)
    rows = load_result(tmp_path, "dp_scaling", "ref")["tables"]["rows"]
    assert [(r["gpus"], r["nodes"], r["measured"]) for r in rows] == [
        (1, 1, "reference"), (2, 1, "predicted"), (4, 1, "predicted"), (8, 1, "predicted"), (16, 2, "predicted")]
    one, two = rows[0], rows[1]
    assert one["reference"] == REFERENCE and one["step_time_s"] >= one["predicted_step_s"]   # a max of parts
    assert one["model_error"] == pytest.approx(1 - one["predicted_step_s"] / one["step_time_s"])
    assert 0.5 < two["predicted_host_GB_per_rank"] / one["predicted_host_GB_per_rank"] < 0.55   # + each reserve
    assert two["predicted_seconds"]["optimizer"] == pytest.approx(one["predicted_seconds"]["optimizer"] / 2)
    assert all(r["predicted_speedup_vs_1"] <= r["gpus"] + 1e-9 for r in rows)

