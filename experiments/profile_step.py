"""Where does a training step go? Step time and the top operators per attention variant.

For each variant: build the reference Trainer on MovingShapes, warm up, time `steps` steps
(synchronised; median and spread), then run `torch.profiler` over two more and keep the
operators with the most device time (CPU time on a CPU run; experiments/op_profile.py).
Batches are made inside the step, so the data cost is part of the step time. The DiT comes from
the `model` group; each variant takes from the `attention` group the options it has (with
`attention=swin`, `attention.window` sets Swin's window), else its defaults. A run on a CPU is a trial: its result
goes under runs/profile_step/<name>/results/ unless MEGASLIDE_RESULTS_DIR says where (=results publishes it).
Configuration: experiments/conf/profile_step.yaml.

    python -m experiments.profile_step device=cpu model=tiny frames=4 size=16                # tiny
    python -m experiments.profile_step device=cuda frames=16 size=32 batch=16 name=h200     # GPU
"""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass

from omegaconf import DictConfig

from experiments.harness import ExperimentRun
from experiments.hydra_config import require_ranges, script_config, script_main
from experiments.op_profile import profile_calls, top_operators
from experiments.report import markdown_table
from megaslide.attention import known_attention
from megaslide.config import DataConfig, DiTConfig, OffloadConfig, TrainConfig, validate_training
from megaslide.device import resolve_device
from megaslide.perf.timing import MIN_REPEATS, timed
from megaslide.train.trainer import Trainer


@dataclass(frozen=True)
class ProfileStepConfig:
    """The keys of experiments/conf/profile_step.yaml (their meaning is documented there)."""

    name: str
    variants: list[str]
    device: str
    frames: int
    size: int
    batch: int
    compile: bool
    warmup: int
    steps: int
    top: int
    model: DiTConfig
    model_preset: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        """This script's sizes by their own names, then every variant's training run, before any run is logged."""
        require_ranges(self, positive=("frames", "size", "batch", "top"), non_negative=("warmup",))
        if self.steps < MIN_REPEATS:
            raise ValueError(f"steps={self.steps} must be >= {MIN_REPEATS}: timed steps, for a median and a spread")
        unknown = [v for v in self.variants if v not in known_attention()]
        if not self.variants or unknown:
            raise ValueError(f"variants={self.variants} must name attention variants among {known_attention()}, "
                             f"e.g. variants=[dense,dsa]")
        resolve_device(self.device)
        self.model.token_grid(self.frames, self.size, self.size, keys=("frames", "size", "size"))
        for name in self.variants:
            validate_training(*variant_configs(name, self), OffloadConfig())


def variant_configs(name: str, cfg: ProfileStepConfig) -> tuple[DiTConfig, DataConfig, TrainConfig]:
    """The model, data and training configs of attention variant `name`'s profiled run."""
    model = dataclasses.replace(cfg.model, attention=cfg.model.attention.for_variant(name))
    data = DataConfig(frames=cfg.frames, height=cfg.size, width=cfg.size, shape_size=max(3, cfg.size // 4),
                      speed=cfg.size / 5)
    train = TrainConfig(device=cfg.device, batch_size=cfg.batch, steps=10**9, log_every=10**9, compile=cfg.compile)
    return model, data, train


def profile_variant(name: str, cfg: ProfileStepConfig) -> dict:
    model, data, train = variant_configs(name, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model, data, train, tmp)
        step = timed(trainer.train_step, trainer.device, cfg.steps, warmup=cfg.warmup)
        prof = profile_calls(trainer.train_step, 2, trainer.device)
        ops = top_operators(prof, 2, cfg.top, trainer.device)
    top = [{"variant": name, "op": t["op"], "ms_per_step": t["ms_per_call"], "share": t["share"],
            "calls_per_step": t["calls_per_call"]} for t in ops["top"]]
    t, h, w = model.token_grid(cfg.frames, cfg.size, cfg.size)
    return {"variant": name, "tokens_per_step": cfg.batch * t * h * w, **step.ms("step_ms"),
            **{f"{k.removesuffix('_call')}_step": v for k, v in ops.items() if k != "top"}, "top": top}


@script_main("profile_step")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(ProfileStepConfig, hydra_cfg)
    on_cpu = resolve_device(cfg.device).type == "cpu"   # a trial unless MEGASLIDE_RESULTS_DIR publishes it
    run = ExperimentRun("profile_step", cfg.name, dataclasses.asdict(cfg), cfg.wandb_dir, cfg.wandb_project,
                        trial=on_cpu)
    profiled = [profile_variant(v, cfg) for v in cfg.variants]
    rows = [{k: v for k, v in r.items() if k != "top"} for r in profiled]
    top = [t for r in profiled for t in r["top"]]
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "wandb_dir", "wandb_project")}
    run.finish({"config": {**config, "model": dataclasses.asdict(cfg.model)}, "rows": rows,
                "tables": {"top operators": top}},
               {f"step_ms/{r['variant']}": r["step_ms"] for r in rows})
    print(markdown_table(top))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
