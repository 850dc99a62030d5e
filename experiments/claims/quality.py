"""MegaSlide-DiT C6-C8: quality results pooled over seeds, and the one verdict rule of the quality claims.

Only result files of one run recipe pool (their config without seeds, the POOL_SETTINGS and the
scorer version); the page's pooled tables come from here too."""
from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from experiments.claims.common import link, read_results, under_previous_rule
from experiments.quality_protocol import aggregate, learned
from experiments.results_io import ANY_GPU, REFERENCE_GPU, ran_on

# Run settings that two quality results must share to pool, besides their config (seeds aside) and the
# scorer version: setting -> where a result records it (config keys, then Hydra overrides of its command).
POOL_SETTINGS = {"model": ("model",), "batch": ("batch_size", "batch_sizes", "train.batch_size"),
                 "n_eval": ("n_eval",), "eval_seed": ("eval_seed",)}
VERDICT_KEYS = ("text_alignment", "temporal_consistency")
NOT_WORSE = -0.05   # C6 "DSA matches dense": parity is |DSA - dense| within this (the paper's own gaps: 0.01-0.02)


def _overrides(command: str) -> dict:
    """The `key=value` Hydra overrides of a recorded command line, values parsed as YAML."""
    pairs = (tok.split("=", 1) for tok in shlex.split(command or "") if "=" in tok and not tok.startswith("-"))
    return {k: yaml.safe_load(v) for k, v in pairs}


def scorer_version(result: dict) -> int:
    """The MovingShapes scorer version of a result's scored rows; scored rows that carry none were scored
    by v1. Rows that were not scored (OOM, failed, not run: a status other than "ok") say nothing."""
    versions = {int(r.get("scorer_version", 1)) for r in result.get("tables", {}).get("per seed", [])
                if r.get("status", "ok") == "ok"}
    if len(versions) > 1:
        raise ValueError(f"a result mixes rows of scorer versions {sorted(versions)}; score a run with one scorer")
    return versions.pop() if versions else 1


def run_settings(result: dict) -> dict | None:
    """What two quality results must share to pool: their config without seeds, the POOL_SETTINGS
    (None where a result records them nowhere) and the scorer version. None if it has no config."""
    if "config" not in result:
        return None
    config = {k: v for k, v in result["config"].items() if k != "seeds"}
    given = {**_overrides(result.get("command", "")), **config}
    settings = {name: next((given[k] for k in keys if k in given), None) for name, keys in POOL_SETTINGS.items()}
    return {**config, **settings, "scorer_version": scorer_version(result)}


def config_key(result: dict) -> str | None:
    settings = run_settings(result)
    return None if settings is None else json.dumps(settings, sort_keys=True, default=str)


@dataclass
class Pooled:
    rows: dict          # (variant, frames) -> mean / sample-std row over the pooled seeds (ground truth included)
    per_seed: list      # the row of each pooled run (seed_runs; no ground truth)
    settings: dict      # run_settings shared by the pooled files
    links: list[str]
    gpus: list[str]     # the GPUs the pooled files ran on

    @property
    def training(self) -> str:
        """The training of one run: "N steps", or per clip with each clip's batch ("2800 + 1400 steps
        (batch 8, 8)" for a progressive study)."""
        clip_steps, batch = self.settings.get("clip_steps"), self.settings.get("batch")
        if not clip_steps or len(clip_steps) < 2:
            return f"{self.settings['steps']} steps"
        shown = f" (batch {', '.join(str(b) for b in batch)})" if isinstance(batch, list) else ""
        return " + ".join(str(s) for s in clip_steps) + " steps" + shown

    def eval_error(self, variant: str, frames: int, key: str) -> float:
        """A run's sampling error of `key` from scoring n_eval clips: the mean of its per-seed standard
        errors where rows record them, else sqrt(p (1 - p) / n_eval) (exact for the 0/1 caption match, an
        upper bound for a [0, 1] score); NaN if n_eval is unknown."""
        recorded = [r[f"{key}_se"] for r in self.per_seed
                    if (r["variant"], r["frames"]) == (variant, frames) and f"{key}_se" in r]
        if recorded:
            return sum(recorded) / len(recorded)
        p, n = self.rows[(variant, frames)][f"{key}_mean"], self.settings["n_eval"]
        return math.sqrt(p * (1 - p) / n) if n else math.nan


