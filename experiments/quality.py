"""Quality study (paper claims C6-C8): dense, Swin, DSA and DSA-zero at a short and a long clip.

Same protocol as ablate_offsets.py (experiments/quality_protocol.py), several seeds, mean
and spread. A variant that runs out of memory is recorded as OOM, not dropped.

`progressive=true` trains the long clips the way video DiTs are trained: each clip after the
first continues the previous clip's run of the same (variant, seed) from its final checkpoint
(weights, EMA, AdamW state and step count) for its `clip_steps` more steps, the same schedule
for every variant. The optimizer state is kept: after warm-up the learning rate is constant,
and fresh AdamW moments would make the first updates about lr on every weight (bias-corrected
first steps), a jolt away from the short-clip solution; kept, the long clip is exactly a
resumed run. With workers > 1 a long run starts as soon as its short run has finished.

`compile_probe=true` measures train.compile instead of running the study: per variant, at the
first clip and its batch size, training steps per second without and with torch.compile
(`probe_steps` timed steps after `probe_warmup` untimed ones, which include compiling; `workers`
measurements at once), in results/quality_compile/<results_name>.json.

    python experiments/quality.py                                        # tiny, CPU
    python experiments/quality.py compile_probe=true                     # tiny, CPU
    experiments/gpu/quality_study.sh                                     # the H200 study, one command
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from concurrent.futures import as_completed
from pathlib import Path

from omegaconf import DictConfig

from experiments.hydra_config import command_line_keys, script_main, typed_configs
from experiments.quality_protocol import (check_study, final_checkpoint, ground_truth_row, make_job, process_pool,
                                          run_study, variant_models)
from experiments.recipe import CANDIDATE_KEYS, WINDOW, read_recipe, tuned_for
from experiments.results_io import write_result
from megaslide.config import DataConfig, DiTConfig, TrainConfig
from megaslide.train.trainer import Trainer


def per_clip(values, default: int, key: str, default_key: str, clip_frames) -> list[int]:
    """One value (>= 1) per entry of clip_frames: `values`, or `default` for every clip when empty."""
    out = [int(v) for v in values] or [default] * len(clip_frames)
    if len(out) != len(clip_frames) or min(out) < 1:
        raise ValueError(f"{key}={list(values)} needs one value >= 1 per entry of clip_frames={list(clip_frames)}, "
                         f"or [] to use {default_key} for every clip")
    return out


@script_main("quality")
def main(cfg: DictConfig) -> None:
    model, data, train, _ = typed_configs(cfg)
    check_study(cfg)
    clips = [dataclasses.replace(data, frames=int(f)) for f in cfg.clip_frames]
    batches = per_clip(cfg.clip_batch_sizes, train.batch_size, "clip_batch_sizes", "train.batch_size", cfg.clip_frames)
    steps = per_clip(cfg.clip_steps, train.steps, "clip_steps", "train.steps", cfg.clip_frames)
    recipes = (read_recipe(cfg.recipe, list(cfg.variants), tuned_for(clips[0], model, steps[0], batches[0]),
                           cfg.eval_seed) if cfg.recipe else {})
    swin_window = recipe_window(recipes, cfg.swin_window)
    models = variant_models(model, cfg.variants, swin_window)
    for clip in clips:                       # every (variant, clip) is validated before training starts
        grid = model.token_grid(clip.frames, clip.height, clip.width)
        for name in cfg.variants:
            models[name].attention.validate(grid)
    if cfg.compile_probe:
        if min(cfg.probe_warmup, cfg.probe_steps) < 1:
            raise ValueError(f"probe_warmup={cfg.probe_warmup} and probe_steps={cfg.probe_steps} must each be >= 1")
        probe_compile(cfg, models, clips[0], dataclasses.replace(train, batch_size=batches[0]))
        return
    totals = list(itertools.accumulate(steps)) if cfg.progressive else steps   # each run's steps in all
    jobs = []
    for seed in cfg.seeds:
        previous: dict[str, dict] = {}       # variant -> its job at the previous clip
        for clip, batch, total in zip(clips, batches, totals):
            for variant in cfg.variants:
                run = dataclasses.replace(train, seed=int(seed), batch_size=batch, steps=total,
                                          **{k: v for k, v in recipes.get(variant, {}).items() if k in CANDIDATE_KEYS})
                if cfg.progressive and variant in previous:
                    run = dataclasses.replace(run, resume=str(final_checkpoint(previous[variant])))
                previous[variant] = make_job(cfg, variant, models[variant], clip, run, f"{cfg.name}{clip.frames}f")
                jobs.append(previous[variant])
    config = {"clip_frames": list(cfg.clip_frames), "speed_px_per_frame": data.speed,
              "size": [data.height, data.width], "swin_window": list(swin_window), "steps": steps[0],
              "clip_steps": steps, "progressive": bool(cfg.progressive), "compile": train.compile,
              "deterministic": train.deterministic, **({"recipe": recipes} if recipes else {}),
              "seeds": list(cfg.seeds), "batch_sizes": batches}
    truth = [ground_truth_row(clip, cfg.n_eval, cfg.eval_seed, cfg.n_train_eval) for clip in clips]
    run_study("quality", cfg, jobs, truth, config, {f"_{clip.frames}f": clip.frames for clip in clips},
              per_run=("recipe", "swin_window"))   # each row's settings digest holds what these set


def recipe_window(recipes: dict[str, dict], swin_window) -> tuple[int, int, int]:
    """Swin's window: the recipe's where it tuned one, else `swin_window`. A swin_window set on the command line
    that differs from the recipe's is refused (ValueError naming both), not silently replaced."""
    tuned = recipes.get("swin", {}).get(WINDOW)
    if tuned is None or tuple(tuned) == tuple(swin_window):
        return tuple(swin_window)
    if "swin_window" in command_line_keys():
        raise ValueError(f"swin_window={list(swin_window)} differs from the recipe's Swin window {list(tuned)}: drop "
                         f"swin_window to train Swin as it was tuned, or pass recipe='' to train without the recipe")
    return tuple(tuned)


