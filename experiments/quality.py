"""Quality study (paper claims C6-C8): dense, Swin, DSA and DSA-zero at a short and a long clip.

Same protocol as ablate_offsets.py (experiments/quality_protocol.py), several seeds, mean
and spread. A variant that runs out of memory is recorded as OOM, not dropped.

    python experiments/quality.py                                        # tiny, CPU
    python experiments/quality.py train.device=cuda train.steps=2000 clip_frames=[16,64] \
        results_dir=results results_name=h200
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import hydra
from omegaconf import DictConfig

from experiments.hydra_config import typed_configs
from experiments.quality_protocol import aggregate, ground_truth_row, publish, run_jobs
from experiments.report import markdown_table


@hydra.main(version_base="1.3", config_path="conf", config_name="quality")
def main(cfg: DictConfig) -> None:
    model, data, train, _ = typed_configs(cfg)
    model.attention.window = tuple(cfg.swin_window)
    clips = [dataclasses.replace(data, frames=int(f)) for f in cfg.clip_frames]
    batches = [int(b) for b in cfg.clip_batch_sizes] or [train.batch_size] * len(clips)
    if len(batches) != len(clips):
        raise ValueError(f"clip_batch_sizes={list(cfg.clip_batch_sizes)} needs one batch size per entry of "
                         f"clip_frames={list(cfg.clip_frames)}, or [] to use train.batch_size for every clip")
    for clip in clips:                       # every (variant, clip) is validated before training starts
        grid = model.token_grid(clip.frames, clip.height, clip.width)
        for name in cfg.variants:
            dataclasses.replace(model.attention, name=name).validate(grid)
    out_dir = Path(cfg.out_dir)
    jobs = [dict(attention=variant, model=model, data=clip,
                 train=dataclasses.replace(train, seed=int(seed), batch_size=batch),
                 n_eval=cfg.n_eval, eval_seed=cfg.eval_seed, sample_batch=cfg.sample_batch, out_dir=out_dir,
                 project=cfg.wandb_project, tag=f"{cfg.name}{clip.frames}f", save_mp4=cfg.save_mp4)
            for seed in cfg.seeds for clip, batch in zip(clips, batches) for variant in cfg.variants]
    truth = [ground_truth_row(clip, cfg.n_eval, cfg.eval_seed) for clip in clips]
    config = {"clip_frames": list(cfg.clip_frames), "speed_px_per_frame": data.speed,
              "size": [data.height, data.width], "swin_window": list(cfg.swin_window), "steps": train.steps,
              "seeds": list(cfg.seeds), "batch_sizes": batches}

    def save(rows: list[dict]) -> Path:
        return publish("quality", cfg.results_name, cfg.results_dir, config, rows, truth, len(jobs),
                       {f"_{clip.frames}f": clip.frames for clip in clips})

    rows = run_jobs(jobs, cfg.workers, on_row=save)
    path = save(rows)
    print(markdown_table(aggregate(rows + truth)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