def seed_runs(group: list[tuple[str, dict]]) -> dict[tuple, tuple[str, dict]]:
    """(variant, frames, seed) -> (file name, per-seed row) over the files of one pool. A run that several
    files hold (a seed run again, e.g. a pilot and the study that repeated it) counts once: its
    finished row before one that did not finish, then the newest file's (by date, then name)."""
    runs: dict[tuple, tuple[str, dict]] = {}
    for name, r in sorted(group, key=lambda nr: (nr[1].get("date", ""), nr[0])):
        for row in r["tables"]["per seed"]:
            key = (row["variant"], row["frames"], row.get("seed"))
            if row["variant"] != "ground_truth" and (row.get("status") == "ok" or key not in runs
                                                     or runs[key][1].get("status") != "ok"):
                runs[key] = (name, row)
    return runs


def training_clips(settings: dict) -> int:
    """Clips one run of a recipe trains on: steps x batch, summed over its clip lengths."""
    batches, steps = settings.get("batch") or 0, settings.get("clip_steps") or [settings.get("steps") or 0]
    batches = batches if isinstance(batches, list) else [batches] * len(steps)
    return sum(int(s) * int(b) for s, b in zip(steps, batches))


def pooled(results_dir: Path, experiment: str, tuned_first: bool = True, gpu: str = ANY_GPU) -> Pooled | None:
    """The results of `experiment` that ran on `gpu` (any GPU by default: a trained model's scores depend on
    its data, model and recipe, which the pool key holds, not on the GPU that ran the steps; until
    GPU_RULE_UNTIL only H200 results pooled) pooled over their per-seed rows (seed_runs): of the files that
    share one run_settings key, the group of the newest scorer, then (`tuned_first`) of a recipe tuned on
    validation clips (experiments/tune_recipe.py; chosen before any test score was seen), then of the recipe
    that trains each run on the most clips (training_clips: the claims are about trained models, and a recipe
    is chosen by its design, never by its scores), then with the most finished runs (e.g. a run cut short and
    the run that added its missing seeds). None if there is no GPU result."""
    groups: dict[str, list] = {}
    for name, r in read_results(results_dir, experiment):
        if ran_on(r, gpu) and "config" in r:
            groups.setdefault(config_key(r), []).append((name, r))

    def rank(group):
        finished = sum(row.get("status") == "ok" for _, row in seed_runs(group).values())
        settings = run_settings(group[0][1])
        tuned = tuned_first and bool(settings.get("recipe"))
        return scorer_version(group[0][1]), tuned, training_clips(settings), finished
    if not groups:
        return None
    group = max(groups.values(), key=rank)
    runs = seed_runs(group)
    per_seed = [row for _, row in runs.values()]
    truth = [row for row in group[0][1]["tables"]["per seed"] if row["variant"] == "ground_truth"]
    rows = {(r["variant"], r["frames"]): r for r in aggregate(per_seed + truth, ddof=1)}
    used = {name for name, _ in runs.values()}
    gpus = sorted({g for n, r in group if n in used for g in r["hardware"]["gpus"]})
    return Pooled(rows, per_seed, run_settings(group[0][1]),
                  [link(results_dir, experiment, n) for n, _ in group if n in used], gpus)


def _scores(r: dict) -> str:
    return (f"TC {r['temporal_consistency_mean']:.2f}, TA {r['text_alignment_mean']:.2f}, "
            f"motion err {r['motion_error_mean']:.2f} ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''})")


def _named(p: Pooled, variant: str) -> str:
    """A variant as the evidence names it: Swin with its window, which its recipe may have tuned, and the keys a
    query attends to there (against DSA's K samples)."""
    window = p.settings.get("swin_window")
    if variant != "swin" or not window:
        return variant
    return f"swin (window {'x'.join(map(str, window))}, {math.prod(window)} keys a query)"


def _short(text_alignment: float, truth: float) -> bool:
    """Whether a pooled caption match fails the training check (`learned`); an unmeasured one (NaN) is not judged."""
    return not (math.isnan(text_alignment) or math.isnan(truth) or learned(text_alignment, truth))


def undertrained(p: Pooled, frames: int) -> str | None:
    """Why the pooled models at this clip length are too weak to test a claim (their best TA < half the
    ground truth's at that length, or the pool's best ground truth where it scored none there), or None.
    Per clip length: models that learned the captions at 16 frames may not have at 64."""
    def top(models: bool, at: int | None) -> float:
        return max((r["text_alignment_mean"] for (v, fr), r in p.rows.items()
                    if (v != "ground_truth") == models and at in (None, fr)
                    and not math.isnan(r["text_alignment_mean"])), default=math.nan)
    best, truth = top(True, frames), top(False, frames)
    truth = top(False, None) if math.isnan(truth) else truth
    return f"under-trained: best TA {best:.2f} vs ground truth {truth:.2f}" if _short(best, truth) else None


