import os
import re
import subprocess
import sys
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from megaslide.data.moving_shapes import MovingShapes
from megaslide.data.video_io import frame_grid_png, side_by_side, to_uint8_frames, write_mp4

os.environ.setdefault("WANDB_MODE", "disabled")


def test_to_uint8_frames_float_layout():
    video = torch.zeros(3, 2, 3, 5)
    video[0, 0, 0, 0] = -1.0
    video[1, 0, 0, 0] = 1.0
    video[2, 0, 0, 0] = 7.0  # clipped
    video[0, 1, 2, 4] = -0.5
    frames = to_uint8_frames(video)
    assert frames.shape == (2, 3, 5, 3) and frames.dtype == np.uint8
    assert frames[0, 0, 0].tolist() == [0, 255, 255]
    assert frames[1, 2, 4, 0] == round(0.5 * 127.5)
    assert frames[1, 0, 0, 1] == 128  # 0.0 -> 127.5 rounds to even 128
    np.testing.assert_array_equal(to_uint8_frames(video.numpy().astype(np.float64)), frames)
    np.testing.assert_array_equal(to_uint8_frames(video.to(torch.bfloat16)), frames)


def test_to_uint8_frames_uint8_layout_passes_through():
    frames = np.random.default_rng(0).integers(0, 256, (4, 6, 7, 3), dtype=np.uint8)
    np.testing.assert_array_equal(to_uint8_frames(frames), frames)
    np.testing.assert_array_equal(to_uint8_frames(torch.from_numpy(frames)), frames)


@pytest.mark.parametrize(
    "video",
    [
        torch.zeros(4, 2, 8, 8),
        np.zeros((2, 8, 8, 4), np.uint8),
        np.zeros((3, 8, 8), np.float32),
        np.zeros((3, 2, 8, 8), np.int32),
    ],
)
def test_to_uint8_frames_rejects_bad_input(video):
    with pytest.raises(ValueError, match="video"):
        to_uint8_frames(video)


@pytest.mark.parametrize("height,width", [(32, 48), (17, 23)])
def test_write_mp4_round_trip(tmp_path, height, width):
    frames = np.zeros((6, height, width, 3), np.uint8)
    frames[:3] = (200, 40, 90)
    frames[3:] = (30, 180, 220)
    path = write_mp4(tmp_path / "sub" / "clip.mp4", frames, fps=8)
    decoded = np.stack(imageio.mimread(path, format="FFMPEG"))
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 4.0


def test_write_mp4_accepts_model_layout(tmp_path):
    item = MovingShapes(1, frames=5, height=32, width=32, shape_size=8)[0]
    path = write_mp4(tmp_path / "shapes.mp4", item["video"])
    decoded = np.stack(imageio.mimread(path, format="FFMPEG"))
    assert decoded.shape == (5, 32, 32, 3)
    assert np.abs(decoded.astype(int) - to_uint8_frames(item["video"]).astype(int)).mean() < 8.0
    with pytest.raises(ValueError, match="fps"):
        write_mp4(tmp_path / "bad.mp4", item["video"], fps=0)


def test_side_by_side_places_clips_left_to_right_with_a_grey_gap():
    left = np.zeros((3, 4, 5, 3), np.uint8)
    right = torch.ones(3, 3, 4, 6)  # model layout: white
    tiled = side_by_side([left, right], gap=2)
    assert tiled.shape == (3, 4, 5 + 2 + 6, 3) and tiled.dtype == np.uint8
    np.testing.assert_array_equal(tiled[:, :, :5], left)
    assert (tiled[:, :, 5:7] == 128).all() and (tiled[:, :, 7:] == 255).all()
    np.testing.assert_array_equal(side_by_side([left]), left)
    with pytest.raises(ValueError, match="length and height"):
        side_by_side([left, np.zeros((2, 4, 5, 3), np.uint8)])


@pytest.mark.parametrize("frames,fps,min_seconds,expected", [(4, 8, 3.0, 24), (5, 8, 3.0, 25), (30, 8, 3.0, 30),
                                                             (4, 8, 0.0, 4)])
def test_write_mp4_loops_a_short_clip_to_min_seconds(tmp_path, frames, fps, min_seconds, expected):
    """Whole loops of the clip until it lasts min_seconds at fps (4 frames at 8 fps: 6 loops for 3 s)."""
    clip = np.zeros((frames, 8, 12, 3), np.uint8)
    clip[:, :, :, 0] = (np.arange(frames) * 255 // max(frames - 1, 1))[:, None, None]  # red ramps up each loop
    decoded = np.stack(imageio.mimread(write_mp4(tmp_path / "loop.mp4", clip, fps=fps, min_seconds=min_seconds),
                                       format="FFMPEG"))
    assert decoded.shape == (expected, 8, 12, 3)
    want = np.tile(clip, (expected // frames, 1, 1, 1))
    assert np.abs(decoded.astype(int) - want.astype(int)).mean() < 4.0
    with pytest.raises(ValueError, match="min_seconds"):
        write_mp4(tmp_path / "bad.mp4", clip, min_seconds=-1)


def test_frame_grid_png(tmp_path):
    ds = MovingShapes(3, frames=6, height=16, width=24, shape_size=5)
    videos = [ds[0]["video"], ds[1]["video"], to_uint8_frames(ds[2]["video"])[:3]]
    path = frame_grid_png(tmp_path / "grid.png", videos, [ds[i]["caption"] for i in range(3)], num_frames=4)
    image = imageio.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 200
    assert image[..., :3].std() > 10  # not a blank canvas
    with pytest.raises(ValueError, match="labels"):
        frame_grid_png(tmp_path / "bad.png", videos, ["only one"])
    with pytest.raises(ValueError, match="videos"):
        frame_grid_png(tmp_path / "bad.png", [])


def test_write_mp4_parent_not_a_folder_raises_naming_the_path(tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "clip.mp4"
    with pytest.raises(OSError, match=re.escape(str(out))):
        write_mp4(out, np.zeros((2, 8, 8, 3), np.uint8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_write_mp4_full_disk_leaves_no_file(tmp_path):
    """A file-size limit makes ffmpeg's write fail as a full disk does: an OSError naming the path and
    ffmpeg's cause, and no partial video or temp file beside it (a child process, as the limit is per process)."""
    out = tmp_path / "clip.mp4"
    code = ("import resource, sys, numpy as np; from megaslide.data.video_io import write_mp4\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
            "try:\n"
            f"    write_mp4({str(out)!r}, np.random.default_rng(0).integers(0, 255, (8, 64, 64, 3), np.uint8))\n"
            "except OSError as err:\n"
            "    sys.exit(str(err))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"could not write the video {out}: ffmpeg exited with status" in done.stderr
    assert list(tmp_path.iterdir()) == []
