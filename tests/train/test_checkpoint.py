import pytest
import torch

from megaslide.train.checkpoint import (checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint,
                                        save_sharded_checkpoint)


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
