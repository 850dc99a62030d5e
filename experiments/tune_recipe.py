"""Tune each variant's learning rate and warm-up on validation clips, before a quality study sees its test clips.

Every (lr, warm-up) candidate of every variant trains once per tuning seed with the quality protocol
(experiments/quality_protocol.py) and is scored on `n_eval` validation clips of data seed `val_seed`, never on
the study's test clips (`eval_seed`, only recorded). experiments/recipe.py `choose` picks each variant's
candidate by its mean validation caption match and says whether it learned the task there. The result,
results/quality_recipe/<results_name>.json, holds every run (`per seed`), each candidate's mean scores
(`candidates`) and the chosen `recipe`, which `quality.py recipe=<file>` trains with. The JSON is rewritten after
every finished run (`jobs_done` / `jobs_total`); `continue_runs=true` finishes a tuning cut short: it keeps the
runs that result already holds (each marked with the commit, date and hardware that ran it, `ran_in`), so a fresh
machine needs only that JSON, and continues the others from their newest checkpoint where out_dir still has one.
`max_runs=n` starts at most n of the runs still to run (in job order), so that a tuning whose runs do not all fit
one machine's time limit runs over several calls, each finishing its runs. A continued tuning may add learning
rates, warm-ups or Swin windows to the grid (`lrs`, `warmups`, `swin_windows`): only the new candidates' runs are
left to run. Swin's window is a candidate too: `swin_windows` lists windows tried beside `swin_window` (a variant
whose windows are too small to learn the task is not a baseline).

    python experiments/tune_recipe.py                                     # tiny, CPU
    python experiments/tune_recipe.py model=quality_gpu train.device=cuda ...   # the GPU tuning: docs/quality_study.md
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from experiments.hydra_config import script_main, typed_configs
from experiments.quality_protocol import (check_study, ground_truth_row, make_job, run_held, run_name, strip_samples,
                                          variant_models)
from experiments.recipe import WINDOW, candidate_means, choose, tuned_for
from experiments.report import markdown_table, render
from experiments.results_io import result_path, write_result

EXPERIMENT = "quality_recipe"


def check_candidates(lrs, warmups, swin_windows) -> None:
    """lrs: finite numbers > 0; warmups: integers >= 0; both non-empty lists; swin_windows: a list of (t, h, w)
    triples of integers >= 1. A ValueError names the key."""
    if not lrs or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                          for x in lrs):
        raise ValueError(f"lrs={list(lrs)} must be a non-empty list of learning rates > 0, e.g. 'lrs=[3e-4,1e-3]'")
    if not warmups or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in warmups):
        raise ValueError(f"warmups={list(warmups)} must be a non-empty list of integers >= 0 (train.warmup_steps "
                         f"candidates), e.g. 'warmups=[10,200]'")
    for w in swin_windows:
        if (isinstance(w, str) or not isinstance(w, Sequence) or len(w) != 3
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in w)):
            raise ValueError(f"swin_windows={[list(x) if isinstance(x, Sequence) else x for x in swin_windows]} must "
                             f"be a list of (t, h, w) windows of integers >= 1, e.g. 'swin_windows=[[4,8,8]]'")


def swin_candidates(swin_window, swin_windows) -> list[tuple[int, int, int]]:
    """The Swin windows a tuning tries: `swin_window` first, then each other window of `swin_windows`."""
    first = tuple(swin_window)
    return [first, *(w for w in dict.fromkeys(tuple(x) for x in swin_windows) if w != first)]


def window_tag(window, first) -> str:
    """A run's tag suffix for a Swin window other than the tuning's `swin_window` (whose runs keep their old
    names, so a tuning extended by windows keeps them)."""
    return "" if tuple(window) == tuple(first) else "_win" + "x".join(map(str, window))


GRID = ("lrs", "warmups", "swin_windows")   # candidate lists a continued tuning may extend (earlier runs stay valid)


@script_main("tune_recipe")
def main(cfg: DictConfig) -> None:
    model, data, train, _ = typed_configs(cfg)
    check_study(cfg)
    check_candidates(cfg.lrs, cfg.warmups, cfg.swin_windows)
    if cfg.val_seed in (cfg.eval_seed, data.seed):
        raise ValueError(f"val_seed={cfg.val_seed} equals eval_seed={cfg.eval_seed} or data.seed={data.seed}: "
                         f"validation clips must be neither test nor training clips; pick another val_seed")
    windows = swin_candidates(cfg.swin_window, cfg.swin_windows)
    models = {w: variant_models(model, cfg.variants, w) for w in windows}   # window -> variant -> model
    grid = model.token_grid(data.frames, data.height, data.width)
    for name, w in itertools.product(cfg.variants, windows):
        models[w][name].attention.validate(grid)
    jobs, candidate_of = [], {}
    for seed, variant, lr, warmup in itertools.product(cfg.seeds, cfg.variants, cfg.lrs, cfg.warmups):
        for window in windows if variant == "swin" else windows[:1]:
            tag = f"{cfg.name}_lr{lr:g}_w{warmup}" + window_tag(window, windows[0])
            run = dataclasses.replace(train, seed=int(seed), lr=float(lr), warmup_steps=int(warmup))
            jobs.append({**make_job(cfg, variant, models[window][variant], data, run, tag), "eval_seed": cfg.val_seed})
            candidate_of[run_name(tag, variant, int(seed))] = {"lr": float(lr), "warmup_steps": int(warmup),
                                                               **({WINDOW: list(window)} if variant == "swin" else {})}
    truth = ground_truth_row(data, cfg.n_eval, cfg.val_seed, cfg.n_train_eval)
    config = {"variants": list(cfg.variants), "lrs": list(cfg.lrs), "warmups": list(cfg.warmups),
              **({"swin_windows": [list(w) for w in windows[1:]]} if len(windows) > 1 else {}),
              "seeds": list(cfg.seeds), "n_eval": cfg.n_eval, "val_seed": cfg.val_seed, "eval_seed": cfg.eval_seed,
              "tuned_for": tuned_for(data, model, train.steps, train.batch_size)}

    def runs_of(rows: list[dict]) -> list[dict]:
        return [{**r, **candidate_of[r["run"]]} for r in strip_samples(rows)]

    def publish(rows: list[dict]) -> Path:
        runs = runs_of(rows)
        candidates = candidate_means(runs)
        payload = {"config": config, "jobs_done": len(rows), "jobs_total": len(jobs),
                   "tables": {"candidates": candidates, "per seed": runs + strip_samples([truth])}}
        if len(rows) == len(jobs):
            payload["recipe"] = choose(candidates, truth["text_alignment"])
        return write_result(EXPERIMENT, cfg.results_name, payload, results_dir=cfg.results_dir)

    # a candidate whose loss goes non-finite is a tuning result (too high a learning rate), not a failed tuning
    rows, published = run_held(cfg, jobs, result_path(EXPERIMENT, cfg.results_name, cfg.results_dir), config,
                               publish, GRID, outcomes=(FloatingPointError,))
    runs = runs_of(rows)
    print(markdown_table(choose(candidate_means(runs), truth["text_alignment"])))
    for r in runs:
        if r["status"] != "ok":
            window = f" window {r[WINDOW]}" if WINDOW in r else ""
            print(f"{r['variant']} lr {r['lr']:g} warm-up {r['warmup_steps']}{window} seed {r['seed']}: {r['status']}")
    print(f"\nvalidation clips' own caption match {truth['text_alignment']:.2f} (a model learned the task at half it)")
    print(f"recipe (JSON): {published[-1]}\ntables (markdown): {render(EXPERIMENT, Path(cfg.results_dir))}")
    print(f"train the study with it: python experiments/quality.py recipe={published[-1]} ...")


if __name__ == "__main__":
    main()
