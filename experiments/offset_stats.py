"""What a trained DSA model's offsets look like: how far each block moves its samples, and which halo holds them.

The halo forward (megaslide/attention/dsa/halo.py) pays only on query tiles whose every sample stays inside the
tile's halo; this script measures that share on a trained checkpoint, which decides which fast path pays.

It loads a checkpoint of experiments/train.py (or of a quality study's run, e.g. experiments/ablate_offsets.py:
<out_dir>/<run>/checkpoints/step_N.pt) with its stored configs, takes `clips` held-out clips of the checkpoint's
own data config under another data seed (`data_seed`; a video folder or latent cache has fixed clips, so there
they are training clips; `data_root` replaces its folder), noises them to each flow time of `timesteps`
(x_t = (1 - t) x_0 + t noise, the model given 1000 t), runs the model (the EMA weights when the run kept them,
in fp32) and reads the offsets (B, T, H, W, heads, K, 3) that every DSA block's offset net gives
(`recorded_offsets`). Per block:
- |offset| per axis (t, y, x) in tokens: the `percentiles` (from a histogram of `bins` bins over [0, max_offset],
  each reported as its bin's upper edge: at most max_offset / bins above the exact value), the exact max and mean;
- per tile of `tiles` and reach of `reaches`: the share of query tiles (of every clip, head and timestep) whose
  every sample lies in the tile's halo at that reach, by the halo forward's own rule
  (`reference.halo_paths_reference`, which the kernel's per-tile path is tested against): the tile grown by
  kernel // 2 + reach tokens on each side, moved inside the grid; a sample counts when its clamped position, and
  so its floor and ceil (the trilinear corners), lies inside. A halo at least as long as the grid's axis holds
  every sample along it (the rows' `whole_axes`), and an edge tile's halo, moved inward, holds samples that go
  farther inward; so the share is also given over the inner tiles alone (`inner_tiles`), the one that carries
  over to a large grid.

Result: results/attention/offsets_<name>.json (tables `blocks`, `halo`, `summary`; experiments/report.py renders
results/attention.md).

    python -m experiments.offset_stats checkpoint=runs/train/checkpoints/step_200.pt name=train200
Configuration: experiments/conf/offset_stats.yaml.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun, progress
from experiments.hydra_config import script_config, script_main
from megaslide.attention.dsa.launch import HaloConfig
from megaslide.attention.dsa.module import DSAAttention
from megaslide.attention.dsa.reference import halo_extent, halo_paths_reference
from megaslide.checkpoint import read_state
from megaslide.config import DataConfig, DiTConfig, TrainConfig, from_dict, require_seed
from megaslide.data.build import build_dataset
from megaslide.device import resolve_device
from megaslide.diffusion.batches import make_batch
from megaslide.diffusion.flow import TIME_SCALE, interpolate
from megaslide.inference.weights import sampling_weights
from megaslide.models.dit import VideoDiT

AXES = ("t", "y", "x")


@dataclass(frozen=True)
class OffsetStatsConfig:
    """The keys of experiments/conf/offset_stats.yaml (their meaning is documented there)."""

    name: str
    checkpoint: str
    clips: int
    batch: int
    data_seed: int
    data_root: str
    timesteps: list[float]
    tiles: list[list[int]]
    reaches: list[int]
    percentiles: list[float]
    bins: int
    device: str
    note: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        if self.clips < 1 or self.batch < 1:
            raise ValueError(f"clips={self.clips}, batch={self.batch}: give clips >= 1 and batch >= 1 (clips per "
                             f"forward)")
        require_seed(self.data_seed, "data_seed")   # the data seed of the held-out clips
        if not self.timesteps or not all(0 <= t <= 1 for t in self.timesteps):
            raise ValueError(f"timesteps={self.timesteps}: give flow times in [0, 1] (0 clean, 1 pure noise)")
        if not self.tiles:
            raise ValueError("tiles=[]: give at least one halo-forward tile [t, y, x], e.g. tiles=[[1,4,4]]")
        for tile in self.tiles:
            try:
                HaloConfig(tuple(tile))
            except (ValueError, TypeError) as err:
                raise ValueError(f"tiles={self.tiles}: {err}; e.g. tiles=[[1,4,4],[2,4,4]]") from None
        if not self.reaches or min(self.reaches) < 0:
            raise ValueError(f"reaches={self.reaches}: give halo reaches >= 0 (tokens of offset a halo covers)")
        if not self.percentiles or not all(0 < p <= 100 for p in self.percentiles):
            raise ValueError(f"percentiles={self.percentiles}: give percentiles in (0, 100]")
        if self.bins < 1:
            raise ValueError(f"bins={self.bins} must be >= 1 (histogram bins of |offset| over [0, max_offset])")
        resolve_device(self.device, key="device")
        if not Path(self.checkpoint).exists():
            raise ValueError(f"checkpoint={self.checkpoint!r} does not exist; pass a checkpoint of "
                             f"experiments/train.py (<out_dir>/checkpoints/step_N.pt or step_N/) of a dsa model")


def checkpoint_configs(cfg: OffsetStatsConfig) -> tuple[DiTConfig, DataConfig]:
    """The checkpoint's model config (a `dsa` model, else a ValueError naming it) and its data config with the
    held-out seed; read from its run state alone, before any weights."""
    state = read_state(cfg.checkpoint)
    model = from_dict(DiTConfig, state["model_cfg"])
    if model.attention.name != "dsa":
        raise ValueError(f"checkpoint={cfg.checkpoint!r} holds a model with model.attention.name="
                         f"{model.attention.name!r}; offset_stats reads learned offsets: pass a checkpoint of a "
                         f"model trained with attention=dsa")
    data = from_dict(DataConfig, state["data_cfg"])
    if data.name == "moving_shapes" and data.seed == cfg.data_seed:
        raise ValueError(f"data_seed={cfg.data_seed} is the checkpoint's training data.seed: its clips are "
                         f"training clips; give another data_seed")
    data = dataclasses.replace(data, seed=cfg.data_seed, root=cfg.data_root or data.root)
    try:
        data.validate()
    except ValueError as err:
        raise ValueError(f"the data config of checkpoint={cfg.checkpoint!r} fails here: {err} (data_root=... "
                         f"replaces its data.root)") from None
    return model, data


def dsa_layers(model: VideoDiT) -> list[tuple[int, DSAAttention]]:
    """(block index, attention) of the blocks whose attention learns offsets."""
    return [(i, block.attn) for i, block in enumerate(model.blocks)
            if isinstance(block.attn, DSAAttention) and not block.attn.fixed_zero_offsets]


@contextmanager
def recorded_offsets(model: VideoDiT, record: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Inside the `with`, every DSA block i's offsets (B, T, H, W, heads, K, 3), as its offset net computes them
    for its attention, go to record(i, offsets) too. The blocks must run whole (a chunked block reads its offsets
    in runs of frames and is not recorded)."""
    layers = dsa_layers(model)
    for i, attn in layers:
        def offsets(x, grid, i=i, attn=attn):
            o = DSAAttention.offsets(attn, x, grid)  # (B, T, H, W, heads, K, 3)
            record(i, o)
            return o
        attn.offsets = offsets   # an instance attribute, over the method, for this block only
    try:
        yield
    finally:
        for _, attn in layers:
            del attn.offsets


