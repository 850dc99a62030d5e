"""The video Diffusion Transformer, written for one device.

Latents (B, C, T, H, W) are cut into 3D patches, run through adaLN-Zero blocks
(self-attention from the registry, cross-attention to caption tokens, MLP, all modulated
by the timestep) and mapped back. How the blocks run (checkpointing, token chunks, frame slabs:
chunking.py's `apply_execution`), offload and sequence parallelism are applied from outside; the
pieces they need are the public methods `embed`, `run_block` and `unembed`, which `forward` simply
chains.

Token rows: a clip is also a sequence of N patch rows (B, N, pv*C) (`patchify` / `unpatchify`),
and the patch embedding, the timestep modulation and the final layer act on each row alone.
Sequence-parallel inference uses that: `embed_shard` embeds any run of rows (one rank's
shard), `run_block(..., attn=...)` runs a block with its self-attention replaced, and `head`
maps tokens back to rows; only self-attention makes tokens meet.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megaslide.attention import build_attention
from megaslide.config import AttentionConfig, DiTConfig, ExecutionConfig
from megaslide.models.chunking import BlockRunner, apply_execution
from megaslide.models.layers import MLP, CrossAttention, FinalLayer, PatchEmbed3D, TimestepEmbedder, default_init
from megaslide.models.text import HashTokenizer, TextEncoder
from megaslide.nn import RopeTable, modulate

MOD_ROWS = {"dit": 9, "wan": 6}
"""Modulation rows of a block (config.BLOCK_FAMILIES): (shift, scale, gate) for self-attention, then
cross-attention (dit only), then the MLP."""


def _xavier_linears(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class DiTBlock(nn.Module):
    """adaLN-Zero block: self-attention, cross-attention to the caption and an MLP, gated by the timestep.

    Two families (`cfg.block`) share it: `dit` modulates and gates all three; `wan` (Wan 2.x, as diffusers'
    `WanTransformerBlock`) modulates and gates self-attention and MLP only, and runs cross-attention on an
    affine LayerNorm of its input, ungated. `forward` reads pre-attention -> attention -> post-attention;
    everything but the attention acts on each token alone, which is what lets the chunk runner (chunking.py)
    run those two halves over slices."""

    def __init__(self, cfg: DiTConfig, layer_idx: int):
        super().__init__()
        a = cfg.attention
        self.norm1 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.attn = build_attention(a.name, cfg.dim, cfg.num_heads, qk_norm=cfg.qk_norm, layer_idx=layer_idx,
                                    **dataclasses.asdict(a.options))
        self.modulated_cross = cfg.block == "dit"
        self.norm2 = nn.LayerNorm(cfg.dim, elementwise_affine=not self.modulated_cross, eps=1e-6)
        self.cross = CrossAttention(cfg.dim, cfg.num_heads, cfg.dim, cfg.qk_norm)
        self.norm3 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)
        self.modulation = nn.Parameter(torch.zeros(MOD_ROWS[cfg.block], cfg.dim))  # offsets to the shared t_mod

    def reset_parameters(self) -> None:
        """Every parameter as the constructors define it (zero modulation, unit norms, torch's default
        linears and convolutions), drawn in their order: the first half of `initialize_weights`."""
        for child in self.children():
            default_init(child)
        nn.init.zeros_(self.modulation)

    def initialize_weights(self, *, defaults: bool = True) -> None:
        """Every parameter of the block: `reset_parameters` (unless `defaults` is False: `VideoDiT` runs it
        for the whole model first), then Xavier linears, zero biases, the attention's own rule (DSA: zero
        offsets); the gates start at zero through `modulation`. The offload engine initialises a model one
        block at a time with it, each block built on the meta device."""
        if defaults:
            self.reset_parameters()
        _xavier_linears(self)
        init = getattr(self.attn, "initialize_weights", None)
        if init is not None:
            init()

    def forward(self, x, t_mod, ctx, ctx_mask, rope, grid, attn=None):
        """x (B, N, D); t_mod (B, R, D), R = MOD_ROWS; ctx (B, L, D); ctx_mask (B, L); rope (cos, sin) (N, d/2).

        `attn(h, rope, grid) -> (B, N, D)` replaces the self-attention call (default
        `self.attn`); KV-cached and sequence-parallel inference pass their own, built from
        `self.attn.project_qkv` / `project_out`."""
        attn = self.attn if attn is None else attn
        mod = self.modulation[None] + t_mod                                  # (B, R, D)
        h = self.pre_attention(x, mod)                                       # (B, N, D)
        return self.post_attention(x, attn(h, rope, grid), mod, ctx, ctx_mask)  # (B, N, D)

    def pre_attention(self, x, mod):
        """Tokens x (B, n, D), modulation mod (B, R, D) -> the self-attention input (B, n, D)."""
        m = mod.unbind(1)                                                    # R x (B, D)
        return modulate(self.norm1(x), m[0], m[1])                           # (B, n, D)

    def post_attention(self, x, a, mod, ctx, ctx_mask):
        """Tokens x (B, n, D) and their self-attention output a (B, n, D) -> the block output (B, n, D):
        the gated residual, cross-attention to the caption and the MLP (its rows are the last three)."""
        m = mod.unbind(1)                                                    # R x (B, D)
        x = x + m[2][:, None] * a                                            # (B, n, D)
        if self.modulated_cross:
            x = x + m[5][:, None] * self.cross(modulate(self.norm2(x), m[3], m[4]), ctx, ctx_mask)
        else:
            x = x + self.cross(self.norm2(x), ctx, ctx_mask)                 # (B, n, D)
        return x + m[-1][:, None] * self.mlp(modulate(self.norm3(x), m[-3], m[-2]))


@dataclasses.dataclass
class Embedded:
    """What the blocks need, produced once per forward by `VideoDiT.embed`."""

    x: torch.Tensor                 # (B, N, D) tokens
    t_emb: torch.Tensor             # (B, D) timestep embedding
    t_mod: torch.Tensor             # (B, R, D) shared block modulation, R = MOD_ROWS[cfg.block]
    ctx: torch.Tensor               # (B, L, D) caption features, projected to the model width
    ctx_mask: torch.Tensor          # (B, L) True where a caption token is real
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (N, d/2)
    grid: tuple[int, int, int]      # token grid (T', H', W')


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Latents (B, C, T, H, W) -> rows (B, N, pv*C): tokens row-major over (t, y, x), each row's
    values in (pt, ph, pw, C) order (the order of the final layer's output)."""
    B, C, T, H, W = x.shape
    pt, ph, pw = patch
    x = x.reshape(B, C, T // pt, pt, H // ph, ph, W // pw, pw)                # (B, C, T', pt, H', ph, W', pw)
    x = x.permute(0, 2, 4, 6, 3, 5, 7, 1)                                      # (B, T', H', W', pt, ph, pw, C)
    return x.reshape(B, (T // pt) * (H // ph) * (W // pw), pt * ph * pw * C)  # (B, N, pv*C)


def unpatchify(rows: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """Rows (B, N, pv*C) of the token grid (T', H', W') -> latents (B, C, T, H, W); inverts `patchify`."""
    B = rows.shape[0]
    T, H, W = grid
    pt, ph, pw = patch
    x = rows.reshape(B, T, H, W, pt, ph, pw, -1)             # (B, T', H', W', pt, ph, pw, C)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)                    # (B, C, T', pt, H', ph, W', pw)
    return x.reshape(B, x.shape[1], T * pt, H * ph, W * pw)  # (B, C, T, H, W)


class VideoDiT(nn.Module):
    """The model. Its modules are built on the meta device and then defined once by `initialize_weights`, on
    the device current at construction (`torch.device(...)` as a context); under `torch.device("meta")` it
    stays unallocated, and `to_empty` plus `initialize_weights()` make it usable later (FSDP2's path)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        D = cfg.dim
        self.patch_volume = cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
        self.tokenizer = HashTokenizer(cfg.vocab_size, cfg.text_len)
        device = torch.get_default_device()
        with torch.device("meta"):
            self.patch_embed = PatchEmbed3D(cfg.in_channels, D, cfg.patch_size)
            self.t_embed = TimestepEmbedder(D, cfg.freq_dim)
            self.t_proj = nn.Sequential(nn.SiLU(), nn.Linear(D, MOD_ROWS[cfg.block] * D))
            self.text_encoder = (TextEncoder(cfg.vocab_size, cfg.text_len, cfg.text_dim, cfg.text_layers)
                                 if cfg.text_encoder else None)
            self.text_proj = nn.Sequential(nn.Linear(cfg.text_dim, D), nn.GELU(approximate="tanh"), nn.Linear(D, D))
            self.blocks = nn.ModuleList(DiTBlock(cfg, i) for i in range(cfg.depth))
            self.final = FinalLayer(D, self.patch_volume, cfg.in_channels)
        self._rope: RopeTable | None = None
        self.runner = BlockRunner()  # how the blocks run: whole, until apply_execution (chunking.py) says else
        if device.type != "meta":
            self.to_empty(device=device)
            self.initialize_weights()

    def initialize_weights(self) -> None:
        """Define every parameter: first as the constructors define them, drawn in their order
        (`default_init`), then Xavier linears, zero biases, and adaLN-Zero: every gate and the output start
        at zero. Children are visited in registration order: the random draws of one walk over all modules,
        so a seed gives the same weights on every path (host, meta + `to_empty`). The RoPE tables (no
        parameters, no buffers) are rebuilt on first use."""
        default_init(self)
        for name, child in self.named_children():
            if name == "blocks":
                for block in child:
                    block.initialize_weights(defaults=False)
            else:
                _xavier_linears(child)
        w = self.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch_embed.proj.bias)
        for lin in (self.t_embed.mlp[0], self.t_embed.mlp[2]):
            nn.init.normal_(lin.weight, std=0.02)
        nn.init.zeros_(self.t_proj[1].weight)
        nn.init.zeros_(self.t_proj[1].bias)
        nn.init.zeros_(self.final.linear.weight)
        nn.init.zeros_(self.final.linear.bias)
        self._rope = None

    def rope_table(self, grid: tuple[int, int, int], t_start: int = 0) -> RopeTable:
        """The cos/sin tables, grown (rarely) to cover frames up to t_start + T and the spatial grid."""
        need = (t_start + grid[0], grid[1], grid[2])
        if self._rope is None or any(n > m for n, m in zip(need, self._rope.max_sizes)):
            sizes = need if self._rope is None else tuple(max(a, b) for a, b in zip(need, self._rope.max_sizes))
            self._rope = RopeTable(self.cfg.head_dim, *sizes)
        return self._rope

    def encode_text(self, context: torch.Tensor, context_mask: torch.Tensor | None = None):
        """Token ids (B, L) long -> encoded features; float (B, L, Dt) embeddings pass through."""
        if context.dtype == torch.long:
            if self.text_encoder is None:
                raise ValueError("this model has no built-in text encoder (model.text_encoder=false): pass caption "
                                 "embeddings (B, L, model.text_dim), not token ids")
            return self.text_encoder(context)  # (B, L, Dt), (B, L)
        if context.shape[-1] != self.cfg.text_dim:
            raise ValueError(f"precomputed caption embeddings have width {context.shape[-1]}, "
                             f"but model.text_dim={self.cfg.text_dim}; set model.text_dim to match")
        mask = context_mask if context_mask is not None else torch.ones(context.shape[:2], dtype=torch.bool,
                                                                        device=context.device)
        return context, mask

    def embed_context(self, context: torch.Tensor, context_mask: torch.Tensor | None = None):
        """Caption ids (B, L) or embeddings (B, L, Dt) -> ctx (B, L, D), ctx_mask (B, L): the blocks'
        cross-attention input, which depends on the caption only (compute it once per video)."""
        ctx, ctx_mask = self.encode_text(context, context_mask)  # (B, L, Dt), (B, L)
        return self.text_proj(ctx.to(self.text_proj[0].weight.dtype)), ctx_mask  # (B, L, D), (B, L)

    def embed_timestep(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Timesteps t (B,) in [0, 1000] -> t_emb (B, D), the shared block modulation t_mod (B, R, D).

        The sinusoidal features are fp32; a model with bf16 / fp16 weights runs the timestep MLP
        under autocast to its own dtype (an fp32 model runs it as called)."""
        dtype = self.t_proj[1].weight.dtype
        low = dtype in (torch.bfloat16, torch.float16)
        with torch.autocast(t.device.type, dtype=dtype, cache_enabled=False) if low else contextlib.nullcontext():
            t_emb = self.t_embed(t)                          # (B, D)
        t_mod = self.t_proj(t_emb).unflatten(1, (-1, self.cfg.dim))  # (B, R, D)
        return t_emb, t_mod

    def embed(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor | None = None, t_start: int = 0) -> Embedded:
        """Latents x (B, C, T, H, W), timesteps t (B,) in [0, 1000], captions -> block inputs.

        `t_start` is the global index of the first latent frame (in tokens along t), used for RoPE."""
        grid = self.cfg.token_grid(*x.shape[2:])
        tokens = self.patch_embed(x.to(self.patch_embed.proj.weight.dtype))  # (B, N, D)
        t_emb, t_mod = self.embed_timestep(t)                      # (B, D), (B, R, D)
        ctx, ctx_mask = self.embed_context(context, context_mask)  # (B, L, D), (B, L)
        rope = self.rope_table(grid, t_start).grid(grid, t_start, device=x.device)  # (N, d/2) x 2
        return Embedded(tokens, t_emb, t_mod, ctx, ctx_mask, rope, grid)

    def embed_shard(self, rows: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor], grid: tuple[int, int, int]) -> Embedded:
        """Block inputs for a run of n token rows, e.g. one rank's shard of a sequence.

        rows (B, n, pv*C) in `patchify`'s layout; t (B,) in [0, 1000]; ctx (B, L, D), ctx_mask (B, L)
        from `embed_context`; rope: cos, sin (n, d/2) of exactly these tokens; grid: the token grid
        of the whole sequence. The patch embedding is `patch_embed`'s Conv3d as the linear map of
        each row that it is (its kernel equals its stride)."""
        w = self.patch_embed.proj.weight                                # (D, C, pt, ph, pw)
        w = w.permute(0, 2, 3, 4, 1).flatten(1)                         # (D, pv*C), (pt, ph, pw, C) order
        tokens = F.linear(rows.to(w.dtype), w, self.patch_embed.proj.bias)  # (B, n, D)
        t_emb, t_mod = self.embed_timestep(t)                           # (B, D), (B, R, D)
        return Embedded(tokens, t_emb, t_mod, ctx, ctx_mask, rope, grid)

    def run_block(self, i: int, x: torch.Tensor, e: Embedded, attn=None) -> torch.Tensor:
        """Block i on tokens x (B, N, D), as `self.runner` runs it; `attn(h, rope, grid) -> (B, N, D)`
        replaces its self-attention."""
        return self.runner.run_block(self.blocks[i], x, e, attn, training=self.training)

    def head(self, x: torch.Tensor, e: Embedded) -> torch.Tensor:
        """Tokens (B, n, D) -> velocity rows (B, n, pv*C) in `patchify`'s layout: the final layer, per row."""
        return self.runner.head(self.final, x, e.t_emb)

    def unembed(self, x: torch.Tensor, e: Embedded) -> torch.Tensor:
        """Tokens (B, N, D) -> latents (B, C, T, H, W)."""
        return unpatchify(self.head(x, e), e.grid, self.cfg.patch_size)

    def save_pretrained(self, path, max_shard_size: int | str = "10GB") -> None:
        """Write this (`wan`) model as a diffusers-format folder: megaslide/models/pretrained.py."""
        from megaslide.models.pretrained import save_pretrained  # it imports this module
        save_pretrained(self, path, max_shard_size)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None, t_start: int = 0) -> torch.Tensor:
        """Velocity prediction (B, C, T, H, W) for latents x (B, C, T, H, W) at timesteps t (B,)."""
        e = self.embed(x, t, context, context_mask, t_start)
        h = e.x                                    # (B, N, D)
        for i in range(len(self.blocks)):
            h = self.run_block(i, h, e)            # (B, N, D)
        return self.unembed(h, e)                  # (B, C, T, H, W)


def count_params(cfg: DiTConfig) -> int:
    """Parameters of `VideoDiT(cfg)`, counted on a meta-device build (allocates nothing)."""
    with torch.device("meta"):
        return sum(p.numel() for p in VideoDiT(cfg).parameters())


def _preset(dim, depth, heads, ffn, **kw) -> DiTConfig:
    base = {"in_channels": 16, "patch_size": (1, 2, 2), "text_dim": 1024, "text_layers": 2, "text_len": 64,
            "vocab_size": 32768}
    return DiTConfig(dim=dim, depth=depth, num_heads=heads, ffn_dim=ffn, **{**base, **kw})


def _wan(dim, depth, heads, ffn) -> DiTConfig:
    """Wan 2.x (diffusers' WanTransformer3DModel): umT5 caption embeddings (512 x 4096) come precomputed;
    `model.text_encoder=true` adds an embeddings-only built-in encoder for training on worded captions."""
    return _preset(dim, depth, heads, ffn, text_dim=4096, text_len=512, text_layers=0, vocab_size=4096, block="wan",
                   text_encoder=False)


DIT_PRESETS: dict[str, DiTConfig] = {
    "tiny": DiTConfig(dim=64, depth=2, num_heads=4, ffn_dim=256, in_channels=3, text_dim=64, text_layers=1,
                      text_len=16, vocab_size=1024),
    "S": _preset(384, 12, 6, 1536, text_dim=384, text_len=32, vocab_size=8192),
    "B": _preset(768, 12, 12, 3072, text_dim=512, text_len=32, vocab_size=8192),
    "L": _preset(1024, 24, 16, 4096, text_dim=512, text_len=32, vocab_size=8192),
    "XL": _preset(1152, 28, 16, 4608, text_dim=512, text_len=32, vocab_size=8192),
    "1B": _preset(2048, 13, 16, 8192),
    "7B": _preset(4096, 25, 32, 16384),
    "14B": _preset(5120, 31, 40, 20480, text_dim=4096),
    "33B": _preset(7168, 39, 56, 28672, text_dim=4096),
    "105B": _preset(12288, 43, 96, 49152, text_dim=4096),
    "wan-1.3b": _wan(1536, 30, 12, 8960),
    "wan-14b": _wan(5120, 40, 40, 13824),
}


def build_dit(name_or_config: str | DiTConfig, **overrides) -> VideoDiT:
    """A VideoDiT from a preset name or a config; overrides replace config fields
    (`attention=` takes an AttentionConfig, a dict, or an attention name). The `ExecutionConfig` fields
    among them (checkpoint_blocks, chunk_tokens, slab_frames) say how it runs: `apply_execution`.

    Build big presets under `torch.device("meta")` to inspect them without allocating."""
    if isinstance(name_or_config, str):
        if name_or_config not in DIT_PRESETS:
            raise ValueError(f"unknown DiT preset {name_or_config!r}; known: {sorted(DIT_PRESETS)}")
        cfg = DIT_PRESETS[name_or_config]
    else:
        cfg = name_or_config
    if isinstance(overrides.get("attention"), str):
        overrides["attention"] = AttentionConfig(overrides["attention"])
    elif isinstance(overrides.get("attention"), dict):
        overrides["attention"] = AttentionConfig.parse(overrides["attention"])
    how = {f.name for f in dataclasses.fields(ExecutionConfig)}
    execution = ExecutionConfig(**{k: overrides.pop(k) for k in how & set(overrides)})
    cfg = dataclasses.replace(cfg, **overrides)
    execution.validate(cfg.attention)      # before anything is built
    return apply_execution(VideoDiT(cfg), execution)
