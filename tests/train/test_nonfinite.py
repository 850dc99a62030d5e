"""A step that says it trained: a non-finite loss or gradient norm is refused, naming the step,
before its update is applied, on both engines; the Trainer stops without checkpointing it, and
metrics.jsonl stays JSON."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import megaslide.train.trainer as trainer_module
from megaslide.config import OffloadConfig
from megaslide.train.engine import NonFiniteStep
from megaslide.train.logger import RunLogger
from megaslide.train.trainer import Trainer
from tests.experiments.runner import REPO_ROOT
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg
from tests.offload.conftest import torch_adamw  # noqa: F401  (a fixture: the offload engine's AdamW on torch's math)

ENGINES = {"resident": OffloadConfig(), "offload": OffloadConfig(enabled=True)}


@pytest.fixture
def poisoned_batches(monkeypatch):
    """make_batch with NaN clips from 0-based step index 2 on (the run's step 3)."""
    real = trainer_module.make_batch

    def make_batch(dataset, tokenizer, cfg, step, rows=slice(None)):
        batch = real(dataset, tokenizer, cfg, step, rows)
        if step >= 2:
            batch.x0 = torch.full_like(batch.x0, float("nan"))
        return batch
    monkeypatch.setattr(trainer_module, "make_batch", make_batch)


def _trainer(tmp_path, engine: str, **train) -> Trainer:
    return Trainer(tiny_model_cfg(), tiny_data_cfg(num_videos=4), tiny_train_cfg(steps=5, ckpt_every=1, **train),
                   tmp_path, offload_cfg=ENGINES[engine])


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.engine.model_state_dict().items()}


@pytest.mark.usefixtures("torch_adamw")
@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_nan_loss_stops_the_run_before_its_update(tmp_path, poisoned_batches, engine, grad_clip):
    trainer = _trainer(tmp_path, engine, grad_clip=grad_clip)
    trainer.logger = RunLogger(tmp_path, mode="disabled")
    with pytest.raises(NonFiniteStep, match=r"^step 3: loss is nan; lower train.lr \(now 1e-03\) or check the data"):
        trainer.fit()
    trainer.logger.finish()
    assert sorted(p.name for p in trainer.checkpoints.iterdir()) == ["step_1", "step_2"] if engine == "offload" \
        else ["step_1.pt", "step_2.pt"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    weights = _weights(trainer)                        # the step-2 weights: step 3 applied nothing
    trainer.load(trainer.checkpoints / ("step_2" if engine == "offload" else "step_2.pt"))
    for name, value in _weights(trainer).items():
        assert torch.isfinite(weights[name]).all() and torch.equal(weights[name], value), name
    trainer.close()


@pytest.mark.usefixtures("torch_adamw")
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_infinite_gradient_norm_is_refused_naming_the_step(tmp_path, engine):
    """A finite loss whose gradient is not: the final layer's gradient made infinite from step 2 on."""
    trainer = _trainer(tmp_path, engine, grad_clip=1.0)
    trainer.train_step()
    before = _weights(trainer)
    weight = trainer.engine.model.final.linear.weight
    weight.register_hook(lambda g: g * float("inf"))
    with pytest.raises(NonFiniteStep, match=r"^step 2: grad norm is inf"):
        trainer.train_step()
        trainer.engine.model_state_dict()       # the offload engine raises at its next wait at the latest
    after = _weights(trainer)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    trainer.close()


@pytest.mark.usefixtures("torch_adamw")
def test_offload_refuses_a_non_finite_block_gradient_without_clipping(tmp_path):
    """Unclipped, a block's update is queued before the global norm exists: the updater checks the
    block's own gradient, and refuses it (and every later update)."""
    trainer = _trainer(tmp_path, "offload", grad_clip=0.0)
    engine = trainer.engine
    before = engine.host.blocks[1].master.clone()
    real = engine._on_block_grads

    def poison(index, shell, landed, used, **kw):
        if index == 1:
            engine.host.blocks[1].grads.fill_(float("nan"))   # staged on the host (CPU: landed already)
        real(index, shell, landed, used, **kw)
    engine._on_block_grads = poison
    with pytest.raises(NonFiniteStep, match=r"^step 1: block 1's gradient is not finite"):
        trainer.train_step()
        engine.flush()
    assert torch.equal(engine.host.blocks[1].master, before)
    trainer.close()


def test_metrics_log_writes_non_finite_values_as_null(tmp_path):
    logger = RunLogger(tmp_path, mode="disabled")
    logger.log({"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3}, 1)
    logger.finish()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": None, "grad_norm": None,
                                                                     "lr": 1e-3}


def test_train_script_exits_non_zero_on_a_nan_loss(tmp_path):
    done = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "train.py"), f"out_dir={tmp_path}",
                           "train.lr=1e6", "train.steps=4", "train.batch_size=2", "data.frames=4", "data.height=8",
                           "data.width=8", "data.shape_size=4", "data.num_videos=4", "sample_captions=[]",
                           "train.ckpt_every=1"],
                          check=False, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: step \d+: loss is (nan|inf); lower train.lr \(now 1e\+06\) or check the data",
                        error), done.stderr
    assert "Traceback" not in done.stderr
    step = int(error.split()[2].rstrip(":"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step_{i}.pt" for i in range(1, step)]
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
