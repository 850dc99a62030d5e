"""The claims' verdicts on synthetic result files: seed pooling, the one quality rule of C6-C8, SP and SwiftFusion
rules."""
import json
import math

import numpy as np
import pytest

from experiments.claims import causal_sp, common, page, quality, swiftfusion
from experiments.results_io import write_result

H200 = {"cpu": "x", "gpus": ["NVIDIA H200"]}

SE = 0.01   # recorded sampling error of every synthetic score


def _rows(seed: int, scores: dict[str, tuple[float, float]], frames: int = 16, version: int | None = 2,
          truth: tuple[float, float] = (1.0, 1.0)) -> list[dict]:
    """Per-seed rows: variant -> (temporal consistency, text alignment), plus a ground truth."""
    rows = [{"variant": v, "frames": frames, "seed": seed, "status": "ok", "temporal_consistency": tc,
             "text_alignment": ta, "motion_error": 0.5, "flickering": 0.9, "frame_consistency": 0.9,
             "temporal_consistency_se": SE, "text_alignment_se": SE}
            for v, (tc, ta) in scores.items()]
    rows.append({"variant": "ground_truth", "frames": frames, "seed": 99, "status": "ok",
                 "temporal_consistency": truth[0], "text_alignment": truth[1], "motion_error": 0.0, "flickering": 0.9,
                 "frame_consistency": 1.0})
    if version is not None:
        for r in rows:
            r["scorer_version"] = float(version)
    return rows


def _write(tmp_path, name: str, steps: int, seeds: list[int], per_seed: list[dict], experiment="ablate_offsets",
           **config):
    write_result(experiment, name, {"config": {"steps": steps, "seeds": seeds, "n_eval": 32, **config}, "rows": [],
                                    "tables": {"per seed": per_seed}}, results_dir=tmp_path)


def _seeds(scores_per_seed: list[dict], frames: int = 16, **kw) -> list[dict]:
    rows = [r for seed, scores in enumerate(scores_per_seed) for r in _rows(seed, scores, frames, **kw)]
    return [r for r in rows if r["variant"] != "ground_truth"] + [r for r in rows if r["variant"] == "ground_truth"][:1]


def _claim(results, claim_id: str) -> tuple[str, str]:
    """(our evidence, the verdict) of one claim on the synthetic results."""
    return next(c for claims_ in page.CLAIMS.values() for c in claims_ if c.id == claim_id).ours(results)


def _verdict(results, claim_id: str) -> str:
    return _claim(results, claim_id)[1]


def test_seeds_pool_across_files_of_one_config(results):
    _write(results, "a", 1500, [0], _rows(0, {"dsa": (0.70, 0.8), "dsa_zero": (0.50, 0.6)}))
    _write(results, "b", 1500, [1, 2], _rows(1, {"dsa": (0.72, 0.8), "dsa_zero": (0.52, 0.6)})[:-1]
           + _rows(2, {"dsa": (0.71, 0.8), "dsa_zero": (0.51, 0.6)}))
    _write(results, "short", 100, [0], _rows(0, {"dsa": (0.1, 0.0), "dsa_zero": (0.9, 0.9)}))  # fewer runs
    pooled = quality.pooled(results, "ablate_offsets")
    assert pooled.training == "1500 steps" and len(pooled.links) == 2
    row = pooled.rows[("dsa", 16)]
    assert row["seeds"] == 3 and row["temporal_consistency_mean"] == pytest.approx(0.71)
    assert row["temporal_consistency_std"] == pytest.approx(np.std([0.70, 0.72, 0.71], ddof=1))   # sample std
    ours, verdict = page.CLAIMS["MegaSlide-DiT"][7].ours(results)
    assert "1500 steps" in ours and "scorer v2" in ours and verdict.startswith("supported")


