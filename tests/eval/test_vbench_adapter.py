import importlib.util
import os

import cv2
import numpy as np
import pytest

from megaslide.data.moving_shapes import MovingShapes
from megaslide.data.video_io import write_mp4
from megaslide.eval import vbench_adapter
from megaslide.eval.video import temporal_flickering

os.environ.setdefault("WANDB_MODE", "disabled")

HAVE_VBENCH = importlib.util.find_spec("vbench") is not None


def test_unavailable_reason_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("VBENCH_CACHE_DIR", str(tmp_path / "empty_cache"))
    assert vbench_adapter.vbench_cache_dir() == tmp_path / "empty_cache"
    reason = vbench_adapter.vbench_unavailable(["dynamic_degree"])
    if HAVE_VBENCH:
        assert "raft-things.pth" in reason and "VBENCH_CACHE_DIR" in reason
    else:
        assert "pip install vbench" in reason
        with pytest.raises(RuntimeError, match="pip install vbench"):
            vbench_adapter.vbench_temporal_flickering(tmp_path / "any.mp4")
    with pytest.raises(ValueError, match="dimensions"):
        vbench_adapter.vbench_unavailable(["aesthetic_wow"])


def test_default_cache_dir(monkeypatch):
    monkeypatch.delenv("VBENCH_CACHE_DIR", raising=False)
    assert vbench_adapter.vbench_cache_dir().parts[-2:] == (".cache", "vbench")


@pytest.mark.skipif(not HAVE_VBENCH, reason="UNTESTED in CI: vbench is in no dependency list (vbench 0.1.5 pins "
                    "numpy<2 and transformers==4.33.2 and pulls opencv-python beside our opencv-python-headless), so "
                    "the comparison with the real VBench runs only where someone ran pip install vbench")
def test_temporal_flickering_matches_vbench(tmp_path):
    video = MovingShapes(1, frames=10, height=32, width=32, speed=3.0, shape_size=8)[0]["video"]
    path = write_mp4(tmp_path / "clip.mp4", video)
    capture = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    capture.release()
    ours = temporal_flickering(np.stack(frames))
    assert ours == pytest.approx(vbench_adapter.vbench_temporal_flickering(path), abs=1e-6)
