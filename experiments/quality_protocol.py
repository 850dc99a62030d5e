"""The quality protocol shared by ablate_offsets.py and quality.py.

Train one DiT variant on MovingShapes, sample videos for held-out captions, and score
them with weight-free MovingShapes scores (text alignment, temporal consistency, motion
error) and the VBench formulas (temporal flickering, frame consistency with a colour-
histogram encoder standing in for DINO). The ground-truth clips of the same captions are
scored too, as the ceiling each score can reach, and shown in the first row of the sample
grid. Frames in the grid and the mp4s are upscaled (nearest) to at least MIN_FRAME_PX, so
that the 16-pixel shapes of the CPU size can be seen. A run's mp4 shows its first sample beside the
ground-truth clip of the same caption (ground truth left), looped to at least MP4_SECONDS (video_io).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from experiments.hydra_config import RUN_GROUPS, command_line_keys, refuse_repeats
from experiments.report import render
from experiments.results_io import check_result_name, check_writable_folder, result_path, write_result
from megaslide.checkpoint import checkpoint_path, clear_checkpoints, read_state, step_checkpoints
from megaslide.config import DataConfig, DiTConfig, TrainConfig, require_seed
from megaslide.data.moving_shapes import MovingShapes
from megaslide.data.video_io import MP4_SECONDS, frame_grid_png, side_by_side, to_uint8_frames, write_mp4
from megaslide.eval.motion import score_videos
from megaslide.eval.video import frame_consistency, temporal_flickering
from megaslide.models.dit import count_params
from megaslide.train.engine import StepEngine
from megaslide.train.logger import RunLogger
from megaslide.train.trainer import Trainer

# text_alignment needs every part of the caption; color/shape/direction_match say which part fails
SCORE_KEYS = ("text_alignment", "color_match", "shape_match", "direction_match", "temporal_consistency",
              "motion_error", "flickering", "frame_consistency")
# the printed summary (the JSON and the markdown hold every score with its spread): (header, key); "on train" is
# the caption match on training clips (n_train_eval), "-" where none were scored
SUMMARY = (("colour", "color_match"), ("shape", "shape_match"), ("direction", "direction_match"),
           ("caption", "text_alignment"), ("on train", "trainset_text_alignment"),
           ("consistency", "temporal_consistency"), ("motion err", "motion_error"))
MIN_FRAME_PX = 96
GRID_CAPTIONS = 3  # held-out captions the sample grid shows, each with the ground truth and every variant's sample
SAMPLES_FILE = "eval.npz"     # a run's sampled held-out clips, under <run>/samples/ (re-scored from there)
VIDEO_FILE = "eval_0.mp4"     # its first sample beside the ground truth, beside them
MEDIA_KEYS = ("samples", "captions", "mp4")  # kept in the rows for the grid and the printout, not in the JSON


# scores also taken on training clips (`n_train_eval`), prefixed TRAINSET: a model that fits its training clips but
# fails on held-out ones shows it as a gap between the two
TRAINSET = "trainset_"
TRAINSET_KEYS = tuple(TRAINSET + k for k in ("text_alignment", "color_match", "shape_match", "direction_match",
                                              "temporal_consistency"))


def eval_set(data: DataConfig, n: int, seed: int) -> tuple[list[str], list, torch.Tensor]:
    """Captions, labels and ground-truth clips of the first n clips of data seed `seed`: held out when `seed` is
    not the training data's (data.seed), the training clips themselves when it is."""
    ds = MovingShapes(num_videos=n, frames=data.frames, height=data.height, width=data.width,
                      num_shapes=data.num_shapes, speed=data.speed, shape_size=data.shape_size, seed=seed)
    items = [ds[i] for i in range(n)]
    return [it["caption"] for it in items], [it["labels"] for it in items], torch.stack([it["video"] for it in items])


def learned(text_alignment: float, truth: float) -> bool:
    """The training check of the quality studies: a model learned the task when its caption match is at least
    half the ground truth's on the same clips."""
    return text_alignment >= truth / 2


def score(videos: torch.Tensor, labels) -> dict:
    """All scores of a batch of videos (B, 3, T, H, W) in [-1, 1]."""
    motion = score_videos(videos, labels)
    frames = [to_uint8_frames(v) for v in videos]
    return {"text_alignment": motion["text_alignment"], "color_match": motion["color_ok"],
            "shape_match": motion["shape_ok"], "direction_match": motion["direction_ok"],
            "temporal_consistency": motion["temporal_consistency"], "motion_error": motion["motion_error"],
            "text_alignment_se": motion["text_alignment_se"],
            "temporal_consistency_se": motion["temporal_consistency_se"], "scorer_version": motion["scorer_version"],
            "flickering": float(np.mean([temporal_flickering(f) for f in frames])),
            "frame_consistency": float(np.mean([frame_consistency(f) for f in frames]))}


