"""Typed configs for the model, attention, data, training and offload.

Configs are plain dataclasses. Hydra YAML (experiments/conf) is turned into them by
`from_dict`, so modules only ever see these objects or plain constructor arguments.
Each `validate()` runs before anything is allocated and raises a `ValueError` that names
the offending field and says how to fix it.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from megaslide.attention import SelfAttention, attention_class


def _tuple3(name: str, value) -> tuple[int, int, int]:
    t = tuple(int(v) for v in value)
    if len(t) != 3:
        raise ValueError(f"{name}={value!r} must have three entries (t, h, w)")
    return t


@dataclass(slots=True)
class AttentionConfig:
    """Self-attention of the DiT blocks (cross-attention is always dense).

    `name` picks a variant of the attention registry; `options` are that variant's own typed
    options, its `Options` dataclass (dense: none; swin: window; dsa and dsa_zero: kernel_size,
    max_offset, backend). Given as a dict or as another variant's options they are converted
    field by field, and one the variant does not take raises a ValueError listing those it does.
    As a dict (`from_dict`) the config is either flat, `name` beside the options as in the
    Hydra group experiments/conf/attention, or `{name, options}` as `dataclasses.asdict` writes it.
    """

    name: str = "dense"
    options: Any = None

    def __post_init__(self):
        self.validate()

    @property
    def variant(self) -> type[SelfAttention]:
        return attention_class(self.name)

    @classmethod
    def parse(cls, data: dict[str, Any]) -> AttentionConfig:
        rest = {k: v for k, v in data.items() if k != "name"}
        options = rest["options"] if set(rest) == {"options"} else rest
        return cls(options=options) if "name" not in data else cls(data["name"], options)

    def for_variant(self, name: str, **options) -> AttentionConfig:
        """This config moved to variant `name`, for a study that runs several variants from one
        config: the options `name` also takes carry over, the others stay behind; `options` override."""
        takes = {f.name for f in dataclasses.fields(attention_class(name).Options)}
        carried = {k: v for k, v in dataclasses.asdict(self.options).items() if k in takes}
        return AttentionConfig(name, {**carried, **options})

    def validate(self, grid: tuple[int, int, int] | None = None) -> None:
        """Convert the options to the variant's (again: `name` may have been reassigned since)
        and, given the token grid (T', H', W'), check that they fit it."""
        self.options = self.variant.parse_options(self.options)
        if grid is not None:
            self.variant.check_grid(self.options, grid)


@dataclass
class DiTConfig:
    """Shape of a video DiT. Input latents are (B, in_channels, T, H, W)."""

    dim: int = 64
    depth: int = 2
    num_heads: int = 4
    ffn_dim: int = 256
    in_channels: int = 3
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 64          # width of the built-in text encoder (or of precomputed embeddings)
    text_layers: int = 1        # transformer layers of the built-in text encoder (0: embeddings only)
    text_len: int = 16          # caption tokens
    vocab_size: int = 1024      # hashed word vocabulary of the built-in tokenizer
    qk_norm: bool = True
    freq_dim: int = 256         # sinusoidal timestep features
    checkpoint_blocks: bool = False  # activation checkpointing per block
    chunk_tokens: int = 0       # token-wise work of each block over slices of this many tokens (0: off)
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self):
        self.patch_size = _tuple3("model.patch_size", self.patch_size)
        if isinstance(self.attention, dict):
            self.attention = from_dict(AttentionConfig, self.attention)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def validate(self) -> None:
        for name in ("dim", "depth", "num_heads", "ffn_dim", "in_channels", "text_dim", "text_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.dim % self.num_heads:
            raise ValueError(f"model.num_heads={self.num_heads} does not divide model.dim={self.dim}; "
                             f"choose heads so that dim % heads == 0")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} (model.dim / model.num_heads) must be even for RoPE")
        if any(p < 1 for p in self.patch_size):
            raise ValueError(f"model.patch_size={self.patch_size} must be positive")
        if self.text_layers < 0:
            raise ValueError(f"model.text_layers={self.text_layers} must be >= 0")
        if self.chunk_tokens < 0:
            raise ValueError(f"model.chunk_tokens={self.chunk_tokens} must be >= 0: set 0 to run each block "
                             f"unchunked, or n > 0 to run its token-wise work over slices of n tokens")
        self.attention.validate()

    def token_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Token grid (T', H', W') of a latent clip; raises if the clip does not patchify."""
        for axis, size, p in zip(("frames", "height", "width"), (frames, height, width), self.patch_size):
            if size % p:
                raise ValueError(f"data.{axis}={size} is not divisible by the patch size {p} "
                                 f"(model.patch_size={self.patch_size}); change one of them")
        return frames // self.patch_size[0], height // self.patch_size[1], width // self.patch_size[2]


@dataclass
class DataConfig:
    name: str = "moving_shapes"   # moving_shapes | video_folder
    frames: int = 8
    height: int = 32
    width: int = 32
    num_videos: int = 512
    num_shapes: int = 1
    speed: float = 2.0            # pixels per frame (moving_shapes)
    shape_size: int = 8
    root: str = ""                # video_folder: folder of mp4 files + captions.jsonl
    seed: int = 0

    def validate(self) -> None:
        if self.name not in ("moving_shapes", "video_folder"):
            raise ValueError(f"data.name={self.name!r}: choose moving_shapes or video_folder")
        for name in ("frames", "height", "width", "num_videos"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name}={getattr(self, name)} must be >= 1")
        if self.name == "video_folder":
            if not self.root or not os.path.isdir(self.root):
                raise ValueError(f"data.root={self.root!r} is not a folder; point it at a folder of mp4 files "
                                 f"with a captions.jsonl")


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 4
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0         # global-norm clip; 0 disables
    warmup_steps: int = 10
    ema_decay: float = 0.0         # 0 disables EMA
    caption_dropout: float = 0.1   # for classifier-free guidance
    logit_normal_mean: float = 0.0
    logit_normal_std: float = 1.0
    device: str = "auto"           # auto | cpu | cuda
    precision: str = "auto"        # auto (bf16 autocast on cuda, fp32 on cpu) | fp32 | bf16
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 100
    sample_steps: int = 20
    cfg_scale: float = 3.0
    resume: str = ""               # checkpoint path to resume from ("" = fresh, "auto" = latest in out dir)
    compile: bool = False          # torch.compile each DiT block of the trained model (fuses the small ops)

    def __post_init__(self):
        self.betas = tuple(float(b) for b in self.betas)

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"train.steps={self.steps} and train.batch_size={self.batch_size} must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"train.lr={self.lr} must be > 0")
        if not 0 <= self.caption_dropout < 1:
            raise ValueError(f"train.caption_dropout={self.caption_dropout} must be in [0, 1)")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"train.ema_decay={self.ema_decay} must be in [0, 1)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r}: choose auto, cpu or cuda")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"train.precision={self.precision!r}: choose auto, fp32 or bf16")


