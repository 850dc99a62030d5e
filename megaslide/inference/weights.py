"""Models for inference: weights from a training checkpoint, or seeded random weights for speed runs."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from megaslide.checkpoint import BLOCK_LAYOUT, SHARD_RANKS, block_weights, flat_layout, read_state
from megaslide.config import DiTConfig, from_dict
from megaslide.models.dit import DiTBlock, VideoDiT, build_dit

# The alignment (elements) of the block buffers of every sharded checkpoint written before state.pt recorded
# their layout. A fact about those files, fixed for good: the offload engine's own alignment may change.
UNRECORDED_LAYOUT_ALIGN = 64


@torch.no_grad()
def random_weights_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter with seeded random values (identical on every rank of one device type).

    Matrices get N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2), other vectors N(0, 0.1^2). Unlike
    the adaLN-Zero init, no gate or output layer is zero, so every path of the network carries
    signal: what speed and equivalence checks of an untrained model need."""
    norms = {id(mod.weight) for mod in model.modules()
             if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) and mod.weight is not None}
    for i, p in enumerate(model.parameters()):
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if p.dim() >= 2:
            p.copy_(noise / p[0].numel() ** 0.5)
        elif id(p) in norms:
            p.copy_(1 + 0.1 * noise)
        else:
            p.copy_(0.1 * noise)
    return model


def caption_input(model: VideoDiT, captions: list[str], device: torch.device, seed: int = 0) -> torch.Tensor:
    """The captions as `model`'s forward takes them: token ids (B, L) of its built-in tokenizer, or, for a model
    that reads caption embeddings (model.text_encoder=false: the Wan presets), seeded random stand-ins
    (B, text_len, text_dim) of the text encoder's output: a random-weight speed run needs their shape only."""
    if model.text_encoder is not None:
        return model.tokenizer(captions).to(device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(captions), model.cfg.text_len, model.cfg.text_dim, generator=gen).to(device)


def sampling_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, run state) of a checkpoint of either format: the state dict to sample with (the EMA
    when the run kept one, else the trained weights; fp32 masters of a sharded checkpoint) and
    the checkpoint's `read_state`."""
    path, state = Path(path), read_state(path)
    if not path.is_dir():
        return state.get("ema") or state["model"], state
    cfg = from_dict(DiTConfig, state["model_cfg"])
    return {**state["params"], **block_weights(path, shard_layout(state, cfg), cfg.depth,
                                                              state.get(SHARD_RANKS, 1))}, state


def shard_layout(state: dict, cfg: DiTConfig) -> dict:
    """The flat layout of a sharded checkpoint's block buffers: the one its state.pt records, or, for a
    checkpoint older than that record, the layout it was written in (a block's parameters in
    `named_parameters()` order, each on an UNRECORDED_LAYOUT_ALIGN boundary), rebuilt from a block of its
    config on the meta device."""
    if BLOCK_LAYOUT in state:
        return state[BLOCK_LAYOUT]
    with torch.device("meta"):
        block = DiTBlock(cfg, 0)
    return flat_layout(((name, p.shape) for name, p in block.named_parameters()), UNRECORDED_LAYOUT_ALIGN)


def load_model(config: DiTConfig, *, checkpoint: str = "", seed: int = 0, device: torch.device,
               dtype: torch.dtype) -> VideoDiT:
    """An eval-mode VideoDiT on `device` in `dtype`, the same on every rank.

    With `checkpoint` (of experiments/train.py: a step_N.pt file or a sharded step_N/ folder) the
    model takes the checkpoint's own config and its EMA weights (its raw weights if it kept no EMA),
    and `config` is not used; without it, `config` gets seeded random weights (`random_weights_`)."""
    if checkpoint:
        weights, state = sampling_weights(checkpoint)
        model = VideoDiT(from_dict(DiTConfig, state["model_cfg"]))
        model.load_state_dict(weights)
        model.to(device)
    else:
        with torch.device(device):
            model = random_weights_(build_dit(config), seed)
    return model.to(dtype).eval()
