"""Typed configs: one `RunConfig` tree of the model (with its attention), how its blocks run (execution),
the data, training, offload and parallelism.

Configs are plain dataclasses. Hydra YAML (experiments/conf, one group per field of `RunConfig`) is
turned into them by `from_dict`, so modules only ever see these objects or plain constructor arguments.
Each `validate()` runs before anything is allocated and raises a `ValueError` that names
the offending key and says how to fix it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megaslide.attention import SelfAttention, attention_class
from megaslide.parallel import MODES, PLACEMENTS, TRANSPORTS, resolve_degrees


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
    max_offset, backend, halo_reach, halo_kernel). Given as a dict or as another variant's options they are converted
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


_RUN_OPTIONS = ("backend",)  # attention options that say how it runs, not what it computes


def architecture_changes(saved: DiTConfig, current: DiTConfig) -> list[str]:
    """`key: saved vs current` for every architecture field (DiTConfig.architecture) that differs."""
    old, new = saved.architecture(), current.architecture()
    return [f"{k}: {old.get(k)!r} in the checkpoint vs {new.get(k)!r} now" for k in dict.fromkeys([*old, *new])
            if old.get(k) != new.get(k)]


BLOCK_FAMILIES = {
    "dit": "9 modulation rows: self-attention, cross-attention and MLP each get a shift, scale and gate",
    "wan": "6 modulation rows (self-attention and MLP); cross-attention unmodulated, after an affine LayerNorm",
}
"""The block families of `DiTConfig.block` (megaslide/models/dit.py, `DiTBlock`), what each one modulates."""


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
    block: str = "dit"          # dit: MegaSlide's 9-row adaLN-Zero block; wan: Wan 2.x's 6-row block (BLOCK_FAMILIES)
    text_encoder: bool = True   # the built-in hashed-word encoder; false: captions come as embeddings (B, L, text_dim)
    pretrained: str = ""        # a diffusers-format Wan folder to start from ("": fresh weights); its config.json
                                # sets the architecture (experiments/hydra_config.model_config)
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    # how the blocks run, which configs and checkpoints written before ExecutionConfig kept here: `from_dict`
    # drops them (a saved run's weights do not depend on them); they are set under execution.* now
    moved_keys: ClassVar[dict[str, str]] = {k: f"execution.{k}" for k in ("checkpoint_blocks", "chunk_tokens",
                                                                           "slab_frames")}

    def __post_init__(self):
        self.patch_size = _tuple3("model.patch_size", self.patch_size)
        if isinstance(self.attention, dict):
            self.attention = from_dict(AttentionConfig, self.attention)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def validate(self) -> None:
        _require_at_least(self, "model", 1, "dim", "depth", "num_heads", "ffn_dim", "in_channels", "text_dim",
                          "text_len", "vocab_size")
        if self.dim % self.num_heads:
            raise ValueError(f"model.num_heads={self.num_heads} does not divide model.dim={self.dim}; "
                             f"choose heads so that dim % heads == 0")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} (model.dim / model.num_heads) must be even for RoPE")
        if any(p < 1 for p in self.patch_size):
            raise ValueError(f"model.patch_size={self.patch_size} must be positive")
        if self.text_layers < 0:
            raise ValueError(f"model.text_layers={self.text_layers} must be >= 0")
        if self.block not in BLOCK_FAMILIES:
            raise ValueError(f"model.block={self.block!r}: choose one of {list(BLOCK_FAMILIES)}")
        if self.pretrained and not os.path.isfile(os.path.join(self.pretrained, "config.json")):
            raise ValueError(f"model.pretrained={self.pretrained!r} is not a diffusers-format folder (no config.json); "
                             f"give the transformer/ folder of a Wan 2.x diffusers checkpoint")
        self.attention.validate()

    def architecture(self) -> dict[str, Any]:
        """The fields that decide the weights' names and shapes and what they compute, flat by their
        config key (`model.dim`, `model.attention.name`, ...): everything but the attention backend and the
        folder the weights started from. Checkpoints are resumed only into the same architecture."""
        flat = {f"model.{k}": v for k, v in dataclasses.asdict(self).items()}
        del flat["model.attention"], flat["model.pretrained"]
        flat["model.attention.name"] = self.attention.name
        flat.update({f"model.attention.{k}": v for k, v in dataclasses.asdict(self.attention.options).items()
                     if k not in _RUN_OPTIONS})
        return flat

    def token_grid(self, frames: int, height: int, width: int, *,
                   keys: tuple[str, str, str] = ("data.frames", "data.height", "data.width")) -> tuple[int, int, int]:
        """Token grid (T', H', W') of a latent clip; raises if the clip does not patchify, naming the size's config
        key in `keys` (frames, height, width)."""
        for key, size, p in zip(keys, (frames, height, width), self.patch_size):
            if size % p:
                raise ValueError(f"{key}={size} is not divisible by the patch size {p} "
                                 f"(model.patch_size={self.patch_size}); change one of them")
        return frames // self.patch_size[0], height // self.patch_size[1], width // self.patch_size[2]


@dataclass
class ExecutionConfig:
    """How the blocks of a built model run; not what they compute (megaslide/models/chunking.py applies it)."""

    checkpoint_blocks: bool = False  # activation checkpointing per block (the resident trainer)
    chunk_tokens: int = 0       # token-wise work of each block (and the final layer) over slices of this many tokens
    slab_frames: int | str = 0  # each block over slabs of this many token frames plus the attention's halo (0: off;
                                # auto: the fewest slabs whose step fits the device, megaslide/perf/slab_choice.py)

    def validate(self, attention: AttentionConfig | None = None) -> None:
        """The values; given the model's attention, that slabs have a bounded reach to pad them with."""
        if self.chunk_tokens < 0:
            raise ValueError(f"execution.chunk_tokens={self.chunk_tokens} must be >= 0: set 0 to run each block "
                             f"unchunked, or n > 0 to run its token-wise work over slices of n tokens")
        if self.slab_frames == SLAB_AUTO:
            return
        if isinstance(self.slab_frames, str) or self.slab_frames < 0:
            raise ValueError(f"execution.slab_frames={self.slab_frames!r} must be >= 0 or {SLAB_AUTO}: set 0 to run "
                             f"each block over the whole clip, n > 0 to run it over slabs of n token frames, or "
                             f"{SLAB_AUTO} to let the planner take the fewest slabs that fit the device")
        if self.slab_frames and attention is not None and attention.variant.temporal_reach(attention.options) is None:
            raise ValueError(f"execution.slab_frames={self.slab_frames} needs a self-attention whose reach along "
                             f"time is bounded (dsa, dsa_zero); {attention.name!r} attends across the whole clip: "
                             f"set execution.slab_frames=0")


SLAB_AUTO = "auto"
"""execution.slab_frames's value that leaves the slab size to the planner (megaslide/perf/slab_choice.py)."""

DATASETS = ("moving_shapes", "video_folder", "latent_cache")


@dataclass
class DataConfig:
    name: str = "moving_shapes"   # moving_shapes | video_folder | latent_cache
    frames: int = 8               # latent_cache: latent frames, 0 = the cache's
    height: int = 32              # latent_cache: latent height, 0 = the cache's
    width: int = 32               # latent_cache: latent width, 0 = the cache's
    num_videos: int = 512
    num_shapes: int = 1
    speed: float = 2.0            # pixels per frame (moving_shapes)
    shape_size: int = 8
    root: str = ""                # video_folder: mp4 files + captions.jsonl; latent_cache: precompute.py's out
    seed: int = 0

    channels = 3                  # moving_shapes and video_folder are RGB video in [-1, 1], trained on in pixel space

    def validate(self) -> None:
        """The values; for a latent cache also its manifest, whose latent size fills frames, height and width
        left at 0 (a latent cache's clip size is the cache's: other values are refused)."""
        if self.name not in DATASETS:
            raise ValueError(f"data.name={self.name!r}: choose one of {list(DATASETS)}")
        _require_finite(self, "data")
        require_seed(self.seed, "data.seed")
        if self.name == "latent_cache":
            self._take_cache_size()
        _require_at_least(self, "data", 1, "frames", "height", "width", "num_videos", "num_shapes", "shape_size")
        _require_at_least(self, "data", 0, "speed")
        if self.name == "video_folder":
            if not self.root or not os.path.isdir(self.root):
                raise ValueError(f"data.root={self.root!r} is not a folder; point it at a folder of mp4 files "
                                 f"with a captions.jsonl")
            if not os.path.isfile(os.path.join(self.root, "captions.jsonl")):
                raise ValueError(f"data.root={self.root!r} has no captions.jsonl; write one JSON line per clip "
                                 f'in it, e.g. {{"file": "a.mp4", "caption": "a red circle moving left"}}')

    def _take_cache_size(self) -> None:
        from megaslide.data.latent_cache import read_manifest   # a leaf module: it imports no config
        _, frames, height, width = read_manifest(self.root, key="data.root")["latent_shape"]
        for key, cached in (("frames", frames), ("height", height), ("width", width)):
            if getattr(self, key) == 0:
                setattr(self, key, cached)
            elif getattr(self, key) != cached:
                raise ValueError(f"data.{key}={getattr(self, key)}, but the latent cache {self.root!r} holds latents "
                                 f"of {key} {cached}; set data.{key}=0 (the cache's) or precompute another cache")

    def check_captions(self, text_encoder: bool, text_dim: int) -> None:
        """moving_shapes and video_folder caption their clips in words, which only the built-in text encoder
        reads; a latent cache holds a real text encoder's embeddings, which must be model.text_dim wide."""
        if self.name == "latent_cache":
            from megaslide.data.latent_cache import read_manifest
            cached = read_manifest(self.root, key="data.root")["text_dim"]
            if cached != text_dim:
                raise ValueError(f"model.text_dim={text_dim}, but the latent cache {self.root!r} holds caption "
                                 f"embeddings of width {cached}; set model.text_dim={cached}")
        elif not text_encoder:
            raise ValueError(f"model.text_encoder=false: the model takes caption embeddings (B, L, text_dim), but "
                             f"data={self.name} gives captions in words; add model.text_encoder=true to train it "
                             f"with the built-in encoder, or precompute a latent cache of a real text encoder "
                             f"(experiments/precompute.py) and train on it with data=latent_cache")

    def check_channels(self, in_channels: int) -> None:
        """The model must take the data's channels: RGB clips (3) in pixel space, a latent cache's latent
        channels (16 for the Wan 2.1 VAE)."""
        if self.name == "latent_cache":
            from megaslide.data.latent_cache import read_manifest
            channels = read_manifest(self.root, key="data.root")["latent_shape"][0]
            if in_channels != channels:
                raise ValueError(f"model.in_channels={in_channels}, but the latent cache {self.root!r} holds "
                                 f"latents of {channels} channels; set model.in_channels={channels}")
        elif in_channels != self.channels:
            raise ValueError(f"model.in_channels={in_channels}, but data={self.name} is RGB video "
                             f"({self.channels} channels, pixel space; precompute VAE latents with "
                             f"experiments/precompute.py to train in latent space); add "
                             f"model.in_channels={self.channels} to train this model on pixels")


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
    keep_checkpoints: int = 0      # after each save, delete all but the newest k checkpoints; 0 keeps all
    sample_steps: int = 20
    cfg_scale: float = 3.0
    resume: str = ""               # checkpoint path to resume from ("" = fresh, "auto" = latest in out dir)
    compile: bool = False          # the blocks' token-wise work through torch.compile, on both engines (chunking.py)
    deterministic: bool = False    # the same bits every run at a seed, at a cost in time (train/determinism.py)

    def __post_init__(self):
        self.betas = tuple(float(b) for b in self.betas)

    def validate(self) -> None:
        _require_finite(self, "train")
        require_seed(self.seed, "train.seed")
        _require_at_least(self, "train", 1, "steps", "batch_size", "log_every", "ckpt_every", "sample_steps")
        _require_at_least(self, "train", 0, "warmup_steps", "weight_decay", "cfg_scale", "keep_checkpoints")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip={self.grad_clip} must be >= 0: the global-norm bound, or 0 to "
                             f"turn clipping off")
        if self.lr <= 0:
            raise ValueError(f"train.lr={self.lr} must be > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas={list(self.betas)} must each be in [0, 1)")
        if self.logit_normal_std <= 0:
            raise ValueError(f"train.logit_normal_std={self.logit_normal_std} must be > 0")
        if not 0 <= self.caption_dropout < 1:
            raise ValueError(f"train.caption_dropout={self.caption_dropout} must be in [0, 1)")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"train.ema_decay={self.ema_decay} must be in [0, 1)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r}: choose auto, cpu or cuda")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"train.precision={self.precision!r}: choose auto, fp32 or bf16")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"train.deterministic={self.deterministic!r} must be true or false (true: the same bits "
                             f"every run at a seed, megaslide/train/determinism.py)")


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
    boundary_stride: int = 1           # keep the inputs of blocks 0, k, 2k, ...; the backward re-runs the rest
    init_on_host: bool = True          # a random model is first built whole in fp32 on the host (see builds_on_host)
    master_dtype: str = "fp32"         # fp32 | bf16: bf16 master weights, updated with stochastic rounding
    moments: str = "fp32"              # fp32 | int8: AdamW moments block-quantised to 8 bits
    keep_attention: str = "off"        # off | on | auto: keep attention output + lse for the backward (auto: planner)

    def builds_on_host(self, model: DiTConfig) -> bool:
        """Whether the engine first builds the whole fp32 model in host RAM: a random model with init_on_host,
        which gives the resident trainer's initial weights bit for bit. Otherwise it is built one block at a
        time (same init rules, another random stream) or, with model.pretrained, read one block at a time:
        the host then never holds more than its state plus about a block."""
        return self.init_on_host and not model.pretrained

    def validate(self) -> None:
        if self.resident_blocks < 0:
            raise ValueError(f"offload.resident_blocks={self.resident_blocks} must be >= 0 (0: recompute every block)")
        if self.optimizer_device not in ("cpu", "gpu"):
            raise ValueError(f"offload.optimizer_device={self.optimizer_device!r}: choose cpu or gpu")
        if not 0 <= self.gpu_memory_fraction <= 1:
            raise ValueError(f"offload.gpu_memory_fraction={self.gpu_memory_fraction} must be in [0, 1]")
        if self.boundary_stride < 1:
            raise ValueError(f"offload.boundary_stride={self.boundary_stride} must be >= 1 (1: keep every block's "
                             f"input; k: keep every k-th and re-run the forward of the others in the backward)")
        if self.keep_attention not in KEEP_ATTENTION:
            raise ValueError(f"offload.keep_attention={self.keep_attention!r}: choose off (the backward re-runs every "
                             f"block's attention), on (keep every streamed block's attention output and lse, or "
                             f"fail) or auto (keep those that fit, as the planner places them)")
        if self.activation_offload and not self.enabled:
            raise ValueError("offload.activation_offload=true needs the offload engine, but offload.enabled=false: "
                             "set offload.enabled=true, or offload.activation_offload=false")
        self._validate_compact_state()

    def _validate_compact_state(self) -> None:
        for key, value, choices in (("master_dtype", self.master_dtype, ("fp32", "bf16")),
                                    ("moments", self.moments, ("fp32", "int8"))):
            if value not in choices:
                raise ValueError(f"offload.{key}={value!r}: choose one of {list(choices)} ({choices[0]}: the full "
                                 f"fp32 optimizer state, {choices[1]}: compact host state)")
        compact = [f"offload.{key}={value}" for key, value in (("master_dtype", self.master_dtype),
                                                                ("moments", self.moments)) if value != "fp32"]
        if compact and not self.enabled:
            raise ValueError(f"{' '.join(compact)} is compact optimizer state of the offload engine, but "
                             f"offload.enabled=false: set offload.enabled=true (offload=engine), or leave "
                             f"offload.master_dtype and offload.moments at fp32")
        if compact and self.optimizer_device == "gpu":
            raise ValueError(f"{' '.join(compact)}: the optimizer_device=gpu ablation streams fp32 state; set "
                             f"offload.optimizer_device=cpu, or leave offload.master_dtype and offload.moments "
                             f"at fp32")


