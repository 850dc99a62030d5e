"""experiments/offset_stats.py on tiny dsa checkpoints written here: zero offsets stay in every halo; known injected
offsets give the percentiles, max and halo shares of a direct numpy computation; bad input is refused by key."""
import dataclasses
import json
import math
import sys

import numpy as np
import pytest
import torch

import experiments.offset_stats as offset_stats
from megaslide.attention.dsa.module import DSAAttention
from megaslide.checkpoint import save_checkpoint
from megaslide.config import DataConfig
from megaslide.models.dit import build_dit
from tests.helpers import tiny_data_cfg, tiny_model_cfg

DATA = tiny_data_cfg(height=32, width=32)      # 4 x 16 x 16 tokens at the tiny preset's 1 x 2 x 2 patches
KERNEL = (3, 3, 3)
BOUND = 3.0                                    # the tiny dsa model's max_offset


def write_checkpoint(path, attention: str = "dsa", data: DataConfig = DATA):
    """A step_0.pt of a freshly initialised tiny model (dsa: offset nets at zero) in the Trainer's format."""
    model_cfg = tiny_model_cfg(attention, **({"max_offset": BOUND} if attention == "dsa" else {}))
    state = {"step": 0, "model_cfg": dataclasses.asdict(model_cfg), "data_cfg": dataclasses.asdict(data),
             "model": build_dit(model_cfg).state_dict()}
    return save_checkpoint(path, state)


def config(checkpoint, tmp_path, **kw) -> offset_stats.OffsetStatsConfig:
    fields = dict(name="t", checkpoint=str(checkpoint), clips=3, batch=2, data_seed=7, data_root="",
                  timesteps=[0.3, 0.9], tiles=[[1, 4, 4], [2, 4, 4]], reaches=[0, 1, 2], percentiles=[50, 90, 99.9],
                  bins=3000, device="cpu", note="", wandb_dir=str(tmp_path / "runs"), wandb_project="p")
    return offset_stats.OffsetStatsConfig(**{**fields, **kw})


