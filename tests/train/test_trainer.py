import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megaslide.config import OffloadConfig
from megaslide.train.trainer import Trainer
from tests.helpers import needs_inductor, tiny_data_cfg, tiny_model_cfg, tiny_train_cfg


def test_loss_drops_on_tiny_moving_shapes(tmp_path):
    trainer = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=40, lr=2e-3, batch_size=4,
                                                                        caption_dropout=0.0), tmp_path)
    # Fixed evaluation batch: the same videos, timesteps and noise before and after training.
    from megaslide.diffusion.batches import make_batch
    probe = make_batch(trainer.dataset, trainer.engine.model.tokenizer, tiny_train_cfg(batch_size=8, seed=123), 0)
    with torch.no_grad():
        before = trainer.engine.loss(probe).item()
    while trainer.step < 40:
        trainer.train_step()
    with torch.no_grad():
        after = trainer.engine.loss(probe).item()
    assert after < 0.8 * before, (before, after)


def test_resume_is_bit_identical(tmp_path):
    cfg = tiny_train_cfg(steps=4, ema_decay=0.9)
    straight = Trainer(tiny_model_cfg(), tiny_data_cfg(), cfg, tmp_path / "a")
    straight.fit()

    first = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=2, ema_decay=0.9), tmp_path / "b")
    first.fit()                                           # writes checkpoints/step_2.pt
    resumed = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=4, ema_decay=0.9, resume="auto"),
                      tmp_path / "b")
    resumed.fit()
    assert resumed.step == 4
    for (name, a), b in zip(straight.engine.model.state_dict().items(), resumed.engine.model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(straight.engine.ema.parameters(), resumed.engine.ema.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    trainer = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(), tmp_path)
    path = trainer.save()
    good = path.read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(torch, "save", boom)
    trainer.engine.step = 0                               # same file name as before
    try:
        trainer.save()
    except RuntimeError:
        pass
    assert path.read_bytes() == good                      # the old checkpoint survives a failed write


def test_sample_shapes_and_range(tmp_path):
    trainer = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=2), tmp_path)
    trainer.fit()
    video = trainer.sample(["a red circle moving left"])
    assert video.shape == (1, 3, 4, 16, 16)
    assert video.min() >= -1 and video.max() <= 1


@pytest.mark.slow
@needs_inductor
def test_compiled_blocks_train_like_eager(tmp_path):
    """train.compile: the same losses and weights as eager, state-dict names unchanged. The
    blocks go through Inductor (torch.compile's default backend), which generates C++ on CPU.
    DSA, whose fused op Dynamo must keep opaque; each attention's compiled block against the eager
    one is tests/models/test_compiled.py's."""
    trainers = [Trainer(tiny_model_cfg("dsa"), tiny_data_cfg(), tiny_train_cfg(steps=3, compile=c),
                        tmp_path / str(c)) for c in (False, True)]
    losses = [[t.train_step()["loss"].item() for _ in range(3)] for t in trainers]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    eager, compiled = (t.engine.model.state_dict() for t in trainers)
    assert eager.keys() == compiled.keys()
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5, msg=name)


class Recorder:
    def __init__(self):
        self.rows = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append((step, metrics))


@pytest.mark.parametrize("offload", [False, True])
def test_fit_logs_and_checkpoints_with_either_engine(tmp_path, offload):
    """One fit loop: every log_every steps the loss, lr and the engine's time breakdown; the
    checkpoint in the engine's format (step_N.pt, or with offload a step_N/ folder)."""
    logger = Recorder()
    trainer = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=3, log_every=2), tmp_path, logger,
                      offload_cfg=OffloadConfig(enabled=offload))
    last = trainer.fit()
    assert [step for step, _ in logger.rows] == [2, 3] and logger.rows[-1][1] == last
    breakdown = {"compute_s", "h2d_s", "d2h_s", "optimizer_s", "overlap_efficiency"} if offload else set()
    for _, metrics in logger.rows:
        assert metrics.keys() == {"loss", "grad_norm", "lr", "step_time_s"} | breakdown
        assert metrics["step_time_s"] > 0 and metrics["loss"] == metrics["loss"]
    written = tmp_path / "checkpoints" / ("step_3/state.pt" if offload else "step_3.pt")
    assert written.is_file()
    trainer.close()


@pytest.mark.parametrize("offload", [False, True])
def test_keep_checkpoints_leaves_the_newest(tmp_path, offload):
    """train.keep_checkpoints=2 with a checkpoint every step: the two newest stay, in either format, and a
    run resumed from the newest trains on."""
    cfg = tiny_train_cfg(steps=4, ckpt_every=1, keep_checkpoints=2)
    trainer = Trainer(tiny_model_cfg(), tiny_data_cfg(), cfg, tmp_path, offload_cfg=OffloadConfig(enabled=offload))
    trainer.fit()
    trainer.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == (["step_3", "step_4"] if offload else
                                                                           ["step_3.pt", "step_4.pt"])
    resumed = Trainer(tiny_model_cfg(), tiny_data_cfg(), dataclasses.replace(cfg, steps=5, resume="auto"), tmp_path,
                      offload_cfg=OffloadConfig(enabled=offload))
    resumed.fit()
    assert resumed.step == 5
    resumed.close()


def test_step_time_is_divided_by_the_steps_since_the_last_log(tmp_path, monkeypatch):
    """steps=3, log_every=2: the last row covers one step, not log_every. A clock that advances 1 s
    per reading makes every step take exactly 1 s (one reading at each step's start, one per log)."""
    ticks = iter(range(100))
    monkeypatch.setattr("megaslide.train.resident.time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    logger = Recorder()
    Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=3, log_every=2), tmp_path, logger).fit()
    assert [(step, m["step_time_s"]) for step, m in logger.rows] == [(2, 1.0), (3, 1.0)]


def test_resume_says_what_it_resumed_from(tmp_path, capsys):
    Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=2), tmp_path).fit()
    capsys.readouterr()
    resumed = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=3, resume="auto"), tmp_path)
    assert resumed.resume_from == (tmp_path / "checkpoints" / "step_2.pt", 2)
    resumed.fit()
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_2.pt'} at step 2" in capsys.readouterr().out


def test_resume_into_another_attention_is_refused_before_building(tmp_path, monkeypatch):
    Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=1), tmp_path).fit()
    monkeypatch.setattr("megaslide.train.trainer.build_engine", lambda *a, **k: pytest.fail("built an engine"))
    with pytest.raises(ValueError, match="model.attention.name: 'dense' in the checkpoint vs 'dsa' now"):
        Trainer(tiny_model_cfg("dsa"), tiny_data_cfg(), tiny_train_cfg(steps=2, resume="auto"), tmp_path)