def upscaled(video: torch.Tensor) -> np.ndarray:
    """uint8 frames (T, f*H, f*W, 3) of a video (3, T, H, W), each pixel repeated f times per axis
    (nearest), with f the smallest integer that makes both sides at least MIN_FRAME_PX."""
    frames = to_uint8_frames(video)  # (T, H, W, 3)
    f = max(1, math.ceil(MIN_FRAME_PX / min(frames.shape[1:3])))
    return frames.repeat(f, axis=1).repeat(f, axis=2)  # (T, f*H, f*W, 3)


def trainset_scores(videos: torch.Tensor, labels) -> dict:
    """score() of clips sampled for training captions, under TRAINSET_KEYS."""
    scores = score(videos, labels)
    return {k: scores[k.removeprefix(TRAINSET)] for k in TRAINSET_KEYS}


def sample_in_batches(trainer: Trainer, captions: list[str], batch: int, seed: int) -> torch.Tensor:
    return torch.cat([trainer.sample(captions[i:i + batch], seed=seed + i) for i in range(0, len(captions), batch)])


def run_name(tag: str, attention: str, seed: int) -> str:
    """The folder of one run under out_dir."""
    return f"{tag}_{attention}_seed{seed}"


def final_checkpoint(job: dict) -> Path:
    """The checkpoint a job's run writes when it finishes (training saves one at its last step)."""
    run_dir = Path(job["out_dir"]) / run_name(job["tag"], job["attention"], job["train"].seed)
    return checkpoint_path(run_dir / "checkpoints", job["train"].steps, sharded=False)


