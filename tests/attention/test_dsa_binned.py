"""The binned (atomic-free) fused DSA backward (backward.py) under the Triton interpreter: dq, dk, dv and
d(offsets) against the float64 reference at chosen key tiles and entry blocks, the binning against a
plain PyTorch construction of the key tiles' entry lists, and the kernels' sm_90 build.

Tolerances as tests/attention/test_dsa_triton.py (megaslide.testing.within_tolerance: at most 2x the
same-dtype reference's error plus a rounding floor)."""
from __future__ import annotations

import math

import pytest
import torch

from megaslide.attention.dsa.constants import ENTRY_FLOATS, LOG2E, SCRATCH_BYTES, backward_scratch_bytes
from megaslide.attention.dsa.reference import base_positions, trilinear_corners
from megaslide.testing import deterministic_algorithms, rounding_floor, within_tolerance
from tests.attention.test_dsa_triton import FLOOR_ULPS, backward, forward, launch, make_inputs, run
from tests.helpers import builds_for_sm90

F64 = torch.float64


def assert_backward_matches(shape, kernel_size, dtype, tile, block_e, offsets_dtype=None, half_tokens=False,
                            capacity=None, scratch_bytes=SCRATCH_BYTES, rank_block=launch.RANKED_BIN_BLOCK,
                            **input_kw):
    """dsa_backward with key tiles `tile`, `block_e` entries per dot, `capacity` records per capped list and
    `rank_block` entries per block of the deterministic binning: every gradient within tolerance of the float64
    reference; under deterministic algorithms, a second backward gives the same bits. half_tokens: offsets
    rounded to multiples of 0.5 (zero-weight corners); scratch_bytes: the head groups' scratch bound."""
    inputs = make_inputs(shape, kernel_size, dtype, **input_kw)
    if half_tokens:
        inputs[3] = (inputs[3] * 2).round() / 2
    truth = run("reference", inputs, kernel_size, F64)
    same_dtype = run("reference", inputs, kernel_size, dtype, offsets_dtype=offsets_dtype)
    q, k, v, grad_out = (inputs[i] for i in (0, 1, 2, 4))
    offsets = inputs[3].to(offsets_dtype or dtype)
    scale = shape[-1] ** -0.5
    out, lse = forward.dsa_forward(q, k, v, offsets, kernel_size, scale)
    keys = launch.KeyConfig(tile, block_e, num_warps=1, capacity=capacity, rank_block=rank_block)

    def run_backward():
        return backward.dsa_backward(q, k, v, offsets, out, lse, grad_out, kernel_size, scale, offsets_grad=True,
                                     key_config=keys, scratch_bytes=scratch_bytes)
    grads = run_backward()
    if torch.are_deterministic_algorithms_enabled():  # the striped lists: the same order every run
        assert all(torch.equal(a, b) for a, b in zip(grads, run_backward()))
    for name, want, ref, got in zip(["dq", "dk", "dv", "doffsets"], truth[1:], same_dtype[1:], grads):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        err = (got.to(F64) - want).abs().max().item()
        err_ref = (ref.to(F64) - want).abs().max().item()
        floor = rounding_floor(got.dtype, want, FLOOR_ULPS)
        assert within_tolerance(err, err_ref, floor), f"{name}: error {err:.3e} vs reference {err_ref:.3e}"


def test_odd_grid_tiles_not_dividing_it_far_offsets():
    """3 x 5 x 7 grid in 2 x 2 x 4 tiles (partial on every axis), 2 batches, 3 heads, d = 12 padded to
    16, clamped far offsets (border tiles get long lists: many 16-entry blocks)."""
    assert_backward_matches((2, 3, 5, 7, 3, 12), (1, 3, 3), torch.float32, (2, 2, 4), 16,
                            far_fraction=0.3, offset_std=2.0)


def test_overflowing_lists_fall_back_to_exact_ones(monkeypatch):
    """Capped lists of 5 records overflow in both head groups (scratch for one of 2 heads; a spy reads the
    device flag after each binning); the backward then reads the exact lists, and every gradient still
    matches: odd 3 x 4 x 5 grid, bf16, far offsets."""
    flags = []
    bin_entries = backward.bin_entries
    monkeypatch.setattr(backward, "bin_entries", lambda *a, **kw: (bin_entries(*a, **kw), flags.append(int(a[8]))))
    assert_backward_matches((1, 3, 4, 5, 2, 16), (1, 3, 3), torch.bfloat16, (2, 2, 4), 16, capacity=5,
                            scratch_bytes=60 * backward_scratch_bytes(9), far_fraction=0.3, offset_std=2.0)
    assert flags == [1, 1]