def _trainset(a: dict, b: dict) -> str:
    """The caption match (TA) two pooled rows score on training clips (n_train_eval), beside the held-out TA above."""
    ta = [r.get("trainset_text_alignment_mean", math.nan) for r in (a, b)]
    if any(math.isnan(x) for x in ta):
        return "TA on training clips not recorded"
    return f"TA on training clips {ta[0]:.2f} vs {ta[1]:.2f}"


@dataclass
class Gap:
    """a - b of one pooled score and the margin it must clear to count."""
    key: str
    diff: float
    margin: float   # 2 x the combined spread of one run of each: seed-to-seed sample std and sampling error


def gap(p: Pooled, a: str, b: str, frames: int, key: str) -> Gap:
    ra, rb = p.rows[(a, frames)], p.rows[(b, frames)]
    spread = sum(r[f"{key}_std"] ** 2 + p.eval_error(v, frames, key) ** 2 for v, r in ((a, ra), (b, rb)))
    return Gap(key, ra[f"{key}_mean"] - rb[f"{key}_mean"], 2 * math.sqrt(spread))


def not_learned(p: Pooled, frames: int, variants: tuple[str, ...]) -> str | None:
    """Why a comparison at this clip length says nothing: one of its `variants` did not learn the task (its TA
    below half the ground truth's there, as `undertrained` judges the best model), or None. A comparison against a
    model that learned nothing is reported as that, never as support."""
    truth = max((r["text_alignment_mean"] for (v, fr), r in p.rows.items() if v == "ground_truth" and fr == frames),
                default=max(r["text_alignment_mean"] for (v, _), r in p.rows.items() if v == "ground_truth"))
    weak = [f"{v} TA {p.rows[(v, frames)]['text_alignment_mean']:.2f}" for v in variants
            if _short(p.rows[(v, frames)]["text_alignment_mean"], truth)]
    return f"{' and '.join(w.split()[0] for w in weak)} did not learn the task ({', '.join(weak)} vs ground " \
           f"truth {truth:.2f})" if weak else None


BETTER = "better on this proxy"


def decide(gaps: list[Gap], claimed: float, weak: str | None, parity: bool = False) -> tuple[str, str]:
    """The one verdict rule of C6-C8. A one-sided claim says a - b > `claimed` on every gap; a parity claim
    (`parity`) says |a - b| <= -`claimed` on every gap.

    inconclusive if a model is too weak to test it (`weak`) or a margin is unknown (one seed, or n_eval
    unknown). One-sided: supported if every diff - margin > claimed, contradicted if some diff + margin <
    claimed. Parity: supported if every |diff| + margin <= -claimed, contradicted if some diff + margin <
    claimed (a worse), "better on this proxy" if some diff - margin > -claimed (a ahead of b beyond parity).
    Otherwise inconclusive. Returns (word, why)."""
    if weak:
        return "inconclusive", weak
    if any(math.isnan(g.margin) for g in gaps):
        return "inconclusive", "margin unknown (one seed, or n_eval not recorded)"
    if any(g.diff + g.margin < claimed for g in gaps):
        return "contradicted", "the other way beyond the margin"
    if not parity and all(g.diff - g.margin > claimed for g in gaps):
        return "supported", "beyond the margin"
    if parity and all(abs(g.diff) + g.margin <= -claimed for g in gaps):
        return "supported", f"within ±{-claimed:.2f} beyond the margin"
    if parity and any(g.diff - g.margin > -claimed for g in gaps):
        return BETTER, "ahead beyond the margin, not at parity"
    return "inconclusive", "inside the margin"


def overall(words: set[str]) -> str:
    """A claim's word from the words of its clip lengths."""
    if "contradicted" in words:
        return "contradicted"
    if words == {"supported"}:
        return "supported"
    return BETTER if words and words <= {"supported", BETTER} else "inconclusive"


def mean_loss(p: Pooled, variant: str, frames: int) -> float:
    """The mean over seeds of a variant's final training loss at one clip length (NaN where none is recorded)."""
    losses = [r["final_loss"] for r in p.per_seed if (r["variant"], r["frames"]) == (variant, frames)
              and r.get("final_loss") is not None]
    return sum(losses) / len(losses) if losses else math.nan


ABBREV = {"text_alignment": "TA", "temporal_consistency": "TC"}


