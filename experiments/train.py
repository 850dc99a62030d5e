"""Train a video DiT. Default: the tiny model on MovingShapes, on CPU, in a few minutes.

    python experiments/train.py                                   # tiny, dense attention
    python experiments/train.py attention=swin data=moving_shapes_fast train.steps=500
    python experiments/train.py model=1B offload=engine train.device=cuda   # MegaSlide-DiT engine

Writes <out_dir>/checkpoints/ (step_N.pt; the offload engine writes step_N/ folders),
<out_dir>/samples/*.mp4, <out_dir>/metrics.jsonl and
an offline W&B run under <out_dir>/wandb (upload with `wandb sync`).
"""
from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.hydra_config import typed_configs
from megaslide.data.video_io import write_mp4
from megaslide.train.logger import RunLogger
from megaslide.train.trainer import Trainer


def build_trainer(cfg: DictConfig, logger: RunLogger | None):
    model_cfg, data_cfg, train_cfg, offload_cfg = typed_configs(cfg)
    return Trainer(model_cfg, data_cfg, train_cfg, cfg.out_dir, logger=logger, offload_cfg=offload_cfg)


def save_samples(trainer, captions: list[str], out_dir: Path, logger: RunLogger) -> list[Path]:
    videos = trainer.sample(captions)  # (B, C, T, H, W) in [-1, 1]
    paths = []
    for i, (video, caption) in enumerate(zip(videos, captions)):
        paths.append(write_mp4(out_dir / "samples" / f"step{trainer.step}_{i}.mp4", video))
        logger.log_video(f"sample/{i}", paths[-1], caption, trainer.step)
    return paths


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    out_dir = Path(cfg.out_dir)
    typed_configs(cfg)  # validate the whole config before any allocation or logging
    logger = RunLogger(out_dir, project=cfg.wandb_project, name=cfg.name,
                       config=OmegaConf.to_container(cfg, resolve=True))
    trainer = build_trainer(cfg, logger)
    last = trainer.fit()
    samples = save_samples(trainer, list(cfg.sample_captions), out_dir, logger)
    print(f"trained {trainer.step} steps, final loss {last.get('loss', float('nan')):.4f}")
    print(f"checkpoints: {out_dir / 'checkpoints'}")
    print(f"samples:    {', '.join(str(p) for p in samples)}")
    if logger.wandb_dir:
        print(f"W&B run:    {logger.wandb_dir}  (upload: wandb sync {logger.wandb_dir})")
    logger.finish()


if __name__ == "__main__":
    main()
