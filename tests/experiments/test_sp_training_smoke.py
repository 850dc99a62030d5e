"""Smoke run of experiments/sp_training.py at its tiny size: torchrun, 2 gloo ranks on CPU; and one process on the
offload engine."""
import math

from tests.experiments.runner import load_result, run_script


def test_sp_training_smoke_measures_two_ranks_and_predicts_more(tmp_path):
    stdout = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                         "experiments.sp_training", "smoke=true"], tmp_path, OMP_NUM_THREADS="1")
    assert "wrote" in stdout
    record = load_result(tmp_path, "sp_training", "smoke_2gpu")
    assert record["world_size"] == 2 and record["grid"] == [6, 4, 4]
    comm = record["comm"]
    assert comm["halo_frames"] > 0 and comm["link_GBps"] > 0 and comm["allreduce_busbw_GBps"] > 0
    measured, *predicted = record["steps"]
    assert measured["status"] == "measured" and measured["gpus"] == 2 and measured["step_s"] > 0
    assert len(measured["losses"]) == 2 + 5                        # warm-up and timed steps, all finite
    assert {r["status"] for r in predicted} == {"predicted"}
    assert {(r["gpus"], r["latent_frames"]) for r in predicted} == {
        (1, 6), (2, 6), (4, 6), (1, 256), (2, 256), (4, 256), (8, 256), (16, 256)}
    fitted = next(r for r in predicted if r["gpus"] == 2 and r["latent_frames"] == 6)
    assert abs(fitted["step_s"] - measured["step_s"]) < 1e-9 * measured["step_s"] + 1e-12  # fitted to it
    long = [r["step_s"] for r in sorted(predicted, key=lambda r: r["gpus"]) if r["latent_frames"] == 256]
    assert long == sorted(long, reverse=True)                      # more GPUs, shorter steps


def test_sp_training_on_the_offload_engine_measures_the_step_and_predicts_no_rows(tmp_path):
    run_script(["-m", "experiments.sp_training", "smoke=true", "offload=engine", "name=engine"], tmp_path)
    record = load_result(tmp_path, "sp_training", "engine")
    assert record["engine"] == "offload" and record["comm"] == {}
    measured, = record["steps"]                                    # the cost model is the resident trainer's
    assert measured["status"] == "measured" and len(measured["losses"]) == 2 + 5
    assert all(math.isfinite(loss) for loss in measured["losses"])