def test_a_capacity_past_the_records_buffer_is_refused():
    q, k, v, offsets, grad_out = make_inputs((1, 2, 3, 4, 1, 16), (1, 3, 3), torch.float32)
    out, lse = forward.dsa_forward(q, k, v, offsets, (1, 3, 3), 0.25)
    for capacity in (0, 2 * 24 * 9 * 8):
        with pytest.raises(ValueError, match="key_config.capacity"):
            backward.dsa_backward(q, k, v, offsets, out, lse, grad_out, (1, 3, 3), 0.25, True,
                                 key_config=launch.KeyConfig((1, 2, 4), 16, 1, capacity=capacity))


def test_a_rank_block_other_than_a_power_of_two_from_16_to_128_is_refused():
    for rank_block in (8, 24, 256):
        with pytest.raises(ValueError, match=r"KeyConfig.rank_block=\d+: .* must be one of \(16, 32, 64, 128\)"):
            launch.KeyConfig((1, 2, 4), 16, 1, rank_block=rank_block)


def test_deterministic_backward_at_the_smallest_rank_block(monkeypatch):
    """Under deterministic algorithms, the key config's rank_block reaches the binning (a spy), whose fill then
    ranks blocks of 16 entries, the smallest: every gradient still matches, the same bits twice (32's lists are
    checked entry by entry in the list-order test). Odd 3 x 4 x 5 grid, 2 heads, d = 12, 2 x 2 x 4 tiles, far
    offsets: 540 entries per head in 2 stripes of 17 blocks of 16."""
    rank_block = 16
    blocks = []
    bin_entries = backward.bin_entries
    monkeypatch.setattr(backward, "bin_entries", lambda *a: (blocks.append((a[9], a[10])), bin_entries(*a)))
    with deterministic_algorithms():
        assert_backward_matches((1, 3, 4, 5, 2, 12), (1, 3, 3), torch.float32, (2, 2, 4), 16,
                                rank_block=rank_block, far_fraction=0.3, offset_std=2.0)
    assert blocks == [(2, rank_block)] * 2


def test_one_key_tiles_bf16_d40():
    """Tiles of one key (8 tiles for most samples, the key rows padded to 16), bf16 with fp32 offsets,
    d = 40 padded to 64, a 1 x 3 x 5 window."""
    assert_backward_matches((1, 2, 3, 6, 2, 40), (1, 3, 5), torch.bfloat16, (1, 1, 1), 16,
                            offsets_dtype=torch.float32, far_fraction=0.1)


def test_integer_offsets_zero_weight_corners_3x1x1():
    """Offsets at whole and half tokens: corners of weight 0, whose tiles must not matter; 3 x 1 x 1 window,
    fp16, 4 x 4 x 4 tiles over a 5 x 4 x 6 grid."""
    assert_backward_matches((1, 5, 4, 6, 2, 16), (3, 1, 1), torch.float16, (4, 4, 4), 32, half_tokens=True,
                            offset_std=3.0, seed=1)


def test_axes_of_one_token():
    """A 1-frame, 1-column grid (T = W = 1): tiles of extent 1 there, 2 x 1 x 1 windows in y."""
    assert_backward_matches((2, 1, 7, 1, 3, 16), (1, 3, 1), torch.float32, (1, 4, 1), 16, far_fraction=0.2)


def test_default_key_tiles_through_the_op():
    """The op's default key tiles and entry blocks (key_config) on a multi-frame grid, bf16."""
    assert launch.key_config((5, 6, 7), 16).tile == (4, 4, 4)
    assert launch.key_config((16, 128, 128), 64).tile == (4, 4, 4)
    assert launch.key_config((16, 128, 128), 64).maxnreg == launch.KEY_MAXNREG
    assert launch.key_config((16, 128, 128), 80).maxnreg is None  # block_d 128: uncapped (launch.capped_registers)
    assert launch.key_config((16, 128, 128), 64).rank_block == launch.RANKED_BIN_BLOCK
    assert launch.key_config((1, 6, 300), 64).tile == (1, 8, 8)
    assert launch.key_config((2, 64, 64), 64).tile == (2, 4, 8)
    assert launch.key_config((1, 1, 5), 64).tile == (1, 1, 8)
    assert_backward_matches((1, 5, 6, 7, 1, 16), (3, 3, 3), torch.bfloat16, launch.key_config((5, 6, 7), 16).tile,
                            launch.key_config((5, 6, 7), 16).block_e)