KEEP_ATTENTION = ("off", "on", "auto")


@dataclass
class ParallelConfig:
    """How a run spreads over processes: `dp` data-parallel replicas x `sp` sequence-parallel ranks (dp x sp =
    the world size) and the sequence-parallel attention's form, the options of
    `megaslide.parallel.sequence_parallel_attention` (`parallelize_dit` takes this config whole)."""

    dp: int = 1
    sp: int = 1
    sp_mode: str = "ulysses"            # ulysses | ring | hybrid | torus
    ulysses_degree: int | None = None   # hybrid / torus: Ulysses x Ring degrees, product = the SP group size
    ring_degree: int | None = None
    placement: str = "ulysses_intra"    # ulysses_intra | ring_intra: which groups are consecutive ranks
    transport: str = "p2p"              # p2p | symm_mem | auto: how ring K/V moves
    chunks: int | None = None           # torus: head chunks per rank (None: min(heads / ulysses_degree, 4))

    @property
    def ranks_key(self) -> str:
        """The keys that give the run's ranks, as an error message names them."""
        return f"parallel.dp={self.dp}" + (f" x parallel.sp={self.sp}" if self.sp > 1 else "")

    def validate(self) -> None:
        _require_at_least(self, "parallel", 1, "dp", "sp")
        for name, known in (("sp_mode", MODES), ("placement", PLACEMENTS), ("transport", TRANSPORTS)):
            if getattr(self, name) not in known:
                raise ValueError(f"parallel.{name}={getattr(self, name)!r}: choose one of {list(known)}")
        for name in ("ulysses_degree", "ring_degree", "chunks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1, or null to derive it")

    def check_sequence_parallel(self, model: DiTConfig, grid: tuple[int, int, int], offload: OffloadConfig,
                                train: TrainConfig) -> None:
        """That `sp` ranks can train one clip of token grid `grid` (megaslide/parallel/sp_train.py): at most one
        rank per token frame, an attention with a sequence-parallel form (dense in `sp_mode`), no kept attention,
        eager blocks. ValueError naming the key, before anything is built."""
        if self.sp == 1:
            return
        attention = model.attention
        form = attention.variant.sp_form
        if form is None:
            raise ValueError(f"parallel.sp={self.sp} with attention.name={attention.name!r}: this attention has no "
                             f"sequence-parallel form; use dense, dsa, dsa_zero or swin, or set parallel.sp=1")
        if self.sp > grid[0]:
            raise ValueError(f"parallel.sp={self.sp} is larger than the clip's {grid[0]} token frames (data.frames / "
                             f"model.patch_size[0]): every rank needs a frame; set parallel.sp <= {grid[0]}")
        if offload.keep_attention != "off":
            raise ValueError(f"parallel.sp={self.sp} with offload.keep_attention={offload.keep_attention}: a "
                             f"sequence-parallel block recomputes its attention (its halo comes from other ranks); "
                             f"set offload.keep_attention=off or parallel.sp=1")
        if train.compile:
            raise ValueError(f"parallel.sp={self.sp} runs its blocks eager: set train.compile=false")
        if form == "global":
            try:
                resolve_degrees(self.sp_mode, self.sp, model.num_heads, self.ulysses_degree, self.ring_degree)
            except ValueError as e:
                raise ValueError(f"parallel.sp_mode={self.sp_mode!r} on parallel.sp={self.sp} ranks: {e}") from None


