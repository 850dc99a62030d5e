import math
import os

import numpy as np
import pytest
import torch

from megaslide.data.moving_shapes import (
    COLORS,
    DIRECTIONS,
    SHAPES,
    MovingShapes,
    caption_for,
    collate,
    parse_caption,
    render_video,
)

os.environ.setdefault("WANDB_MODE", "disabled")


def reference_inside(shape: str, dy: float, dx: float, size: float) -> bool:
    """Slow point-in-shape test written from the geometry, independent of signed_distance."""
    half = size / 2.0
    if shape == "circle":
        return dy * dy + dx * dx <= half * half
    if shape == "square":
        return abs(dy) <= half and abs(dx) <= half
    if shape == "diamond":
        return abs(dy) + abs(dx) <= half
    # triangle: apex (-2s/3, 0), base corners (s/3, -s/2) and (s/3, s/2); same-side test
    corners = [(-2 * size / 3, 0.0), (size / 3, -half), (size / 3, half)]
    signs = []
    for (ay, ax), (by, bx) in zip(corners, corners[1:] + corners[:1]):
        signs.append((bx - ax) * (dy - ay) - (by - ay) * (dx - ax))
    return all(s >= 0 for s in signs) or all(s <= 0 for s in signs)


def reference_frame(height, width, centers, labels, size, wrap):
    """Hard-edged (3, H, W) frame in [0, 255] by a per-pixel loop; centers (S, 2)."""
    frame = np.zeros((3, height, width))
    for (cy, cx), label in zip(centers.tolist(), labels):
        for i in range(height):
            for j in range(width):
                dy, dx = i - cy, j - cx
                if wrap:
                    dy = (dy + height / 2) % height - height / 2
                    dx = (dx + width / 2) % width - width / 2
                if reference_inside(label["shape"], dy, dx, size):
                    frame[:, i, j] = COLORS[label["color"]]
    return frame


@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("height,width", [(17, 23), (32, 32)])
def test_hard_render_matches_pixel_loop(wrap, height, width):
    rng = np.random.default_rng(height * 100 + width + wrap)
    labels = [{"color": c, "shape": s} for c, s in zip(["red", "blue", "yellow", "white"], SHAPES)]
    size = 7.3
    margin = 0 if wrap else size
    centers = torch.tensor(
        [[rng.uniform(margin, height - margin), rng.uniform(margin, width - margin)] for _ in labels],
        dtype=torch.float32,
    ).view(len(labels), 1, 2)
    fast = render_video(height, width, centers, labels, size, wrap=wrap, antialias=False)[:, 0]
    slow = reference_frame(height, width, centers[:, 0].double(), labels, size, wrap)
    np.testing.assert_array_equal(fast.numpy(), slow)


@pytest.mark.parametrize(
    "shape,area_factor", [("circle", math.pi / 4), ("square", 1.0), ("triangle", 0.5), ("diamond", 0.5)]
)
def test_antialiased_area_and_centroid(shape, area_factor):
    size, height, width = 11.0, 40, 40
    centers = torch.tensor([[[13.3, 20.6]], [[38.2, 0.7]]])  # second one wraps over two borders
    for center in centers:
        video = render_video(height, width, center.view(1, 1, 2), [{"color": "white", "shape": shape}], size)
        alpha = video[0, 0] / 255.0  # (H, W)
        assert alpha.sum().item() == pytest.approx(area_factor * size * size, rel=0.02)
        ys = torch.arange(height, dtype=torch.float32).view(-1, 1)
        xs = torch.arange(width, dtype=torch.float32).view(1, -1)
        dy = torch.remainder(ys - center[0, 0] + height / 2, height) - height / 2
        dx = torch.remainder(xs - center[0, 1] + width / 2, width) - width / 2
        assert (alpha * dy).sum().item() / alpha.sum().item() == pytest.approx(0.0, abs=0.1)
        assert (alpha * dx).sum().item() / alpha.sum().item() == pytest.approx(0.0, abs=0.1)


def test_item_contract_and_determinism():
    ds = MovingShapes(5, frames=9, height=24, width=40, num_shapes=3, speed=(6.0, 10.0), shape_size=8, seed=7)
    again = MovingShapes(5, frames=9, height=24, width=40, num_shapes=3, speed=(6.0, 10.0), shape_size=8, seed=7)
    other_seed = MovingShapes(5, frames=9, height=24, width=40, num_shapes=3, speed=(6.0, 10.0), shape_size=8, seed=8)
    item = ds[3]
    assert set(item) == {"video", "caption", "trajectory", "labels"}
    assert item["video"].shape == (3, 9, 24, 40) and item["video"].dtype == torch.float32
    assert item["video"].min() >= -1.0 and item["video"].max() <= 1.0
    assert item["video"].min() == -1.0  # black background
    assert item["trajectory"].shape == (3, 9, 2) and item["trajectory"].dtype == torch.float32
    assert len(item["labels"]) == 3
    assert len({lab["color"] for lab in item["labels"]}) == 3
    for lab in item["labels"]:
        assert lab["shape"] in SHAPES and lab["direction"] in DIRECTIONS and 6.0 <= lab["speed"] <= 10.0
    assert item["caption"] == caption_for(item["labels"])
    named = [{k: lab[k] for k in ("color", "shape", "direction")} for lab in item["labels"]]
    assert parse_caption(item["caption"]) == named
    assert torch.equal(item["video"], again[3]["video"]) and item["caption"] == again[3]["caption"]
    assert not torch.equal(item["video"], ds[2]["video"])
    assert not torch.equal(item["video"], other_seed[3]["video"])


