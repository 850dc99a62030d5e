"""The training benchmarks (oom_thresholds, scaling, mfu_overlap) run train.py's config: every cell's RunConfig is
the one that train.yaml composes with the train.py overrides the cell records, and plan.py with the same overrides
plans that run; keys that moved into the run's groups are refused naming their new key."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments import mfu_overlap, scaling
from experiments.hydra_config import compose_run, run_config, script_config, train_overrides
from experiments.oom_thresholds import OOMConfig, RowSpec, cells_of_row, model_changes
from experiments.plan import plan_config
from megaslide.config import RunConfig

CONF = Path(__file__).resolve().parents[2] / "experiments" / "conf"


def composed(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(name, overrides=overrides)


def assert_train_makes(run: RunConfig, overrides: list[str]) -> None:
    """train.py's config (and plan.py's) with `overrides` is `run`."""
    assert run_config(composed("train", overrides), check_device=False) == run
    assert plan_config(composed("plan", overrides)).run == run


@pytest.mark.parametrize("mode", ["resident", "offload", "chunked_offload"])
@pytest.mark.parametrize("script_overrides", [["smoke=true"], ["oom_preset=headline", "train.lr=2e-5"]])
def test_oom_cells_are_train_runs(mode, script_overrides):
    base = composed("oom_thresholds", script_overrides)
    cfg = script_config(OOMConfig, base)
    (label, model), = list(model_changes(cfg, base).items())[:1]
    cells = cells_of_row(cfg, base, label, model, RowSpec("dsa", [mode], [8, 16]), mode)
    for cell in cells:
        assert_train_makes(cell.run, list(cell.run_overrides))
    run = cells[-1].run
    assert run.data.frames == 16 and run.model.attention.name == "dsa" and run.offload.enabled == (mode != "resident")
    assert run.execution.checkpoint_blocks == (mode == "resident")
    assert run.offload.activation_offload == (mode == "chunked_offload")
    chunked = mode == "chunked_offload"
    assert run.execution.chunk_tokens == (base.execution.chunk_tokens if chunked else 0)
    assert run.execution.slab_frames == (base.execution.slab_frames if chunked else 0)
    assert run.train.lr == base.train.lr and run.data.height == base.data.height


def test_oom_dense_chunked_cells_run_without_slabs():
    base = composed("oom_thresholds", ["oom_preset=headline"])
    cfg = script_config(OOMConfig, base)
    (cell,) = cells_of_row(cfg, base, "1B", ["model=1B"], RowSpec("dense", ["chunked_offload"], [16]),
                           "chunked_offload")
    assert base.execution.slab_frames == "auto" and cell.run.execution.slab_frames == 0   # dense reaches the whole clip
    assert cell.run.model.depth == 13 and cell.run.model.in_channels == 3
    assert_train_makes(cell.run, list(cell.run_overrides))


@pytest.mark.parametrize("preset", ["1B", "105B"])
def test_scaling_runs_are_train_runs(preset):
    base = composed("scaling", ["data.frames=16"])
    for changes in ([f"model={preset}"], [f"model={preset}", *scaling.cap_changes(94.0, {"hbm_total_GB": 150.0})]):
        run = compose_run(base, changes)
        assert_train_makes(run, train_overrides(base, changes))
        assert run.model.attention.name == "dsa" and run.offload.enabled and run.data.frames == 16
    assert run.offload.gpu_memory_fraction == pytest.approx(94 / 150)


@pytest.mark.parametrize("variant", list(mfu_overlap.VARIANTS))
def test_mfu_overlap_runs_are_train_runs(variant):
    base = composed("mfu_overlap", ["attention=dsa", "train.lr=2e-5"])
    changes = mfu_overlap.engine_changes(False, True, depth=4, threads=15) + mfu_overlap.variant_changes(variant)
    run = compose_run(base, changes)
    assert_train_makes(run, train_overrides(base, changes))
    overlap, optimizer_device, clip = mfu_overlap.VARIANTS[variant]
    assert (run.offload.overlap, run.offload.optimizer_device, run.offload.cpu_threads) == (overlap, optimizer_device,
                                                                                           15)
    assert run.train.grad_clip == (1.0 if clip is None else clip) and run.train.lr == 2e-5
    assert (run.model.depth, run.model.dim, run.offload.gpu_memory_fraction) == (4, 4096, 0.5)   # 7B width


def test_mfu_overlap_tiny_run_on_cpu():
    base = composed("mfu_overlap", ["tiny=true"])
    changes = mfu_overlap.engine_changes(True, False, depth=3, threads=1)
    run = compose_run(base, changes)
    assert_train_makes(run, train_overrides(base, changes))
    assert (run.model.dim, run.model.depth, run.grid, run.offload.gpu_memory_fraction) == (64, 3, (4, 8, 8), 0)


def test_a_run_config_base_takes_changes():
    """offload_peers' form: a RunConfig as the base."""
    base = compose_run(RunConfig(), ["model=S", "model.in_channels=3", "attention=dsa", "data.frames=4"])
    changes = ["offload=engine", "execution.chunk_tokens=64", "model.depth=2"]
    run = compose_run(base, changes)
    assert_train_makes(run, train_overrides(base, changes))
    assert (run.model.dim, run.model.depth, run.data.frames, run.execution.chunk_tokens) == (384, 2, 4, 64)


@pytest.mark.parametrize("script, cls, old, new", [
    ("oom_thresholds", OOMConfig, "chunk_tokens=8", "execution.chunk_tokens"),
    ("oom_thresholds", OOMConfig, "height=64", "data.height"),
    ("oom_thresholds", OOMConfig, "precision=bf16", "train.precision"),
    ("scaling", scaling.ScalingConfig, "frames=16", "data.frames"),
    ("scaling", scaling.ScalingConfig, "batch=2", "train.batch_size"),
])
def test_moved_script_keys_are_refused_naming_the_new_key(script, cls, old, new):
    with pytest.raises(ValueError, match=f"{old.split('=')[0]} is now {new}"):
        script_config(cls, composed(script, [old]))


@pytest.mark.parametrize("old, new", [("bench.depth=12", "model.depth"), ("bench.lr=0.1", "train.lr"),
                                      ("bench.gpu_memory_fraction=0", "offload.gpu_memory_fraction")])
def test_moved_mfu_bench_keys_are_refused_naming_the_new_key(old, new):
    with pytest.raises(ValueError, match=f"{old.split('=')[0]} is now {new}"):
        mfu_overlap.bench_config(composed("mfu_overlap", [old]))