@dataclass
class OffloadConfig:
    """MegaSlide-DiT offload engine (megaslide/offload)."""

    enabled: bool = False
    overlap: bool = True               # False: the same work, serially (ablation)
    optimizer_device: str = "cpu"      # cpu | gpu (master + moments streamed to the GPU: ablation)
    cpu_threads: int = 0               # 0: torch.get_num_threads()
    gpu_memory_fraction: float = 0.0   # >0 caps usable HBM to emulate a smaller card
    resident_blocks: int = 0           # the last k blocks keep weights + activations on the GPU through backward
    activation_offload: bool = False   # park the block inputs saved for recompute in pinned host RAM

    def validate(self) -> None:
        if self.resident_blocks < 0:
            raise ValueError(f"offload.resident_blocks={self.resident_blocks} must be >= 0 (0: recompute every block)")
        if self.optimizer_device not in ("cpu", "gpu"):
            raise ValueError(f"offload.optimizer_device={self.optimizer_device!r}: choose cpu or gpu")
        if not 0 <= self.gpu_memory_fraction <= 1:
            raise ValueError(f"offload.gpu_memory_fraction={self.gpu_memory_fraction} must be in [0, 1]")
        if self.activation_offload and not self.enabled:
            raise ValueError("offload.activation_offload=true needs the offload engine, but offload.enabled=false: "
                             "set offload.enabled=true, or offload.activation_offload=false")


def _coerce(tp, value):
    """Turn YAML values (lists, dicts) into the dataclass field type."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return from_dict(tp, value)
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(value)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is not type(None):
                return _coerce(arg, value)
    return value


def from_dict(cls, data: dict[str, Any] | None):
    """Build dataclass `cls` from a plain dict; unknown keys are an error that lists the known ones.
    A config with a dict form of its own (AttentionConfig) reads it with its `parse`."""
    data = dict(data or {})
    if hasattr(cls, "parse"):
        return cls.parse(data)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(names)}")
    return cls(**{k: _coerce(hints[k], v) for k, v in data.items()})
