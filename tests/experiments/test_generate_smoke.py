"""experiments/generate_full.py and generate_causal.py at the tiny size: one process, and torchrun on 2 gloo ranks.

The tiny preset is pixel-space (3 channels), so each run writes the latents and an mp4. Two ranks
must reproduce one process (the same fp32 math in another order: tolerance as in tests/inference).
"""
import math

import imageio.v2 as imageio
import pytest
import torch

from megaslide.data.video_io import MP4_SECONDS
from tests.experiments.runner import run_script

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
VIDEO = ["frames=6", "height=8", "width=8", "device=cpu"]


@pytest.mark.parametrize("script, sp", [("generate_full", ["parallel.sp_mode=torus"]),
                                        ("generate_causal", ["chunk_frames=2"])])
def test_two_ranks_match_one_process_and_write_the_video(tmp_path, script, sp):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run_script([f"experiments/{script}.py", *VIDEO, *sp, f"out={one}"])
    stdout = run_script([*TORCHRUN, f"experiments/{script}.py", *VIDEO, *sp, f"out={two}"], OMP_NUM_THREADS="1")
    assert f"wrote {two.with_suffix('.mp4')}" in stdout  # rank 0 alone writes
    single, sharded = torch.load(one), torch.load(two)
    assert single.shape == (1, 3, 6, 8, 8) and single.abs().mean() > 0.1
    torch.testing.assert_close(sharded, single, atol=2e-5, rtol=2e-5)
    frames = imageio.mimread(two.with_suffix(".mp4"))
    assert len(frames) == 6 * math.ceil(MP4_SECONDS * 8 / 6) and frames[0].shape == (8, 8, 3)  # looped, 8 fps


def test_causal_prints_each_chunk_when_final(tmp_path):
    stdout = run_script(["experiments/generate_causal.py", *VIDEO, "chunk_frames=3", f"out={tmp_path / 'c.pt'}"])
    lines = [line for line in stdout.splitlines() if line.startswith("chunk")]
    want = ["chunk 0 (latent frames 0..2)", "chunk 1 (latent frames 3..5)"]
    assert [line.split(" final")[0] for line in lines] == want