def run(cfg, tmp_path, monkeypatch) -> dict:
    monkeypatch.setenv("MEGASLIDE_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg.validate()
    return json.loads(offset_stats.offset_stats(cfg).read_text())


def test_zero_offsets_stay_in_every_halo(tmp_path, monkeypatch):
    result = run(config(write_checkpoint(tmp_path / "step_0.pt"), tmp_path), tmp_path, monkeypatch)
    blocks, halo = result["tables"]["blocks"], result["tables"]["halo"]
    assert result["grid"] == [4, 16, 16] and result["step"] == 0
    assert {r["block"] for r in blocks} == {0, 1, "all"} and len(blocks) == 9
    assert all(r[k] == 0 for r in blocks for k in ("p50", "p90", "p99_9", "max", "mean"))
    assert all(r[f"{kind}{reach}"] == 1 for r in halo for reach in (0, 1, 2) for kind in ("in_pm", "inner_pm"))
    # every (clip, head, tile) of each timestep: 3 clips x 4 heads x 4 x 4 x 4 tiles of 1 x 4 x 4, x 2 timesteps
    assert halo[0]["tile"] == [1, 4, 4] and halo[0]["tiles"] == 2 * 3 * 4 * 64


def halo_shares_numpy(offsets: np.ndarray, tile, reach: int) -> tuple[int, int, int, int]:
    """(tiles whose every sample lies in the halo, tiles, the same two of the tiles whose halo is not moved by a
    grid edge or spans the axis) of offsets (B, T, H, W, heads, K, 3), written out plainly:
    along an axis of size S a query i's window starts at clip(i - k // 2, 0, S - k), its sample j sits at
    start + j + offset clipped to [0, S - 1]; a tile starting at a has the halo [o, o + E - 1] with
    E = tile + 2 (k // 2) + 2 reach, o = max(0, min(a - k // 2 - reach, S - E))."""
    B, T, H, W, heads = offsets.shape[:5]
    inside = np.ones(offsets.shape[:6], dtype=bool)                     # (B, T, H, W, heads, K)
    inner = []                                                          # per axis: (S,) query's tile is inner
    window = np.stack(np.meshgrid(*(np.arange(k) for k in KERNEL), indexing="ij"), -1).reshape(-1, 3)  # (K, 3)
    for axis, (size, step, k) in enumerate(zip((T, H, W), tile, KERNEL)):
        extent = step + 2 * (k // 2) + 2 * reach
        i = np.arange(size)
        start = np.clip(i - k // 2, 0, size - k)
        origin = np.maximum(0, np.minimum(i // step * step - k // 2 - reach, size - extent))
        inner.append((origin == i // step * step - k // 2 - reach) | (extent >= size))
        shape = [1, 1, 1, 1, 1, 1]
        shape[1 + axis] = size
        pos = np.clip(start.reshape(shape) + window[:, axis] + offsets[..., axis], 0, size - 1)
        inside &= (pos >= origin.reshape(shape)) & (pos <= origin.reshape(shape) + extent - 1)
    query = inside.all(axis=-1)                                          # (B, T, H, W, heads)
    counts = [math.ceil(s / step) for s, step in zip((T, H, W), tile)]
    held = [0, 0, 0, 0]
    for b, h, *index in np.ndindex(B, heads, *counts):
        first = [n * step for n, step in zip(index, tile)]
        region = tuple(slice(f, f + step) for f, step in zip(first, tile))
        fits = bool(query[(b, *region, slice(h, h + 1))].all())
        is_inner = all(axis_inner[f] for axis_inner, f in zip(inner, first))
        held = [held[0] + fits, held[1] + 1, held[2] + (fits and is_inner), held[3] + is_inner]
    return tuple(held)


def test_injected_offsets_match_a_direct_computation(tmp_path, monkeypatch):
    made = {0: [], 1: []}
    gen = torch.Generator().manual_seed(0)

    def injected(self, x, grid):     # uniform in +-scale, a scale per head: in every halo, past reach 0, 1 and 2
        scale = torch.tensor([0.0, 0.4, 1.5, 2.8])[:, None, None]                          # (heads, 1, 1)
        o = scale * (2 * torch.rand(x.shape[0], *grid, self.num_heads, 27, 3, generator=gen) - 1)
        made[self.layer_idx].append(o)
        return o

    monkeypatch.setattr(DSAAttention, "offsets", injected)
    cfg = config(write_checkpoint(tmp_path / "step_0.pt"), tmp_path)
    result = run(cfg, tmp_path, monkeypatch)
    width = BOUND / cfg.bins
    blocks = {(r["block"], r["axis"]): r for r in result["tables"]["blocks"]}
    halo = {(r["block"], tuple(r["tile"])): r for r in result["tables"]["halo"]}
    made["all"] = made[0] + made[1]
    assert len(made[0]) == len(cfg.timesteps) * 2          # two forwards (batches of 2 and 1 clips) per timestep
    for block, tensors in made.items():
        values = np.concatenate([o.abs().reshape(-1, 3).numpy() for o in tensors])
        for axis, name in enumerate("tyx"):
            row = blocks[block, name]
            assert row["max"] == pytest.approx(values[:, axis].max(), abs=1e-6)
            assert row["mean"] == pytest.approx(values[:, axis].mean(), rel=1e-5)
            for q in cfg.percentiles:
                exact = np.percentile(values[:, axis], q, method="inverted_cdf")
                assert exact - 1e-6 <= row[offset_stats.percentile_key(q)] <= exact + width + 1e-6, (block, name, q)
        for tile in map(tuple, cfg.tiles):
            counts = np.array([[halo_shares_numpy(o.numpy(), tile, r) for o in tensors] for r in cfg.reaches])
            held, tiles, inner_held, inner = counts.sum(axis=1).T               # (reaches,) each
            row = halo[block, tile]
            assert row["tiles"] == tiles[0] and row["inner_tiles"] == inner.tolist()
            assert [row[f"in_pm{r}"] for r in cfg.reaches] == pytest.approx(held / tiles)
            assert [row[f"inner_pm{r}"] for r in cfg.reaches] == pytest.approx(inner_held / inner)
    shares = [halo["all", (1, 4, 4)][f"{kind}{r}"] for kind in ("in_pm", "inner_pm") for r in cfg.reaches]
    assert 0 < shares[0] < shares[1] < shares[2] < 1 and 0 < shares[3] < shares[4] < shares[5] < 1, shares
    assert halo["all", (1, 4, 4)]["inner_tiles"][0] < halo["all", (1, 4, 4)]["tiles"]   # edge tiles left out


def refused(args: list[str], tmp_path, monkeypatch, capsys) -> str:
    """offset_stats' main run with command-line `args` in an empty folder: the error, which must leave nothing."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["offset_stats.py", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        offset_stats.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and list(cwd.iterdir()) == [], err
    return err


@pytest.mark.parametrize("args, message", [
    (["checkpoint={tmp}/none.pt"], "checkpoint='{tmp}/none.pt' does not exist"),
    (["checkpoint={dense}"], "holds a model with model.attention.name='dense'"),
    (["checkpoint={dsa}", "data_seed=0"], "data_seed=0 is the checkpoint's training data.seed"),
    (["checkpoint={dsa}", "tiles=[[1,2,2]]"], "tiles=[[1, 2, 2]]: HaloConfig: tile=(1, 2, 2) must be powers of two "
                                              "with at least 16 queries"),
    (["checkpoint={dsa}", "timesteps=[1.5]"], "timesteps=[1.5]: give flow times in [0, 1]"),
    (["checkpoint={video}"], "the data config of checkpoint='{video}' fails here: data.root='{tmp}/clips' is not "
                             "a folder"),
], ids=["missing", "not dsa", "training seed", "small tile", "timestep", "data root"])
def test_bad_input_is_refused_naming_the_key(args, message, tmp_path, monkeypatch, capsys):
    clips = DataConfig("video_folder", root=f"{tmp_path}/clips")      # a folder that is not there
    paths = {"tmp": tmp_path, "dense": write_checkpoint(tmp_path / "dense.pt", "dense"),
             "dsa": write_checkpoint(tmp_path / "dsa.pt"), "video": write_checkpoint(tmp_path / "video.pt", data=clips)}
    err = refused([a.format(**paths) for a in args], tmp_path, monkeypatch, capsys)
    assert message.format(**paths) in err