@dataclass
class RunConfig:
    """Everything a training run is, one field per Hydra group of experiments/conf: the model (its
    attention inside, `model.attention`, the group `attention`), how its blocks run, the data, the
    training, offload and parallelism. train.py trains it; plan.py predicts it from the same overrides."""

    model: DiTConfig = field(default_factory=DiTConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def grid(self) -> tuple[int, int, int]:
        """A training clip's token grid (T', H', W')."""
        return self.model.token_grid(self.data.frames, self.data.height, self.data.width)

    def validate(self) -> None:
        """Every check of a training run that needs nothing but its configs: each config's own, the
        clip's token grid against the patch size and the attention's window or kernel, the model's
        input channels against the data's, the global batch against the data-parallel ranks and the clip
        against the sequence-parallel ones (the world size itself is checked where the processes are,
        `megaslide.parallel.mesh`). Scripts call it
        before they create a folder or a W&B run."""
        for cfg in (self.model, self.data, self.train, self.offload, self.parallel):
            cfg.validate()
        self.execution.validate(self.model.attention)
        self.model.attention.validate(self.grid)
        self.data.check_channels(self.model.in_channels)
        self.data.check_captions(self.model.text_encoder, self.model.text_dim)
        if self.train.batch_size % self.parallel.dp:
            raise ValueError(f"train.batch_size={self.train.batch_size} (the global batch) is not divisible by "
                             f"parallel.dp={self.parallel.dp}: each data-parallel rank takes an equal share; use a "
                             f"multiple of {self.parallel.dp}")
        self.parallel.check_sequence_parallel(self.model, self.grid, self.offload, self.train)


def validate_training(model: DiTConfig, data: DataConfig, train: TrainConfig, offload: OffloadConfig,
                      execution: ExecutionConfig | None = None, parallel: ParallelConfig | None = None) -> None:
    """`RunConfig.validate` of these parts (the default execution and parallelism where not given)."""
    RunConfig(model, execution or ExecutionConfig(), data, train, offload, parallel or ParallelConfig()).validate()


def _require_finite(cfg, key: str) -> None:
    """Every float of `cfg` (and of its float tuples) is finite: a NaN passes every `<` check and would reach the
    optimizer or turn a bound off silently."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ValueError(f"{key}.{f.name}={value!r} must be a finite number; give a value such as the default "
                             f"{f.default!r}")


SEED_LIMIT = 2 ** 63  # torch.manual_seed and numpy take seeds below this


def require_seed(seed: int, key: str) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{key}={seed} must be in [0, 2**63): choose a smaller non-negative seed")


def _require_at_least(cfg, key: str, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < minimum:
            raise ValueError(f"{key}.{name}={value} must be >= {minimum}")


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _scalar(tp: type, value, key: str):
    """`value` as the scalar type `tp`: an int field takes an integer (or a whole float: 2.0), a float
    field any number, a string field also a number (Hydra reads `name=2024` as one); bool is neither
    a number nor a string here. Anything else is a ValueError naming `key`."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int and number and float(value).is_integer():
        return int(value)
    if tp in (float, str) and number:
        return tp(value)
    if isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):
        return value
    raise ValueError(f"{key}={value!r} must be {_SCALARS[tp]}")