def weights_digest(engine: StepEngine) -> str:
    """sha256 (first 16 hex digits) of the trained weights and the sampling weights (the EMA when kept), by
    name: equal digests mean a run continued from exactly the weights another run ended with."""
    h = hashlib.sha256()
    for state in (engine.model.state_dict(), engine.model_state_dict()):
        for name, tensor in sorted(state.items()):
            h.update(name.encode())
            h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_samples(path: Path, videos: torch.Tensor, captions: list[str], labels: list) -> Path:
    """All sampled clips of a run as uint8 frames (B, T, H, W, 3) with their captions and labels (JSON),
    compressed, so that a later scorer can re-score them (load_samples)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, videos=np.stack([to_uint8_frames(v) for v in videos]), captions=np.array(captions),
                        labels=np.array(json.dumps(labels)))
    return path


def load_samples(path: str | Path) -> tuple[torch.Tensor, list[str], list]:
    """What save_samples wrote: videos (B, 3, T, H, W) in [-1, 1] (as score() takes them), captions, labels."""
    with np.load(path) as f:
        frames = torch.from_numpy(f["videos"])                                   # (B, T, H, W, 3) uint8
        captions, labels = [str(c) for c in f["captions"]], json.loads(str(f["labels"]))
    return frames.permute(0, 4, 1, 2, 3).float() / 127.5 - 1, captions, labels  # (B, 3, T, H, W)


def run_variant(attention: str, model: DiTConfig, data: DataConfig, train: TrainConfig, *, n_eval: int,
                eval_seed: int, sample_batch: int, out_dir: Path, project: str, tag: str,
                save_mp4: bool = True, continue_own: bool = False, n_train_eval: int = 0,
                progress: str = "bar") -> dict:
    """Train `attention` with `train.seed`, sample the eval captions, score; returns one result row.

    A run whose `train.resume` names a checkpoint continues that run (weights, EMA, optimizer
    state, step count) on this clip up to `train.steps` in all: quality.py's progressive
    long-clip runs. The row says what the run started from (`init_from`: the checkpoint,
    relative to out_dir, or "scratch"; `init_step`), its total `steps`, the weights_digest
    at its start and end, and `samples_file`: every sampled clip (save_samples), relative to
    out_dir. `save_mp4=False` skips the mp4 sample (for machines without an ffmpeg binary). `progress`: how
    training shows its progress, labelled with the run (Trainer.fit: "bar", or "lines" in a worker process).

    `continue_own=True` continues a run that an earlier invocation left unfinished (cut by a time
    limit or a crash): when the run's folder holds its own checkpoints, training resumes from the
    newest of them instead of from `train.resume`, and the row says so (`restarted_from`; then
    `init_step`, `init_weights` and `train_s` are those of this invocation). Its metrics.jsonl keeps
    the rows up to that checkpoint. A finished run re-samples and re-scores its final weights
    without training.

    `n_train_eval` > 0 also samples the captions of the first that many training clips and adds their scores
    (TRAINSET_KEYS) beside the held-out ones."""
    model = dataclasses.replace(model, attention=model.attention.for_variant(attention))
    run_dir = out_dir / run_name(tag, attention, train.seed)
    source = Path(train.resume) if train.resume else None
    row = {"variant": attention, "frames": data.frames, "seed": train.seed, "run": run_dir.name,
           "params": count_params(model),
           "steps": train.steps, "init_from": "scratch" if source is None else _relative(source, out_dir)}
    own = own_checkpoint(run_dir, data, train) if continue_own else None   # the run's own newest, checked
    restart = own[1] if own else None      # the step of the run's own newest checkpoint
    if own is not None:
        train = dataclasses.replace(train, resume=str(own[0]))
        row["restarted_from"] = _relative(own[0], out_dir)
    else:   # a fresh run: nothing an earlier run left in its folder may be resumed, re-scored or shown as its own
        clear_run(run_dir, keep=source)
    logger = RunLogger(run_dir, project=project, name=f"{tag}-{attention}-s{train.seed}",
                       config={"model": dataclasses.asdict(model), "data": dataclasses.asdict(data),
                               "train": dataclasses.asdict(train)}, resume_step=restart)
    try:
        trainer = Trainer(model, data, train, run_dir, logger=logger)
        trainer.maybe_resume()
        row.update(init_step=trainer.step, init_weights=weights_digest(trainer.engine))
        t0 = time.perf_counter()
        last = trainer.fit(label=f"{attention} {data.frames}f seed {train.seed}", progress=progress)
        row["train_s"] = time.perf_counter() - t0
        row["final_loss"] = last.get("loss", math.nan)
        row["final_weights"] = weights_digest(trainer.engine)
        captions, labels, truth = eval_set(data, n_eval, eval_seed)
        videos = sample_in_batches(trainer, captions, sample_batch, seed=eval_seed)
        if n_train_eval:
            seen_captions, seen_labels, _ = eval_set(data, n_train_eval, data.seed)
            row.update(trainset_scores(sample_in_batches(trainer, seen_captions, sample_batch, seed=data.seed),
                                       seen_labels))
    except torch.OutOfMemoryError as e:
        logger.finish()
        return {**row, "status": f"OOM: {str(e).splitlines()[0][:120]}"}
    row.update(score(videos, labels), status="ok")
    samples = save_samples(run_dir / "samples" / SAMPLES_FILE, videos, captions, labels)
    row["samples_file"] = _relative(samples, out_dir)
    logger.log({f"eval/{k}": row[k] for k in SCORE_KEYS}, trainer.step)
    if save_mp4:
        mp4 = write_mp4(run_dir / "samples" / VIDEO_FILE, side_by_side([upscaled(truth[0]), upscaled(videos[0])]),
                        min_seconds=MP4_SECONDS)
        logger.log_video("eval/sample", mp4, f"ground truth | sample: {captions[0]}", trainer.step)
        row["mp4"] = str(mp4)
    logger.finish()
    row["samples"] = videos[:4]
    row["captions"] = captions[:4]
    return row


# the training settings a continued run must share with the checkpoint it continues (the rest, e.g. train.device,
# train.ckpt_every or the sampling settings, do not change what was trained)
RUN_SETTINGS = ("batch_size", "lr", "weight_decay", "betas", "grad_clip", "warmup_steps", "ema_decay",
                "caption_dropout", "logit_normal_mean", "logit_normal_std", "seed", "precision")


def own_checkpoint(run_dir: Path, data: DataConfig, train: TrainConfig) -> tuple[Path, int] | None:
    """(path, step) of the newest checkpoint of `run_dir`, which continue_runs=true continues (None: none, the run
    starts fresh), refused (ValueError naming each differing setting, saved vs now, and the fix) unless an earlier
    run of these training and data settings wrote it, at most `train.steps` in: a run of other settings left in
    out_dir (another lr, batch size, clip) would otherwise be continued as this one."""
    own = step_checkpoints(run_dir / "checkpoints")
    if not own:
        return None
    restart = max(own)
    if restart > train.steps:
        raise ValueError(f"{run_dir} holds a checkpoint at step {restart}, past this run's {train.steps} steps: "
                         f"it belongs to another study; use another out_dir")
    path = own[restart]
    state = read_state(path)
    saved = {**{f"train.{k}": v for k, v in state.get("train_cfg", {}).items() if k in RUN_SETTINGS},
             **{f"data.{k}": v for k, v in state.get("data_cfg", {}).items()}}
    now = {**{f"train.{k}": v for k, v in dataclasses.asdict(train).items() if k in RUN_SETTINGS},
           **{f"data.{k}": v for k, v in dataclasses.asdict(data).items()}}
    differ = [f"{k}: {saved.get(k)!r} in the checkpoint vs {now.get(k)!r} now" for k in sorted(set(saved) | set(now))
              if json.dumps(saved.get(k), default=str) != json.dumps(now.get(k), default=str)]
    if differ:
        raise ValueError(f"continue_runs=true: {path} is a checkpoint of a run with other settings ("
                         f"{'; '.join(differ)}); pass continue_runs=false to start the run again, or another out_dir")
    return path, restart


def check_continued(jobs: list[dict]) -> None:
    """own_checkpoint of every job that continues its own run (continue_own), before any job starts or any result
    is written: a checkpoint of another run is refused first, not after the other jobs have trained."""
    for job in jobs:
        if job.get("continue_own"):
            run_dir = Path(job["out_dir"]) / run_name(job["tag"], job["attention"], job["train"].seed)
            own_checkpoint(run_dir, job["data"], job["train"])


def clear_run(run_dir: Path, keep: Path | None = None) -> None:
    """Before a fresh run trains in `run_dir`: delete the training checkpoints and the sample files (save_samples'
    eval.npz, the eval mp4) that an earlier run left there (all but `keep`, the checkpoint this run starts from),
    so that a later continue_runs=true cannot continue another run's checkpoint and a row never points at another
    run's samples. metrics.jsonl is emptied by the run's logger."""
    for path in clear_checkpoints(run_dir / "checkpoints", keep=keep):
        print(f"fresh run: removed {path}, left by an earlier run (continue_runs=true continues a run instead)")
    for name in (SAMPLES_FILE, VIDEO_FILE):
        (run_dir / "samples" / name).unlink(missing_ok=True)


def _relative(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """`workers` spawned processes, each with an equal share of the CPU threads."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                               initargs=(threads,))


