"""Train a video DiT. Default: the tiny model on MovingShapes, on CPU, in a few minutes.

    python experiments/train.py                                   # tiny, dense attention
    python experiments/train.py attention=swin data=moving_shapes_fast train.steps=500
    python experiments/train.py model=1B model.in_channels=3 offload=engine train.device=cuda \
        data=video_folder data.root=/data/clips                   # MegaSlide-DiT engine on RGB clips

Data parallel on P processes (gloo with train.device=cpu, NCCL with cuda; README "Train on several GPUs"):

    torchrun --nproc-per-node=2 experiments/train.py parallel.dp=2 train.device=cpu

Writes <out_dir>/checkpoints/ (step_N.pt; the offload engine writes step_N/ folders, each rank its shards),
<out_dir>/samples/*.mp4 (looped to at least video_io.MP4_SECONDS), <out_dir>/metrics.jsonl (rank 0, the global
batch's loss) and an offline W&B run under <out_dir>/wandb (upload with `wandb sync`). The whole config is checked
first (run_config, then the Trainer: resume checkpoint, data folder, planner): a refused
config leaves no folder and no W&B run behind. `python -m experiments.plan` with the same overrides
predicts this run's memory and step time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.hydra_config import RUN_GROUPS, run_config, script_main
from experiments.results_io import check_writable_folder
from megaslide.config import from_dict
from megaslide.data.video_io import MP4_SECONDS, write_mp4
from megaslide.train.logger import RunLogger
from megaslide.train.trainer import Trainer


@dataclass
class ScriptConfig:
    """train.yaml's own keys (beside the groups of the RunConfig, hydra_config.RUN_GROUPS)."""

    name: str
    out_dir: str
    wandb_project: str
    sample_captions: list[str]   # sampled into <out_dir>/samples after training; [] samples nothing


def save_samples(trainer, captions: list[str], out_dir: Path, logger: RunLogger | None) -> list[Path]:
    """Sample the captions (every rank: the offload engine's sampling is collective) and write them (rank 0, which
    alone has a logger), each mp4 looped to at least MP4_SECONDS."""
    if not captions:
        return []
    videos = trainer.sample(captions)  # (B, C, T, H, W) in [-1, 1]
    if logger is None:
        return []
    paths = []
    for i, (video, caption) in enumerate(zip(videos, captions)):
        paths.append(write_mp4(out_dir / "samples" / f"step{trainer.step}_{i}.mp4", video, min_seconds=MP4_SECONDS))
        logger.log_video(f"sample/{i}", paths[-1], caption, trainer.step)
    return paths


@script_main("train")
def main(cfg: DictConfig) -> None:
    run = run_config(cfg)
    script = from_dict(ScriptConfig, {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items()
                                      if k not in RUN_GROUPS})
    if run.data.name == "latent_cache" and script.sample_captions:
        raise ValueError("sample_captions: a run on a latent cache has no text encoder to turn words into "
                         "embeddings, nor a VAE to decode with; set sample_captions=[] and sample with "
                         "python -m experiments.sample (prompt embeddings from experiments/precompute.py, vae=...)")
    check_writable_folder(script.out_dir, "out_dir")
    trainer = Trainer(run.model, run.data, run.train, script.out_dir, offload_cfg=run.offload,
                      execution=run.execution, parallel=run.parallel)
    out_dir = Path(script.out_dir)               # the first write: every check above has passed
    config = {**dataclasses.asdict(run), **dataclasses.asdict(script),
              "execution": dataclasses.asdict(trainer.execution)}   # as run: slab_frames=auto resolved
    if trainer.dp.is_main:                       # rank 0 writes metrics.jsonl and the W&B run
        trainer.logger = RunLogger(out_dir, project=script.wandb_project, name=script.name, config=config,
                                   resume_step=trainer.resume_from[1] if trainer.resume_from else None)
    try:
        last = trainer.fit()
    except FloatingPointError:  # a non-finite step: the run stops after its last good checkpoint (exit status 3)
        if trainer.logger:
            trainer.logger.finish()
        trainer.close()
        raise
    samples = save_samples(trainer, script.sample_captions, out_dir, trainer.logger)
    if not trainer.logger:
        trainer.close()
        return
    print(f"trained {trainer.step} steps, final loss {last.get('loss', float('nan')):.4f}")
    print(f"checkpoints: {out_dir / 'checkpoints'}")
    print(f"samples:    {', '.join(str(p) for p in samples) or 'none (sample_captions=[])'}")
    if trainer.logger.wandb_dir:
        print(f"W&B run:    {trainer.logger.wandb_dir}  (upload: wandb sync {trainer.logger.wandb_dir})")
    trainer.logger.finish()
    trainer.close()


if __name__ == "__main__":
    main()