def clamped_positions(offsets: torch.Tensor, kernel_size) -> torch.Tensor:
    """(B, T, H, W, heads, K, 3) fp32: the reference's sample positions, clamped to the grid."""
    T, H, W = offsets.shape[1:4]
    pos = base_positions((T, H, W), kernel_size)[None, :, :, :, None] + offsets.float()
    return torch.clamp(pos, min=torch.zeros(3), max=torch.tensor([T - 1.0, H - 1.0, W - 1.0]))


def scratch_entries(offsets: torch.Tensor, kernel_size) -> torch.Tensor:
    """The query pass's scratch (B, heads, K, N, ENTRY_FLOATS) for these offsets, as binning reads it: the
    clamped position in words 2-4 (ds, p and the padding are arbitrary: binning must not read them)."""
    B, T, H, W, heads, K, _ = offsets.shape
    pos = clamped_positions(offsets, kernel_size).permute(0, 4, 5, 1, 2, 3, 6).reshape(B, heads, K, T * H * W, 3)
    entries = torch.full((B, heads, K, T * H * W, ENTRY_FLOATS), float("nan"))
    entries[..., 2:5] = pos
    return entries


def test_query_pass_entries():
    """The query pass's scratch entry of each (query, sample), read in the layout the later passes read it
    (B, heads, K, N, ENTRY_FLOATS): words 2-4 are the reference's clamped position (exactly, fp32), p sums
    to 1 and ds to 0 over a query's samples (sum_j p_j (<dO, V_j> - <dO, out>) = 0), the padding is 0.
    2 batches, 3 heads, an odd 3 x 5 x 7 grid, far offsets (clamped positions on every face)."""
    shape, kernel_size = (2, 3, 5, 7, 3, 16), (3, 3, 3)
    B, T, H, W, heads, d = shape
    K, N = math.prod(kernel_size), T * H * W
    q, k, v, offsets, grad_out = make_inputs(shape, kernel_size, torch.float32, offset_std=2.0, far_fraction=0.3)
    scale = d ** -0.5
    out, lse = forward.dsa_forward(q, k, v, offsets, kernel_size, scale)
    dsp = torch.full((B * heads * K * N * ENTRY_FLOATS,), float("nan"))
    backward.query_pass(q, k, v, offsets, out, grad_out, lse, torch.empty_like(q), torch.empty_like(offsets), dsp,
                      kernel_size, scale, scale * LOG2E, True, launch.launch_config(N, d))
    entries = dsp.view(B, heads, K, N, ENTRY_FLOATS)
    pos = clamped_positions(offsets, kernel_size).permute(0, 4, 5, 1, 2, 3, 6).reshape(B, heads, K, N, 3)
    assert torch.equal(entries[..., 2:5], pos)
    torch.testing.assert_close(entries[..., 1].sum(2), torch.ones(B, heads, N), rtol=0, atol=1e-5)
    torch.testing.assert_close(entries[..., 0].sum(2), torch.zeros(B, heads, N), rtol=0, atol=1e-5)
    assert (entries[..., 5:] == 0).all() and (entries[..., 1] > 0).all()


