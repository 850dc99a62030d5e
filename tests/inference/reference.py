"""Slow, readable references for the inference tests: dense attention with explicit masks.

They use the model's own `embed` (Conv3d patch embedding, RoPE tables via `RopeTable.grid`
with a `t_start`) and `unembed`, never the sharded runner, the KV cache or the fused kernel.
"""
from __future__ import annotations

import dataclasses

import torch

from megaslide.diffusion.flow import TIME_SCALE
from megaslide.inference.weights import random_weights_
from megaslide.models.dit import DIT_PRESETS, VideoDiT


def tiny_model(dim: int = 96, heads: int = 6, seed: int = 0) -> VideoDiT:
    """The `tiny` preset with `heads` heads (6 divides by 2 and 3 ranks) and random weights, fp32, eval."""
    cfg = dataclasses.replace(DIT_PRESETS["tiny"], dim=dim, num_heads=heads)
    torch.manual_seed(seed)
    return random_weights_(VideoDiT(cfg), seed).eval()


def chunk_ids(grid: tuple[int, int, int], chunk_frames: int, t_start: int = 0) -> torch.Tensor:
    """Chunk index (N,) of every token of a row-major (T, H, W) grid whose first frame is t_start."""
    T, H, W = grid
    frames = torch.arange(t_start, t_start + T).repeat_interleave(H * W)  # (N,)
    return frames // chunk_frames


def block_causal_mask(q_chunks: torch.Tensor, k_chunks: torch.Tensor, window: int | None) -> torch.Tensor:
    """(Nq, Nk) True where a query of chunk i may see a key of chunk j: j <= i (and j >= i - window)."""
    qi, kj = q_chunks[:, None], k_chunks[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed &= kj >= qi - window
    return allowed


def dense_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d)) v for q (B, Nq, h, d), k, v (B, Nk, h, d), mask (Nq, Nk) bool or None."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5  # (B, h, Nq, Nk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)  # (B, Nq, h, d)


@torch.no_grad()
def masked_forward(model: VideoDiT, x: torch.Tensor, t: float, ids: torch.Tensor, chunk_frames: int,
                   window: int | None = None) -> torch.Tensor:
    """Velocity (B, C, T, H, W) of one forward of the whole video x (B, C, T, H, W) at time t, with
    dense self-attention under the block-causal (banded, with a window) mask of its chunks and
    RoPE from frame 0."""
    e = model.embed(x, torch.full((x.shape[0],), t * TIME_SCALE), ids, t_start=0)
    chunks = chunk_ids(e.grid, chunk_frames // model.cfg.patch_size[0])
    mask = block_causal_mask(chunks, chunks, window)                         # (N, N)
    h = e.x                                                                  # (B, N, D)
    for block in model.blocks:
        def attn(hh, rope, grid, a=block.attn):
            return a.project_out(dense_attention(*a.project_qkv(hh, rope), mask))  # (B, N, D)
        h = block(h, e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid, attn=attn)  # (B, N, D)
    return model.unembed(h, e)                                               # (B, C, T, H, W)


def chunked_forward(gen, x: torch.Tensor, t: float, ids: torch.Tensor) -> torch.Tensor:
    """Teacher forcing through a `CausalGenerator`: each chunk of x (B, C, T, H, W) once at time t, in
    order, through the KV cache (sharded over the generator's group). Returns (B, C, T, H, W)."""
    ctx, mask = gen.encode_context(ids)
    F = gen.config.chunk_frames
    outs = []
    for c in range(x.shape[2] // F):
        rows = gen.shard_rows(x[:, :, c * F:(c + 1) * F])                     # (B, n, pv*C)
        outs.append(gen.gather_chunk(gen.forward_chunk(c, rows, t, ctx, mask)))  # (B, C, F, H, W)
    return torch.cat(outs, dim=2)


@torch.no_grad()
def past_keys_values(model: VideoDiT, past: torch.Tensor, ids: torch.Tensor, chunk_frames: int,
                     window: int | None):
    """Per block, the roped k and v (B, N_past, h, d) of the clean past chunks past (B, C, T', H, W)
    at t = 0, computed densely under the block-causal mask."""
    e = model.embed(past, torch.zeros(past.shape[0]), ids, t_start=0)
    chunks = chunk_ids(e.grid, chunk_frames // model.cfg.patch_size[0])
    mask = block_causal_mask(chunks, chunks, window)
    kv, h = [], e.x
    for block in model.blocks:
        def attn(hh, rope, grid, a=block.attn):
            q, k, v = a.project_qkv(hh, rope)
            kv.append((k, v))
            return a.project_out(dense_attention(q, k, v, mask))
        h = block(h, e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid, attn=attn)
    return kv


@torch.no_grad()
def reference_generate(model: VideoDiT, noise: torch.Tensor, ids: torch.Tensor, chunk_frames: int,
                       timesteps: tuple[float, ...], window: int | None = None) -> torch.Tensor:
    """Chunked generation with no cache: before each chunk, the past is recomputed densely from the
    final clean chunks; the chunk's forwards attend to the past K/V of the last `window` chunks
    (all with None) and to themselves. Euler from t = timesteps[0] to 0. Returns (B, C, T, H, W)."""
    done: list[torch.Tensor] = []
    for c in range(noise.shape[2] // chunk_frames):
        past_kv = past_keys_values(model, torch.cat(done, 2), ids, chunk_frames, window) if done else None
        x = noise[:, :, c * chunk_frames:(c + 1) * chunk_frames]
        for t, t_next in zip(timesteps, tuple(timesteps[1:]) + (0.0,)):
            e = model.embed(x, torch.full((x.shape[0],), t * TIME_SCALE), ids, t_start=c * chunk_frames)
            keep = (c if window is None else min(c, window)) * e.x.shape[1]  # past rows attended
            h = e.x
            for i, block in enumerate(model.blocks):
                def attn(hh, rope, grid, a=block.attn, i=i):
                    q, k, v = a.project_qkv(hh, rope)                       # (B, Nc, h, d)
                    if keep:
                        k = torch.cat([past_kv[i][0][:, -keep:], k], dim=1)  # (B, L, h, d)
                        v = torch.cat([past_kv[i][1][:, -keep:], v], dim=1)
                    return a.project_out(dense_attention(q, k, v))
                h = block(h, e.t_mod, e.ctx, e.ctx_mask, e.rope, e.grid, attn=attn)
            x = x + (t_next - t) * model.unembed(h, e)
        done.append(x)
    return torch.cat(done, dim=2)
