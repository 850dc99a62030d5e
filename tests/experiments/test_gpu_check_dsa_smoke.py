import pytest
import torch

from tests.experiments.runner import load_result, run_script


def test_gpu_check_dsa_smoke(tmp_path):
    run_script(["-m", "experiments.gpu_check_dsa", "smoke=true", "sweep=true", "ops=[dsa,dsa_zero]",
                f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "attention", "dsa_gpu_check_smoke")
    assert data["passed"] is True and data["rows"] and data["jobs_done"] == data["jobs_total"]
    zero = [r for r in data["rows"] if r["op"] == "dsa_zero" and "_launch_" not in r["case"]]
    assert zero and all(r["deterministic"] and "doffsets" not in r["errors"] for r in zero)
    # every query block the sweep times is checked for both ops and both dtypes, the 4 x 4 patches (with
    # capped registers, which the interpreter ignores: this checks the plumbing) included
    launches = {(r["op"], r["dtype"], r["case"].split("_launch_")[1]) for r in data["rows"] if "_launch_" in r["case"]}
    assert launches == {(op, dtype, block) for op in ("dsa", "dsa_zero") for dtype in ("fp32", "bf16")
                        for block in ("q16_y1_w1", "q16_y4_w1_r128")}
    assert {(c["block_y"], c["maxnreg"]) for c in data["sweep"]["configs"]} == {(1, None), (4, 128)}
    keys = {r["case"].split("_keys_")[1] for r in data["rows"] if "_keys_" in r["case"]}
    assert keys - {k for k in keys if k.endswith("_cap8")} == {"1x2x4_e16_w1", "2x2x2_e32_w1_r128"}
    assert data["sweep"]["forward_default_config"] == data["sweep"]["default_config"]   # the interpreter: rows
    general = [r for r in data["rows"]
               if r["op"] == "dsa" and "_keys_" not in r["case"] and "_launch_" not in r["case"]]
    assert general and all(r["deterministic"] for r in general)  # sorted key-tile lists, run twice
    assert {r["dtype"] for r in data["rows"] if r["case"].endswith("_cap8")} == {"fp32", "bf16"}  # exact lists
    assert all(c["fwd_ms"] > 0 and c["bwd_ms"] > 0 and c["zero_fwd_ms"] > 0 and c["zero_bwd_ms"] > 0
               for c in data["sweep"]["configs"])
    assert data["sweep"]["key_configs"] and all(c["bwd_ms"] > 0 for c in data["sweep"]["key_configs"])


def test_gpu_check_dsa_halo_smoke(tmp_path):
    """Ops dsa_halo and dsa_halo_cuda (their own test, so that the two smoke runs share the CI's workers): the op
    with the halo forward, both dtypes, out, all four gradients and the lse; the op with the CUDA halo forward's CPU
    emulation, bf16, out, all four gradients and the lse; tiles of both paths matching the plain rule, same bits."""
    import experiments.gpu_check_dsa as gpu_check
    run_script(["-m", "experiments.gpu_check_dsa", "smoke=true", "ops=[dsa_halo,dsa_halo_cuda]",
                f"wandb.dir={tmp_path}/runs"], tmp_path)
    data = load_result(tmp_path, "attention", "dsa_gpu_check_smoke")
    halo = [r for r in data["rows"] if r["op"] == "dsa_halo"]
    cuda = [r for r in data["rows"] if r["op"] == "dsa_halo_cuda"]
    assert data["passed"] is True and len(halo) + len(cuda) == len(data["rows"])
    assert [(r["dtype"], sorted(r["errors"])) for r in cuda] == [("bf16", sorted(["lse", *gpu_check.GRADS]))]
    assert all(r["paths_match"] and min(r["paths"].values()) > 0 and r["deterministic"] for r in cuda)
    assert {r["dtype"] for r in halo} == {"fp32", "bf16"}
    assert all(sorted(r["errors"]) == sorted(["lse", *gpu_check.GRADS]) for r in halo)
    assert all(sorted(r["worst_tile_path"]) == sorted(gpu_check.QUERY_SIDE)
               and set(r["worst_tile_path"].values()) <= {"halo", "gather"} for r in halo + cuda)
    assert all(r["paths_match"] and min(r["paths"].values()) > 0 and r["deterministic"] for r in halo)


def test_a_check_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """The result is rewritten after every check: a run killed at its time limit leaves the rows done so
    far, marked partial (jobs_done < jobs_total)."""
    import experiments.gpu_check_dsa as gpu_check
    monkeypatch.setenv("MEGASLIDE_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("TRITON_INTERPRET", "1")     # check() sets it for smoke; restored after the test
    calls = []

    def check_case(case, dtype, device, op, key_config=None, launch=None):
        calls.append(case.name)
        if len(calls) == 3:
            raise TimeoutError("cut")
        return {"case": case.name, "op": op, "dtype": dtype, "passed": True, "errors": {}}

    monkeypatch.setattr(gpu_check, "check_case", check_case)
    cfg = gpu_check.GpuCheckConfig(name="cut", smoke=True, sweep=False, launch_candidates=[], key_candidates=[],
                                   dtypes=["fp32", "bf16"], ops=["dsa"], cases=[],
                                   wandb_dir=str(tmp_path / "runs"), wandb_project="p")
    with pytest.raises(TimeoutError):
        gpu_check.check(cfg)
    data = load_result(tmp_path, "attention", "cut")
    assert data["jobs_done"] == 2 and data["jobs_total"] > 3 and len(data["rows"]) == 2 and data["passed"] is True


def test_cases_keep_only_the_named_rows_and_refuse_unknown_names(tmp_path, monkeypatch):
    """cases=[...] checks only those cases (no key-tile rows unless the key case is named); an unknown name, or
    names with no case of the chosen ops, is refused before anything runs, naming the key and the choices."""
    import experiments.gpu_check_dsa as gpu_check
    monkeypatch.setenv("MEGASLIDE_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(gpu_check, "check_case", lambda case, dtype, device, op, key_config=None, launch=None:
                        calls.append((case.name, op, key_config))
                        or {"case": case.name, "op": op, "dtype": dtype, "passed": True, "errors": {}})

    def check(ops, cases):
        return gpu_check.check(gpu_check.GpuCheckConfig(
            name="some", smoke=True, sweep=False, launch_candidates=[], key_candidates=[], dtypes=["bf16"], ops=ops,
            cases=cases, wandb_dir=str(tmp_path / "runs"), wandb_project="p"))
    assert check(["dsa", "dsa_halo"], ["smoke_halo_d16"]) == 0
    assert calls == [("smoke_halo_d16", "dsa_halo", None)]
    for ops, cases, match in ((["dsa"], ["d128_halo_reach9"], r"cases=.*unknown.*smoke_halo_d16"),
                              (["dsa"], ["smoke_halo_d16"], r"no case of ops=\['dsa'\]")):
        with pytest.raises(ValueError, match=match):
            check(ops, cases)
    assert calls == [("smoke_halo_d16", "dsa_halo", None)]   # the refused calls checked nothing


def test_sweep_candidates_parse_with_their_defaults():
    """Launch candidates [BLOCK_Q, warps[, block_y[, maxnreg]]] and key candidates [t, y, x, BLOCK_E,
    warps[, maxnreg]]: what is left out takes its default (block_y 1, registers uncapped), 0 uncaps."""
    import experiments.gpu_check_dsa as gpu_check
    got = [gpu_check.launch_of(c, 80) for c in ([16, 2], [32, 4, 4], [16, 2, 1, 128], [16, 2, 4, 0])]
    assert [(c.block_q, c.num_warps, c.block_y, c.maxnreg, c.block_d) for c in got] == [
        (16, 2, 1, None, 128), (32, 4, 4, None, 128), (16, 2, 1, 128, 128), (16, 2, 4, None, 128)]
    keys = [gpu_check.key_of(c) for c in ([4, 4, 4, 128, 4], [2, 2, 4, 64, 2, 168], [1, 2, 4, 16, 1, 0])]
    assert [(k.tile, k.block_e, k.num_warps, k.maxnreg) for k in keys] == [
        ((4, 4, 4), 128, 4, None), ((2, 2, 4), 64, 2, 168), ((1, 2, 4), 16, 1, None)]
    with pytest.raises(ValueError, match="launch_candidates"):
        gpu_check.launch_of([16], 64)
    with pytest.raises(ValueError, match="key_candidates"):
        gpu_check.key_of([4, 4, 4, 128, 4, 128, 1])


def test_worst_tile_paths_name_the_path_of_the_tile_holding_the_largest_error():
    """Tiles of 1 x 4 x 4 over a (2, 4, 8) grid: 2 x 1 x 2 tiles a (batch, head), row-major over (t, y, x) tile
    indices; the largest error's token picks its tile's path, for out-like and offset-like tensors alike."""
    from experiments.gpu_check_dsa import worst_tile_paths
    B, T, H, W, heads = 1, 2, 4, 8, 2
    path = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.int8)  # (B * heads, tiles): head 1, tile 1 gathers
    dq = torch.zeros(B, T, H, W, heads, 3)
    dq[0, 0, 2, 5, 1, 2] = 1.0  # t 0, x 5 -> tile (0, 0, 1) = 1, head 1: the gathers
    doffsets = torch.zeros(B, T, H, W, heads, 27, 3)
    doffsets[0, 1, 3, 6, 1, 4, 0] = 1.0  # t 1, x 6 -> tile (1, 0, 1) = 3: the halo path
    doffsets[0, 0, 0, 7, 0, 0, 0] = 0.5  # head 0's tile 1 takes the halo path, but this is not the largest
    assert worst_tile_paths(path, (1, 4, 4), {"dq": dq, "doffsets": doffsets}) == {"dq": "gather", "doffsets": "halo"}