def _run_job(job: dict) -> dict:
    """run_variant in a worker process: progress as labelled lines, as the workers share one terminal."""
    return run_variant(**job, progress="lines")


def dependencies(jobs: list[dict]) -> dict[int, int]:
    """job index -> index of the earlier job whose final checkpoint it starts from (its `train.resume`)."""
    writers = {str(final_checkpoint(job)): i for i, job in enumerate(jobs)}
    after = {i: writers[job["train"].resume] for i, job in enumerate(jobs) if job["train"].resume in writers}
    late = [(i, j) for i, j in after.items() if j >= i]
    if late:
        raise ValueError(f"jobs {[i for i, _ in late]} start from the checkpoints of the later jobs "
                         f"{[j for _, j in late]}; list each run after the run it continues")
    return after


def _row_of(job: dict, status: str) -> dict:
    """The row of a job that has no scores."""
    return {"variant": job["attention"], "frames": job["data"].frames, "seed": job["train"].seed,
            "run": run_name(job["tag"], job["attention"], job["train"].seed), "steps": job["train"].steps,
            "status": status}


def run_jobs(jobs: list[dict], workers: int, on_row: Callable[[list[dict]], None] = lambda rows: None,
             outcomes: tuple[type[Exception], ...] = ()) -> list[dict]:
    """run_variant(**job) for every job; result rows in job order.

    A job that continues another job's run (dependencies) starts once that run has finished,
    and is recorded as not run if it did not end "ok". `on_row(rows)` is called after each
    finished job with the rows finished so far (in job order), so a caller can publish partial
    results that survive an interrupted run. A job that raises is recorded as failed and the
    others go on; the first such error is raised once every job has ended. An error of a type in `outcomes` is a
    result instead (a tuning candidate whose loss went non-finite: FloatingPointError): its row's status says
    "diverged" and why, and nothing is raised. workers > 1 runs
    that many jobs at once in spawned processes; each gets an equal share of the CPU threads and prints
    its progress as plain lines labelled with its run (no bars that overwrite each other's line).
    Every job is seeded, so the rows do not depend on `workers`."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (1 runs the jobs one after another in this process)")
    after = dependencies(jobs)
    done: dict[int, dict] = {}
    errors: list[Exception] = []

    def finish(i: int, row: dict) -> None:
        done[i] = row
        on_row([done[k] for k in sorted(done)])

    def attempt(i: int, run: Callable[[], dict]) -> None:
        try:
            row = run()
        except outcomes as err:   # a result of the job, not a failure of the study
            row = _row_of(jobs[i], f"diverged: {str(err)[:200]}")
        except Exception as err:  # recorded, and raised after the other jobs
            errors.append(err)
            row = _row_of(jobs[i], f"failed: {type(err).__name__}: {str(err)[:200]}")
        finish(i, row)

    def blocked(i: int) -> bool:
        """Whether job i continues a run that did not end "ok"; if so it is recorded as not run."""
        if i in after and done[after[i]].get("status") != "ok":
            source = done[after[i]]
            finish(i, _row_of(jobs[i], f"not run: the run it continues ({source['frames']} frames) ended "
                                       f"{source['status']}"))
            return True
        return False

    if workers == 1:
        for i, job in enumerate(jobs):
            if not blocked(i):
                attempt(i, lambda: run_variant(**job))
        return _rows(done, errors)
    with process_pool(workers) as pool:
        running: dict = {}

        def start(i: int) -> None:
            """Submit job i, or record it (and the jobs that continue it) as not run."""
            if not blocked(i):
                running[pool.submit(_run_job, jobs[i])] = i
                return
            for k in (k for k, j in after.items() if j == i):
                start(k)

        for i in range(len(jobs)):
            if i not in after:
                start(i)
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                i = running.pop(future)
                attempt(i, future.result)
                for k in (k for k, j in after.items() if j == i):
                    start(k)
    return _rows(done, errors)


def _rows(done: dict[int, dict], errors: list[Exception]) -> list[dict]:
    if errors:
        raise errors[0]
    return [done[i] for i in sorted(done)]


def publish(experiment: str, name: str, results_dir, config: dict, rows: list[dict], truth: list[dict],
            jobs_total: int, grids: dict[str, int | None]) -> tuple[Path, list[Path]]:
    """Write the result JSON (summary over seeds + per-seed table) and the sample grids; returns
    their paths.

    `rows` may be those of the jobs finished so far (`jobs_done` < `jobs_total` marks a partial result);
    `grids` maps a PNG suffix to the clip length it shows (None: every row); the ground truth
    of that clip length heads each grid. A grid is written once a model's run has samples here. Runs kept from an
    earlier call (continue_runs) have theirs on the machine that ran them: a grid that lacks a finished variant for
    that reason is named after the variants it shows (`<name><suffix>_samples_<variants>.png`), so that it never
    replaces the earlier call's grid of them all."""
    everything = rows + truth
    path = write_result(experiment, name, {"config": config, "jobs_done": len(rows), "jobs_total": jobs_total,
                                           "rows": aggregate(everything),
                                           "tables": {"per seed": strip_samples(everything)}},
                        results_dir=results_dir)
    pngs = []
    for suffix, frames in grids.items():
        runs = [r for r in rows if (frames is None or r["frames"] == frames) and r.get("status") == "ok"]
        finished = [r["variant"] for r in runs]
        sampled = [v for v in dict.fromkeys(finished) if any("samples" in r for r in runs if r["variant"] == v)]
        if not sampled:
            continue
        part = "" if set(sampled) == set(finished) else "_" + "_".join(sampled)
        png = path.with_name(f"{name}{suffix}_samples{part}.png")
        if save_grid(png, [r for r in truth if frames is None or r["frames"] == frames] + runs):
            pngs.append(png)
    return path, pngs


