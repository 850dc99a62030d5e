"""wan_parity.py at tiny CPU size: the forward and every gradient match diffusers within the target."""
import pytest

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