def test_pool_key_holds_model_batch_n_eval_eval_seed_and_scorer(results):
    base = _rows(0, {"dsa": (0.7, 0.8), "dsa_zero": (0.5, 0.2)})
    _write(results, "a", 1500, [0], base, model="quality_gpu", batch_size=8, eval_seed=7)
    for name, change in {"model": {"model": "tiny"}, "batch": {"batch_size": 4}, "n_eval": {"n_eval": 16},
                         "eval_seed": {"eval_seed": 8}}.items():
        _write(results, name, 1500, [1], _rows(1, {"dsa": (0.7, 0.8), "dsa_zero": (0.5, 0.2)})[:-1],
               **{"model": "quality_gpu", "batch_size": 8, "eval_seed": 7, **change})
    _write(results, "same", 1500, [1], _rows(1, {"dsa": (0.7, 0.8), "dsa_zero": (0.5, 0.2)})[:-1],
           model="quality_gpu", batch_size=8, eval_seed=7)
    pooled = quality.pooled(results, "ablate_offsets")
    assert {link.split("/")[1].split(".")[0] for link in pooled.links} == {"a", "same"}
    # runs scored by different scorers never pool; rows without a version are scorer v1 and pool with each other
    _write(results, "old1", 1500, [2], _rows(2, {"dsa": (0.9, 0.9), "dsa_zero": (0.1, 0.1)}, version=None),
           model="quality_gpu", batch_size=8, eval_seed=7)
    _write(results, "old2", 1500, [3], _rows(3, {"dsa": (0.9, 0.9), "dsa_zero": (0.1, 0.1)}, version=None),
           model="quality_gpu", batch_size=8, eval_seed=7)
    pooled = quality.pooled(results, "ablate_offsets")                 # the newest scorer wins over more runs
    assert pooled.settings["scorer_version"] == 2 and pooled.rows[("dsa", 16)]["seeds"] == 2
    old = quality.run_settings(json.loads((results / "ablate_offsets" / "old1.json").read_text()))
    assert old["scorer_version"] == 1 and quality.config_key({**old, "config": {}}) != quality.config_key(
        json.loads((results / "ablate_offsets" / "a.json").read_text()))


def test_settings_missing_from_the_config_come_from_the_recorded_command():
    result = {"config": {"steps": 1500, "seeds": [0]}, "tables": {"per seed": [{"variant": "dsa"}]},
              "command": "python experiments/ablate_offsets.py model=quality_gpu n_eval=32 train.batch_size=8 "
                         "'seeds=[0,1]' workers=2"}
    assert quality.run_settings(result) == {"steps": 1500, "model": "quality_gpu", "batch": 8, "n_eval": 32,
                                           "eval_seed": None, "scorer_version": 1}


def _gap(diff, margin=0.1):
    return quality.Gap("temporal_consistency", diff, margin)


@pytest.mark.parametrize("gaps,claimed,weak,word", [
    ([_gap(0.3), _gap(0.2)], 0.0, None, "supported"),
    ([_gap(0.3), _gap(0.05)], 0.0, None, "inconclusive"),          # one gap inside its margin
    ([_gap(0.3), _gap(-0.2)], 0.0, None, "contradicted"),           # one the other way beyond the margin
    ([_gap(0.3)], 0.0, "under-trained: best TA 0.1 vs ground truth 1.0", "inconclusive"),
    ([_gap(0.3, math.nan)], 0.0, None, "inconclusive"),             # one seed: no spread
    ([_gap(-0.03, 0.01)], -0.05, None, "supported"),                # "not worse than": 0.03 lower is within 0.05
    ([_gap(-0.2, 0.05)], -0.05, None, "contradicted"),
])
def test_decide_is_one_rule(gaps, claimed, weak, word):
    assert quality.decide(gaps, claimed, weak)[0] == word


@pytest.mark.parametrize("gaps,word", [
    ([_gap(-0.01, 0.02), _gap(0.02, 0.02)], "supported"),              # both within ±0.05 beyond the margin
    ([_gap(0.03, 0.04)], "inconclusive"),                              # could be over 0.05 either way
    ([_gap(0.58, 0.26), _gap(0.32, 0.19)], "better on this proxy"),    # C6 at 64 frames: DSA well ahead
    ([_gap(-0.2, 0.05), _gap(0.3, 0.05)], "contradicted"),             # worse beyond the margin outweighs ahead
])
def test_a_parity_claim_is_two_sided(gaps, word):
    assert quality.decide(gaps, -0.05, None, parity=True)[0] == word


