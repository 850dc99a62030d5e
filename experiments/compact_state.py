"""Compact optimizer state of the offload engine against its fp32 state (issue 39): does a run whose host keeps
bf16 master weights (stochastic rounding), 8-bit block-quantised moments, or both, reach the loss of the same run
with fp32 master and moments?

Every (variant, seed) trains the same model on the offload engine (on the CPU its fallback runs the same host
state and CPU AdamW) for train.steps steps; a seed fixes the initial weights and every batch, so the variants of
one seed differ only in their optimizer state. A run's final loss is the mean of its last `tail` step losses; a
variant's is the mean over seeds, compared with the fp32 state's by `verdict` (within `tolerance`, 1%). The
paired differences (same seed) and the fp32 runs' spread over seeds are reported beside it, to judge the
verdict by. Each run records its host bytes per block parameter (HostState.bytes_report).

    python -m experiments.compact_state                          # CPU default: ~10 min on 2 cores
    python -m experiments.compact_state compact_preset=gpu       # one H200 (experiments/conf/compact_preset/gpu.yaml)
    python -m experiments.compact_state smoke=true               # CI: a few steps

JSON: results/compact_state/<results_name>.json (runs, summary, every run's loss curve); W&B offline: the
curves and tables. Configuration: experiments/conf/compact_state.yaml.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.harness import ExperimentRun, progress
from experiments.hydra_config import refuse_repeats, run_config, script_config, script_main
from experiments.quality_protocol import process_pool
from megaslide.config import RunConfig
from megaslide.train.trainer import Trainer

VARIANTS = {"fp32": ("fp32", "fp32"), "bf16_master": ("bf16", "fp32"), "int8_moments": ("fp32", "int8"),
            "both": ("bf16", "int8")}   # variant -> (offload.master_dtype, offload.moments)
BASELINE = "fp32"
SMOKE = {"train": {"steps": 4, "warmup_steps": 1}, "tail": 2, "seeds": [0], "workers": 1,
         "variants": [BASELINE, "both"]}
VERDICT_RULE = ("pass when |mean final loss - fp32's mean final loss| / fp32's <= tolerance; final loss = mean of a "
                "run's last `tail` step losses, means over seeds")


@dataclass(frozen=True)
class CompactStateConfig:
    """The keys of experiments/conf/compact_state.yaml besides the run's groups (documented there)."""

    name: str
    results_name: str
    smoke: bool
    variants: list[str]
    seeds: list[int]
    tail: int
    tolerance: float
    workers: int
    out_dir: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or BASELINE not in self.variants:
            raise ValueError(f"variants={self.variants}: choose among {list(VARIANTS)}, {BASELINE} (the baseline) "
                             f"included")
        if not self.seeds:
            raise ValueError("seeds=[] must list at least one seed, e.g. seeds=[0]")
        refuse_repeats("variants", self.variants)
        refuse_repeats("seeds", self.seeds)
        for key in ("tail", "workers"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance={self.tolerance} must be > 0 (0.01: within 1%)")

    def check_run(self, run: RunConfig) -> None:
        if not run.offload.enabled:
            raise ValueError("offload=none: the study compares the offload engine's optimizer states; use "
                             "offload=engine (the default of this script)")
        if self.tail > run.train.steps:
            raise ValueError(f"tail={self.tail} exceeds train.steps={run.train.steps}; use tail <= train.steps")


def verdict(rel_diff: float, tolerance: float) -> str:
    """VERDICT_RULE: a variant passes when its mean final loss lies within `tolerance` (relative) of fp32's."""
    return "pass" if abs(rel_diff) <= tolerance else "fail"


def train_run(run: RunConfig, variant: str, seed: int, tail: int, out_dir: str) -> dict:
    """One run: `run` with `variant`'s optimizer state and train.seed = `seed`; every step's loss recorded."""
    master_dtype, moments = VARIANTS[variant]
    offload = dataclasses.replace(run.offload, master_dtype=master_dtype, moments=moments)
    train = dataclasses.replace(run.train, seed=seed)
    trainer = Trainer(run.model, run.data, train, Path(out_dir) / f"{variant}_seed{seed}", offload_cfg=offload,
                      execution=run.execution)
    start = time.perf_counter()
    losses = [float(trainer.train_step()["loss"]) for _ in range(train.steps)]
    seconds = time.perf_counter() - start
    host = trainer.engine.host.bytes_report()
    trainer.close()
    return {"variant": variant, "seed": seed, "master_dtype": master_dtype, "moments": moments,
            "final_loss": statistics.fmean(losses[-tail:]), "host_bytes_per_param": host["bytes_per_param_total"],
            "step_s": seconds / train.steps, "losses": losses}


def run_all(run: RunConfig, cfg: CompactStateConfig) -> list[dict]:
    """Every (variant, seed), `cfg.workers` at once (1: one after another in this process); in (variant, seed)
    order."""
    jobs = [(variant, seed) for variant in cfg.variants for seed in cfg.seeds]
    if cfg.workers == 1:
        return [train_run(run, v, s, cfg.tail, cfg.out_dir) for v, s in jobs]
    with process_pool(cfg.workers) as pool:
        futures = {pool.submit(train_run, run, v, s, cfg.tail, cfg.out_dir): (v, s) for v, s in jobs}
        done = {}
        for future in as_completed(futures):
            done[futures[future]] = row = future.result()
            progress(f"{row['variant']} seed {row['seed']}: final loss {row['final_loss']:.5f} "
                     f"({row['step_s'] * 1e3:.0f} ms/step)")
    return [done[job] for job in jobs]


def summarise(rows: list[dict], cfg: CompactStateConfig) -> list[dict]:
    """Per variant: mean and spread of the final loss over seeds, its relative difference to fp32's, the paired
    (same seed) differences, and the verdict."""
    final = {(r["variant"], r["seed"]): r["final_loss"] for r in rows}
    base = statistics.fmean(final[BASELINE, s] for s in cfg.seeds)
    out = []
    for variant in cfg.variants:
        losses = [final[variant, s] for s in cfg.seeds]
        paired = [final[variant, s] / final[BASELINE, s] - 1 for s in cfg.seeds]
        rel = statistics.fmean(losses) / base - 1
        first = next(r for r in rows if r["variant"] == variant)
        out.append({"variant": variant, "master_dtype": first["master_dtype"], "moments": first["moments"],
                    "host_bytes_per_param": first["host_bytes_per_param"], "final_loss": statistics.fmean(losses),
                    "final_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0, "rel_diff": rel,
                    "paired_rel_diff_min": min(paired), "paired_rel_diff_max": max(paired),
                    "verdict": verdict(rel, cfg.tolerance)})
    return out


def print_table(summary: list[dict], cfg: CompactStateConfig) -> None:
    print(f"\ncompact optimizer state vs fp32, {len(cfg.seeds)} seeds, final loss = mean of the last {cfg.tail} steps")
    print(f"{'variant':<14} {'B/param':>8} {'final loss':>11} {'std':>8} {'vs fp32':>8} {'paired':>17} verdict")
    for r in summary:
        paired = f"[{r['paired_rel_diff_min']:+.2%}, {r['paired_rel_diff_max']:+.2%}]"
        print(f"{r['variant']:<14} {r['host_bytes_per_param']:>8.3f} {r['final_loss']:>11.5f} "
              f"{r['final_loss_std']:>8.5f} {r['rel_diff']:>+8.2%} {paired:>17} {r['verdict']}")
    print(f"rule: {VERDICT_RULE} (tolerance {cfg.tolerance:g})")


@script_main("compact_state")
def main(hydra_cfg: DictConfig) -> None:
    if hydra_cfg.smoke:
        hydra_cfg = OmegaConf.merge(hydra_cfg, SMOKE)
    cfg = script_config(CompactStateConfig, hydra_cfg)
    run = run_config(hydra_cfg)
    cfg.check_run(run)
    name = cfg.name or ("smoke" if cfg.smoke else cfg.results_name)
    config = {"study": asdict(cfg), "run": asdict(run), "rule": VERDICT_RULE}
    experiment = ExperimentRun("compact_state", name, config, cfg.wandb_dir, cfg.wandb_project, trial=cfg.smoke)
    rows = run_all(run, dataclasses.replace(cfg, out_dir=str(Path(cfg.out_dir) / name)))
    summary = summarise(rows, cfg)
    curves = {f"{r['variant']}_seed{r['seed']}": r.pop("losses") for r in rows}
    for step in range(run.train.steps):
        experiment.logger.log({f"loss/{key}": losses[step] for key, losses in curves.items()}, step + 1)
    payload = {"rule": VERDICT_RULE, "tolerance": cfg.tolerance, "tail": cfg.tail, "steps": run.train.steps,
               "seeds": list(cfg.seeds), "summary": summary, "runs": rows, "curves": curves}
    path = experiment.finish(payload, {f"rel_diff/{r['variant']}": r["rel_diff"] for r in summary})
    print(f"wrote {path}")
    print_table(summary, cfg)


if __name__ == "__main__":
    main()
