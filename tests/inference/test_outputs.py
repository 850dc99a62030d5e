"""save_latents: the latents, and for a pixel-space model its first video as an mp4 looped to MP4_SECONDS."""
import math

import imageio.v2 as imageio
import numpy as np
import torch

from megaslide.data.video_io import MP4_SECONDS, to_uint8_frames
from megaslide.inference.outputs import save_latents
from tests.helpers import needs_ffmpeg


@needs_ffmpeg
def test_pixel_latents_write_a_video_looped_to_mp4_seconds(tmp_path):
    grey = torch.linspace(-1, 1, 5)  # frame t of the first video is flat grey grey[t], which H.264 keeps exactly
    latents = torch.stack([grey.view(1, 5, 1, 1).expand(3, 5, 8, 8), -torch.ones(3, 5, 8, 8)])  # (B, C, T, H, W)
    pt, mp4 = save_latents(tmp_path / "out" / "x.pt", latents)
    torch.testing.assert_close(torch.load(pt), latents, rtol=0, atol=0)
    decoded = np.stack(imageio.mimread(mp4, format="FFMPEG"))  # (frames, H, W, 3) at write_mp4's default 8 fps
    loops = math.ceil(MP4_SECONDS * 8 / 5)
    assert len(decoded) == 5 * loops and len(decoded) / 8 >= MP4_SECONDS
    want = np.tile(to_uint8_frames(latents[0]), (loops, 1, 1, 1))  # the first video, played `loops` times
    assert np.abs(decoded.astype(int) - want.astype(int)).max() <= 2


def test_latent_space_latents_write_no_video(tmp_path):
    assert save_latents(tmp_path / "x.pt", torch.zeros(1, 4, 2, 4, 4)) == [tmp_path / "x.pt"]
