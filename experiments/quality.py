"""Quality study (paper claims C6-C8): dense, Swin, DSA and DSA-zero at a short and a long clip.

Same protocol as ablate_offsets.py (experiments/quality_protocol.py), several seeds, mean
and spread. A variant that runs out of memory is recorded as OOM, not dropped.

    python experiments/quality.py                                        # tiny, CPU
    python experiments/quality.py train.device=cuda train.steps=2000 clip_frames=[16,64] \
        results_dir=results results_name=h200
"""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from experiments.hydra_config import script_main, typed_configs
from experiments.quality_protocol import check_study, ground_truth_row, make_job, run_study


@script_main("quality")
def main(cfg: DictConfig) -> None:
    model, data, train, _ = typed_configs(cfg)
    check_study(cfg)
    swin = {"window": tuple(cfg.swin_window)}
    models = {v: dataclasses.replace(model, attention=model.attention.for_variant(v, **(swin if v == "swin" else {})))
              for v in cfg.variants}
    clips = [dataclasses.replace(data, frames=int(f)) for f in cfg.clip_frames]
    batches = [int(b) for b in cfg.clip_batch_sizes] or [train.batch_size] * len(clips)
    if len(batches) != len(clips):
        raise ValueError(f"clip_batch_sizes={list(cfg.clip_batch_sizes)} needs one batch size per entry of "
                         f"clip_frames={list(cfg.clip_frames)}, or [] to use train.batch_size for every clip")
    for clip in clips:                       # every (variant, clip) is validated before training starts
        grid = model.token_grid(clip.frames, clip.height, clip.width)
        for name in cfg.variants:
            models[name].attention.validate(grid)
    jobs = [make_job(cfg, variant, models[variant], clip,
                     dataclasses.replace(train, seed=int(seed), batch_size=batch), f"{cfg.name}{clip.frames}f")
            for seed in cfg.seeds for clip, batch in zip(clips, batches) for variant in cfg.variants]
    config = {"clip_frames": list(cfg.clip_frames), "speed_px_per_frame": data.speed,
              "size": [data.height, data.width], "swin_window": list(cfg.swin_window), "steps": train.steps,
              "seeds": list(cfg.seeds), "batch_sizes": batches}
    run_study("quality", cfg, jobs, [ground_truth_row(clip, cfg.n_eval, cfg.eval_seed) for clip in clips], config,
              {f"_{clip.frames}f": clip.frames for clip in clips})


if __name__ == "__main__":
    main()