def time_steps(model: DiTConfig, data: DataConfig, train: TrainConfig, out_dir: str, warmup: int,
               steps: int) -> dict:
    """Seconds of `warmup` untimed training steps (compiling, with train.compile) and the steps per second
    of the `steps` after them; a failure (e.g. of the compiler) is the row's status."""
    try:
        trainer = Trainer(model, data, train, out_dir)
        for _ in range(warmup):
            trainer.train_step()
        warmup_s = trainer.engine.timings(range(0, warmup))["step_time_s"] * warmup
        for _ in range(steps):
            trainer.train_step()
        step_s = trainer.engine.timings(range(warmup, warmup + steps))["step_time_s"]
    except Exception as err:  # the probe's question is whether compiling works here at all
        return {"compile": train.compile, "status": f"failed: {type(err).__name__}: {str(err)[:200]}"}
    return {"compile": train.compile, "warmup_s": warmup_s, "steps_per_s": 1 / step_s, "status": "ok"}


def probe_compile(cfg: DictConfig, models: dict[str, DiTConfig], clip: DataConfig, train: TrainConfig) -> None:
    """Each variant's training speed without and with train.compile (module docstring), each measured in a
    spawned process, `workers` at once. The compiled row adds `speedup` and
    `break_even_steps`, the steps after which compiling has paid for its longer warm-up. The JSON
    is rewritten after every measurement, so a probe cut short keeps what it measured."""
    config = {"frames": clip.frames, "size": [clip.height, clip.width], "batch_size": train.batch_size,
              "warmup": cfg.probe_warmup, "steps": cfg.probe_steps, "variants": list(cfg.variants),
              "workers": cfg.workers, "deterministic": train.deterministic}
    pairs = list(itertools.product(cfg.variants, (False, True)))   # (variant, compile): eager, then compiled
    jobs = [(models[v], clip, dataclasses.replace(train, compile=on), cfg.out_dir, cfg.probe_warmup, cfg.probe_steps)
            for v, on in pairs]
    rows: dict[int, dict] = {}

    def finish(i: int, row: dict) -> Path:
        rows[i] = {"variant": pairs[i][0], **row}
        eager, compiled = rows.get(i - i % 2), rows.get(i - i % 2 + 1)
        if eager and compiled and eager["status"] == compiled["status"] == "ok":
            compiled.update(compile_gain(eager, compiled))
        payload = {"config": config, "rows": [rows[k] for k in sorted(rows)], "jobs_done": len(rows),
                   "jobs_total": len(jobs)}
        return write_result("quality_compile", cfg.results_name, payload, results_dir=cfg.results_dir)

    with process_pool(cfg.workers) as pool:
        futures = {pool.submit(time_steps, *job): i for i, job in enumerate(jobs)}
        paths = [finish(futures[f], f.result()) for f in as_completed(futures)]
    for r in (rows[k] for k in sorted(rows)):
        speed = f"{r['steps_per_s']:.1f} steps/s, warm-up {r['warmup_s']:.1f} s" if r["status"] == "ok" else r["status"]
        gain = f", speed-up {r['speedup']:.2f}x (pays after {r['break_even_steps']} steps)" if "speedup" in r else ""
        print(f"{r['variant']:9s} compile={str(r['compile']).lower():5s} {speed}{gain}")
    print(f"\ncompile probe (JSON): {paths[-1]}")


def compile_gain(eager: dict, compiled: dict) -> dict:
    """`speedup` (compiled / eager steps per second) and `break_even_steps`: the training steps after which
    the compiled run has caught up with the eager one despite its longer warm-up (None: it never does)."""
    saved = 1 / eager["steps_per_s"] - 1 / compiled["steps_per_s"]            # seconds per step
    extra = max(0.0, compiled["warmup_s"] - eager["warmup_s"])
    return {"speedup": compiled["steps_per_s"] / eager["steps_per_s"],
            "break_even_steps": math.ceil(extra / saved) if saved > 0 else None}

if __name__ == "__main__":
    main()
