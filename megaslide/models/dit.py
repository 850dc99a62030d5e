"""The video Diffusion Transformer, written for one device.

Latents (B, C, T, H, W) are cut into 3D patches, run through adaLN-Zero blocks
(self-attention from the registry, cross-attention to caption tokens, MLP, all modulated
by the timestep) and mapped back. Offload, sequence parallelism and checkpointing are
applied from outside; the pieces they need are the public methods `embed`, `run_block` and
`unembed`, which `forward` simply chains.

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
from torch.utils.checkpoint import checkpoint

from megaslide.attention import SelfAttention, build_attention
from megaslide.config import AttentionConfig, DiTConfig
from megaslide.models.layers import MLP, CrossAttention, FinalLayer, PatchEmbed3D, TimestepEmbedder, default_init
from megaslide.models.text import HashTokenizer, TextEncoder, text_encoder_params
from megaslide.nn import RopeTable, modulate

N_MOD = 9  # (shift, scale, gate) for self-attention, cross-attention and MLP


def _xavier_linears(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class DiTBlock(nn.Module):
    """adaLN-Zero block: self-attention, cross-attention to the caption and an MLP, each gated by the timestep.

    Token chunking (`cfg.chunk_tokens` = c > 0). Apart from self-attention, everything in a block
    acts on each token alone: modulation, norms, the QKV and output projections, QK-norm + RoPE,
    cross-attention to the caption and the MLP. The chunked forward runs that work over slices of
    c tokens, each slice under its own non-reentrant checkpoint, so autograd keeps only a slice's
    inputs (its run of x and of the attention output), never a whole-sequence intermediate such as
    the MLP's ffn-wide hidden or the cross-attention's scores. Self-attention (dense, swin, dsa)
    still sees the whole sequence, and the block keeps whole only what it needs: q, k, v, the
    attention input if the variant reads it (`reads_input`: DSA's offset net, which itself runs
    over runs of frames), the output and what the op saves (lse, DSA's offsets). A block's
    activation memory in forward and backward is then O(c x (dim + ffn)) plus O(N x dim) for
    self-attention, instead of O(N x ffn); the price is one more forward of each slice's token-wise
    work in backward. Under `checkpoint_blocks` the recomputed forward is chunked the same way
    (the checkpoints nest). Outputs and gradients equal the unchunked block's up to rounding.
    Every slice launches the block's small kernels again, and a DSA frame run also convolves its
    two halo frames, so slices should be large: several frames, enough tokens that their matmuls
    keep the device busy.
    Frame slabs (`cfg.slab_frames` = s > 0, for an attention of bounded temporal reach r: DSA's
    window plus its largest offset). A key more than r frames from a query never meets it, so the
    block's output on frames [t0, t0 + s) depends only on its input on [t0 - r, t0 + s + r). The
    block then runs slab by slab, each under its own checkpoint: the slab with its halo goes through
    the token-wise projections and the attention (on that sub-grid: RoPE keeps the global positions,
    and the attention's clamps at the clip's ends fall where they fall on the whole grid, because a
    halo is cut only there), and only the kept frames go on through the output projection,
    cross-attention and MLP. Nothing of the attention is ever whole-clip: a block's memory is
    O((s + 2r) x per-token state) plus its input, output and their gradients. The price: the halo's
    projections and attention are computed for each of its two slabs ((s + 2r) / s), and one more
    forward of the token-wise work in backward (the slab checkpoint around the slice checkpoints).
    The `attn=` override (KV-cached and sequence-parallel inference) and a self-attention that is
    not a `SelfAttention` (the sequence-parallel form of `parallelize_dit`) run unchunked.
    """

    def __init__(self, cfg: DiTConfig, layer_idx: int):
        super().__init__()
        a = cfg.attention
        self.chunk_tokens, self.slab_frames = cfg.chunk_tokens, cfg.slab_frames
        self.norm1 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.attn = build_attention(a.name, cfg.dim, cfg.num_heads, qk_norm=cfg.qk_norm, layer_idx=layer_idx,
                                    chunk_tokens=cfg.chunk_tokens, **dataclasses.asdict(a.options))
        self.norm2 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.cross = CrossAttention(cfg.dim, cfg.num_heads, cfg.dim, cfg.qk_norm)
        self.norm3 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)
        self.modulation = nn.Parameter(torch.zeros(N_MOD, cfg.dim))  # per-block offsets to the shared t_mod

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
        """x (B, N, D); t_mod (B, 9, D); ctx (B, L, D); ctx_mask (B, L); rope (cos, sin) (N, d/2).

        `attn(h, rope, grid) -> (B, N, D)` replaces the self-attention call (default
        `self.attn`); KV-cached and sequence-parallel inference pass their own, built from
        `self.attn.project_qkv` / `project_out`."""
        if attn is None and (self.chunk_tokens or self.slab_frames) and isinstance(self.attn, SelfAttention):
            return self._forward_chunked(x, t_mod, ctx, ctx_mask, rope, grid)
        attn = self.attn if attn is None else attn
        m = (self.modulation[None] + t_mod).unbind(1)                                  # 9 x (B, D)
        x = x + m[2][:, None] * attn(modulate(self.norm1(x), m[0], m[1]), rope, grid)  # (B, N, D)
        return self._cross_and_mlp(x, m, ctx, ctx_mask)

    def _cross_and_mlp(self, x, m, ctx, ctx_mask):
        """x (B, n, D) after self-attention, m the 9 modulation rows (B, D) -> the block output (B, n, D)."""
        x = x + m[5][:, None] * self.cross(modulate(self.norm2(x), m[3], m[4]), ctx, ctx_mask)
        return x + m[8][:, None] * self.mlp(modulate(self.norm3(x), m[6], m[7]))

    def _forward_chunked(self, x, t_mod, ctx, ctx_mask, rope, grid):
        """`forward` with the token-wise work over slices of `chunk_tokens` tokens and, with `slab_frames`,
        the whole block over slabs of frames (see the class docstring)."""
        mod = self.modulation[None] + t_mod                                           # (B, 9, D)
        reach = self.attn.temporal_reach(self.attn.options) if self.slab_frames else None
        slabs = frame_slabs(grid[0], self.slab_frames, reach)
        if len(slabs) == 1:
            return self._run_slab(x, mod, ctx, ctx_mask, rope, grid, slice(None))
        T, H, W = grid
        fr = H * W                                                                     # tokens per frame
        cos, sin = rope                                                               # (N, d/2) each
        out = [checkpoint(self._run_slab, x[:, a * fr:b * fr], mod, ctx, ctx_mask,
                          (cos[a * fr:b * fr], sin[a * fr:b * fr]), (b - a, H, W),
                          slice((t0 - a) * fr, (t1 - a) * fr), use_reentrant=False)
               for a, t0, t1, b in slabs]                                             # (B, (t1-t0)*fr, D) each
        return torch.cat(out, dim=1)                                                  # (B, N, D)

    def _run_slab(self, x, mod, ctx, ctx_mask, rope, grid, keep: slice):
        """The block over x (B, n, D), a run of whole frames (grid (t, H, W)), returning only the rows
        `keep` (B, n_keep, D): the halo rows outside it are there for the attention of the kept ones."""
        cos, sin = rope                                                               # (n, d/2) each
        step = self.chunk_tokens or len(range(x.shape[1])[keep])  # unset: slices of the kept rows' size
        spans = [slice(s, s + step) for s in range(0, x.shape[1], step)]
        parts = [checkpoint(self._project_slice, x[:, s], mod, cos[s], sin[s], use_reentrant=False) for s in spans]
        q, k, v, *h = (torch.cat(p, dim=1) for p in zip(*parts))                     # (B, n, h, d) x 3[, (B, n, D)]
        del parts  # the slices: only their concatenations stay alive through attention
        o = self.attn.attend(q, k, v, h[0] if h else None, grid)[:, keep]            # (B, n_keep, h, d)
        x = x[:, keep]                                                                # (B, n_keep, D)
        spans = [slice(s, s + step) for s in range(0, x.shape[1], step)]
        out = [checkpoint(self._finish_slice, x[:, s], o[:, s], mod, ctx, ctx_mask, use_reentrant=False)
               for s in spans]
        return torch.cat(out, dim=1)                                                  # (B, n_keep, D)

    def _project_slice(self, x, mod, cos, sin):
        """A slice x (B, n, D) -> q, k, v (B, n, heads, d), and the attention input (B, n, D) if the variant reads it."""
        m = mod.unbind(1)                                                             # 9 x (B, D)
        h = modulate(self.norm1(x), m[0], m[1])                                       # (B, n, D)
        q, k, v = self.attn.project_qkv(h, (cos, sin))                                # (B, n, h, d) each
        return (q, k, v, h) if self.attn.reads_input else (q, k, v)

    def _finish_slice(self, x, o, mod, ctx, ctx_mask):
        """A slice x (B, n, D) and its attention output o (B, n, heads, d) -> the block output (B, n, D)."""
        m = mod.unbind(1)                                                             # 9 x (B, D)
        x = x + m[2][:, None] * self.attn.project_out(o)                              # (B, n, D)
        return self._cross_and_mlp(x, m, ctx, ctx_mask)


def frame_slabs(frames: int, slab: int, reach: int | None) -> list[tuple[int, int, int, int]]:
    """The slabs (a, t0, t1, b) of a clip of `frames` token frames: slab i keeps frames [t0, t1) =
    [i * slab, (i + 1) * slab) and reads [a, b), those padded by `reach` frames on each side (cut at
    the clip's ends). One slab (0, 0, T, T) when `slab` is 0 or covers the clip."""
    if not slab or slab >= frames:
        return [(0, 0, frames, frames)]
    return [(max(0, t0 - reach), t0, min(t0 + slab, frames), min(frames, t0 + slab + reach))
            for t0 in range(0, frames, slab)]


@dataclasses.dataclass
class Embedded:
    """What the blocks need, produced once per forward by `VideoDiT.embed`."""

    x: torch.Tensor                 # (B, N, D) tokens
    t_emb: torch.Tensor             # (B, D) timestep embedding
    t_mod: torch.Tensor             # (B, 9, D) shared block modulation
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
            self.t_proj = nn.Sequential(nn.SiLU(), nn.Linear(D, N_MOD * D))
            self.text_encoder = TextEncoder(cfg.vocab_size, cfg.text_len, cfg.text_dim, cfg.text_layers)
            self.text_proj = nn.Sequential(nn.Linear(cfg.text_dim, D), nn.GELU(approximate="tanh"), nn.Linear(D, D))
            self.blocks = nn.ModuleList(DiTBlock(cfg, i) for i in range(cfg.depth))
            self.final = FinalLayer(D, self.patch_volume, cfg.in_channels)
        self._rope: RopeTable | None = None
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
        """Timesteps t (B,) in [0, 1000] -> t_emb (B, D), the shared block modulation t_mod (B, 9, D).

        The sinusoidal features are fp32; a model with bf16 / fp16 weights runs the timestep MLP
        under autocast to its own dtype (an fp32 model runs it as called)."""
        dtype = self.t_proj[1].weight.dtype
        low = dtype in (torch.bfloat16, torch.float16)
        with torch.autocast(t.device.type, dtype=dtype, cache_enabled=False) if low else contextlib.nullcontext():
            t_emb = self.t_embed(t)                          # (B, D)
        t_mod = self.t_proj(t_emb).unflatten(1, (N_MOD, -1))  # (B, 9, D)
        return t_emb, t_mod

    def embed(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor | None = None, t_start: int = 0) -> Embedded:
        """Latents x (B, C, T, H, W), timesteps t (B,) in [0, 1000], captions -> block inputs.

        `t_start` is the global index of the first latent frame (in tokens along t), used for RoPE."""
        grid = self.cfg.token_grid(*x.shape[2:])
        tokens = self.patch_embed(x.to(self.patch_embed.proj.weight.dtype))  # (B, N, D)
        t_emb, t_mod = self.embed_timestep(t)                      # (B, D), (B, 9, D)
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
        t_emb, t_mod = self.embed_timestep(t)                           # (B, D), (B, 9, D)
        return Embedded(tokens, t_emb, t_mod, ctx, ctx_mask, rope, grid)

    def run_block(self, i: int, x: torch.Tensor, e: Embedded, attn=None) -> torch.Tensor:
        """Block i on tokens x (B, N, D); `attn(h, rope, grid) -> (B, N, D)` replaces its self-attention."""
        block = self.blocks[i]
        if self.cfg.checkpoint_blocks and self.training and torch.is_grad_enabled():
            return checkpoint(block, x, e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid, attn, use_reentrant=False)
        return block(x, e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid, attn)

    def head(self, x: torch.Tensor, e: Embedded) -> torch.Tensor:
        """Tokens (B, n, D) -> velocity rows (B, n, pv*C) in `patchify`'s layout: the final layer, per row;
        with `chunk_tokens`, over slices of that many rows, each under a checkpoint (its LayerNorm keeps
        fp32 copies of whole rows, too much over millions of tokens)."""
        step = self.cfg.chunk_tokens
        if not step or x.shape[1] <= step:
            return self.final(x, e.t_emb)
        return torch.cat([checkpoint(self.final, x[:, s:s + step], e.t_emb, use_reentrant=False)
                          for s in range(0, x.shape[1], step)], dim=1)      # (B, n, pv*C)

    def unembed(self, x: torch.Tensor, e: Embedded) -> torch.Tensor:
        """Tokens (B, N, D) -> latents (B, C, T, H, W)."""
        return unpatchify(self.head(x, e), e.grid, self.cfg.patch_size)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None, t_start: int = 0) -> torch.Tensor:
        """Velocity prediction (B, C, T, H, W) for latents x (B, C, T, H, W) at timesteps t (B,)."""
        e = self.embed(x, t, context, context_mask, t_start)
        h = e.x                                    # (B, N, D)
        for i in range(len(self.blocks)):
            h = self.run_block(i, h, e)            # (B, N, D)
        return self.unembed(h, e)                  # (B, C, T, H, W)


def count_params(cfg: DiTConfig) -> int:
    """Exact parameter count of `VideoDiT(cfg)`, computed analytically (allocates nothing)."""
    D, F, Dt, C = cfg.dim, cfg.ffn_dim, cfg.text_dim, cfg.in_channels
    pv = cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    norms = 2 * D if cfg.qk_norm else 0
    a = cfg.attention
    self_attn = 4 * D * D + 4 * D + norms + a.variant.extra_params(a.options, D, cfg.num_heads)
    cross_attn = 4 * D * D + 4 * D + norms
    mlp = 2 * D * F + F + D
    block = self_attn + cross_attn + mlp + N_MOD * D
    stem = (C * pv * D + D) + (cfg.freq_dim * D + D + D * D + D) + (N_MOD * D * D + N_MOD * D)
    text = text_encoder_params(cfg.vocab_size, cfg.text_len, Dt, cfg.text_layers) + (Dt * D + D + D * D + D)
    final = 2 * D + D * pv * C + pv * C
    return stem + text + cfg.depth * block + final


def _preset(dim, depth, heads, ffn, **kw) -> DiTConfig:
    base = {"in_channels": 16, "patch_size": (1, 2, 2), "text_dim": 1024, "text_layers": 2, "text_len": 64,
            "vocab_size": 32768}
    return DiTConfig(dim=dim, depth=depth, num_heads=heads, ffn_dim=ffn, **{**base, **kw})


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
    "wan-1.3b": _preset(1536, 30, 12, 8960, text_dim=4096, text_len=512, text_layers=0, vocab_size=4096),
}


def build_dit(name_or_config: str | DiTConfig, **overrides) -> VideoDiT:
    """A VideoDiT from a preset name or a config; overrides replace config fields
    (`attention=` takes an AttentionConfig, a dict, or an attention name).

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
    cfg = dataclasses.replace(cfg, **overrides)
    return VideoDiT(cfg)
