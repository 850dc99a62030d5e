"""Caption conditioning that needs no downloads.

`HashTokenizer` maps lower-cased words to ids by a stable hash into a fixed vocabulary
(id 0 = padding, 1 = start token), so any caption is valid without a vocabulary file.
`TextEncoder` is a few transformer layers trained jointly with the DiT. Users with a real
T5/CLIP can skip both and pass precomputed embeddings (`load_text_embeddings`).
"""
from __future__ import annotations

import re
import zlib
from pathlib import Path

import torch
from torch import nn

from megaslide.models.layers import default_init

PAD_ID, START_ID = 0, 1
_WORD = re.compile(r"[a-z0-9]+")


class HashTokenizer:
    def __init__(self, vocab_size: int, max_len: int):
        if vocab_size < 3:
            raise ValueError(f"vocab_size={vocab_size} must be >= 3 (pad, start and at least one word id)")
        self.vocab_size = vocab_size
        self.max_len = max_len

    def word_id(self, word: str) -> int:
        return 2 + zlib.crc32(word.encode()) % (self.vocab_size - 2)

    def __call__(self, captions: list[str]) -> torch.Tensor:
        """Token ids (B, max_len); an empty caption (the CFG null caption) is the start token alone."""
        ids = torch.full((len(captions), self.max_len), PAD_ID, dtype=torch.long)
        for row, caption in enumerate(captions):
            words = [START_ID] + [self.word_id(w) for w in _WORD.findall(caption.lower())]
            words = words[: self.max_len]
            ids[row, : len(words)] = torch.tensor(words)
        return ids


class TextEncoder(nn.Module):
    """Token ids (B, L) -> caption features (B, L, text_dim) and a validity mask (B, L)."""

    def __init__(self, vocab_size: int, max_len: int, dim: int, layers: int, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        nn.init.normal_(self.pos, std=0.02)
        heads = heads if dim % heads == 0 else 1
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def reset_parameters(self) -> None:
        """Every parameter as the constructor defines it, drawn in its order: the embedding, the positions
        (normal, std 0.02), the layers, the final norm."""
        self.embed.reset_parameters()
        nn.init.normal_(self.pos, std=0.02)
        default_init(self.layers)
        self.norm.reset_parameters()

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = ids != PAD_ID                                  # (B, L)
        x = self.embed(ids) + self.pos[: ids.shape[1]]        # (B, L, Dt)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=~mask)          # (B, L, Dt)
        return self.norm(x), mask


def load_text_embeddings(path: str | Path) -> dict[str, torch.Tensor]:
    """Precomputed caption embeddings: a torch file mapping caption -> (L, text_dim) tensor."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"text embeddings file {str(path)!r} does not exist; save a dict caption -> (L, D) "
                         f"tensor with torch.save")
    table = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(table, dict) or not all(isinstance(v, torch.Tensor) and v.ndim == 2 for v in table.values()):
        raise ValueError(f"{str(path)!r} must hold a dict of caption -> (L, D) tensors")
    return table
