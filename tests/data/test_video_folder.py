import json
import os
import sys

import numpy as np
import pytest

from megaslide.data.moving_shapes import collate
from megaslide.data.video_folder import VideoFolder, read_video_frames, uniform_frame_indices
from megaslide.data.video_io import write_mp4

os.environ.setdefault("WANDB_MODE", "disabled")

pytest.importorskip("decord", reason="decord (pip install decord2) is needed to read mp4 files")

RED = (220, 30, 40)
TEAL = (20, 160, 150)


@pytest.fixture
def folder(tmp_path):
    """Two solid-colour clips and a clip whose grey level encodes the frame index."""
    write_mp4(tmp_path / "red.mp4", np.full((10, 64, 64, 3), RED, np.uint8))
    write_mp4(tmp_path / "teal.mp4", np.full((7, 48, 80, 3), TEAL, np.uint8))
    ramp = np.stack([np.full((32, 32, 3), 12 * t, np.uint8) for t in range(20)])
    write_mp4(tmp_path / "ramp.mp4", ramp, crf=0)
    lines = [
        {"file": "red.mp4", "caption": "a red screen"},
        {"file": "teal.mp4", "caption": "a teal screen"},
        {"file": "ramp.mp4", "caption": "a fade in"},
    ]
    (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return tmp_path


def test_uniform_frame_indices():
    np.testing.assert_array_equal(uniform_frame_indices(5, 5), np.arange(5))
    np.testing.assert_array_equal(uniform_frame_indices(20, 4), [2, 7, 12, 17])
    np.testing.assert_array_equal(uniform_frame_indices(3, 6), [0, 0, 1, 1, 2, 2])
    for available, frames in [(1, 3), (7, 7), (100, 9), (9, 100)]:
        indices = uniform_frame_indices(available, frames)
        assert indices.shape == (frames,) and indices.min() >= 0 and indices.max() < available
        assert np.all(np.diff(indices) >= 0)
    with pytest.raises(ValueError, match="num_available"):
        uniform_frame_indices(0, 4)


@pytest.mark.parametrize("height,width", [(32, 32), (24, 40), (32, 48)])
def test_items_have_right_shape_range_and_colour(folder, height, width):
    ds = VideoFolder(folder, frames=6, height=height, width=width)
    assert len(ds) == 3
    for index, (colour, caption) in enumerate([(RED, "a red screen"), (TEAL, "a teal screen")]):
        item = ds[index]
        assert item["caption"] == caption
        assert item["video"].shape == (3, 6, height, width)
        assert item["video"].min() >= -1.0 and item["video"].max() <= 1.0
        expected = np.array(colour) / 127.5 - 1.0
        mean_colour = item["video"].mean(dim=(1, 2, 3)).numpy()
        np.testing.assert_allclose(mean_colour, expected, atol=0.05)
        assert (item["video"] - item["video"].mean(dim=(1, 2, 3), keepdim=True)).abs().max() < 0.1


def test_sampled_frames_are_the_uniform_indices(folder):
    frames = read_video_frames(folder / "ramp.mp4", 5, 32, 32)  # (5, 32, 32, 3)
    expected = 12 * uniform_frame_indices(20, 5)
    np.testing.assert_allclose(frames.reshape(5, -1).mean(axis=1), expected, atol=2.0)


def test_collate_of_folder_items(folder):
    ds = VideoFolder(folder, frames=4, height=16, width=32)
    batch = collate([ds[0], ds[1]])
    assert batch["video"].shape == (2, 3, 4, 16, 32)
    assert batch["caption"] == ["a red screen", "a teal screen"]


def test_missing_folder_and_captions(tmp_path):
    with pytest.raises(ValueError, match="root=.*nowhere"):
        VideoFolder(tmp_path / "nowhere", frames=4, height=16, width=16)
    with pytest.raises(ValueError, match="captions.jsonl"):
        VideoFolder(tmp_path, frames=4, height=16, width=16)
    (tmp_path / "captions.jsonl").write_text('{"file": "gone.mp4", "caption": "x"}\n')
    with pytest.raises(ValueError, match="gone.mp4"):
        VideoFolder(tmp_path, frames=4, height=16, width=16)
    (tmp_path / "captions.jsonl").write_text('{"caption": "no file"}\n')
    with pytest.raises(ValueError, match='"file"'):
        VideoFolder(tmp_path, frames=4, height=16, width=16)
    (tmp_path / "captions.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="JSON"):
        VideoFolder(tmp_path, frames=4, height=16, width=16)
    (tmp_path / "captions.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no clips"):
        VideoFolder(tmp_path, frames=4, height=16, width=16)


def test_missing_decord_gives_install_hint(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "decord", None)
    with pytest.raises(ImportError, match="pip install decord2"):
        read_video_frames(folder / "red.mp4", 2, 16, 16)
    with pytest.raises(ValueError, match="pip install decord2"):             # found when the folder is opened
        VideoFolder(folder, frames=2, height=16, width=16)


def test_an_undecodable_first_clip_is_named_when_the_folder_is_opened(folder):
    (folder / "red.mp4").write_bytes(b"not a video")
    with pytest.raises(ValueError, match="red.mp4, the first clip of .*could not be decoded"):
        VideoFolder(folder, frames=2, height=16, width=16)
