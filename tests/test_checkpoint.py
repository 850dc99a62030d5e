import dataclasses
import re

import pytest
import torch

from megaslide.checkpoint import (check_fresh_folder, checkpoint_path, latest_checkpoint, load_checkpoint,
                                  prune_checkpoints, read_state, remove_stale_temps, resume_point, save_checkpoint,
                                  save_sharded_checkpoint)
from megaslide.inference.weights import sampling_weights


def test_latest_checkpoint_is_the_newest_complete_one_of_its_format(tmp_path):
    save_checkpoint(checkpoint_path(tmp_path, 2, sharded=False), {"step": 2})
    save_checkpoint(checkpoint_path(tmp_path, 10, sharded=False), {"step": 10})
    save_sharded_checkpoint(checkpoint_path(tmp_path, 5, sharded=True), [("block_0000", {"x": 1})], {"step": 5})
    (tmp_path / "step_20").mkdir()       # a folder without state.pt: not a complete checkpoint
    (tmp_path / ".step_30.tmp").mkdir()  # a write in progress
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10.pt"  # by step number, not by name
    assert latest_checkpoint(tmp_path, sharded=True) == tmp_path / "step_5"
    assert load_checkpoint(tmp_path / "step_5" / "block_0000.pt") == {"x": 1}
    assert latest_checkpoint(tmp_path / "missing") is None


def test_pruning_keeps_the_newest_complete_checkpoints_of_one_format(tmp_path):
    for step in (3, 20, 100):
        save_checkpoint(checkpoint_path(tmp_path, step, sharded=False), {"step": step})
    for step in (1, 50):
        save_sharded_checkpoint(checkpoint_path(tmp_path, step, sharded=True), [("block_0000", {"x": 1})],
                                {"step": step})
    (tmp_path / "step_200").mkdir()      # incomplete (no state.pt): neither counted nor deleted
    (tmp_path / "step_best.pt").write_bytes(b"")
    assert prune_checkpoints(tmp_path, 2) == [tmp_path / "step_3.pt"]
    assert prune_checkpoints(tmp_path, 1, sharded=True) == [tmp_path / "step_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_100.pt", "step_20.pt", "step_200", "step_50",
                                                         "step_best.pt"]
    assert prune_checkpoints(tmp_path, 2) == []


def test_a_failed_sharded_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    folder = save_sharded_checkpoint(tmp_path / "step_1", [("a", {"v": 1})], {"step": 1})
    real_save, calls = torch.save, []

    def fails_second(obj, f):
        calls.append(obj)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        real_save(obj, f)
    monkeypatch.setattr(torch, "save", fails_second)
    with pytest.raises(RuntimeError, match="disk full"):
        save_sharded_checkpoint(folder, [("a", {"v": 2}), ("b", {"v": 2})], {"step": 1})
    assert load_checkpoint(folder / "a.pt") == {"v": 1} and not (folder / "b.pt").exists()
    assert latest_checkpoint(tmp_path, sharded=True) == folder


def _tiny_run(out_dir, steps=1, **kw):
    """A finished tiny Trainer (checkpoint at its last step) and its configs."""
    from megaslide.config import OffloadConfig
    from megaslide.train.trainer import Trainer
    from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

    offload = kw.pop("offload", False)
    trainer = Trainer(kw.pop("model", None) or tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=steps, **kw),
                      out_dir, offload_cfg=OffloadConfig(enabled=offload))
    trainer.fit()
    return trainer


def test_non_step_names_are_not_checkpoints(tmp_path):
    save_checkpoint(tmp_path / "step_3.pt", {"step": 3})
    save_checkpoint(tmp_path / "step_best.pt", {"step": 9})
    save_checkpoint(tmp_path / "step_7.pt.bak", {"step": 7})
    (tmp_path / "step_final").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3.pt"
    assert latest_checkpoint(tmp_path, sharded=True) is None


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "text"])
def test_a_damaged_file_is_named_as_damaged(tmp_path, damage):
    path = save_checkpoint(tmp_path / "step_1.pt", {"step": 1, "w": torch.arange(1000.0)})
    good = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": good[: len(good) // 2], "garbage": bytes(range(256)) * 4,
                      "text": b"step: 1\n"}[damage])
    with pytest.raises(ValueError, match=rf"checkpoint file '{re.escape(str(path))}' is damaged .*empty, truncated"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="is damaged"):
        read_state(path)


