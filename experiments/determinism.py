"""What train.deterministic costs, and whether it makes two runs of one seed the same bits.

Per attention variant, on the quality study's model and short clip (experiments/conf/determinism.yaml), and per
train.deterministic in (false, true): `repeats` runs from the same seed, each `warmup` untimed training steps and
then `steps` timed ones (the device synchronised around each). Each (variant, setting) runs in a fresh process,
since the mode's cuBLAS workspace is read once per process (megaslide/train/determinism.py) and a plain row must
not run with it; the runs of a row share their process (across processes, the quality study's recorded weights
repeat bit for bit where nothing varies within one: docs/quality_study.md, "Repeatability"). A row: the median step
time and its spread over the timed steps of all its runs, whether the runs' losses (every step) and final weights
are the same bits, the largest loss difference between them, and for the deterministic row `cost`, its median step
time over the plain row's. A run that fails (an op without a deterministic implementation raises under the flag) is
the row's status. A run on a CPU is a trial: its result goes under runs/determinism/<name>/results/ unless
MEGASLIDE_RESULTS_DIR says where.

    python -m experiments.determinism name=h200                     # GPU: the quality study's 16-frame clip
    python -m experiments.determinism train.device=cpu model=tiny data.frames=3 data.height=8 data.width=8 \\
        data.shape_size=3 train.batch_size=1 variants=[dsa] steps=5   # tiny, CPU
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from omegaconf import DictConfig

from experiments.harness import ExperimentRun
from experiments.hydra_config import script_config, script_main, typed_configs
from experiments.quality_protocol import weights_digest
from experiments.report import markdown_table
from megaslide.config import DataConfig, DiTConfig, TrainConfig
from megaslide.device import resolve_device
from megaslide.perf.timing import MIN_REPEATS, Timing, timed
from megaslide.train.trainer import Trainer


@dataclass(frozen=True)
class DeterminismConfig:
    """The keys of experiments/conf/determinism.yaml (their meaning is documented there)."""

    name: str
    variants: list[str]
    warmup: int
    steps: int
    repeats: int
    swin_window: tuple[int, int, int]
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        if self.steps < MIN_REPEATS:
            raise ValueError(f"steps={self.steps} must be >= {MIN_REPEATS}: timed steps per run (median and spread)")
        if self.warmup < 1:
            raise ValueError(f"warmup={self.warmup} must be >= 1: untimed steps per run (Triton compiles there)")
        if self.repeats < 2:
            raise ValueError(f"repeats={self.repeats} must be >= 2: runs per row whose losses are compared")
        if not self.variants:
            raise ValueError("variants=[] names no attention variant; e.g. variants=[dense,dsa]")


def train_runs(model: DiTConfig, data: DataConfig, train: TrainConfig, warmup: int, steps: int,
               repeats: int) -> dict:
    """`repeats` runs of `warmup` + `steps` training steps from train.seed in this process: each run's losses
    (every step), timed step seconds and weights digest; a failure is the status."""
    runs = []
    try:
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                trainer = Trainer(model, data, train, tmp)
                try:
                    losses = []
                    timing = timed(lambda: losses.append(trainer.train_step()["loss"]), trainer.device, steps,
                                   warmup=warmup)
                    runs.append({"losses": [float(x) for x in losses], "times": timing.times,
                                 "weights": weights_digest(trainer.engine)})
                finally:
                    trainer.close()
    except Exception as err:  # recorded as the row's status: the other rows still run
        return {"runs": runs, "status": f"failed: {type(err).__name__}: {str(err)[:300]}"}
    return {"runs": runs, "status": "ok"}


def in_fresh_process(fn, *args):
    """fn(*args) in a spawned process of its own, which ends with it."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def row_of(variant: str, deterministic: bool, measured: dict) -> dict:
    """A result row from `train_runs`' runs: step time over all timed steps, and whether the runs agree."""
    row = {"variant": variant, "deterministic": deterministic, "status": measured["status"]}
    runs = measured["runs"]
    if measured["status"] != "ok":
        return row
    first = runs[0]["losses"]
    diffs = [abs(a - b) for run in runs[1:] for a, b in zip(run["losses"], first)]
    return {**row, **Timing(tuple(t for run in runs for t in run["times"])).ms("step_ms"),
            "runs": len(runs), "same_losses": all(run["losses"] == first for run in runs),
            "same_weights": len({run["weights"] for run in runs}) == 1, "max_loss_diff": max(diffs),
            "final_loss": first[-1]}


@script_main("determinism")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(DeterminismConfig, hydra_cfg)
    model, data, train, _ = typed_configs(hydra_cfg)
    swin = {"window": tuple(cfg.swin_window)}
    models = {v: dataclasses.replace(model, attention=model.attention.for_variant(v, **(swin if v == "swin" else {})))
              for v in cfg.variants}
    grid = model.token_grid(data.frames, data.height, data.width)
    for m in models.values():            # every variant checked before anything runs
        m.attention.validate(grid)
    config = {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("wandb_dir", "wandb_project")},
              "model": dataclasses.asdict(model), "data": dataclasses.asdict(data), "train": dataclasses.asdict(train)}
    on_cpu = resolve_device(train.device, key="train.device").type == "cpu"   # a trial: the question is the GPU's
    run = ExperimentRun("determinism", cfg.name, config, cfg.wandb_dir, cfg.wandb_project, trial=on_cpu)
    rows = []
    for variant in cfg.variants:
        for deterministic in (False, True):
            settings = dataclasses.replace(train, deterministic=deterministic)
            measured = in_fresh_process(train_runs, models[variant], data, settings, cfg.warmup, cfg.steps,
                                        cfg.repeats)
            rows.append(row_of(variant, deterministic, measured))
            plain = rows[-2] if deterministic else None
            if plain and plain["status"] == rows[-1]["status"] == "ok":
                rows[-1]["cost"] = rows[-1]["step_ms"] / plain["step_ms"]
            run.save({"config": config, "rows": rows})
    path = run.finish({"config": config, "rows": rows},
                      {f"cost/{r['variant']}": r["cost"] for r in rows if "cost" in r})
    print(markdown_table(rows))
    print(f"\nresult (JSON): {path}")


if __name__ == "__main__":
    main()