def test_margin_counts_seed_spread_and_sampling_error(results):
    rows = _seeds([{"dsa": (0.60, 0.5), "dsa_zero": (0.50, 0.5)}, {"dsa": (0.62, 0.5), "dsa_zero": (0.50, 0.5)}])
    for r in rows:                                         # older rows: no recorded error, so sqrt(p(1-p)/n_eval)
        r.pop("text_alignment_se", None)
    _write(results, "a", 1500, [0, 1], rows)
    p = quality.pooled(results, "ablate_offsets")
    ta = quality.gap(p, "dsa", "dsa_zero", 16, "text_alignment")
    assert ta.diff == 0.0 and ta.margin == pytest.approx(2 * math.sqrt(2 * 0.25 / 32))   # TA std 0.00 hides nothing
    tc = quality.gap(p, "dsa", "dsa_zero", 16, "temporal_consistency")
    assert tc.margin == pytest.approx(2 * math.sqrt(np.std([0.60, 0.62], ddof=1) ** 2 + 2 * SE ** 2))


def _quality(results, per_frames: dict[int, list[dict]], **config):
    rows = [r for frames, seeds in per_frames.items() for r in _seeds(seeds, frames)]
    _write(results, "q", 1500, [0, 1, 2], rows, experiment="quality", clip_frames=sorted(per_frames), **config)


def _four(dsa, dense, swin, zero):
    return {"dsa": dsa, "dense": dense, "swin": swin, "dsa_zero": zero}


def test_one_rule_for_c6_c7_c8_supported_inconclusive_contradicted(results):
    strong = [_four((0.80, 0.80), (0.80, 0.81), (0.60, 0.70), (0.60, 0.50)),
              _four((0.82, 0.82), (0.82, 0.83), (0.62, 0.72), (0.62, 0.52)),
              _four((0.81, 0.81), (0.81, 0.82), (0.61, 0.71), (0.61, 0.51))]
    _quality(results, {16: strong, 64: strong})
    assert _verdict(results, "C6").startswith("supported")          # TA 0.01 below dense: within the tolerance
    assert _verdict(results, "C7").startswith("supported") and _verdict(results, "C8").startswith("supported")
    close = [_four((0.80, 0.8), (0.90, 0.8), (0.79, 0.8), (0.79, 0.8)) for _ in range(3)]
    _quality(results, {16: strong, 64: close})                       # at 64 frames: dense well above, swin equal
    assert _verdict(results, "C6").startswith("contradicted") and "64 frames: contradicted" in _verdict(results, "C6")
    assert _verdict(results, "C7").startswith("inconclusive") and "16 frames: supported" in _verdict(results, "C7")
    worse = [_four((0.60, 0.8), (0.6, 0.8), (0.8, 0.8), (0.8, 0.8)) for _ in range(3)]
    _quality(results, {16: worse, 64: worse})
    assert _verdict(results, "C7").startswith("contradicted") and _verdict(results, "C8").startswith("contradicted")


def test_c8_pools_the_ablation_and_the_four_way_study_at_every_clip_length(results):
    good = [{"dsa": (0.80, 0.8), "dsa_zero": (0.60, 0.5)} for _ in range(3)]
    _write(results, "abl", 1500, [0, 1, 2], _seeds(good))
    reversed_ta = [_four((0.60, 0.1), (0.6, 0.1), (0.6, 0.1), (0.58, 0.2)) for _ in range(3)]
    _quality(results, {16: [_four((0.8, 0.8), (0.8, 0.8), (0.8, 0.8), (0.6, 0.5))] * 3, 64: reversed_ta})
    ours, verdict = page.CLAIMS["MegaSlide-DiT"][7].ours(results)
    assert "ablate_offsets, 16 frames" in ours and "quality, 16 frames" in ours and "quality, 64 frames" in ours
    assert verdict.startswith("inconclusive")                       # 64 frames: inside the margin
    assert "ablate_offsets, 16 frames: supported" in verdict and "quality, 64 frames: inconclusive" in verdict
    assert "TA -0.10" in verdict                                     # TA reverses at 64 frames and is reported


