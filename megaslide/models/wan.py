"""Wan 2.x in MegaSlide's terms: diffusers' `WanTransformer3DModel` config and weight names.

A Wan transformer is a `VideoDiT` of the `wan` block family (`DiTConfig.block`) without the built-in text
encoder: MegaSlide's stem (Conv3d patch embedding, sinusoidal timestep -> MLP -> SiLU -> Linear to the block
modulation, caption Linear -> tanh-GELU -> Linear), its 3D RoPE (head dim split t : h : w as d - 4(d//6) :
2(d//6) : 2(d//6)), QK RMSNorm over all heads, tanh-GELU MLP and final layer compute what diffusers' do.
Only names and layouts differ: diffusers keeps q, k, v (and the cross-attention's k, v) as separate Linears,
which MegaSlide fuses, and its modulation tables carry a leading axis of 1. This module maps both ways;
megaslide/models/pretrained.py reads and writes the files.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from megaslide.config import DiTConfig
from megaslide.models.dit import DIT_PRESETS

WAN_CLASS = "WanTransformer3DModel"

DIFFUSERS_DEFAULTS = {
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}
"""`WanTransformer3DModel`'s constructor defaults: what diffusers assumes for a key a config.json lacks."""

_SUPPORTED = {
    "image_dim": (None, "image conditioning (Wan I2V) is not supported"),
    "added_kv_proj_dim": (None, "image conditioning (Wan I2V) is not supported"),
    "pos_embed_seq_len": (None, "image conditioning (Wan FLF2V) is not supported"),
    "cross_attn_norm": (True, "MegaSlide's wan block always has the cross-attention LayerNorm"),
    "eps": (1e-6, "MegaSlide's norms use eps 1e-6"),
}
"""Config keys whose value MegaSlide supports only as given, and why."""

_STEM = {
    "patch_embed.proj": ("patch_embedding",),
    "t_embed.mlp.0": ("condition_embedder.time_embedder.linear_1",),
    "t_embed.mlp.2": ("condition_embedder.time_embedder.linear_2",),
    "t_proj.1": ("condition_embedder.time_proj",),
    "text_proj.0": ("condition_embedder.text_embedder.linear_1",),
    "text_proj.2": ("condition_embedder.text_embedder.linear_2",),
    "final.linear": ("proj_out",),
}
_BLOCK = {
    "attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
    "attn.out": ("attn1.to_out.0",),
    "attn.q_norm": ("attn1.norm_q",),
    "attn.k_norm": ("attn1.norm_k",),
    "norm2": ("norm2",),
    "cross.q": ("attn2.to_q",),
    "cross.kv": ("attn2.to_k", "attn2.to_v"),
    "cross.out": ("attn2.to_out.0",),
    "cross.q_norm": ("attn2.norm_q",),
    "cross.k_norm": ("attn2.norm_k",),
    "mlp.fc1": ("ffn.net.0.proj",),
    "mlp.fc2": ("ffn.net.2",),
}
"""MegaSlide module -> the diffusers modules whose weights (and biases) it holds, stacked along dim 0."""
_TABLES = {"final.modulation": "scale_shift_table", "modulation": "scale_shift_table"}
"""Modulation tables: MegaSlide's (R, D) is diffusers' (1, R, D)."""
_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)")


def diffusers_names(name: str) -> tuple[str, ...]:
    """The diffusers keys that MegaSlide parameter `name` holds, stacked along dim 0; () for a parameter that
    diffusers' Wan lacks (a DSA offset net, the built-in text encoder)."""
    block = _BLOCK_NAME.fullmatch(name)
    prefix, rest, modules = (f"blocks.{block[1]}.", block[2], _BLOCK) if block else ("", name, _STEM)
    if rest in _TABLES:
        return (prefix + _TABLES[rest],)
    module, _, leaf = rest.rpartition(".")
    return tuple(f"{prefix}{m}.{leaf}" for m in modules.get(module, ()))


def to_diffusers(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """MegaSlide parameter `name` as diffusers tensors (copies, ready for a file)."""
    names = diffusers_names(name)
    rest = _BLOCK_NAME.fullmatch(name)[2] if name.startswith("blocks.") else name
    if rest in _TABLES:
        return {names[0]: tensor.detach().unsqueeze(0).clone()}   # (R, D) -> (1, R, D)
    return {n: part.detach().clone() for n, part in zip(names, tensor.chunk(len(names)))}


def from_diffusers(tensors: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    """diffusers tensors (in `diffusers_names` order) as one MegaSlide parameter of `shape`; None if their
    shapes do not stack to it."""
    stacked = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    if stacked.shape == shape:
        return stacked
    if len(tensors) == 1 and stacked.shape == (1, *shape):    # a modulation table
        return stacked[0]
    return None


def config_from_diffusers(raw: dict, where: str) -> DiTConfig:
    """A `wan` DiTConfig from a diffusers config.json's dict; `where` names the file in errors."""
    if raw.get("_class_name") != WAN_CLASS:
        raise ValueError(f"{where}: _class_name is {raw.get('_class_name')!r}, not {WAN_CLASS!r}; load_pretrained "
                         f"reads Wan 2.x transformers (the transformer/ folder of a Wan diffusers pipeline)")
    c = {**DIFFUSERS_DEFAULTS, **raw}
    for key, (value, why) in _SUPPORTED.items():
        if c[key] != value:
            raise ValueError(f"{where}: {key}={c[key]!r} is not supported ({why}); MegaSlide needs {key}={value!r}")
    if c["qk_norm"] not in ("rms_norm_across_heads", None):   # diffusers' WanAttention norms q, k across heads
        raise ValueError(f"{where}: qk_norm={c['qk_norm']!r} is not supported; MegaSlide needs rms_norm_across_heads")
    if c["out_channels"] not in (None, c["in_channels"]):
        raise ValueError(f"{where}: out_channels={c['out_channels']} differs from in_channels={c['in_channels']}; "
                         f"MegaSlide predicts as many channels as it reads")
    heads = c["num_attention_heads"]
    return dataclasses.replace(DIT_PRESETS["wan-1.3b"], dim=heads * c["attention_head_dim"], num_heads=heads,
                               depth=c["num_layers"], ffn_dim=c["ffn_dim"], in_channels=c["in_channels"],
                               patch_size=tuple(c["patch_size"]), text_dim=c["text_dim"], freq_dim=c["freq_dim"])


def diffusers_config(cfg: DiTConfig) -> dict:
    """The config.json dict of a `wan` DiTConfig, every key diffusers' constructor takes."""
    if cfg.block != "wan" or not cfg.qk_norm:
        raise ValueError(f"only a wan model with QK-norm has a diffusers form; this one has model.block={cfg.block!r}, "
                         f"model.qk_norm={cfg.qk_norm}")
    return {"_class_name": WAN_CLASS, **DIFFUSERS_DEFAULTS, "patch_size": list(cfg.patch_size),
            "num_attention_heads": cfg.num_heads, "attention_head_dim": cfg.head_dim, "in_channels": cfg.in_channels,
            "out_channels": cfg.in_channels, "text_dim": cfg.text_dim, "freq_dim": cfg.freq_dim,
            "ffn_dim": cfg.ffn_dim, "num_layers": cfg.depth}