def reference_lists(offsets: torch.Tensor, kernel_size, tile) -> dict[tuple[int, int], set[int]]:
    """{(batch * heads + head, key tile): {entries e = j * N + n whose nonzero-weight corners lie in it}}
    from the reference's positions and trilinear corners."""
    B, T, H, W, heads, K, _ = offsets.shape
    N = T * H * W
    pos = clamped_positions(offsets, kernel_size)  # (B, T, H, W, heads, K, 3)
    tiles_y, tiles_x = math.ceil(H / tile[1]), math.ceil(W / tile[2])
    lists: dict[tuple[int, int], set[int]] = {}
    for token, weight in trilinear_corners(pos, (T, H, W)):
        t, y, x = token // (H * W), token // W % H, token % W
        key_tile = (t // tile[0] * tiles_y + y // tile[1]) * tiles_x + x // tile[2]  # (B, T, H, W, heads, K)
        for b, n_t, n_y, n_x, h, j in (weight != 0).nonzero().tolist():
            n = (n_t * H + n_y) * W + n_x
            lists.setdefault((b * heads + h, key_tile[b, n_t, n_y, n_x, h, j].item()), set()).add(j * N + n)
    return lists


def _far_half_token_offsets(shape, seed):
    """Offsets (B, T, H, W, heads, K, 3) of std 2, half of them rounded to half tokens (zero-weight corners)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randn(shape, generator=g) * 2
    return torch.where(torch.rand(offsets.shape, generator=g) < 0.5, (offsets * 2).round() / 2, offsets)


@pytest.mark.parametrize("grid,kernel_size,tile,capacity", [((3, 5, 7), (3, 3, 3), (2, 2, 4), None),
                                                            ((1, 4, 6), (1, 3, 5), (1, 1, 1), None),
                                                            ((1, 4, 6), (1, 3, 5), (1, 1, 1), 6)])
def test_binning_matches_plain_lists(grid, kernel_size, tile, capacity):
    """Each (batch, head, tile)'s list holds exactly the entries with a nonzero-weight corner in the tile
    (as a set: the order is the order programs took slots). Offsets at half tokens give zero weights.
    The default capacity gives the capped lists (flag clear, nothing written outside their rooms); 6
    records overflow, and the exact lists (flag set) hold the same sets."""
    B, heads, K = 2, 3, math.prod(kernel_size)
    offsets = _far_half_token_offsets((B, *grid, heads, K, 3), seed=0)
    tiles = math.prod(backward.tiles_per_axis(grid, tile))
    lists = B * heads * tiles
    capacity = capacity or backward.list_capacity(math.prod(grid), K, tiles)
    cursors = torch.empty(lists, dtype=torch.int32)
    starts = torch.empty(2 * lists + 1, dtype=torch.int32)
    records = torch.full((B * heads * math.prod(grid) * K * 8,), -1, dtype=torch.int32)
    flag = torch.empty(1, dtype=torch.int32)
    backward.bin_entries(scratch_entries(offsets, kernel_size), (B, *grid, heads), K, tile, capacity,
                         cursors, starts, records, flag)
    exact = bool(flag)
    assert exact == (capacity == 6)
    bounds = [(starts[i], starts[i + 1]) if exact else (i * capacity, i * capacity + min(cursors[i], capacity))
              for i in range(lists)]
    want = reference_lists(offsets, kernel_size, tile)
    got = {}
    for i, (start, end) in enumerate(bounds):
        entries = records[start:end].tolist()
        assert len(entries) == len(set(entries)), f"list {i} repeats an entry"
        if entries:
            got[divmod(i, tiles)] = set(entries)
    assert got == want
    if not exact:
        unused = torch.ones_like(records, dtype=torch.bool)
        for start, end in bounds:
            unused[start:end] = False
        assert (records[unused] == -1).all()  # nothing written outside the lists


def _striped_segments(offsets, kernel_size, tile, stripes, rank_block=launch.RANKED_BIN_BLOCK):
    """The deterministic binning's lists of `offsets` with `stripes` stripes of blocks of `rank_block` entries, by
    segment: {(bh, tile): [segment s's entries in list order for s < stripes]} for each nonempty list."""
    B, T, H, W, heads, K, _ = offsets.shape
    tiles = math.prod(backward.tiles_per_axis((T, H, W), tile))
    lists = B * heads * tiles
    starts = torch.full((2 * lists * stripes + 1,), -1, dtype=torch.int32)
    records = torch.full((B * heads * T * H * W * K * 8,), -1, dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)
    backward.bin_entries(scratch_entries(offsets, kernel_size), (B, T, H, W, heads), K, tile, 1,
                         torch.empty(lists, dtype=torch.int32), starts, records, flag, stripes, rank_block)
    assert int(flag) == 1 and int(starts[0]) == 0
    bounds = starts[:lists * stripes + 1].tolist()
    return {divmod(i, tiles): [records[bounds[s]:bounds[s + 1]].tolist() for s in range(i * stripes, (i + 1) * stripes)]
            for i in range(lists) if bounds[(i + 1) * stripes] > bounds[i * stripes]}


def _striped_lists(offsets, kernel_size, tile, stripes, rank_block=launch.RANKED_BIN_BLOCK):
    """The deterministic binning's lists of `offsets` with `stripes` stripes of blocks of `rank_block` entries:
    {(bh, tile): entries in list order}."""
    by_list = _striped_segments(offsets, kernel_size, tile, stripes, rank_block)
    return {key: sum(segments, []) for key, segments in by_list.items()}


@pytest.mark.parametrize("rank_block", [32, 64])
def test_deterministic_lists_hold_their_entries_in_entry_order_whatever_the_stripes(rank_block):
    """With stripes, each list holds exactly the plain construction's entries, in one order fixed by the entries
    and the rank block alone: entry block (rank_block entries, the default's and a smaller one), then the corner
    that reaches the tile (t, y, x bits, lower 0), then the entry; so 1 and 3 stripes (3 programs that each own a
    segment of every list, the last one shorter) give the same lists. 1 batch, 2 heads, odd 3 x 5 x 7 grid,
    2 x 2 x 4 tiles, far offsets at half tokens."""
    grid, kernel_size, tile = (3, 5, 7), (3, 3, 3), (2, 2, 4)
    B, heads, K, N = 1, 2, math.prod(kernel_size), math.prod(grid)
    offsets = _far_half_token_offsets((B, *grid, heads, K, 3), seed=1)
    lower = clamped_positions(offsets, kernel_size).floor().long()  # (B, T, H, W, heads, K, 3)
    lower = lower.permute(0, 4, 5, 1, 2, 3, 6).reshape(B * heads, K * N, 3).tolist()  # [bh][e][axis]
    tiles_t, tiles_y, tiles_x = backward.tiles_per_axis(grid, tile)

    def corner(bh, key_tile, e):
        at = (key_tile // (tiles_y * tiles_x), key_tile // tiles_x % tiles_y, key_tile % tiles_x)
        return sum(4 >> axis for axis in range(3) if at[axis] != lower[bh][e][axis] // tile[axis])

    lists = _striped_lists(offsets, kernel_size, tile, 1, rank_block)
    assert {key: set(v) for key, v in lists.items()} == reference_lists(offsets, kernel_size, tile)
    for (bh, key_tile), entries in lists.items():
        assert entries == sorted(entries, key=lambda e: (e // rank_block, corner(bh, key_tile, e), e))
    assert _striped_lists(offsets, kernel_size, tile, 3, rank_block) == lists


@pytest.mark.parametrize("stripes", [4, 7, 10])
def test_deterministic_counts_land_in_the_stripes_that_fill_them(stripes):
    """Segment s of each list holds exactly the list's entries of stripe s (launch.stripe_entries), so each count
    landed in the segment that its stripe's fill program fills (a count in another segment moves the segments'
    bounds off the records the fill writes). 2835 entries per (batch, head): 45 rank blocks of 64 entries, the
    last partial, counted in 12 blocks of BIN_BLOCK; 4 stripes of 12 blocks (the last 9; bounds on counted
    blocks' bounds), 7 of 7 (the last 3) and 10 of 5 (the last empty), whose bounds fall inside counted blocks.
    1 batch, 2 heads, odd 3 x 5 x 7 grid, 2 x 2 x 4 tiles, far offsets at half tokens."""
    grid, kernel_size, tile = (3, 5, 7), (3, 3, 3), (2, 2, 4)
    B, heads, K = 1, 2, math.prod(kernel_size)
    entries = math.prod(grid) * K
    assert (entries, math.ceil(entries / 64)) == (2835, 45)
    per_stripe = launch.stripe_entries(entries, stripes, 64)
    assert per_stripe == 64 * {4: 12, 7: 7, 10: 5}[stripes]
    offsets = _far_half_token_offsets((B, *grid, heads, K, 3), seed=2)
    want = reference_lists(offsets, kernel_size, tile)
    got = _striped_segments(offsets, kernel_size, tile, stripes, 64)
    assert got.keys() == want.keys()
    for key, segments in got.items():
        assert [sorted(segment) for segment in segments] == [
            sorted(e for e in want[key] if e // per_stripe == s) for s in range(stripes)], key


def test_deterministic_algorithms_build_striped_lists(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the backward bins in stripes (a spy) and its gradients equal
    the default run's (in the interpreter both orders are fixed)."""
    shape, kernel_size = (1, 3, 4, 5, 2, 16), (1, 3, 3)
    q, k, v, offsets, grad_out = make_inputs(shape, kernel_size, torch.float32, offset_std=2.0)
    out, lse = forward.dsa_forward(q, k, v, offsets, kernel_size, 0.25)
    args = (q, k, v, offsets, out, lse, grad_out, kernel_size, 0.25, True)
    plain = backward.dsa_backward(*args)
    stripes = []
    bin_entries = backward.bin_entries
    monkeypatch.setattr(backward, "bin_entries", lambda *a: (stripes.append(a[9]), bin_entries(*a)))
    with deterministic_algorithms():
        striped = backward.dsa_backward(*args)
    assert not torch.are_deterministic_algorithms_enabled()
    assert stripes and all(s is not None and s >= 1 for s in stripes), stripes
    for a, b in zip(plain, striped):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_binned_kernels_compile_for_sm90():
    """Build the query, both binning (the ranked fill at each of launch.RANK_BLOCKS) and the key kernels to sm_90
    SASS (bf16 and fp32 rows, the default and swept key tiles) in a process without TRITON_INTERPRET."""
    assert builds_for_sm90("""
        from megaslide.attention.dsa import backward, constants, launch

        common = {"T": "i32", "H": "i32", "W": "i32", "HEADS": "i32"}
        window = {"KT": 3, "KH": 3, "KW": 3}
        cfg = launch.launch_config(262144, 64)
        query = {**{n: "*bf16" for n in ["q_ptr", "k_ptr", "v_ptr", "off_ptr", "out_ptr", "dout_ptr"]},
                 "lse_ptr": "*fp32", "dq_ptr": "*bf16", "doff_ptr": "*fp32", "dsp_ptr": "*fp32", **common,
                 "D": "i32", "stride_tok": "i32", "stride_off_tok": "i32", "scale": "fp32", "qk_scale": "fp32"}
        build(backward._query_kernel, query, {**window, "BLOCK_Q": cfg.block_q, "BLOCK_D": cfg.block_d,
                                            "OFFSET_GRAD": True, "ENTRY": constants.ENTRY_FLOATS,
                                            "WIDE": False, "EVEN_D": True, "BLOCK_Y": 1}, cfg.num_warps,
              aligned_ints=("D", "stride_tok"))
        tiles = {"TILES_Y": "i32", "TILES_X": "i32", "TILES": "i32"}
        bins = {"dsp_ptr": "*fp32", "slot_ptr": "*i32", "records_ptr": "*i32", "flag_ptr": "*i32", "T": "i32",
                "H": "i32", "W": "i32", **tiles}
        bin_const = {"K": 27, "TT": 4, "TY": 4, "TX": 4, "BLOCK": launch.BIN_BLOCK, "ENTRY": constants.ENTRY_FLOATS}
        capped = {("cursor_ptr" if n == "slot_ptr" else n): t for n, t in bins.items()}
        build(backward._bin_capped_kernel, {**capped, "CAP": "i32"}, bin_const, 4)
        exact = [(False, False, launch.BIN_BLOCK), (True, False, launch.BIN_BLOCK)]
        for fill, ranked, block in exact + [(True, True, b) for b in launch.RANK_BLOCKS]:
            build(backward._bin_kernel, {**bins, "BLOCKS": "i32", "STRIPES": "i32", "STRIPE_ENTRIES": "i32"},
                  {**bin_const, "BLOCK": block, "FILL": fill, "RANKED": ranked}, 4)
        for dtype, tile, block_e, block_d in [("bf16", (4, 4, 4), 32, 64), ("bf16", (2, 4, 8), 64, 128),
                                              ("bf16", (1, 1, 1), 16, 64), ("fp32", (4, 4, 4), 32, 64)]:
            keys = {"q_ptr": "*" + dtype, "dout_ptr": "*" + dtype, "dsp_ptr": "*fp32", "cursor_ptr": "*i32",
                    "starts_ptr": "*i32", "flag_ptr": "*i32", "records_ptr": "*i32", "dk_ptr": "*" + dtype,
                    "dv_ptr": "*" + dtype, **common, "D": "i32", "stride_tok": "i32", **tiles, "CAP": "i32",
                    "STRIPES": "i32"}
            const = {"K": 27, "TT": tile[0], "TY": tile[1], "TX": tile[2], "PX": backward.padded_x(tile),
                     "BLOCK_E": block_e, "BLOCK_D": block_d, "UPCAST": False, "ENTRY": constants.ENTRY_FLOATS,
                     "WIDE": False, "EVEN_D": True}
            build(backward._key_kernel, keys, const, 4, aligned_ints=("D", "stride_tok"))
    """) == 12