def test_only_the_newest_scorer_among_a_claims_studies_votes(results):
    """C8's ablation scored by v1 (under-trained) beside a v2 four-way study that supports it: the v1 study is
    reported, marked not counted, and the verdict follows the v2 study; with both at v2 it votes again."""
    weak = [{"dsa": (0.80, 0.1), "dsa_zero": (0.60, 0.05)} for _ in range(3)]
    _write(results, "abl", 1500, [0, 1, 2], _seeds(weak, version=None))
    strong = [_four((0.8, 0.8), (0.8, 0.8), (0.8, 0.8), (0.6, 0.5))] * 3
    _quality(results, {16: strong, 64: strong})
    ours, verdict = page.CLAIMS["MegaSlide-DiT"][7].ours(results)
    assert "ablate_offsets, 16 frames: dsa TC 0.80" in ours and verdict.startswith("supported")
    assert "ablate_offsets, 16 frames: not counted, scorer v1, the verdict uses v2 (inconclusive, under-trained" \
        in verdict
    _write(results, "abl", 1500, [0, 1, 2], _seeds(weak))
    assert page.CLAIMS["MegaSlide-DiT"][7].ours(results)[1].startswith("inconclusive: ablate_offsets, 16 frames: "
                                                                         "inconclusive, under-trained")


def test_the_most_trained_recipe_is_pooled(results):
    """Of two recipes, the one that trains each run on more clips decides, though it finished fewer runs."""
    _write(results, "long", 1500, [0], _rows(0, {"dsa": (0.9, 0.9)}), clip_steps=[1500, 900], batch_sizes=[8, 8])
    _write(results, "short", 1500, [0, 1], _rows(0, {"dsa": (0.1, 0.1), "dsa_zero": (0.1, 0.1)})[:-1]
           + _rows(1, {"dsa": (0.1, 0.1), "dsa_zero": (0.1, 0.1)}), clip_steps=[1500, 900], batch_sizes=[8, 2])
    assert quality.training_clips(quality.pooled(results, "ablate_offsets").settings) == 1500 * 8 + 900 * 8
    assert quality.pooled(results, "ablate_offsets").links == [common.link(results, "ablate_offsets", "long")]


def test_a_run_in_two_files_counts_once(results):
    """A pilot's seed 0 and the study that ran seed 0 again pool as one run: the study's (newer) row; a
    row that did not finish never hides a finished one; a file whose runs all lost is not linked."""
    pilot = _rows(0, {"dsa": (0.10, 0.1), "dsa_zero": (0.50, 0.2)})
    pilot.insert(0, {**pilot[0], "variant": "dense", "status": "ok", "temporal_consistency": 0.9})
    _write(results, "pilot", 1500, [0], pilot)
    study = _rows(0, {"dsa": (0.70, 0.8), "dsa_zero": (0.52, 0.2)})[:-1] + _rows(1, {"dsa": (0.72, 0.8),
                                                                                      "dsa_zero": (0.52, 0.2)})
    study.insert(0, {**study[0], "variant": "dense", "status": "failed: RuntimeError"})
    _write(results, "study", 1500, [0, 1], study)
    _write(results, "again", 1500, [1], [{**r, "status": "not run"} for r in _rows(1, {"dsa": (0.0, 0.0)})])
    for name, date in (("pilot", "2026-01-01"), ("study", "2026-02-01"), ("again", "2026-03-01")):
        path = results / "ablate_offsets" / f"{name}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "date": date}))
    p = quality.pooled(results, "ablate_offsets")
    assert p.rows[("dsa", 16)]["seeds"] == 2 and p.rows[("dsa", 16)]["temporal_consistency_mean"] == pytest.approx(0.71)
    assert p.rows[("dense", 16)]["seeds"] == 1 and p.rows[("dense", 16)]["temporal_consistency_mean"] == 0.9
    assert sorted(link.split("/")[1].split(".")[0] for link in p.links) == ["pilot", "study"]


