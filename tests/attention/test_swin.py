import torch
import torch.nn.functional as F

from baselines.swin_attention import SwinAttention, shift_mask
from megaslide.attention import build_attention


def _qkv(B, N, h, d):
    return [torch.randn(B, N, h, d, dtype=torch.float64) for _ in range(3)]


def test_one_window_covering_grid_equals_dense():
    grid = (2, 4, 6)
    attn = build_attention("swin", 32, 4, window=grid, layer_idx=1)   # shifted layer, but nothing to shift
    q, k, v = _qkv(2, 48, 4, 8)
    dense = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(attn.attend(q, k, v, None, grid), dense)


def _brute_force(q, k, v, grid, window, shifted):
    """Each token attends to the tokens of its (possibly shifted) window that were its neighbours."""
    T, H, W = grid
    coords = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij"), -1)
    coords = coords.reshape(-1, 3)
    shift = torch.tensor([w // 2 if shifted and w < s else 0 for w, s in zip(window, grid)])
    sizes, win = torch.tensor(grid), torch.tensor(window)
    rolled = (coords - shift) % sizes                         # position after rolling by -shift
    same_window = ((rolled[:, None] // win) == (rolled[None] // win)).all(-1)
    wrapped = (coords - shift) < 0                            # tokens that wrapped around the border
    same_side = (wrapped[:, None] == wrapped[None]).all(-1)
    mask = same_window & same_side
    s = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


def test_shifted_windows_match_brute_force():
    torch.manual_seed(0)
    grid, window = (4, 4, 6), (2, 2, 3)
    for layer in (0, 1):
        attn = SwinAttention(16, 2, window=window, layer_idx=layer)
        q, k, v = _qkv(1, 96, 2, 8)
        torch.testing.assert_close(attn.attend(q, k, v, None, grid), _brute_force(q, k, v, grid, window, layer == 1))


def test_shift_mask_is_symmetric_with_true_diagonal():
    m = shift_mask((4, 4, 4), (2, 2, 2), (1, 1, 1), "cpu")
    assert m.shape == (8, 8, 8)
    assert torch.equal(m, m.transpose(1, 2)) and m.diagonal(dim1=1, dim2=2).all()
    assert not m.all()