SUPERSEDED = "not counted"


@dataclass(frozen=True)
class QualityClaim:
    """Paper: `variant` - `baseline` > `claimed` on each of `keys`, tested at every clip length of each study.
    Only the studies scored by the newest scorer among them vote, as within one study's pool (`pooled`):
    the older scorer's scores are reported, but v1 let a frozen clip score full consistency."""
    variant: str
    baseline: str
    keys: tuple[str, ...]
    claimed: float
    studies: tuple[str, ...]
    parity: bool = False   # the paper claims a match (|a - b| small), not a lead

    def judge(self, results_dir: Path) -> tuple[str, str]:
        found = self._pools(results_dir, tuned_first=True, gpu=ANY_GPU)
        if not found:
            return "not measured at GPU scale", "open"
        ours, text, verdict = self._assess(found)
        for rule, until, tuned_first in ((GPU_RULE, GPU_RULE_UNTIL, True), (UNTUNED_RULE, UNTUNED_RULE_UNTIL, False)):
            earlier = self._pools(results_dir, tuned_first, gpu=REFERENCE_GPU)   # the rules before were H200-only
            word = self._assess(earlier)[2] if earlier else "open"
            if word != verdict:
                text += "; " + under_previous_rule(rule, word, until=until)
        return ours, text

    def _pools(self, results_dir: Path, tuned_first: bool, gpu: str) -> list[tuple[str, Pooled]]:
        return [(e, p) for e in self.studies if (p := pooled(results_dir, e, tuned_first, gpu))]

    def _assess(self, found: list[tuple[str, Pooled]]) -> tuple[str, str, str]:
        """(our evidence, the verdict with its reasons, the verdict word) of the pooled studies `found`."""
        ours, parts, previous = [], [], []
        newest = max(p.settings["scorer_version"] for _, p in found)
        for experiment, p in found:
            version = p.settings["scorer_version"]
            for frames in sorted({fr for v, fr in p.rows if v == "ground_truth"}):   # every clip of the study
                where = f"{experiment}, {frames} frames"
                missing = [v for v in (self.variant, self.baseline) if (v, frames) not in p.rows]
                if missing:
                    ours.append(f"{where}: no finished run of {' or '.join(missing)}")
                    word, text = "inconclusive", f"not measured (no finished run of {' or '.join(missing)})"
                    old = word
                else:
                    a, b = p.rows[(self.variant, frames)], p.rows[(self.baseline, frames)]
                    gaps = [gap(p, self.variant, self.baseline, frames, k) for k in VERDICT_KEYS]
                    voting = [g for g in gaps if g.key in self.keys]
                    weak = undertrained(p, frames) or not_learned(p, frames, (self.variant, self.baseline))
                    word, why = decide(voting, self.claimed, weak, self.parity)
                    old = decide(voting, self.claimed, undertrained(p, frames))[0]
                    losses = [mean_loss(p, v, frames) for v in (self.variant, self.baseline)]
                    shown = "not recorded" if any(math.isnan(x) for x in losses) else " vs ".join(f"{x:.3f}"
                                                                                                for x in losses)
                    ours.append(f"{where}: {_named(p, self.variant)} {_scores(a)} vs {_named(p, self.baseline)} "
                                f"{_scores(b)}; final "
                                f"training loss {shown}; {_trainset(a, b)}")
                    measured = ", ".join(f"{ABBREV[g.key]} {g.diff:+.2f} (margin ±{g.margin:.2f})" for g in gaps)
                    text = f"{why}; {self.variant} minus {self.baseline} {measured}"
                    if word == BETTER:
                        text += (f" (held-out clips; the training losses and TA on training clips above show "
                                 f"whether {self.baseline} fit its training clips better while failing on held-out "
                                 f"ones)")
                if version < newest:
                    word, text = SUPERSEDED, f"scorer v{version}, the verdict uses v{newest} ({word}, {text})"
                    old = SUPERSEDED
                parts.append((word, f"{where}: {word}, {text}"))
                previous.append(old)
            truth = max(fr for v, fr in p.rows if v == "ground_truth")
            gt = p.rows[("ground_truth", truth)]
            ours.append(f"{experiment} ground truth TC {gt['temporal_consistency_mean']:.2f}, TA "
                        f"{gt['text_alignment_mean']:.2f}; {p.training}, n_eval {p.settings['n_eval']}, scorer "
                        f"v{version}, {', '.join(p.gpus)} ({', '.join(p.links)})")
        verdict = overall({w for w, _ in parts} - {SUPERSEDED})
        was = overall(set(previous) - {SUPERSEDED})
        text = f"{verdict}: " + "; ".join(text for _, text in parts)
        if was != verdict:
            text += "; " + under_previous_rule(PREVIOUS_RULE + (PREVIOUS_PARITY if self.parity else ""), was,
                                               until=PREVIOUS_RULE_UNTIL)
        return "; ".join(ours), text, verdict


