"""The `dsa` module's whole offset net (conv + GELU, Linear, bound) on its Triton kernels against the net
written out plainly in float64 (megaslide.testing.offset_net_reference), on CPU through the Triton
interpreter: the offsets and the gradients of x, the conv's weight and bias and the Linear's weight and
bias, by the project's tolerance rule (megaslide.testing.within_tolerance)."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built
pytest.importorskip("triton")

from megaslide.attention.dsa import bounded_kernels, depthwise_kernels  # noqa: E402
from megaslide.testing import check_offset_net  # noqa: E402

for kernels in (depthwise_kernels, bounded_kernels):
    if not kernels.INTERPRETED:  # built earlier in this process without the interpreter
        importlib.reload(kernels)


def assert_net_matches(grid, dim, heads, frames, dtype, batch=1):
    result = check_offset_net(grid, dim, heads, frames, dtype, torch.device("cpu"), batch=batch)
    assert result["passed"], result["errors"]


def test_fp32_odd_grid_frame_slab_at_the_clip_end():
    """A 3 x 3 x 5 grid, 6 channels (3 per head), 2 clips: output frames [1, 3) read frame 0 as the halo
    (a slab whose batch stride is the whole clip's), and the conv's zero padding at the clip's last frame
    and every spatial border."""
    assert_net_matches((3, 3, 5), 6, 2, (1, 3), torch.float32, batch=2)


def test_bf16_autocast_whole_clip():
    """bf16 autocast over fp32 weights, as training runs the net: 10 channels, 2 heads of 5."""
    assert_net_matches((3, 3, 5), 10, 2, (0, 3), torch.bfloat16)