def test_a_clip_without_a_finished_run_is_not_measured(results):
    strong = [_four((0.80, 0.80), (0.60, 0.60), (0.60, 0.50), (0.60, 0.55)) for _ in range(3)]
    _quality(results, {16: strong, 64: [{k: v for k, v in s.items() if k != "dsa"} for s in strong]},
             clip_steps=[2800, 1400], batch_sizes=[8, 2])
    assert quality.pooled(results, "quality").training == "2800 + 1400 steps (batch 8, 2)"
    for claim, word in (("C6", "better on this proxy"), ("C7", "supported"), ("C8", "supported")):
        verdict = _verdict(results, claim)
        assert verdict.startswith("inconclusive") and f"quality, 16 frames: {word}" in verdict
        assert "quality, 64 frames: inconclusive, not measured (no finished run of dsa)" in verdict


def test_under_training_is_judged_at_each_clip_length(results):
    strong = [_four((0.80, 0.80), (0.80, 0.60), (0.60, 0.50), (0.60, 0.55)) for _ in range(3)]
    weak = [_four((0.30, 0.30), (0.05, 0.05), (0.05, 0.05), (0.05, 0.05)) for _ in range(3)]
    _quality(results, {16: strong, 64: weak})       # dsa far ahead at 64 frames, but no model learned the captions
    verdict = _verdict(results, "C8")
    assert verdict.startswith("inconclusive") and "16 frames: supported" in verdict
    assert "64 frames: inconclusive, under-trained: best TA 0.30" in verdict


def test_cpu_results_are_not_claims_and_weak_models_are_inconclusive_under_every_claim(results, monkeypatch):
    monkeypatch.setattr("experiments.results_io.hardware", lambda: {"cpu": "x", "gpus": []})
    _write(results, "cpu", 60, [0], _rows(0, {"dsa": (0.9, 0.9), "dsa_zero": (0.1, 0.1)}))
    assert quality.pooled(results, "ablate_offsets") is None and _verdict(results, "C8") == "open"
    monkeypatch.setattr("experiments.results_io.hardware", lambda: H200)
    weak = [_four((0.90, 0.2), (0.5, 0.0), (0.5, 0.0), (0.5, 0.0)) for _ in range(3)]
    _write(results, "gpu", 1500, [0, 1, 2], _seeds([{"dsa": (0.90, 0.2), "dsa_zero": (0.50, 0.0)}] * 3))
    _quality(results, {16: weak})
    for claim in ("C6", "C7", "C8"):
        verdict = _verdict(results, claim)
        assert verdict.startswith("inconclusive") and "under-trained: best TA 0.20" in verdict


def test_pooled_table_shows_caption_parts_only_when_every_row_has_them(results):
    rows = _rows(0, {"dsa": (0.6, 0.2), "dsa_zero": (0.5, 0.0)})
    _write(results, "old", 1500, [0], rows)
    header = quality.pooled_table("ablate_offsets", quality.pooled(results, "ablate_offsets"))
    assert "n_eval 32, scorer v2" in header[0]
    assert "color match" not in header[2] and "text alignment" in header[2]
    for r in rows:
        r.update(color_match=1.0, shape_match=0.5, direction_match=0.25)
    _write(results, "old", 1500, [0], rows)
    table = quality.pooled_table("ablate_offsets", quality.pooled(results, "ablate_offsets"))
    assert "| color match | shape match | direction match |" in table[2]
    assert "| dsa | 16 | 1 | 0.20 | 1.00 | 0.50 | 0.25 |" in table[4]   # one seed: no spread to show