@pytest.mark.parametrize("boundary", ["wrap", "inside"])
def test_trajectory_is_constant_velocity_along_label_direction(boundary):
    height, width = 36, 44
    ds = MovingShapes(
        6, frames=6, height=height, width=width, num_shapes=2, speed=(1.0, 3.0), shape_size=8, boundary=boundary
    )
    extent = torch.tensor([height, width], dtype=torch.float32)
    for index in range(len(ds)):
        item = ds[index]
        steps = item["trajectory"][:, 1:] - item["trajectory"][:, :-1]  # (S, T-1, 2)
        steps = torch.remainder(steps + extent / 2, extent) - extent / 2
        for label, shape_steps in zip(item["labels"], steps):
            expected = torch.tensor(DIRECTIONS[label["direction"]]) * label["speed"]
            torch.testing.assert_close(shape_steps, expected.expand_as(shape_steps), atol=1e-4, rtol=0)
        if boundary == "inside":
            video = item["video"]
            border = torch.cat([video[..., 0, :], video[..., -1, :], video[..., :, 0], video[..., :, -1]], dim=-1)
            assert torch.all(border == -1.0), "a shape touched the border with boundary='inside'"


def test_direction_reads_from_pixels():
    """The colour-weighted centroid of the frames moves the way the caption says."""
    ds = MovingShapes(
        len(DIRECTIONS), frames=5, height=48, width=48, speed=3.0, shape_size=10, boundary="inside", seed=1
    )
    for index in range(len(ds)):
        item = ds[index]
        mass = (item["video"] + 1).sum(0)  # (T, H, W)
        ys = torch.arange(48.0).view(1, -1, 1)
        xs = torch.arange(48.0).view(1, 1, -1)
        center = torch.stack([(mass * ys).sum((1, 2)), (mass * xs).sum((1, 2))], -1) / mass.sum((1, 2)).unsqueeze(-1)
        velocity = (center[-1] - center[0]) / 4
        expected = torch.tensor(DIRECTIONS[item["labels"][0]["direction"]]) * 3.0
        torch.testing.assert_close(velocity, expected, atol=0.05, rtol=0)


def test_allowed_names_and_single_speed():
    ds = MovingShapes(8, colors=["red", "cyan"], shapes=["square"], directions=["left", "up"], speed=8.0, seed=3)
    for index in range(len(ds)):
        lab = ds[index]["labels"][0]
        assert lab["color"] in ("red", "cyan") and lab["shape"] == "square" and lab["direction"] in ("left", "up")
        assert lab["speed"] == 8.0


def test_collate_stacks_tensors_and_lists_the_rest():
    ds = MovingShapes(3, frames=4, height=16, width=16, num_shapes=2, shape_size=4)
    batch = collate([ds[i] for i in range(3)])
    assert batch["video"].shape == (3, 3, 4, 16, 16)
    assert batch["trajectory"].shape == (3, 2, 4, 2)
    assert batch["caption"] == [ds[i]["caption"] for i in range(3)]
    assert len(batch["labels"]) == 3
    with pytest.raises(ValueError, match="items"):
        collate([])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(colors=["red", "purple"]), "colors"),
        (dict(shapes=["hexagon"]), "shapes"),
        (dict(directions=["sideways"]), "directions"),
        (dict(num_shapes=3, colors=["red", "blue"]), "num_shapes"),
        (dict(speed=16.0), "speed"),
        (dict(speed=(3.0, 2.0)), "speed"),
        (dict(speed=4.0, frames=16, boundary="inside"), "boundary='wrap'"),
        (dict(shape_size=20), "shape_size"),
        (dict(frames=1), "frames"),
        (dict(background=(255, 0, 0)), "background"),
        (dict(boundary="bounce"), "boundary"),
        (dict(num_videos=0), "num_videos"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(num_videos=2, frames=8, height=32, width=32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MovingShapes(**args)


def test_index_out_of_range_and_bad_caption():
    ds = MovingShapes(2)
    with pytest.raises(IndexError):
        ds[2]
    with pytest.raises(ValueError, match="caption"):
        parse_caption("a red circle flying left")
    with pytest.raises(ValueError, match="color"):
        parse_caption("a purple circle moving left")
