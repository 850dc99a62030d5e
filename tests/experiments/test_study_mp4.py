"""A study run's mp4 (quality_protocol.run_variant, as the main job writes it): the first sample beside the
ground-truth clip of its caption, looped to at least MP4_SECONDS (video_io)."""
import math
import os

import imageio.v2 as imageio
import numpy as np

import experiments.quality_protocol as protocol
from megaslide.data.video_io import MP4_SECONDS
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

os.environ.setdefault("WANDB_MODE", "disabled")


def test_study_mp4_shows_ground_truth_beside_the_sample_looped(tmp_path):
    data = tiny_data_cfg()  # 4 frames of 16 x 16: upscaled 6x to 96 x 96
    row = protocol.run_variant("dense", tiny_model_cfg(), data, tiny_train_cfg(steps=1, sample_steps=1), n_eval=1,
                               eval_seed=5, sample_batch=1, out_dir=tmp_path, project="p", tag="t")
    decoded = np.stack(imageio.mimread(row["mp4"], format="FFMPEG"))  # (frames, H, W, 3)
    side = protocol.upscaled(row["samples"][0]).shape[1]
    loops = math.ceil(MP4_SECONDS * 8 / data.frames)  # write_mp4's default 8 fps
    assert decoded.shape == (loops * data.frames, side, 2 * side + 4, 3)
    _, _, truth = protocol.eval_set(data, 1, 5)
    want = np.tile(protocol.upscaled(truth[0]), (loops, 1, 1, 1))  # the left clip: the caption's ground truth
    assert np.abs(decoded[:, :, :side].astype(int) - want.astype(int)).mean() < 6.0
    sample = np.tile(protocol.upscaled(row["samples"][0]), (loops, 1, 1, 1))
    assert np.abs(decoded[:, :, side + 4:].astype(int) - sample.astype(int)).mean() < 6.0