def test_degenerate_modes_and_noise_band_from_world_size_and_degrees():
    timing = [{"variant": v, "seq_len": 16384, "time_s": 1.0, "speedup_vs_usp": x}
              for v, x in (("ulysses", 0.98), ("hybrid_ring_intra", 1.03), ("ring", 0.90), ("torus", 1.2))]
    two = {"world_size": 2, "usp_degrees": [2, 1], "timings": timing}
    assert swiftfusion.degenerate_modes(two) == {"usp": "ulysses", "hybrid_ring_intra": "ulysses",
                                                 "swiftfusion": "torus"}
    assert swiftfusion.noise_band(two) == (0.98, 1.03)                   # ring and torus are other computations
    assert swiftfusion.degenerate_modes({"world_size": 8, "usp_degrees": [4, 2]}) == {}
    assert swiftfusion.degenerate_modes({"world_size": 8, "usp_degrees": [1, 8]})["usp"] == "ring"
    assert swiftfusion.against_band([1.0, 0.99], (0.975, 1.04)) == "inside the noise band"
    assert swiftfusion.against_band([0.92, 1.0], (0.975, 1.04)) == "below or inside the noise band"


def test_sp_ladder_names_the_rungs_that_got_slower():
    result = {"ranks": 2, "rows": [{"variant": f"causal: {v}", "ranks": r, "total_s": t} for v, r, t in
                                   (("none", 2, 2.6), ("+a", 2, 2.9), ("+b", 2, 2.4), ("+c", 1, 9.0))]}
    assert causal_sp._ladder(result) == [("none", 2.6), ("+a", 2.9), ("+b", 2.4)]
    assert causal_sp._slower_rungs(causal_sp._ladder(result)) == ["+a (2.60 -> 2.90 s)"]


def test_f1_is_undetermined_while_the_model_errs_more_than_its_predicted_gaps(tmp_path):
    plan = {"total_s": 1.0}
    sim = {"simulation": [{"seq_len": 1 << 18, "winner_placement": "ulysses_intra", "usp": plan,
                           "ring_intra": {"total_s": 1.01}}]}
    wide = ("w2", {"world_size": 2, "timings": [{"variant": "usp", "measured_over_predicted": 1.2},
                                                 {"variant": "sdpa_1gpu", "measured_over_predicted": 1.01}]})
    assert swiftfusion.f1(tmp_path, ("one", sim), wide)[1].startswith("undetermined until the model is calibrated")
    assert "measured/predicted 1.20-1.20" in swiftfusion.f1(tmp_path, ("one", sim), wide)[1]
    calibrated = ("w2", {"world_size": 2, "timings": [{"variant": "usp", "measured_over_predicted": 1.001}]})
    assert swiftfusion.f1(tmp_path, ("one", sim), calibrated)[1].startswith("not supported by the model")


def test_scorer_version_reads_only_scored_rows():
    """A failed, OOM or not-run row carries no scorer version; it must not read as v1 beside v2 rows."""
    rows = [{"variant": "dsa", "status": "ok", "scorer_version": 2},
            {"variant": "dense", "status": "OOM"}, {"variant": "swin", "status": "failed: boom"}]
    assert quality.scorer_version({"tables": {"per seed": rows}}) == 2
    with pytest.raises(ValueError, match="mixes rows of scorer versions"):
        quality.scorer_version({"tables": {"per seed": [*rows, {"variant": "dsa_zero", "status": "ok"}]}})


