import torch

from megaslide.nn.rope import RopeTable, apply_rope, grid_positions


def test_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    d = 24
    table = RopeTable(d, 40, 40, 40)
    q, k = torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d)

    def score(pq, pk):
        cq, sq = table.lookup(*[torch.tensor([v]) for v in pq])
        ck, sk = table.lookup(*[torch.tensor([v]) for v in pk])
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    base = score((3, 5, 7), (1, 2, 9))
    for shift in [(10, 0, 0), (0, 4, 1), (7, 11, 13)]:
        moved = score(tuple(a + s for a, s in zip((3, 5, 7), shift)), tuple(a + s for a, s in zip((1, 2, 9), shift)))
        torch.testing.assert_close(base, moved, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(base, score((3, 5, 7), (2, 2, 9)))  # a different offset changes the score


def test_rotation_keeps_norm_and_global_time_slices_agree():
    table = RopeTable(16, 20, 4, 4)
    cos_full, sin_full = table.grid((6, 4, 4))
    cos_tail, sin_tail = table.grid((2, 4, 4), t_start=4)   # frames 4..5 computed on their own
    torch.testing.assert_close(cos_full[4 * 16:], cos_tail)
    torch.testing.assert_close(sin_full[4 * 16:], sin_tail)
    x = torch.randn(2, 6 * 16, 3, 16)
    torch.testing.assert_close(apply_rope(x, cos_full, sin_full).norm(dim=-1), x.norm(dim=-1))
    t, y, xx = grid_positions((2, 3, 4), t_start=5)
    assert t.tolist()[:12] == [5] * 12 and y.tolist()[:4] == [0] * 4 and xx.tolist()[:5] == [0, 1, 2, 3, 0]


def test_grid_is_the_lookup_of_every_token_and_made_where_asked():
    """grid() gathers the per-axis tables at each token's (t, y, x), row-major, on the device asked for (the
    tables are copied there once; on a GPU a long clip's (N, d/2) tables then never cross the bus)."""
    table = RopeTable(24, 7, 5, 6)
    cos, sin = table.grid((3, 5, 6), t_start=2, device=torch.device("cpu"))
    for n, (t, y, x) in enumerate([(2, 0, 0), (2, 0, 5), (2, 1, 0), (4, 4, 5)]):
        row = (t - 2) * 30 + y * 6 + x
        want = table.lookup(torch.tensor([t]), torch.tensor([y]), torch.tensor([x]))
        assert torch.equal(cos[row], want[0][0]) and torch.equal(sin[row], want[1][0]), n
    assert cos.device.type == "cpu" and list(table._copies) == [torch.device("cpu")]