def _coerce(tp, value, key: str):
    """A YAML value as the dataclass field type `tp` (dataclasses from dicts, tuples from lists, scalars
    checked); a value of the wrong type is a ValueError naming the config key `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return from_dict(tp, value, key=key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and str in args:
            return value
        return _coerce(next(a for a in args if a is not type(None)), value, key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}={value!r} must be a list, e.g. {key}=[{value}]")
        if origin is list or args[-1:] == (Ellipsis,):
            item_types = [args[0] if args else Any] * len(value)
        elif len(args) != len(value):
            raise ValueError(f"{key}={list(value)} must have {len(args)} entries")
        else:
            item_types = args
        return origin(_coerce(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(item_types, value)))
    if tp in _SCALARS:
        return _scalar(tp, value, key)
    return value


def from_dict(cls, data: dict[str, Any] | None, *, key: str = ""):
    """Build dataclass `cls` from a plain dict. Unknown keys are an error that lists the known ones; a
    value of the wrong type (2.5 or "abc" for an int) is an error naming it as `key`.<field>. A config
    with a dict form of its own (AttentionConfig) reads it with its `parse`; keys a config lists in its
    `moved_keys` (DiTConfig: how the blocks run, now under execution.*) are dropped, so old saved configs load."""
    data = dict(data or {})
    if hasattr(cls, "parse"):
        return cls.parse(data)
    for moved in getattr(cls, "moved_keys", ()):
        data.pop(moved, None)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f" under {key}" if key else ""
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}{where}; known fields: {sorted(names)}")
    return cls(**{k: _coerce(hints[k], v, f"{key}.{k}" if key else k) for k, v in data.items()})