def test_both_sides_must_learn_and_parity_is_two_sided_with_the_previous_rule_shown(results):
    """A baseline whose caption match is below half the ground truth's did not learn the task: the comparison says
    so instead of supporting the claim. C6 (parity) with DSA far ahead of a dense that learned is "better on this
    proxy". Each verdict the new rule changed shows the previous rule's verdict beside it."""
    runs = [_four((0.80, 0.90), (0.40, 0.60), (0.10, 0.10), (0.50, 0.60)),
            _four((0.82, 0.92), (0.42, 0.62), (0.12, 0.12), (0.52, 0.62)),
            _four((0.81, 0.91), (0.41, 0.61), (0.11, 0.11), (0.51, 0.61))]
    _quality(results, {16: runs})
    c7 = _verdict(results, "C7")
    assert c7.startswith("inconclusive: quality, 16 frames: inconclusive, swin did not learn the task (swin TA 0.11")
    assert c7.endswith(f"up to commit {quality.PREVIOUS_RULE_UNTIL}: only the best model had to clear the training "
                       "check, so a baseline that learned nothing still voted): supported")
    c6 = _verdict(results, "C6")
    assert c6.startswith("better on this proxy: quality, 16 frames: better on this proxy, ahead beyond the margin")
    assert "parity was one-sided: DSA no worse than -0.05): supported" in c6
    c8 = _verdict(results, "C8")
    assert c8.startswith("supported") and "under the previous rule" not in c8     # unchanged: nothing shown


def test_caption_match_on_training_clips_shows_beside_the_held_out_one(results):
    """Rows scored on training clips (n_train_eval) add a column to the pooled table and a figure to the claim's
    evidence; rows without them say "not recorded"."""
    rows = _rows(0, {"dsa": (0.6, 0.7), "dense": (0.5, 0.3)})
    _write(results, "a", 1500, [0], rows, experiment="quality")
    ours = _claim(results, "C6")[0]
    assert "TA on training clips not recorded" in ours
    for r, seen in zip(rows, (0.75, 0.95, 1.0)):                  # dense fits its training clips, not held-out ones
        r["trainset_text_alignment"] = seen
    _write(results, "a", 1500, [0], rows, experiment="quality")
    assert "TA on training clips 0.75 vs 0.95" in _claim(results, "C6")[0]
    table = quality.pooled_table("quality", quality.pooled(results, "quality"))
    assert "| text alignment | text alignment, training clips |" in table[2]
    assert "| dense | 16 | 1 | 0.30 | 0.95 |" in "\n".join(table)


def test_a_tuned_recipe_is_pooled_first_and_the_untuned_verdict_shows_beside_it(results):
    """A study trained with a recipe tuned on validation clips (quality.py recipe=) votes before an untuned one
    that trained on more clips; where that changes a verdict, the untuned pool's verdict is shown beside it."""
    weak_swin = [_four((0.80, 0.90), (0.80, 0.90), (0.10, 0.10), (0.60, 0.50)) for _ in range(3)]
    _write(results, "untuned", 3000, [0, 1, 2], [r for rows in (_rows(s, weak_swin[s]) for s in range(3))
                                                 for r in rows], experiment="quality", clip_frames=[16], batch_size=8)
    assert _verdict(results, "C7").startswith("inconclusive")          # swin did not learn
    learned_swin = [_four((0.80, 0.90), (0.80, 0.90), (0.60, 0.70), (0.60, 0.50)) for _ in range(3)]
    _write(results, "tuned", 1500, [0, 1, 2], [r for rows in (_rows(s, learned_swin[s]) for s in range(3))
                                               for r in rows], experiment="quality", clip_frames=[16],
           batch_size=8, recipe={"swin": {"lr": 3e-4, "warmup_steps": 100}})
    c7 = _verdict(results, "C7")
    assert c7.startswith("supported") and "quality/tuned.json" in _claim(results, "C7")[0]
    assert c7.endswith(f"up to commit {quality.UNTUNED_RULE_UNTIL}: {quality.UNTUNED_RULE}): inconclusive")
    assert "under the previous rule" not in _verdict(results, "C8")   # both pools support C8: nothing shown


