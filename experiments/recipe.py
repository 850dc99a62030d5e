"""Per-variant training recipes, tuned on validation clips before any test score is seen.

`experiments/tune_recipe.py` trains every candidate (learning rate, warm-up steps; for Swin also its window) of
every variant and scores it on validation clips: clips of data seed `val_seed`, which are neither training clips
(data.seed) nor the study's test clips (eval_seed, never sampled while tuning). `choose` takes per variant the
candidate with the highest mean validation caption match over the tuning seeds (ties: the higher temporal
consistency, then the lower learning rate, then the smaller window). A recipe holds what it was tuned for
(`tuned_for`: the data, the model without its attention, the steps and the batch); `quality.py recipe=<file>`
trains each variant with its own candidate and refuses a recipe tuned for anything else, naming what differs.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from experiments.quality_protocol import SCORE_KEYS, learned
from megaslide.config import DataConfig, DiTConfig

CANDIDATE_KEYS = ("lr", "warmup_steps")   # the TrainConfig fields a recipe sets per variant
WINDOW = "window"   # Swin's candidates also carry its attention window (t, h, w), a list


def tuned_for(data: DataConfig, model: DiTConfig, steps: int, batch_size: int) -> dict:
    """What a recipe is valid for: the training data, the model apart from its attention (each variant has its
    own), the training steps and the batch."""
    return {"data": dataclasses.asdict(data),
            "model": {k: v for k, v in dataclasses.asdict(model).items() if k != "attention"},
            "steps": steps, "batch_size": batch_size}


def candidate_means(runs: list[dict]) -> list[dict]:
    """Per (variant, lr, warm-up, window where a run has one) of the tuning runs' rows (each with variant, seed, lr,
    warmup_steps, status and the validation scores): its finished seeds and the mean of each validation score over
    them (NaN where none finished)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        window = tuple(r[WINDOW]) if WINDOW in r else None
        groups.setdefault((r["variant"], *(r[k] for k in CANDIDATE_KEYS), window), []).append(r)
    out = []
    for (variant, *values, window), group in groups.items():
        ok = [r for r in group if r.get("status") == "ok"]
        row = {"variant": variant, **dict(zip(CANDIDATE_KEYS, values)), **({WINDOW: list(window)} if window else {}),
               "seeds": len(ok)}
        for k in SCORE_KEYS:
            if not ok or all(k in r for r in ok):
                row[k] = sum(r[k] for r in ok) / len(ok) if ok else math.nan
        out.append(row)
    return out


def choose(candidates: list[dict], truth_ta: float) -> list[dict]:
    """One recipe row per variant from `candidate_means`: the candidate with the highest mean validation caption
    match (ties: the higher consistency, then the lower lr, then the window of fewer tokens), and whether it learned
    the task there (`learned`, against the ground truth's `truth_ta`). A variant none of whose runs finished gets no
    row."""
    best: dict[str, dict] = {}
    for c in candidates:
        rank = (c.get("text_alignment"), c.get("temporal_consistency"), -c["lr"], -math.prod(c.get(WINDOW, [1])))
        if c["seeds"] and (c["variant"] not in best or rank > best[c["variant"]][0]):
            best[c["variant"]] = (rank, c)
    return [{"variant": v, **{k: c[k] for k in (*CANDIDATE_KEYS, WINDOW) if k in c}, "seeds": c["seeds"],
             "val_text_alignment": c["text_alignment"], "val_temporal_consistency": c["temporal_consistency"],
             "learned": learned(c["text_alignment"], truth_ta)} for v, (_, c) in best.items()]


def read_recipe(path: str, variants: list[str], expected: dict, eval_seed: int) -> dict[str, dict]:
    """variant -> {lr, warmup_steps} (and Swin's `window`, where it was tuned) of the recipe result JSON at `path`
    (tune_recipe.py's), for a study of `variants` that tests on data seed `eval_seed` and trains as `expected`
    (tuned_for). A ValueError names the key to change where the file is not a finished recipe, was tuned for other
    training, validated on the study's test clips, or lacks a variant."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"recipe={path!r} is not a file; pass a recipe JSON written by experiments/tune_recipe.py "
                         f"(results/quality_recipe/<name>.json), or recipe='' for the config's own lr and warm-up")
    try:
        result = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"recipe={path!r} is not JSON ({err}); pass a file written by tune_recipe.py") from err
    if not isinstance(result, dict) or "recipe" not in result or "tuned_for" not in result.get("config", {}):
        raise ValueError(f"recipe={path!r} holds no finished recipe (a tuning run cut short, or another result); "
                         f"finish it with tune_recipe.py continue_runs=true")
    config = result["config"]
    if config["val_seed"] == eval_seed:
        raise ValueError(f"recipe={path!r} was tuned on clips of data seed {eval_seed}, this study's eval_seed: its "
                         f"test clips would have chosen the recipe; tune again with another val_seed")
    differ = sorted(_differences(config["tuned_for"], expected))
    if differ:
        raise ValueError(f"recipe={path!r} was tuned for other training ({', '.join(differ)}); tune again with this "
                         f"study's settings, or set them as the recipe's config records them")
    chosen = {r["variant"]: {k: r[k] for k in (*CANDIDATE_KEYS, WINDOW) if k in r} for r in result["recipe"]}
    missing = [v for v in variants if v not in chosen]
    if missing:
        raise ValueError(f"recipe={path!r} has no recipe for {missing} (it tuned {sorted(chosen)}); tune them too, "
                         f"or leave them out of variants")
    return {v: chosen[v] for v in variants}


def _differences(recorded, expected, where: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested dicts (tuples and lists compare alike)."""
    if isinstance(recorded, dict) and isinstance(expected, dict):
        return [d for k in sorted(set(recorded) | set(expected))
                for d in _differences(recorded.get(k), expected.get(k), f"{where}.{k}" if where else k)]
    same = json.loads(json.dumps(recorded)) == json.loads(json.dumps(expected))
    close = isinstance(recorded, float) and isinstance(expected, float) and math.isclose(recorded, expected)
    return [] if same or close else [f"{where}: {recorded!r} vs {expected!r}"]
