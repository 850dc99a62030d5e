"""Chunk-by-chunk autoregressive video generation with a KV cache (Self-Forcing style), over P ranks.

A video of T latent frames is made in chunks of F frames (default 3). For chunk c:
1. Start from its slice of the noise and run the one Euler loop, `euler_integrate` of
   `megaslide.diffusion.samplers` (its convention: x_t = (1 - t) x0 + t noise, the model
   predicts v = noise - x0 at timestep 1000 t, x <- x + (t_next - t) v), over the timesteps
   (default t = 1.0, 0.75, 0.5, 0.25, then to 0). Self-Forcing re-noises an x0 prediction
   instead; Euler keeps one convention across the codebase and is deterministic given the noise.
   Each forward attends bidirectionally inside the chunk and to the cached K/V of earlier
   chunks (block-causal; with `window=W` only the W previous chunks).
2. The chunk is final: it is yielded at once (time to first frame = chunk 0's steps).
3. One forward of the clean chunk at t = 0 writes its K/V into the cache (skipped after the
   last chunk). Every forward writes its chunk's K/V to the chunk's own slot and attends to
   the filled prefix, so the denoising steps' entries are simply overwritten by this one.

Causal RoPE: the temporal index of a token is its global frame index (chunk start + local
frame); the cos/sin tables are built once for the longest video, and each rank looks up the
rows of its own token shard, so positions never travel.

Sequence parallelism (`group` of P ranks; None = this process alone): the generator runs its
own copy of the model (sharing the weights) parallelized for Ulysses by
`megaslide.parallel.apply.parallelize_dit`. Each rank holds a contiguous, tail-padded shard of
the chunk's row-major tokens (`sharded.TokenShard`), embeds it, and per block projects q, k, v
for its tokens; the block's attention is overridden by `CachedAttention`: one Ulysses
all-to-all turns q, k, v into all tokens of heads / P heads, attention runs against this rank's
head-sharded cache, and the inverse all-to-all brings the output back to token shards. The
cache holds heads / P heads of every token and never moves. Heads not divisible by P raise
ValueError.

Optimisations, each switchable for the ablation (`CausalConfig`): RoPE rows precomputed per
chunk on the device (else looked up on the host and copied every forward, as
`VideoDiT.embed` does); fused QK-norm + RoPE (`megaslide.nn.qk_rope`, the model's own path on
CUDA; the ablation runs the eager ops); no host synchronisation (cache positions are Python ints;
the ablation reads a device index with `.item()` in every layer);
CUDA graphs of the per-chunk forward (static shapes per cache slot; CUDA only).

Entry point: experiments/generate_causal.py.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaslide.config import ParallelConfig
from megaslide.diffusion.samplers import FEW_STEP_TIMESTEPS, check_timesteps, euler_integrate, model_timesteps
from megaslide.inference.kv_cache import KVCache
from megaslide.inference.sharded import (Rope, TokenShard, forward_shard, gather_rows, shard_rope,
                                         unfused_project_qkv, weight_sharing_copy)
from megaslide.models.dit import VideoDiT, patchify, unpatchify
from megaslide.nn.rope import RopeTable
from megaslide.parallel.apply import SequenceParallelAttention, parallelize_dit
from megaslide.parallel.groups import group_size
from megaslide.parallel.ulysses import head_to_seq, seq_to_head_qkv


@dataclass
class CausalConfig:
    chunk_frames: int = 3                              # latent frames per chunk (F)
    timesteps: tuple[float, ...] = FEW_STEP_TIMESTEPS  # descending, in (0, 1]; the last step goes to 0
    window: int | None = None                        # past chunks attended (None: all of them)
    precompute_rope: bool = True                     # device-resident RoPE rows per chunk
    fused_qk_rope: bool = True                       # fused QK-norm + RoPE (Triton on CUDA)
    host_sync_free: bool = True                      # False: read the cache end with .item() per layer
    cuda_graphs: bool = True                         # CUDA graphs of the per-chunk forward (CUDA only)

    def __post_init__(self):
        self.timesteps = tuple(float(t) for t in self.timesteps)

    def validate(self) -> None:
        if self.chunk_frames < 1:
            raise ValueError(f"chunk_frames={self.chunk_frames} must be >= 1")
        check_timesteps(self.timesteps)
        if self.window is not None and self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1 past chunks, or None to attend to all")
        if self.cuda_graphs and not self.host_sync_free:
            raise ValueError("cuda_graphs=True cannot capture the per-layer .item() of host_sync_free=False; "
                             "turn one of them off")


def check_chunking(frames: int, chunk_frames: int, *, prefix: str = "") -> None:
    """`frames` latent frames as whole chunks of `chunk_frames`; each error names the config keys (`prefix` + the
    name, e.g. `video.` for sp_inference.py's video group) and the fix."""
    if chunk_frames < 1:
        raise ValueError(f"{prefix}chunk_frames={chunk_frames} must be >= 1 (latent frames per chunk)")
    if frames < 1 or frames % chunk_frames:
        raise ValueError(f"{prefix}frames={frames} is not a multiple of {prefix}chunk_frames={chunk_frames}; choose "
                         f"a chunk size that divides the number of latent frames (e.g. 21 frames: 1, 3 or 7)")


@dataclass
class GeneratedChunk:
    index: int             # chunk number
    start: int             # first latent frame of the chunk in the video
    latents: torch.Tensor  # (B, C, F, H, W) float32, final


class CachedAttention:
    """Self-attention of block `layer` for the current chunk, against the KV cache; it overrides the
    block's attention `attn` (its Ulysses form from `parallelize_dit`), whose projections it uses.

    h (B, n, D) this rank's token rows -> q, k, v (B, n, heads, d) -> [Ulysses all-to-all ->
    (B, P*n, heads/P, d)] -> the chunk's real K/V into the cache -> softmax attention of every
    query to the cached keys (B, heads/P, L, d) -> [inverse all-to-all] -> (B, n, D)."""

    def __init__(self, attn: SequenceParallelAttention, layer: int, cache: KVCache):
        self.attn, self.layer, self.cache, self.group = attn, layer, cache, attn.group

    def __call__(self, h: torch.Tensor, rope: Rope, grid: tuple[int, int, int]) -> torch.Tensor:
        q, k, v = self.attn.project_qkv(h, rope)                        # (B, n, h, d) each
        if self.group is not None:
            q, k, v = seq_to_head_qkv(q, k, v, self.group)              # (B, P*n, h/P, d) each
        real = self.cache.chunk_tokens                                  # padding sits at the tail
        keys, values = self.cache.write_and_view(self.layer, k[:, :real], v[:, :real])  # (B, h/P, L, d)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values)  # (B, h/P, P*n, d)
        o = o.transpose(1, 2)                                           # (B, P*n, h/P, d)
        if self.group is not None:
            o = head_to_seq(o, self.group)                              # (B, n, h, d)
        return self.attn.project_out(o)                                 # (B, n, D)


class StepGraphs:
    """CUDA graphs of a static-shape forward, one per key, with inputs copied into static buffers.

    The first call of a key runs eagerly (a warm-up: lazy initialisation, Triton compilation and
    NCCL connection set-up must not happen during capture); the second captures, and every later
    call replays. Under SP the graph holds the NCCL all-to-alls (capturable with NCCL >= 2.9.6);
    a capture that fails on any rank turns graphs off on all ranks, with the reason kept in
    `fallback_reason`. The returned tensor is the graph's static output: use it before the next
    call with the same key."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.fallback_reason: str | None = probe_collective_capture(group) if group is not None else None
        self._graphs: dict = {}
        self._seen: set = set()
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, key, fn, inputs: tuple[torch.Tensor, ...]):
        if self.fallback_reason is not None:
            return fn(*inputs)
        if key not in self._graphs:
            if key not in self._seen:
                self._seen.add(key)
                return fn(*inputs)
            captured = self._capture(fn, inputs)
            if captured is None:
                return fn(*inputs)
            self._graphs[key] = captured
        graph, static_in, static_out = self._graphs[key]
        for buf, x in zip(static_in, inputs):
            buf.copy_(x)
        graph.replay()
        return static_out

    def _capture(self, fn, inputs):
        static_in = tuple(x.clone() for x in inputs)
        graph, static_out, error = torch.cuda.CUDAGraph(), None, None
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                static_out = fn(*static_in)
        except RuntimeError as e:
            error = f"capture failed: {type(e).__name__}: {e}"
        error = _agree(error, self.group)
        if error is not None:
            self.fallback_reason = error
            self._graphs.clear()
            return None
        return graph, static_in, static_out


def _agree(error: str | None, group: dist.ProcessGroup | None) -> str | None:
    """Every rank learns whether any rank failed (one small eager all-reduce under SP)."""
    if group is None:
        return error
    flag = torch.tensor([0 if error is None else 1], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is None and int(flag.item()):
        return "capture failed on another rank"
    return error


def probe_collective_capture(group: dist.ProcessGroup) -> str | None:
    """None if an all-to-all captured in a CUDA graph replays correctly on every rank of `group`,
    else the reason (then the generator runs eagerly)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    send = torch.zeros(P * 4, device="cuda")
    recv = torch.zeros_like(send)
    error = None
    try:
        dist.all_to_all_single(recv, send, group=group)  # connects the peers before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            dist.all_to_all_single(recv, send, group=group)
        for trial in range(2):
            send.copy_(torch.arange(P * 4, device="cuda", dtype=torch.float32) + 1000 * r + 100 * trial)
            graph.replay()
            source = torch.arange(P, device="cuda", dtype=torch.float32)[:, None]
            expected = (torch.arange(4, device="cuda") + 4 * r)[None] + 1000 * source + 100 * trial  # (P, 4)
            if not torch.equal(recv.view(P, 4), expected):
                error = f"a captured all-to-all replayed wrong data (trial {trial})"
                break
    except RuntimeError as e:
        error = f"NCCL all-to-all could not be captured: {type(e).__name__}: {e}"
    return _agree(error, group)


class CausalGenerator:
    """Chunked autoregressive sampling of videos up to `frames` latent frames of `height` x `width`.

    The model (on its device and dtype, eval mode) keeps its weights; the generator runs its own
    parallelized copy (`self.model`, sharing them), and the model passed in is left as it was.
    `group` shards every chunk's tokens over its ranks (None: this process alone). Every rank must
    pass the same noise and caption."""

    def __init__(self, model: VideoDiT, *, frames: int, height: int, width: int,
                 config: CausalConfig | None = None, group: dist.ProcessGroup | None = None, batch: int = 1):
        cfg = config or CausalConfig()
        cfg.validate()
        mc = model.cfg
        F_ = cfg.chunk_frames
        check_chunking(frames, F_)
        self.chunk_grid = mc.token_grid(F_, height, width, keys=("chunk_frames", "height", "width"))  # or raises
        P = group_size(group)
        if mc.num_heads % P:
            raise ValueError(f"model heads={mc.num_heads} are not divisible by the {P} sequence-parallel ranks; "
                             f"use a number of ranks that divides the head count")
        self.config, self.batch = cfg, batch
        self.group = group if P > 1 else None
        self.model = parallelize_dit(weight_sharing_copy(model), self.group, ParallelConfig(sp=P, sp_mode="ulysses"),
                                     project_qkv=None if cfg.fused_qk_rope else unfused_project_qkv)
        self.frames, self.height, self.width = frames, height, width
        self.num_chunks = frames // F_
        self.chunk_tokens = math.prod(self.chunk_grid)
        self.shard = TokenShard.of(self.chunk_tokens, self.group)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.rows_width = math.prod(mc.patch_size) * mc.in_channels  # pv*C values per token row
        _, Hc, Wc = self.chunk_grid
        self.rope_table = RopeTable(mc.head_dim, frames // mc.patch_size[0], Hc, Wc)  # the longest video, once
        self.cache = KVCache(depth=mc.depth, batch=batch, heads=mc.num_heads // P, head_dim=mc.head_dim,
                             chunk_tokens=self.chunk_tokens, num_chunks=self.num_chunks, window=cfg.window,
                             dtype=self.dtype, device=self.device, host_sync=not cfg.host_sync_free)
        self.attns = [CachedAttention(block.attn, i, self.cache) for i, block in enumerate(self.model.blocks)]
        self._ropes = ([self._lookup_rope(c) for c in range(self.num_chunks)] if cfg.precompute_rope else None)
        use_graphs = cfg.cuda_graphs and self.device.type == "cuda"
        self.graphs = StepGraphs(self.group) if use_graphs else None

    def _lookup_rope(self, chunk: int) -> Rope:
        """cos, sin (n, d/2) of this rank's tokens of `chunk`, temporal index = global frame."""
        t_start = chunk * self.chunk_grid[0]
        return shard_rope(self.rope_table, self.chunk_grid, t_start, self.shard, self.device)

    def rope(self, chunk: int) -> Rope:
        return self._ropes[chunk] if self._ropes is not None else self._lookup_rope(chunk)

    def shard_rows(self, latents: torch.Tensor) -> torch.Tensor:
        """A chunk's latents (B, C, F, H, W) -> this rank's rows (B, n, pv*C) in float32."""
        return self.shard.take(patchify(latents.float(), self.model.cfg.patch_size))

    def gather_chunk(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (B, n, pv*C) -> the chunk's latents (B, C, F, H, W) on every rank."""
        return unpatchify(gather_rows(rows, self.shard, self.group), self.chunk_grid, self.model.cfg.patch_size)

    def encode_context(self, context: torch.Tensor, context_mask: torch.Tensor | None = None):
        """Caption ids (B, L) or embeddings (B, L, Dt) -> (ctx (B, L, D), ctx_mask (B, L)), once per video."""
        return self.model.embed_context(context, context_mask)

    @torch.no_grad()
    def forward_chunk(self, chunk: int, x: torch.Tensor, t: float, ctx: torch.Tensor, ctx_mask: torch.Tensor,
                      head: bool = True) -> torch.Tensor | None:
        """One forward of chunk `chunk` at time t in [0, 1]: rows x (B, n, pv*C) -> velocity rows
        (B, n, pv*C) float32 (None if head=False). Writes the chunk's K/V into its cache slot and
        attends to the cached chunks; call chunks in increasing order within one video."""
        if x.shape != (self.batch, self.shard.n, self.rows_width):
            raise ValueError(f"x must be this rank's rows (B, n, pv*C) = ({self.batch}, {self.shard.n}, "
                             f"{self.rows_width}); got {tuple(x.shape)}: use shard_rows")
        self.cache.begin_chunk(chunk)
        tt = model_timesteps(t, self.batch, self.device)  # (B,)
        cos, sin = self.rope(chunk)

        def step(x, tt, cos, sin, ctx, ctx_mask):
            return forward_shard(self.model, x, tt, ctx, ctx_mask, (cos, sin), self.chunk_grid, self.attns, head)

        inputs = (x, tt, cos, sin, ctx, ctx_mask)
        if self.graphs is None:
            v = step(*inputs)
        else:
            key = (self.cache.offset, self.cache.filled, head, tuple(ctx.shape))
            v = self.graphs(key, step, inputs)
        return None if v is None else v.to(torch.float32, copy=True)  # a fresh tensor, even from a graph

    def _check_noise(self, noise: torch.Tensor) -> None:
        want = (self.batch, self.model.cfg.in_channels, self.height, self.width)
        if noise.dim() != 5 or (*noise.shape[:2], *noise.shape[3:]) != want:
            raise ValueError(f"noise must be (B, C, T, H, W) = ({want[0]}, {want[1]}, T, {want[2]}, {want[3]}); "
                             f"got {tuple(noise.shape)}")
        T = noise.shape[2]
        if T % self.config.chunk_frames or not 0 < T <= self.frames:
            raise ValueError(f"noise has {T} frames: it needs a positive multiple of chunk_frames="
                             f"{self.config.chunk_frames}, at most frames={self.frames} (the RoPE table and "
                             f"KV cache size); build the generator for longer videos if needed")

    @torch.no_grad()
    def generate(self, noise: torch.Tensor, context: torch.Tensor,
                 context_mask: torch.Tensor | None = None) -> Iterator[GeneratedChunk]:
        """Yield the chunks of one video, each as soon as it is final.

        noise (B, C, T, H, W) with T a multiple of chunk_frames and <= frames, the same on every
        rank; context: caption ids (B, L) or embeddings (B, L, Dt)."""
        self._check_noise(noise)
        ctx, ctx_mask = self.encode_context(context, context_mask)  # (B, L, D), (B, L)
        self.cache.reset()
        F_, ts = self.config.chunk_frames, self.config.timesteps
        chunks = noise.shape[2] // F_
        for c in range(chunks):
            x = self.shard_rows(noise[:, :, c * F_:(c + 1) * F_].to(self.device))  # (B, n, pv*C)
            x = euler_integrate(functools.partial(self.forward_chunk, c, ctx=ctx, ctx_mask=ctx_mask), x, ts)
            yield GeneratedChunk(c, c * F_, self.gather_chunk(x))
            if c + 1 < chunks:
                self.forward_chunk(c, x, 0.0, ctx, ctx_mask, head=False)        # clean K/V into the cache

    def sample(self, noise: torch.Tensor, context: torch.Tensor,
               context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The whole video (B, C, T, H, W) float32."""
        return torch.cat([c.latents for c in self.generate(noise, context, context_mask)], dim=2)