STUDY_COUNTS = {"n_eval": "held-out captions each run samples and scores, e.g. n_eval=32",
                "workers": "runs at once, e.g. workers=1 for one after another",
                "sample_batch": "clips sampled per batch, e.g. sample_batch=32"}


STUDY_LISTS = ("variants", "clip_frames", "clip_batch_sizes", "clip_steps", "swin_window", "lrs",
               "warmups", "swin_windows")   # lists where present


def check_study(cfg) -> None:
    """The study keys of `cfg` (STUDY_COUNTS integers >= 1, STUDY_LISTS lists, not a string read letter by letter,
    max_runs an integer >= 0 where present, results_name a plain file name, seeds a non-empty list of integers,
    each seed and eval_seed / val_seed in [0, 2**63)); a ValueError names the key and the fix.
    A study script calls it with typed_configs, before anything is written."""
    for key in STUDY_LISTS:
        value = cfg.get(key, [])
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ValueError(f"{key}={value!r} must be a list, e.g. {key}=[{value}]")
    for key, meaning in STUDY_COUNTS.items():
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1: {meaning}")
    max_runs = cfg.get("max_runs", 0)
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 0:
        raise ValueError(f"max_runs={max_runs!r} must be an integer >= 0: the runs to start in this call (0: all "
                         f"that are left)")
    n, clips = cfg.n_train_eval, cfg.data.num_videos
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= clips:
        raise ValueError(f"n_train_eval={n!r} must be an integer from 0 (off) to data.num_videos={clips}: training "
                         f"clips each run also samples and scores, e.g. n_train_eval=32")
    check_result_name(cfg.results_name, "results_name")
    for key in ("out_dir", "results_dir"):
        check_writable_folder(cfg[key], key)
    refuse_added_keys(command_line_keys(added=True))
    seeds = cfg.seeds
    if (isinstance(seeds, str) or not isinstance(seeds, Sequence) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        shown = list(seeds) if isinstance(seeds, Sequence) and not isinstance(seeds, str) else seeds
        raise ValueError(f"seeds={shown!r} must be a non-empty list of integers (one run per seed), e.g. "
                         f"seeds=[0] or 'seeds=[0,1,2]'")
    for i, seed in enumerate(seeds):
        require_seed(seed, f"seeds[{i}]")
    for key in ("eval_seed", "val_seed"):   # data seeds of the held-out clips, where the script has them
        seed = cfg.get(key, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{key}={seed!r} must be an integer in [0, 2**63): the data seed of the held-out clips")
        require_seed(seed, key)
    for key in ("seeds", "variants", "clip_frames", "lrs", "warmups", "swin_windows"):
        refuse_repeats(key, cfg.get(key, []))


def refuse_added_keys(keys: list[str]) -> None:
    """A study script reads its config's keys by name, so a key it does not declare would be ignored: refuse
    every added key outside RunConfig's groups (whose typed configs refuse unknown fields themselves)."""
    unknown = [k for k in keys if k.split(".", 1)[0] not in RUN_GROUPS]
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join('+' + k for k in unknown)}: this script has no such key and "
                         f"would ignore it; see its keys in experiments/conf/<script>.yaml (drop the '+' to set one)")