def test_a_file_without_run_state_or_a_folder_without_state_pt_is_refused(tmp_path):
    save_checkpoint(tmp_path / "weights.pt", {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"lacks \['step', 'model_cfg', 'data_cfg'\]"):
        read_state(tmp_path / "weights.pt")
    (tmp_path / "step_4").mkdir()
    with pytest.raises(ValueError, match="has no state.pt: it is not a complete sharded checkpoint"):
        read_state(tmp_path / "step_4")
    with pytest.raises(ValueError, match="does not exist"):
        read_state(tmp_path / "step_5.pt")


@pytest.mark.parametrize("offload", [False, True])
def test_sampling_weights_of_either_format_are_the_trained_weights(tmp_path, offload):
    """A sharded step_N/ folder of the offload engine unflattens into the model's state dict."""
    from megaslide.models.dit import VideoDiT

    trainer = _tiny_run(tmp_path, steps=2, offload=offload)
    weights, state = sampling_weights(tmp_path / "checkpoints" / ("step_2" if offload else "step_2.pt"))
    assert state["step"] == 2 and state["model_cfg"] == dataclasses.asdict(trainer.model_cfg)
    model = VideoDiT(trainer.model_cfg)
    model.load_state_dict(weights)                    # strict: every parameter, no extra key
    trained = trainer.engine.model_state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p, trained[name]), name
    trainer.close()


def test_resume_point_is_refused_for_another_architecture(tmp_path):
    from tests.helpers import tiny_model_cfg

    _tiny_run(tmp_path)
    folder = tmp_path / "checkpoints"
    assert resume_point("auto", folder, tiny_model_cfg(), sharded=False) == (folder / "step_1.pt", 1)
    assert resume_point("", tmp_path / "empty", tiny_model_cfg(), sharded=False) is None
    with pytest.raises(ValueError, match=r"train.resume='' starts a fresh run, but .* holds 1 checkpoint\(s\) of an "
                                         r"earlier run \(step_1.pt\): continue that run with train.resume=auto"):
        check_fresh_folder("", folder)   # else a later auto would take it as the new run's
    check_fresh_folder("", tmp_path / "empty")
    check_fresh_folder("auto", folder)
    assert resume_point("auto", tmp_path / "empty", tiny_model_cfg(), sharded=False) is None
    other = dataclasses.replace(tiny_model_cfg("dsa_zero"), dim=128, patch_size=(1, 4, 4))
    with pytest.raises(ValueError, match=r"holds another model than this run's: model.dim: 64 in the checkpoint vs "
                                         r"128 now; model.patch_size: \(1, 2, 2\) in the checkpoint vs \(1, 4, 4\) "
                                         r"now; model.attention.name: 'dense' in the checkpoint vs 'dsa_zero' now"):
        resume_point("auto", folder, other, sharded=False)


def test_resume_point_names_the_engine_of_the_other_format(tmp_path):
    from tests.helpers import tiny_model_cfg

    _tiny_run(tmp_path, offload=True)
    folder = tmp_path / "checkpoints"
    with pytest.raises(ValueError, match=r"is a sharded step_N/ folder of the offload engine; resume it with "
                                         r"offload=engine"):
        resume_point("auto", folder, tiny_model_cfg(), sharded=False)
    assert resume_point(str(folder / "step_1"), folder, tiny_model_cfg(), sharded=True) == (folder / "step_1", 1)
    save_checkpoint(folder / "step_9.pt", {"step": 9})
    with pytest.raises(ValueError, match=r"is a step_N.pt file of the resident engine; resume it with offload=none"):
        resume_point(str(folder / "step_9.pt"), folder, tiny_model_cfg(), sharded=True)


def test_a_killed_saves_temp_files_are_removed_when_a_run_starts(tmp_path):
    from tests.helpers import tiny_model_cfg

    _tiny_run(tmp_path)
    folder = tmp_path / "checkpoints"
    (folder / ".step_2.pt.tmp").write_bytes(b"half")                 # a killed file save
    (folder / ".step_3.tmp").mkdir()                                 # a killed sharded save
    (folder / ".step_3.tmp" / "block_0000.pt").write_bytes(b"half")
    keep = [folder / ".notes.tmp", folder / "step_x.tmp", folder / ".step_2.pt.tmp.bak"]   # not this module's names
    for path in keep:
        path.write_text("")
    assert resume_point("auto", folder, tiny_model_cfg(), sharded=False) == (folder / "step_1.pt", 1)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["step_1.pt", *(p.name for p in keep)])
    assert remove_stale_temps(tmp_path / "missing") == []
