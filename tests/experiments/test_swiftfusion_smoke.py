"""Smoke run of experiments/swiftfusion.py: 2 gloo processes on CPU, tiny sizes."""
from tests.experiments.runner import load_result, run_script

SP_VARIANTS = {"ulysses", "ring", "usp", "hybrid_ring_intra", "torus", "swiftfusion"}


def test_swiftfusion_smoke_writes_a_complete_result(tmp_path):
    stdout = run_script(["-m", "experiments.swiftfusion", "smoke=true"], tmp_path)
    record = load_result(tmp_path, "swiftfusion", "smoke")
    assert {"command", "commit", "hardware", "date", "wandb_dir"} <= record.keys()
    assert record["wandb_dir"] is None                            # WANDB_MODE=disabled: no W&B run
    assert record["world_size"] == 2 and record["ceilings"]["sdpa"]["tflops"] > 0
    assert record["ceilings"]["all_to_all"]["busbw_GBps"] > 0

    checked = {(c["variant"], c["causal"]) for c in record["correctness"]}
    assert checked == {(v, causal) for v in SP_VARIANTS for causal in (False, True)}
    assert all(c["passed"] for c in record["correctness"]), record["correctness"]

    rows = record["timings"]
    assert record["jobs_done"] == record["jobs_total"] == 4       # 2 attention + 2 denoising-step lengths
    assert {(r["variant"], r["seq_len"]) for r in rows} == {(v, n) for v in SP_VARIANTS | {"sdpa_1gpu", "ring_onesided"}
                                                            for n in (16, 32)}
    for r in rows:
        if r["variant"] == "ring_onesided":  # no CUDA peers here: declined with the reason
            assert r["status"] == "unavailable" and "cpu" in r["reason"]
        else:
            assert r["status"] == "ok" and r["time_s"] > 0 and r["predicted_s"] > 0
    assert all(r["speedup_vs_usp"] == 1.0 for r in rows if r["variant"] == "usp")

    steps = record["denoising_step"]   # end to end, tiny DiT: every SP variant, fp32 on CPU agrees closely
    assert {(r["variant"], r["latent_frames"]) for r in steps} == {(v, f) for v in SP_VARIANTS | {"ring_onesided"}
                                                                   for f in (2, 3)}
    for r in steps:
        if r["variant"] == "ring_onesided":
            assert r["status"] == "unavailable"
        else:
            assert r["status"] == "ok" and r["step_s"] > 0 and r["max_abs_diff"] < 1e-4 and r["diff_vs"] == "ulysses"
    assert all(r["speedup_vs_usp"] == 1.0 for r in steps if r["variant"] == "usp")

    sim = record["simulation"]
    assert record["simulation_inputs"]["simulated"] is True and all(r["simulated"] for r in sim)
    assert {(r["nodes"], r["gpus"]) for r in sim} == {(2, 16), (4, 32), (8, 64)}
    assert all(r["ring_intra"]["placement"] == "ring_intra" and r["usp"]["placement"] == "ulysses_intra" for r in sim)

    out = stdout.splitlines()
    assert out[-1].startswith("wrote ") and "vs USP" in out[-len(rows) - 2]  # the table is printed last
    assert any("simulated" in line for line in out)