def variant_models(model: DiTConfig, variants, swin_window) -> dict[str, DiTConfig]:
    """variant -> `model` with that attention (swin with `swin_window`)."""
    swin = {"window": tuple(swin_window)}
    return {v: dataclasses.replace(model, attention=model.attention.for_variant(v, **(swin if v == "swin" else {})))
            for v in variants}


def make_job(cfg, attention: str, model: DiTConfig, data: DataConfig, train: TrainConfig, tag: str) -> dict:
    """run_variant's keyword arguments for one (variant, clip, seed) of a study config `cfg`."""
    return dict(attention=attention, model=model, data=data, train=train, n_eval=cfg.n_eval, eval_seed=cfg.eval_seed,
                sample_batch=cfg.sample_batch, out_dir=Path(cfg.out_dir), project=cfg.wandb_project, tag=tag,
                save_mp4=cfg.save_mp4, continue_own=bool(cfg.get("continue_runs", False)),
                n_train_eval=cfg.n_train_eval)


# training settings that do not change what a run trains or how it is scored (where and how often it logs or saves)
BOOKKEEPING = ("device", "log_every", "ckpt_every", "keep_checkpoints", "resume")


# settings added after rows first carried digests -> the value every run before them had: left out of the digest
# at that value, so that the rows of those runs still match (a field added later goes here with its old behaviour)
ADDED_SINCE_DIGESTS = {("model", "attention", "options", "halo_kernel"): "triton"}


def settings_digest(job: dict) -> str:
    """sha256 (first 16 hex digits) of what a job's row depends on: its model, data, training settings (all but
    BOOKKEEPING) and evaluation (n_eval, eval_seed, n_train_eval). Each row carries it (`settings`), so that
    continue_runs=true keeps a result's row only for a run of exactly these settings."""
    train = {k: v for k, v in dataclasses.asdict(job["train"]).items() if k not in BOOKKEEPING}
    what = {"model": dataclasses.asdict(job["model"]), "data": dataclasses.asdict(job["data"]), "train": train,
            **{k: job[k] for k in ("attention", "n_eval", "eval_seed", "n_train_eval")}}
    for (*path, key), old in ADDED_SINCE_DIGESTS.items():
        parent = functools.reduce(lambda node, k: node.get(k) if isinstance(node, dict) else None, path, what)
        if isinstance(parent, dict) and parent.get(key, old) == old:
            parent.pop(key, None)
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def held_runs(path: Path, config: dict, jobs: list[dict], grid: Sequence[str] = (),
              per_run: Sequence[str] = ()) -> dict[str, dict]:
    """Run name -> row of each of `jobs` that the earlier result at `path` finished (ok, or diverged: a tuning
    candidate's outcome) with the job's settings (`settings_digest`), marked with the commit, date and hardware of
    the call that ran it (`ran_in`: a continued result's runs may come from other machines); {} without that
    file. So continue_runs=true keeps what a result JSON holds on a machine where those runs' folders are gone.
    A result of another config is refused (ValueError naming continue_runs and the keys that differ); the
    config lists named in `grid` may add entries to the earlier lists (a list the earlier config lacks counts as
    empty), not drop any; the config keys named in `per_run` may differ, since each row's settings digest holds
    what they set (a study's recipe: its variants' lr, warm-up and Swin window). A row of other run settings
    (another train.lr, say) is not kept: that run trains again. Rows written before rows carried `settings` are
    matched by the config and their run name alone, as they were then."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    ours, theirs = json.loads(json.dumps(config)), earlier.get("config") or {}

    def same(key: str) -> bool:
        now, before = ours.get(key, []), theirs.get(key, [])
        if key in grid and isinstance(now, list) and isinstance(before, list):
            return all(x in now for x in before)
        return key in per_run or ours.get(key) == theirs.get(key)
    differ = sorted(k for k in set(ours) | set(theirs) if not same(k))
    if differ:
        raise ValueError(f"continue_runs=true: {path} holds a run of other settings ({', '.join(differ)}); "
                         f"pass another results_name, or continue_runs=false to start it again")
    origin = {key: earlier.get(key) for key in ("commit", "date", "hardware")}
    digests = dict(zip(job_names(jobs), map(settings_digest, jobs)))
    return {r["run"]: {**r, "ran_in": r.get("ran_in", origin)} for r in earlier["tables"]["per seed"]
            if r.get("run") in digests and r.get("settings", digests[r["run"]]) == digests[r["run"]]
            and (r["status"] == "ok" or r["status"].startswith("diverged"))}


def job_names(jobs: list[dict]) -> list[str]:
    """Each job's run name (its folder under out_dir, the `run` of its row), in job order."""
    return [run_name(job["tag"], job["attention"], job["train"].seed) for job in jobs]