def inner_tiles(grid: tuple[int, int, int], tile: tuple[int, int, int], kernel_size: tuple[int, int, int],
                reach: int) -> torch.Tensor:
    """(tiles,) bool, row-major over (t, y, x) tile indices as `halo_paths_reference` numbers them: the tiles whose
    halo at `reach` no grid edge moves, along each axis either inside the grid as it is (the tile grown by
    kernel // 2 + reach on each side) or spanning the whole axis. An edge tile's halo is moved inward, so it holds
    samples that go farther inward; a large grid has few edge tiles, so the inner tiles' share is what carries over."""
    axes = []
    for size, step, k, extent in zip(grid, tile, kernel_size, halo_extent(tile, kernel_size, reach)):
        first = torch.arange(0, size, step)  # (tiles along the axis,) first query of each
        unmoved = (first - k // 2 - reach >= 0) & (first + step - 1 + k // 2 + reach <= size - 1)
        axes.append(unmoved | (extent >= size))
    return (axes[0][:, None, None] & axes[1][None, :, None] & axes[2][None, None, :]).flatten()


class BlockStats:
    """Running statistics of one block's offsets: a histogram of |offset| per axis over [0, bound], the max,
    the sum, the count, and per (tile, reach) the query tiles, those whose samples stay in their halo, and the
    same two of the inner tiles (`inner_tiles`)."""

    def __init__(self, bound: float, bins: int, kernel_size: tuple[int, int, int], grid: tuple[int, int, int],
                 tiles: list[tuple[int, int, int]], reaches: list[int]):
        self.bound, self.bins, self.kernel_size, self.grid = bound, bins, kernel_size, grid
        self.tiles, self.reaches = tiles, reaches
        self.hist = torch.zeros(3, bins, dtype=torch.int64)   # (3, bins) per axis (t, y, x)
        self.max = torch.zeros(3, dtype=torch.float64)
        self.sum = torch.zeros(3, dtype=torch.float64)
        self.values = 0                                        # |offset| values per axis
        self.inner = {(tile, r): inner_tiles(grid, tile, kernel_size, r) for tile in tiles for r in reaches}
        # (tile, reach) -> [tiles in the halo, tiles, inner tiles in the halo, inner tiles]
        self.counts = {key: torch.zeros(4, dtype=torch.int64) for key in self.inner}

    def add(self, offsets: torch.Tensor) -> None:
        """offsets (B, T, H, W, heads, K, 3) in tokens."""
        a = offsets.detach().abs().reshape(-1, 3).float()     # (n, 3)
        for axis in range(3):
            self.hist[axis] += torch.histc(a[:, axis], self.bins, 0, self.bound).long().cpu()
        self.max = torch.maximum(self.max, a.amax(dim=0).double().cpu())
        self.sum += a.double().sum(dim=0).cpu()
        self.values += a.shape[0]
        for (tile, r), inner in self.inner.items():
            paths = halo_paths_reference(offsets.detach(), self.kernel_size, r, tile).cpu()  # (B * heads, tiles)
            self.counts[tile, r] += torch.tensor([paths.sum(), paths.numel(), paths[:, inner].sum(),
                                                  paths[:, inner].numel()])

    def merge(self, other: BlockStats) -> BlockStats:
        """Add another block's statistics (of the same settings) to these; returns self."""
        self.hist += other.hist
        self.max = torch.maximum(self.max, other.max)
        self.sum += other.sum
        self.values += other.values
        for key in self.counts:
            self.counts[key] += other.counts[key]
        return self

    def percentile(self, axis: int, q: float) -> float:
        """The upper edge of the bin holding the k-th smallest |offset| along `axis` (k = ceil(q / 100 * n)), or
        the max where that is smaller: at most bound / bins above the k-th smallest value, never below it."""
        k = max(1, math.ceil(q / 100 * self.values))
        b = int(torch.searchsorted(self.hist[axis].cumsum(0), k))
        return min((b + 1) * self.bound / self.bins, float(self.max[axis]))


def percentile_key(q: float) -> str:
    return f"p{q:g}".replace(".", "_")


def block_rows(label, stats: BlockStats, percentiles: list[float]) -> list[dict]:
    """One row per axis: |offset| percentiles, max and mean in tokens."""
    return [{"block": label, "axis": name, **{percentile_key(q): stats.percentile(axis, q) for q in percentiles},
             "max": float(stats.max[axis]), "mean": float(stats.sum[axis]) / max(stats.values, 1)}
            for axis, name in enumerate(AXES)]


def halo_rows(label, stats: BlockStats) -> list[dict]:
    """One row per tile: the query tiles counted (`tiles`: of every clip, head and timestep), the share in the halo
    at each reach (`in_pm<r>`), the same of the inner tiles (`inner_pm<r>`; None where there are none) and their
    number per reach (`inner_tiles`), and the axes along which each reach's halo spans the grid (`whole_axes`,
    e.g. "1:t 4:tyx"; "-": none)."""
    rows = []
    for tile in stats.tiles:
        counts = {r: stats.counts[tile, r].tolist() for r in stats.reaches}  # [in halo, tiles, inner in, inner]
        whole = [f"{r}:" + "".join(a for a, e, s in zip(AXES, halo_extent(tile, stats.kernel_size, r), stats.grid)
                                   if e >= s) for r in stats.reaches]
        rows.append({"block": label, "tile": list(tile), "tiles": counts[stats.reaches[0]][1],
                     **{f"in_pm{r}": c[0] / max(c[1], 1) for r, c in counts.items()},
                     **{f"inner_pm{r}": c[2] / c[3] if c[3] else None for r, c in counts.items()},
                     "inner_tiles": [c[3] for c in counts.values()],
                     "whole_axes": " ".join(w for w in whole if not w.endswith(":")) or "-"})
    return rows


@torch.no_grad()
def measure(cfg: OffsetStatsConfig, model_cfg: DiTConfig, data_cfg: DataConfig) -> tuple[list[BlockStats], dict]:
    """Every DSA block's statistics over the held-out clips at every timestep, and what was measured."""
    device = resolve_device(cfg.device, key="device")
    dataset = build_dataset(data_cfg, in_channels=model_cfg.in_channels)
    weights, state = sampling_weights(cfg.checkpoint)
    model = VideoDiT(model_cfg)
    model.load_state_dict(weights)
    model.to(device).eval()
    options = model_cfg.attention.options
    grid = model_cfg.token_grid(data_cfg.frames, data_cfg.height, data_cfg.width)
    tiles = [tuple(t) for t in cfg.tiles]
    stats = {i: BlockStats(options.max_offset or 1.0, cfg.bins, options.kernel_size, grid, tiles, cfg.reaches)
             for i, _ in dsa_layers(model)}
    batch = make_batch(dataset, model.tokenizer, TrainConfig(batch_size=cfg.clips, seed=cfg.data_seed,
                                                             caption_dropout=0.0), step=0)
    with recorded_offsets(model, lambda i, o: stats[i].add(o)):
        for t in cfg.timesteps:
            for rows in range(0, cfg.clips, cfg.batch):
                part = slice(rows, rows + cfg.batch)
                x0, noise = batch.x0[part].to(device), batch.noise[part].to(device)
                time = torch.full((x0.shape[0],), float(t), device=device)   # (b,)
                mask = None if batch.mask is None else batch.mask[part].to(device)
                model(interpolate(x0, noise, time), time * TIME_SCALE, batch.context[part].to(device), mask)
            progress(f"t={t:g}: {cfg.clips} clips")
    setup = {"step": state["step"], "weights": "ema" if state.get("ema") else "trained", "grid": list(grid),
             "heads": model_cfg.num_heads, "depth": model_cfg.depth, "dim": model_cfg.dim,
             "kernel_size": list(options.kernel_size), "max_offset": options.max_offset,
             "data": {**asdict(data_cfg), "held_out": data_cfg.name == "moving_shapes"},
             "timesteps": list(cfg.timesteps), "device": str(device)}
    return [stats[i] for i in sorted(stats)], setup


def result_name(cfg: OffsetStatsConfig) -> str:
    """offsets_<name>; name "" = the checkpoint's run folder and step (runs/x/checkpoints/step_N.pt -> x_step_N)."""
    path = Path(cfg.checkpoint).resolve()
    return f"offsets_{cfg.name or path.parent.parent.name + '_' + path.name.removesuffix('.pt')}"


def offset_stats(cfg: OffsetStatsConfig) -> Path:
    model_cfg, data_cfg = checkpoint_configs(cfg)
    name = result_name(cfg)
    run = ExperimentRun("attention", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project)
    stats, setup = measure(cfg, model_cfg, data_cfg)
    total = functools.reduce(BlockStats.merge, stats[1:], copy.deepcopy(stats[0]))   # all blocks
    blocks, halo = [], []
    for label, s in [*enumerate(stats), ("all", total)]:
        blocks += block_rows(label, s, cfg.percentiles)
        halo += halo_rows(label, s)
    top = percentile_key(max(cfg.percentiles))
    spread = {f"{row['axis']}_{key}": row[key] for row in block_rows("all", total, cfg.percentiles)
              for key in (top, "max")}
    summary = [{**row, **spread} for row in halo_rows("all", total)]   # one row per tile, all blocks
    payload = {"note": cfg.note, "checkpoint": cfg.checkpoint, **setup,
               "tables": {"blocks": blocks, "halo": halo, "summary": summary}}
    scalars = {f"{share}{r}_{'x'.join(map(str, row['tile']))}": row[f"{share}{r}"] for row in summary
               for r in cfg.reaches for share in ("in_pm", "inner_pm")}
    path = run.finish(payload, scalars)
    for row in summary:
        progress(f"tile {row['tile']}: in the halo at " + ", ".join(
            f"+-{r}: {row[f'in_pm{r}']:.3f} (inner {row[f'inner_pm{r}']})" for r in cfg.reaches))
    print(f"wrote {path}")
    return path


@script_main("offset_stats")
def main(hydra_cfg: DictConfig) -> None:
    offset_stats(script_config(OffsetStatsConfig, hydra_cfg))


if __name__ == "__main__":
    main()