PREVIOUS_RULE = ("only the best model had to clear the training check, so a baseline that learned nothing still "
                 "voted")
PREVIOUS_RULE_UNTIL = "6e97fca32"   # the last commit whose verdicts used PREVIOUS_RULE
PREVIOUS_PARITY = f", and parity was one-sided: DSA no worse than {NOT_WORSE:+.2f}"
UNTUNED_RULE = ("a study of a recipe tuned on validation clips was not preferred: of one scorer, the recipe that "
                "trained on the most clips voted")
UNTUNED_RULE_UNTIL = "6455f8a8e"   # the last commit whose pooling did not prefer a tuned recipe
GPU_RULE = "only results that ran on an H200 pooled"
GPU_RULE_UNTIL = "d0e35fdb3"   # the last commit whose pooling kept other GPUs' quality results out


QUALITY_CLAIMS = {
    "C6": QualityClaim("dsa", "dense", VERDICT_KEYS, NOT_WORSE, ("quality",), parity=True),
    "C7": QualityClaim("dsa", "swin", ("temporal_consistency",), 0.0, ("quality",)),
    "C8": QualityClaim("dsa", "dsa_zero", ("temporal_consistency",), 0.0, ("ablate_offsets", "quality")),
}


HEADERS = {"trainset_text_alignment": "text alignment, training clips"}


def pooled_table(experiment: str, p: Pooled) -> list[str]:
    """Markdown lines: mean ± sample std over seeds per (variant, frames) of a pooled quality study."""
    def cell(r, key):
        std = r[f"{key}_std"]
        return f"{r[f'{key}_mean']:.2f}" + ("" if math.isnan(std) else f" ± {std:.2f}")
    keys = ["text_alignment", "temporal_consistency", "motion_error"]
    parts = ["color_match", "shape_match", "direction_match"]   # older result files lack them
    if all(not math.isnan(r.get(f"{k}_mean", math.nan)) for r in p.rows.values() for k in parts):
        keys[1:1] = parts
    if all(not math.isnan(r.get("trainset_text_alignment_mean", math.nan)) for r in p.rows.values()):
        keys[1:1] = ["trainset_text_alignment"]      # caption match on training clips, beside the held-out one
    out = [(f"### {experiment} ({p.training}, n_eval {p.settings['n_eval']}, scorer v{p.settings['scorer_version']}; "
           f"{', '.join(p.links)})"), "",
           "| variant | frames | seeds | " + " | ".join(HEADERS.get(k, k.replace("_", " ")) for k in keys) + " |",
           "|---|---|---|" + "---|" * len(keys)]
    for (variant, frames), r in sorted(p.rows.items(), key=lambda kv: (kv[0][1], kv[0][0] == "ground_truth")):
        out.append(f"| {variant} | {frames} | {r['seeds']} | " + " | ".join(cell(r, k) for k in keys) + " |")
    return out + [""]


QUALITY_NOTE = (
    "Mean ± sample standard deviation over seeds of the GPU runs behind C6-C8 (MovingShapes scores; "
    "a table pools only runs of one config, model, batch, n_eval, eval seed and scorer version). Each "
    "ground_truth row is what that table's scorer gives the true clips of the same captions: the ceiling "
    "a model can reach. The verdict rule of C6-C8: inconclusive while either side of a comparison did not "
    "learn the task (its caption match below half the ground truth's, at that clip length); else a difference "
    "counts when it clears a margin of twice the combined spread of one run of each side (seed-to-seed sample "
    "std and the sampling error of scoring n_eval clips); supported if every difference clears it in the claimed "
    "direction, contradicted if any clears it the other way, inconclusive otherwise. C6 claims parity: supported "
    "only if every difference is within ±0.05 beyond its margin, and 'better on this proxy' where DSA leads "
    "beyond it. Scorer v1 (rows "
    "without a version) let a frozen clip score full temporal consistency; v2 multiplies it by how well "
    "the object moves with the caption's velocity. Of a claim's studies only those of the newest scorer "
    "vote; the others are shown, marked 'not counted'.")