def runs_to_start(jobs: list[dict], kept: dict[str, dict], max_runs: int) -> tuple[list[dict], int]:
    """The jobs whose runs `kept` lacks, in job order, at most `max_runs` of them (0: all), and how many it lacks.
    A job that continues a kept run (progressive clips) needs that run's final checkpoint on this machine: if it is
    gone (a fresh machine), a ValueError says so before anything runs."""
    names = job_names(jobs)
    todo = [job for job, name in zip(jobs, names) if name not in kept]
    finals = {str(final_checkpoint(job)): name for job, name in zip(jobs, names) if name in kept}
    for job in todo:
        source = finals.get(job["train"].resume)
        if source and not Path(job["train"].resume).is_file():
            raise ValueError(f"continue_runs=true: {job_names([job])[0]} continues {source}, which the result holds "
                             f"but whose final checkpoint {job['train'].resume} is not on this machine; a "
                             f"progressive study finishes each run's clips on one machine (continue_runs=false "
                             f"starts it again)")
    return todo[:max_runs or len(todo)], len(todo)


def in_job_order(jobs: list[dict], kept: dict[str, dict], done: list[dict]) -> list[dict]:
    """The kept rows and those of the runs finished now (`done`, each given its job's `settings_digest`), in job
    order."""
    names = job_names(jobs)
    job_of = dict(zip(names, jobs))
    by_name = {**kept, **{r["run"]: {**r, "settings": settings_digest(job_of[r["run"]])} for r in done}}
    return [by_name[n] for n in names if n in by_name]


def run_held(cfg, jobs: list[dict], path: Path, config: dict, publish: Callable[[list[dict]], object],
             grid: Sequence[str] = (), outcomes: tuple[type[Exception], ...] = (),
             per_run: Sequence[str] = ()) -> tuple[list[dict], list]:
    """run_jobs (cfg.workers at once) over the jobs whose runs the result at `path` lacks: with continue_runs=true
    the rows it holds are kept (`held_runs`, with `grid` and `per_run`), and max_runs (0: all) starts only that many
    of the others, in job order, so a study or tuning can be spread over calls and machines (a continue_runs=true that
    finds no result says so, since it then starts every run again). `publish(rows)` gets the
    kept rows and those finished so far, in job order, before the first run and after each. Returns every row in
    job order and what each publish returned."""
    kept = held_runs(path, config, jobs, grid, per_run) if cfg.get("continue_runs", False) else {}
    if cfg.get("continue_runs", False) and not path.exists():
        print(f"continue_runs=true: no result at {path} to continue, so every run starts from its beginning "
              "(pass the results_dir that holds the earlier result to keep its runs)")
    todo, left = runs_to_start(jobs, kept, cfg.get("max_runs", 0))
    check_continued(todo)
    published = [publish(in_job_order(jobs, kept, []))]   # the plan (and kept rows), before the first run finishes
    if kept or len(todo) < left:
        print(f"{len(kept)} of {len(jobs)} runs kept from {path}; {len(todo)} of the {left} left run now")
    done = run_jobs(todo, cfg.workers, on_row=lambda rows: published.append(publish(in_job_order(jobs, kept, rows))),
                    outcomes=outcomes)
    return in_job_order(jobs, kept, done), published


