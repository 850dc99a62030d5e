"""claims.py's quality verdicts on synthetic result files: seed pooling and the decision rules."""
import pytest

import experiments.claims as claims
from experiments.results_io import write_result

H200 = {"cpu": "x", "gpus": ["NVIDIA H200"]}


def _rows(seed: int, scores: dict[str, tuple[float, float]], frames: int = 16) -> list[dict]:
    """Per-seed rows: variant -> (temporal consistency, text alignment), plus a ground truth."""
    rows = [{"variant": v, "frames": frames, "seed": seed, "status": "ok", "temporal_consistency": tc,
             "text_alignment": ta, "motion_error": 0.5, "flickering": 0.9, "frame_consistency": 0.9}
            for v, (tc, ta) in scores.items()]
    rows.append({"variant": "ground_truth", "frames": frames, "seed": 99, "status": "ok", "temporal_consistency": 1.0,
                 "text_alignment": 1.0, "motion_error": 0.0, "flickering": 0.9, "frame_consistency": 1.0})
    return rows


def _write(tmp_path, name: str, steps: int, seeds: list[int], per_seed: list[dict]):
    write_result("ablate_offsets", name, {"config": {"steps": steps, "seeds": seeds}, "rows": [],
                                          "tables": {"per seed": per_seed}}, results_dir=tmp_path)


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(claims, "load", lambda e, n: None)
    return tmp_path


def _c8():
    return next(c for c in claims.CLAIMS["MegaSlide-DiT"] if c.id == "C8").ours()


def test_seeds_pool_across_files_of_one_config(results, monkeypatch):
    monkeypatch.setattr("experiments.results_io.hardware", lambda: H200)
    _write(results, "a", 1500, [0], _rows(0, {"dsa": (0.70, 0.8), "dsa_zero": (0.50, 0.2)}))
    _write(results, "b", 1500, [1, 2], _rows(1, {"dsa": (0.72, 0.8), "dsa_zero": (0.52, 0.2)})[:-1]
           + _rows(2, {"dsa": (0.71, 0.8), "dsa_zero": (0.51, 0.2)}))
    _write(results, "short", 100, [0], _rows(0, {"dsa": (0.1, 0.0), "dsa_zero": (0.9, 0.9)}))  # fewer runs
    pooled = claims.pooled("ablate_offsets")
    assert pooled.steps == 1500 and len(pooled.links) == 2
    assert pooled.rows[("dsa", 16)]["seeds"] == 3
    assert pooled.rows[("dsa", 16)]["temporal_consistency_mean"] == pytest.approx(0.71)
    ours, verdict = _c8()
    assert "1500 steps" in ours and verdict.startswith("supported") and "each of the 3 seeds" in verdict
    assert "caveat" not in verdict                                    # TA 0.8 is well trained here


def test_a_gap_inside_the_seed_spread_is_not_support(results, monkeypatch):
    monkeypatch.setattr("experiments.results_io.hardware", lambda: H200)
    _write(results, "a", 1500, [0, 1], _rows(0, {"dsa": (0.60, 0.8), "dsa_zero": (0.50, 0.8)})
           + _rows(1, {"dsa": (0.40, 0.8), "dsa_zero": (0.49, 0.8)}))
    assert _c8()[1] == "not supported by this run"                    # mean gap 0.005, spread 0.1


def test_cpu_results_are_not_claims_and_weak_models_get_a_caveat(results, monkeypatch):
    monkeypatch.setattr("experiments.results_io.hardware", lambda: {"cpu": "x", "gpus": []})
    _write(results, "cpu", 60, [0], _rows(0, {"dsa": (0.9, 0.9), "dsa_zero": (0.1, 0.1)}))
    assert claims.pooled("ablate_offsets") is None and _c8()[1] == "open"
    monkeypatch.setattr("experiments.results_io.hardware", lambda: H200)
    _write(results, "gpu", 1500, [0], _rows(0, {"dsa": (0.60, 0.2), "dsa_zero": (0.50, 0.0)}))
    assert "caveat: every model is under-trained (best TA 0.20" in _c8()[1]


def test_pooled_table_shows_caption_parts_only_when_every_row_has_them(results, monkeypatch):
    monkeypatch.setattr("experiments.results_io.hardware", lambda: H200)
    rows = _rows(0, {"dsa": (0.6, 0.2), "dsa_zero": (0.5, 0.0)})
    _write(results, "old", 1500, [0], rows)
    header = claims.pooled_table("ablate_offsets", claims.pooled("ablate_offsets"))[2]
    assert "color match" not in header and "text alignment" in header
    for r in rows:
        r.update(color_match=1.0, shape_match=0.5, direction_match=0.25)
    _write(results, "old", 1500, [0], rows)
    table = claims.pooled_table("ablate_offsets", claims.pooled("ablate_offsets"))
    assert "| color match | shape match | direction match |" in table[2]
    assert "| dsa | 16 | 1 | 0.20 ± 0.00 | 1.00 ± 0.00 | 0.50 ± 0.00 | 0.25 ± 0.00 |" in table[4]
