"""Offsets ablation (paper claim C8): DSA with learned offsets vs offsets fixed at zero.

Both variants have the same parameters, steps and data: fast-motion MovingShapes, where a
shape moves further per frame than a zero-offset 3x3x3 neighbourhood reaches. Each is
trained, sampled on held-out captions and scored (experiments/quality_protocol.py).

    python experiments/ablate_offsets.py                                 # the main job: CPU, 2 cores
    python experiments/ablate_offsets.py model=quality_gpu train.device=cuda data.height=16 data.width=16 \
        data.shape_size=6 data.speed=3 data.frames=16 data.num_videos=512 train.lr=1e-3 train.batch_size=8 \
        train.ema_decay=0.995 train.steps=1500 n_eval=32 "seeds=[0,1,2]" results_dir=results results_name=h200

The CPU default shows both models learning colour, and shape in part; the GPU scale tests the claim.
"""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from experiments.hydra_config import script_main, typed_configs
from experiments.quality_protocol import check_study, ground_truth_row, make_job, run_study


@script_main("ablate_offsets")
def main(cfg: DictConfig) -> None:
    model, data, train, _ = typed_configs(cfg)
    check_study(cfg)
    for name in cfg.variants:
        model.attention.name = name
        model.validate()
        model.attention.validate(model.token_grid(data.frames, data.height, data.width))
    jobs = [make_job(cfg, variant, model, data, dataclasses.replace(train, seed=int(seed)), cfg.name)
            for seed in cfg.seeds for variant in cfg.variants]
    config = {"speed_px_per_frame": data.speed, "frames": data.frames, "size": [data.height, data.width],
              "patch": list(model.patch_size), "kernel_size": list(model.attention.options.kernel_size),
              "max_offset": model.attention.options.max_offset, "steps": train.steps, "seeds": list(cfg.seeds)}
    truth = ground_truth_row(data, cfg.n_eval, cfg.eval_seed, cfg.n_train_eval)
    run_study("ablate_offsets", cfg, jobs, [truth], config, {"": None})


if __name__ == "__main__":
    main()
