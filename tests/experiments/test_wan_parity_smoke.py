"""wan_parity.py at tiny CPU size: the forward and every gradient match diffusers within the target, and the
float64 reference it judges both fp32 models by."""
import pytest
import torch

from tests.experiments.runner import load_result, run_script

pytest.importorskip("diffusers", reason='needs the wan extra: pip install -e ".[wan]"')

TINY = ["model.dim=24", "model.num_heads=2", "model.depth=2", "model.ffn_dim=40", "model.text_dim=20",
        "model.freq_dim=16", "frames=3", "height=6", "width=10", "grad_frames=2", "grad_height=4", "grad_width=6",
        "text_len=7", "device=cpu"]


def test_wan_parity_smoke(tmp_path):
    out = run_script(["-m", "experiments.wan_parity", *TINY, f"wandb.dir={tmp_path}/runs"], results_dir=tmp_path)
    data = load_result(tmp_path, "wan_parity", "cpu_tiny")
    forward, grads = data["rows"]
    assert forward["check"] == "forward" and forward["token_grid"] == [3, 3, 5]
    assert grads["check"] == "gradients" and grads["params"] == 2 * 27 + 15   # diffusers: 27 per block, 15 more
    assert all(r["within_target"] and 0 <= r["max_rel_err"] <= data["target"] for r in data["rows"])
    assert data["timing"]["load_s"] > 0 and "gradients" in out
    # the float64 reference: both fp32 models are near it, neither exactly, and ours within diffusers' + target
    assert grads["within_exact_rule"] and 0 < grads["diffusers_exact_err"] < 1e-4
    assert 0 < grads["exact_err"] <= grads["diffusers_exact_err"] + data["target"]
    worst = data["tables"]["worst_params"]
    assert len(worst) == 8 and worst[0]["param"] == grads["worst_param"]
    assert [w["fp32_rel_err"] for w in worst] == sorted((w["fp32_rel_err"] for w in worst), reverse=True)


def test_float64_reference_widens_only_inside():
    from experiments.wan_parity import float64_reference
    wide, narrow = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.bfloat16)
    with float64_reference():
        assert wide.float() is wide and narrow.float().dtype == torch.float32
    assert wide.float().dtype == torch.float32


def test_exact_rule_forgives_only_diffusers_own_rounding():
    from experiments.wan_parity import TARGET, _verdicts
    fp32 = {"a": 3e-5, "b": 1e-7}   # ours against diffusers' fp32: past the target
    kept = _verdicts({}, fp32, {"a": 2.5e-5, "b": 1e-7}, {"a": 2e-5, "b": 1e-7})
    assert not kept["within_target"] and kept["within_exact_rule"] and kept["worst_excess_at"] == "a"
    worse = _verdicts({}, fp32, {"a": 1e-7, "b": 2e-5}, {"a": 1e-7, "b": 1e-7})   # ours alone is off at b
    assert not worse["within_exact_rule"] and worse["worst_excess_at"] == "b"
    assert worse["worst_excess"] == pytest.approx(2e-5 - 1e-7) and worse["worst_excess"] > TARGET
