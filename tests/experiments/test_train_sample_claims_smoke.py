"""train.py -> sample.py end to end at the smallest size, and the claims page on the committed results."""
import json
import math
import os
import subprocess
import sys

import imageio.v2 as imageio

from megaslide.data.video_io import MP4_SECONDS
from tests.experiments.runner import REPO_ROOT, run_script

TINY = ["train.steps=2", "train.batch_size=2", "train.sample_steps=1", "data.frames=4", "data.height=8",
        "data.width=8", "data.shape_size=4", "data.num_videos=4", "sample_captions=[a red circle moving left]"]
LOOPED = 4 * math.ceil(MP4_SECONDS * 8 / 4)  # the 4 frames, played again and again for MP4_SECONDS at 8 fps


def test_train_then_sample(tmp_path):
    run_script(["experiments/train.py", f"out_dir={tmp_path}", *TINY])
    ckpt = tmp_path / "checkpoints" / "step_2.pt"
    assert ckpt.is_file() and (tmp_path / "metrics.jsonl").is_file()
    assert len(imageio.mimread(tmp_path / "samples" / "step2_0.mp4")) == LOOPED >= MP4_SECONDS * 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl", "samples"]  # no *.log
    out = run_script(["experiments/train.py", f"out_dir={tmp_path}", *TINY, "train.steps=3", "train.resume=auto"])
    assert f"resumed from {ckpt} at step 2" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 3]
    again = run_script(["experiments/train.py", f"out_dir={tmp_path}", *TINY, "train.steps=3", "train.resume=auto"])
    assert f"trained 3 steps, final loss {rows[-1]['loss']:.4f}" in again   # a finished run: its logged loss, not nan
    out = tmp_path / "up.mp4"
    run_script(["experiments/sample.py", f"checkpoint={ckpt}", "caption=a blue square moving up", "steps=1",
                f"out={out}"])
    frames = imageio.mimread(out)
    assert len(frames) == LOOPED and frames[0].shape == (8, 8, 3)


def test_a_refused_config_leaves_nothing_behind(tmp_path):
    """The README's promise: a bad value fails with its message alone (no traceback), before any folder,
    log file or W&B run (offline here) exists."""
    done = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "train.py"), "out_dir=run",
                           "train.log_every=0"], cwd=tmp_path, env={**os.environ, "WANDB_MODE": "offline"},
                          capture_output=True, text=True, timeout=600)
    assert (done.returncode, done.stderr) == (2, "error: train.log_every=0 must be >= 1\n"), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_claims_table_from_results(tmp_path):
    out = tmp_path / "README.md"
    run_script(["-m", "experiments.claims", "--out", str(out)])
    text = out.read_text()
    for claim in ["C1", "C4", "C8", "S3", "F4"]:
        assert f"| {claim} |" in text
    verdicts = {line.split(" | ")[0][2:]: line.rsplit(" | ", 1)[1] for line in text.splitlines()
                if line.startswith("| ") and line.count(" | ") >= 3}
    for claim in ["C6", "C7", "C8"]:                                  # one rule, one vocabulary
        assert verdicts[claim].split(":")[0] in ("supported", "inconclusive", "contradicted", "open")
    assert "1.0 on ideal videos" not in text and "scorer v" in text
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert "fused DSA peaks above dense flash" in rows["C3"]  # C3 states the layer peaks
    assert "timed steps" in verdicts["C4"] + text