def test_quality_studies_pool_from_any_gpu_and_the_h200_only_verdict_shows_beside(results, monkeypatch):
    """A trained model's scores do not depend on the GPU that ran its steps: a tuned study that ran on an H100
    votes, and where that changes a verdict, the H200-only pooling's verdict (the rule until GPU_RULE_UNTIL) is
    shown beside it. CPU results still never vote."""
    weak_swin = [_four((0.80, 0.90), (0.80, 0.90), (0.10, 0.10), (0.60, 0.50)) for _ in range(3)]
    _write(results, "h200", 3000, [0, 1, 2], [r for rows in (_rows(s, weak_swin[s]) for s in range(3))
                                              for r in rows], experiment="quality", clip_frames=[16], batch_size=8)
    monkeypatch.setattr("experiments.results_io.hardware", lambda: {"cpu": "x", "gpus": ["NVIDIA H100 80GB HBM3"]})
    learned_swin = [_four((0.80, 0.90), (0.80, 0.90), (0.60, 0.70), (0.60, 0.50)) for _ in range(3)]
    _write(results, "h100", 1500, [0, 1, 2], [r for rows in (_rows(s, learned_swin[s]) for s in range(3))
                                              for r in rows], experiment="quality", clip_frames=[16],
           batch_size=8, recipe={"swin": {"lr": 3e-4, "warmup_steps": 100}})
    ours, c7 = _claim(results, "C7")
    assert c7.startswith("supported") and "NVIDIA H100 80GB HBM3 ([quality/h100.json]" in ours
    assert f"up to commit {quality.GPU_RULE_UNTIL}: {quality.GPU_RULE}): inconclusive" in c7
    assert f"up to commit {quality.UNTUNED_RULE_UNTIL}: {quality.UNTUNED_RULE}): inconclusive" in c7
    h200_only = quality.pooled(results, "quality", gpu="H200")
    assert [link.split("]")[0] for link in h200_only.links] == ["[quality/h200.json"]
    monkeypatch.setattr("experiments.results_io.hardware", lambda: {"cpu": "x", "gpus": []})
    _write(results, "cpu", 9000, [0, 1, 2], [r for rows in (_rows(s, learned_swin[s]) for s in range(3))
                                             for r in rows], experiment="quality", clip_frames=[16], batch_size=8)
    assert "quality/cpu.json" not in _claim(results, "C7")[0]


def test_runs_cut_short_are_listed_with_the_other_files_of_their_config(results):
    rows = _rows(0, {"dsa": (0.70, 0.8), "dsa_zero": (0.50, 0.6)})
    write_result("ablate_offsets", "cut", {"config": {"steps": 1500, "seeds": [0], "n_eval": 32}, "rows": [],
                                           "tables": {"per seed": rows}, "jobs_done": 1, "jobs_total": 2},
                 results_dir=results)
    _write(results, "more_a", 1500, [1], rows)
    _write(results, "more_b", 1500, [2], rows)
    _write(results, "other", 700, [0], rows)                       # another config: not named
    listed = [line.replace(" (dirty tree)", "") for line in page.readme(results).splitlines()   # run in a dirty tree
              if line.startswith("- [ablate_offsets/cut.json]")]
    assert listed == ["- [ablate_offsets/cut.json](ablate_offsets/cut.json): 1 of 2 planned runs; more seeds of its "
                      "config in [ablate_offsets/more_a.json](ablate_offsets/more_a.json), "
                      "[ablate_offsets/more_b.json](ablate_offsets/more_b.json)"]


def test_swin_is_named_with_its_window_and_the_keys_a_query_sees(results):
    """Swin's window may be tuned (tune_recipe swin_windows), so the evidence of a claim against Swin names the
    window its pool trained with and its keys a query; a pool without a recorded window names the variant alone."""
    learned = [_four((0.80, 0.90), (0.80, 0.90), (0.70, 0.85), (0.60, 0.80)) for _ in range(3)]
    _quality(results, {16: learned}, swin_window=[4, 8, 8])
    ours = _claim(results, "C7")[0]
    assert "dsa TC 0.80" in ours and "vs swin (window 4x8x8, 256 keys a query) TC 0.70" in ours
    _quality(results, {16: learned})
    assert "vs swin TC 0.70" in _claim(results, "C7")[0]