def run_study(experiment: str, cfg, jobs: list[dict], truth: list[dict], config: dict,
              grids: dict[str, int | None], per_run: Sequence[str] = ()) -> None:
    """Run the jobs (cfg.workers at once), publishing the result after each; print the summary
    and where the result, its markdown tables, the sample grids and the sample videos are.
    With continue_runs=true the runs the result JSON already holds are kept, and max_runs starts only that many of
    the others (`run_held`; `per_run`: config keys its rows' settings digests hold)."""
    def save(rows: list[dict]) -> tuple[Path, list[Path]]:
        return publish(experiment, cfg.results_name, cfg.results_dir, config, rows, truth, len(jobs), grids)

    rows, published = run_held(cfg, jobs, result_path(experiment, cfg.results_name, cfg.results_dir), config, save,
                               per_run=per_run)
    path, pngs = published[-1]
    print(summary_table(aggregate(truth + rows)))
    print(f"\nscores (JSON): {path}\ntables (markdown): {render(experiment, Path(cfg.results_dir))}")
    for png in pngs:
        print(f"sample grid, each caption's ground truth first: {png}")
    for r in rows:
        if "mp4" in r:
            print(f"sample video (ground truth | sample), {r['variant']} seed {r['seed']}, {r['frames']} frames: "
                  f"{r['mp4']}")


def summary_table(rows: list[dict]) -> str:
    """The SUMMARY scores of aggregated rows (means over seeds), a plain table under 100 columns; a score no row
    has (e.g. "on train" without n_train_eval) is left out, one some rows lack shows "-" there."""
    def mean(r: dict, key: str) -> float:
        return r.get(f"{key}_mean", math.nan)
    shown = [(h, k) for h, k in SUMMARY if any(not math.isnan(mean(r, k)) for r in rows)]
    header = ["variant", "frames", "seeds", *(h for h, _ in shown)]
    lines = [[r["variant"], str(r["frames"]), str(r["seeds"]),
              *("-" if math.isnan(mean(r, k)) else f"{mean(r, k):.2f}" for _, k in shown)] for r in rows]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))) for line in [header, *lines])


def ground_truth_row(data: DataConfig, n_eval: int, eval_seed: int, n_train_eval: int = 0) -> dict:
    """The scores of the true held-out clips (the ceiling of a model's), and of the first `n_train_eval`
    training clips under TRAINSET_KEYS."""
    captions, labels, videos = eval_set(data, n_eval, eval_seed)
    row = {"variant": "ground_truth", "frames": data.frames, "seed": eval_seed, **score(videos, labels),
           "status": "ok", "samples": videos[:4], "captions": captions[:4]}
    if n_train_eval:
        _, seen_labels, seen = eval_set(data, n_train_eval, data.seed)
        row.update(trainset_scores(seen, seen_labels))
    return row


def aggregate(rows: list[dict], ddof: int = 0) -> list[dict]:
    """Mean and std (with `ddof`; NaN for too few values) over seeds per (variant, frames); a score that
    rows of older results lack is NaN, and the training-clip scores appear only where some row has them."""
    out = []
    for key in dict.fromkeys((r["variant"], r["frames"]) for r in rows):
        group = [r for r in rows if (r["variant"], r["frames"]) == key and r.get("status") == "ok"]
        agg = {"variant": key[0], "frames": key[1], "seeds": len(group)}
        for k in SCORE_KEYS + tuple(k for k in TRAINSET_KEYS if any(k in r for r in rows)):   # scored ones
            vals = [g[k] for g in group if not math.isnan(g.get(k, math.nan))]
            agg[f"{k}_mean"] = float(np.mean(vals)) if vals else math.nan
            agg[f"{k}_std"] = float(np.std(vals, ddof=ddof)) if len(vals) > ddof else math.nan
        if not group:
            agg["status"] = next((r["status"] for r in rows if (r["variant"], r["frames"]) == key), "missing")
        out.append(agg)
    return out


def grid_rows(rows: list[dict], captions: int = GRID_CAPTIONS) -> list[tuple[torch.Tensor, str]]:
    """(video, label) of the sample grid: for each of the first `captions` held-out captions, the ground truth's clip
    and each variant's sample of it (its lowest-seed finished run), in the order of `rows`. Every run samples the
    same captions in the same order, so a caption's clips sit together."""
    first: dict[str, dict] = {}
    for r in rows:
        if r.get("status") == "ok" and "samples" in r and (r["variant"] not in first
                                                           or r["seed"] < first[r["variant"]]["seed"]):
            first[r["variant"]] = r
    return [(r["samples"][i], f"{r['variant']} s{r['seed']}: {r['captions'][i]}")
            for i in range(captions) for r in first.values() if i < len(r["samples"])]


def save_grid(path: Path, rows: list[dict]) -> bool:
    """A PNG of upscaled sample frames, one row per (caption, variant) of grid_rows; False if no row has samples."""
    shown = grid_rows(rows)
    if shown:
        frame_grid_png(path, [upscaled(video) for video, _ in shown], [label for _, label in shown])
    return bool(shown)


def strip_samples(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in MEDIA_KEYS} for r in rows]
