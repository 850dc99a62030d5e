"""Causal-RoPE sequence-parallel generation: latency, throughput, speedups, ablation, correctness.

Model: the `wan-1.3b` preset (Wan2.1-1.3B shapes) with seeded RANDOM weights (no pretrained
weights can be downloaded here; speed does not depend on the values), bf16. Video: 5 s at 16
fps = 81 frames -> 21 latent frames of 60 x 104 (480 x 832 pixels, VAE 4x8x8), patch 1x2x2:
1560 tokens per latent frame. Causal generation: chunks of 3 latent frames (4680 tokens,
7 chunks), timesteps 1000/750/500/250 (Euler), KV cache of all earlier chunks, no CFG.
Baseline: the full-sequence bidirectional sampler (all 32760 tokens at once, same 4 steps)
with Ulysses SP over the same ranks, as xDiT/Wan do.

Measured (rank 0 clock, CUDA synchronised, after warm-up videos):
- time to first frame (TTFF): from the start of generation to the first chunk being final on
  the device, i.e. its 4 denoising steps and the gather; VAE decoding is EXCLUDED. The first
  latent chunk decodes to 9 video frames (1 + 4 * 2). For the full-sequence baseline every
  frame is final at the end, so its TTFF is its total time.
- total time and frames/s for the whole video (81 video frames = 1 + 4 * (21 - 1)).
- speedup over 1 GPU: the same generator on rank 0 alone (no SP, no collectives), in the same run.
- speedup over the full-sequence SP baseline on the same ranks.
- the optimisation ladder (each step adds one): none -> precomputed RoPE -> no host sync per
  layer -> fused QK-norm + RoPE -> CUDA graphs (= all on).
- model TFLOP/s per GPU (analytic FLOPs, real tokens only) against the bf16 matmul ceiling
  re-measured in the same run.
Correctness, in the same run, before any timing: max |P ranks - 1 rank| of the whole video
(causal and full-sequence), next to the bf16 noise level max |bf16 - fp32| of 1-rank causal
generation over the first two chunks (the tolerance rule: SP may differ from one rank by
about the rounding noise of the dtype).

    torchrun --standalone --nproc_per_node 1 -m experiments.sp_inference            # one H200
    torchrun --standalone --nproc_per_node 2 -m experiments.sp_inference            # two H200s
    torchrun --standalone --nproc_per_node 2 -m experiments.sp_inference tiny=true  # CPU smoke, gloo

Configuration: experiments/conf/sp_inference.yaml (the model group picks the DiT). Writes
results/sp_inference/<preset>_P<ranks>.json (or under $MEGASLIDE_RESULTS_DIR) on rank 0 after
every variant, so a run that dies late keeps what it measured; logs the run to W&B (offline by
default) and prints a table last.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from experiments.harness import ExperimentRun
from megaslide.perf.timing import Timing, matmul_tflops, sync
from experiments.hydra_config import require_ranges, script_config, script_main, trial_preset
from megaslide.config import DiTConfig, ParallelConfig
from megaslide.inference.causal import CausalConfig, CausalGenerator, check_chunking
from megaslide.inference.full import FullConfig, FullSequenceSampler
from megaslide.inference.launch import DistContext, barrier, init_distributed, shutdown
from megaslide.inference.weights import caption_input, random_weights_
from megaslide.models.dit import build_dit
from megaslide.perf.flops import token_path_flops
from megaslide.testing import within_tolerance

TARGETS = {"ttff_1gpu_s": 1.0, "speedup_2gpu_vs_1gpu": 1.8, "speedup_vs_full_sequence": 1.58}
LADDER = (  # (name, CausalConfig switches); each row adds one optimisation to the one above
    ("causal: none", dict(precompute_rope=False, host_sync_free=False, fused_qk_rope=False, cuda_graphs=False)),
    ("causal: +precomputed RoPE", dict(host_sync_free=False, fused_qk_rope=False, cuda_graphs=False)),
    ("causal: +no host sync", dict(fused_qk_rope=False, cuda_graphs=False)),
    ("causal: +fused QK-norm+RoPE", dict(cuda_graphs=False)),
    ("causal: +CUDA graphs (all)", dict()),
)


@dataclass(frozen=True)
class Setup:
    """The latent video (the `video` keys of sp_inference.yaml)."""

    frames: int
    height: int
    width: int
    chunk_frames: int
    caption: str

    @property
    def video_frames(self) -> int:
        """Pixel frames of the latent video under Wan's causal VAE (first frame alone, then 4 per latent)."""
        return 1 + 4 * (self.frames - 1)

    def validate(self) -> None:
        require_ranges(self, positive=("frames", "height", "width"), prefix="video.")
        check_chunking(self.frames, self.chunk_frames, prefix="video.")


@dataclass(frozen=True)
class SPInferenceConfig:
    """The keys of experiments/conf/sp_inference.yaml (their meaning is documented there)."""

    name: str
    tiny: bool
    video: Setup
    repeats: int
    warmup: int
    ladder: bool
    matmul_n: int
    model: DiTConfig
    model_preset: str
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        self.video.validate()
        require_ranges(self, positive=("repeats", "matmul_n"), non_negative=("warmup",))
        v = self.video   # every chunk (and so the video) patchifies
        self.model.token_grid(v.chunk_frames, v.height, v.width,
                              keys=("video.chunk_frames", "video.height", "video.width"))


TINY = {"model": {"preset": "tiny"}, "video": {"frames": 6, "height": 6, "width": 10, "chunk_frames": 3},
        "repeats": 1, "matmul_n": 512}


def matmul_ceiling(device: torch.device, n: int) -> dict:
    """bf16 (CUDA) / fp32 (CPU) n^3 matmul TFLOP/s, measured now."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"ceiling": f"matmul {n}^3 {str(dtype).removeprefix('torch.')}",
            "tflops": matmul_tflops(device, n, dtype)}


def causal_flops(cfg, setup: Setup, steps: int, window: int | None) -> float:
    frame_tokens = (setup.height // cfg.patch_size[1]) * (setup.width // cfg.patch_size[2])
    nc = setup.chunk_frames // cfg.patch_size[0] * frame_tokens
    chunks = setup.frames // setup.chunk_frames
    total = 0.0
    for c in range(chunks):
        keys = (min(c, window) if window is not None else c) * nc + nc
        total += steps * token_path_flops(cfg, nc, keys, cfg.text_len).forward
        if c + 1 < chunks:
            total += token_path_flops(cfg, nc, keys, cfg.text_len, final_layer=False).forward
    return total


def full_flops(cfg, setup: Setup, steps: int) -> float:
    n = setup.frames // cfg.patch_size[0] * (setup.height // cfg.patch_size[1]) * (setup.width // cfg.patch_size[2])
    return steps * token_path_flops(cfg, n, n, cfg.text_len).forward


def time_videos(generate, device: torch.device, group, warmup: int, repeats: int) -> tuple[Timing, Timing]:
    """(TTFF, total) seconds of `repeats` videos after `warmup` untimed ones, on this rank's clock.

    `generate()` makes one video as an iterator of its latent chunks; TTFF ends when the first
    chunk is final on the device (a one-chunk generator, the full-sequence sampler, has TTFF =
    total). With an SP `group` every rank starts each video together."""
    for _ in range(warmup):
        for _chunk in generate():
            pass
    ttffs, totals = [], []
    for _ in range(repeats):
        sync(device)
        if group is not None:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        first = None
        for _chunk in generate():
            if first is None:
                sync(device)
                first = time.perf_counter() - t0
        sync(device)
        totals.append(time.perf_counter() - t0)
        ttffs.append(first)
    return Timing(tuple(ttffs)), Timing(tuple(totals))


def flags_of(gen: CausalGenerator) -> dict:
    c = gen.config
    return {"precompute_rope": c.precompute_rope, "host_sync_free": c.host_sync_free,
            "fused_qk_rope": c.fused_qk_rope, "cuda_graphs": c.cuda_graphs}


def graphs_status(gen: CausalGenerator) -> str:
    if gen.graphs is None:
        return "off"
    return gen.graphs.fallback_reason or "captured"


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def log(ctx: DistContext, msg: str) -> None:
    if ctx.is_main:
        print(msg, flush=True)


FULL = "full-sequence (ulysses SP)"


class Bench:
    """One run: the model (bf16, and its fp32 master for the noise-level check), the inputs, the result."""

    def __init__(self, ctx: DistContext, cfg: SPInferenceConfig):
        self.ctx, self.cfg, self.setup = ctx, cfg, cfg.video
        setup = cfg.video
        self.steps = len(CausalConfig().timesteps)
        with torch.device(ctx.device):
            self.master = random_weights_(build_dit(cfg.model), seed=0).eval()  # fp32, same on every rank
        self.model = copy.deepcopy(self.master).to(torch.bfloat16)
        self.noise = torch.randn(1, cfg.model.in_channels, setup.frames, setup.height, setup.width,
                                 generator=torch.Generator().manual_seed(0))
        self.ids = caption_input(self.model, [setup.caption], ctx.device)
        patch = math.prod(cfg.model.patch_size)
        shape = dict(preset=cfg.model_preset, latent=(setup.frames, setup.height, setup.width),
                     tokens_per_chunk=setup.chunk_frames * setup.height * setup.width // patch,
                     chunks=setup.frames // setup.chunk_frames, chunk_frames=setup.chunk_frames, steps=self.steps)
        self.name = cfg.name or f"{cfg.model_preset}_P{ctx.world}"
        self.run = ExperimentRun("sp_inference", self.name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project,
                                 trial=cfg.tiny) \
            if ctx.is_main else None
        self.payload = {
            "note": ("wan-1.3b shapes with RANDOM weights (speed does not depend on values); bf16; no CFG; TTFF = "
                     "first latent chunk final on the device, VAE decode excluded; video frames = 1 + 4 * (latent "
                     "frames - 1); the full-sequence baseline's TTFF is its total time."),
            "ranks": ctx.world, "device": str(ctx.device), "setup": shape, "targets": TARGETS, "rows": [],
            "tables": {}}
        log(ctx, f"sp_inference: {shape} on {ctx.world} rank(s) of {ctx.device}")
        self.ceiling = matmul_ceiling(ctx.device, cfg.matmul_n)
        self.payload["tables"]["ceilings"] = [self.ceiling]
        log(ctx, f"ceiling: {self.ceiling}")

    def causal(self, group, model=None, frames=None, **switches) -> CausalGenerator:
        s = self.setup
        return CausalGenerator(model or self.model, frames=frames or s.frames, height=s.height, width=s.width,
                               group=group, config=CausalConfig(chunk_frames=s.chunk_frames, **switches))

    def full(self, group) -> FullSequenceSampler:
        s = self.setup
        return FullSequenceSampler(self.model, frames=s.frames, height=s.height, width=s.width, group=group,
                                   config=FullConfig(parallel=ParallelConfig(sp_mode="ulysses")))

    def check_correctness(self) -> None:
        """P ranks vs rank 0 alone (whole video, causal and full-sequence) and bf16 vs fp32 (two chunks)."""
        ctx, noise, ids = self.ctx, self.noise, self.ids
        sharded_video = self.causal(ctx.group).sample(noise, ids)
        sharded_full = self.full(ctx.group).sample(noise, ids)
        if ctx.is_main:
            single_video = self.causal(None).sample(noise, ids)
            single_full = self.full(None).sample(noise, ids)
            two = 2 * self.setup.chunk_frames
            plain = dict(fused_qk_rope=False, cuda_graphs=False)
            fp32_video = self.causal(None, model=self.master, frames=two, **plain).sample(noise[:, :, :two], ids)
            check = {"causal_max_abs_diff_P_vs_1": (sharded_video - single_video).abs().max().item(),
                     "full_max_abs_diff_P_vs_1": (sharded_full - single_full).abs().max().item(),
                     "bf16_noise_max_abs_diff_vs_fp32_first_2_chunks":
                         (single_video[:, :, :two] - fp32_video).abs().max().item(),
                     "output_max_abs": single_video.abs().max().item()}
            worst = max(check["causal_max_abs_diff_P_vs_1"], check["full_max_abs_diff_P_vs_1"])
            check["sp_within_2x_bf16_noise"] = within_tolerance(
                worst, check["bf16_noise_max_abs_diff_vs_fp32_first_2_chunks"], floor=0.0)
            self.payload["tables"]["correctness"] = [check]
            log(ctx, f"correctness: {check}")
        self.master = None
        barrier(ctx)
        release(ctx.device)

    def record(self, variant: str, ranks: int, flags: dict, ttff: Timing, total_timing: Timing,
               flops: float) -> None:
        total = total_timing.median
        tflops = flops / total / ranks / 1e12
        s = self.setup
        self.payload["rows"].append({
            "variant": variant, "ranks": ranks, **ttff.ms("ttff_ms"), "total_s": total, **total_timing.ms("total_ms"),
            "latent_fps": s.frames / total, "video_fps": s.video_frames / total, "tflops_per_gpu": tflops,
            "frac_of_matmul_ceiling": tflops / self.ceiling["tflops"], **flags})
        log(self.ctx, f"  {variant} on {ranks} rank(s): TTFF {1e3 * ttff.median:.1f} ms, total {total:.3f} s")
        if self.run:
            self.run.save(self.payload)

    def time_causal(self, variant: str, group, **switches) -> None:
        gen = self.causal(group, **switches)
        ttff, total = time_videos(lambda: (c.latents for c in gen.generate(self.noise, self.ids)), self.ctx.device,
                                  gen.group, self.cfg.warmup, self.cfg.repeats)
        flops = causal_flops(self.model.cfg, self.setup, self.steps, None)
        ranks = 1 if gen.group is None else self.ctx.world
        self.record(variant, ranks, {**flags_of(gen), "cuda_graphs_status": graphs_status(gen)}, ttff, total, flops)
        gen = None  # release the generator's caches before the next variant
        release(self.ctx.device)

    def time_full(self, group) -> None:
        sampler = self.full(group)
        _, total = time_videos(lambda: iter([sampler.sample(self.noise, self.ids)]), self.ctx.device, sampler.group,
                               self.cfg.warmup, self.cfg.repeats)
        ranks = 1 if sampler.group is None else self.ctx.world
        flags = {"precompute_rope": sampler.config.precompute_rope, "fused_qk_rope": sampler.config.fused_qk_rope}
        self.record(FULL, ranks, flags, total, total, full_flops(self.model.cfg, self.setup, self.steps))
        sampler = None  # release the sampler before the next variant
        release(self.ctx.device)


@script_main("sp_inference")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(SPInferenceConfig, hydra_cfg, trial_preset(hydra_cfg, tiny=TINY))  # tiny: TINY's sizes
    ctx = init_distributed("cpu" if cfg.tiny else "auto", timeout_s=300)
    bench = Bench(ctx, cfg)
    bench.check_correctness()
    for variant, switches in (LADDER if cfg.ladder else LADDER[-1:]):
        bench.time_causal(variant, ctx.group, **switches)
    bench.time_full(ctx.group)
    if ctx.world > 1:  # the same generators on rank 0 alone: the speedup over 1 GPU, in this run
        if ctx.is_main:
            bench.time_causal(LADDER[-1][0], None)
            bench.time_full(None)
        barrier(ctx)
    if ctx.is_main:
        payload = bench.payload
        payload["summary"] = summarize(payload["rows"], ctx.world)
        bench.run.finish(payload, payload["summary"])
        print_table(payload["rows"], payload["summary"])
    shutdown(ctx)


def summarize(rows: list[dict], P: int) -> dict:
    """Speedups of the all-on causal generator over 1 rank and over the full-sequence baseline."""
    def find(variant, ranks):
        return next((r for r in rows if r["variant"] == variant and r["ranks"] == ranks), None)

    best, full_p = find(LADDER[-1][0], P), find(FULL, P)
    best_1 = find(LADDER[-1][0], 1)
    out = {"ttff_ms": best["ttff_ms"], "total_s": best["total_s"],
           "speedup_vs_full_sequence_total": full_p["total_s"] / best["total_s"],
           "speedup_vs_full_sequence_ttff": full_p["ttff_ms"] / best["ttff_ms"]}
    if P > 1:
        out["speedup_vs_1gpu_total"] = best_1["total_s"] / best["total_s"]
        out["speedup_vs_1gpu_ttff"] = best_1["ttff_ms"] / best["ttff_ms"]
    if best_1 is not None:
        out["ttff_1gpu_below_1s"] = best_1["ttff_ms"] < 1e3 * TARGETS["ttff_1gpu_s"]
    if P == 2:
        out["speedup_vs_1gpu_meets_1.8x"] = out["speedup_vs_1gpu_total"] >= TARGETS["speedup_2gpu_vs_1gpu"]
    out["speedup_vs_full_meets_1.58x"] = out["speedup_vs_full_sequence_total"] >= TARGETS["speedup_vs_full_sequence"]
    for r in rows:
        r["speedup_vs_full_sequence"] = full_p["total_s"] / r["total_s"] if r["ranks"] == P else None
    return out


def print_table(rows: list[dict], summary: dict) -> None:
    print("summary: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in summary.items()))
    print(f"{'variant':<30} {'ranks':>5} {'TTFF ms':>9} {'total s':>8} {'video fps':>9} {'vs full':>7} "
          f"{'TFLOP/s/GPU':>11}")
    for r in rows:
        vs = r["speedup_vs_full_sequence"]
        print(f"{r['variant']:<30} {r['ranks']:>5} {r['ttff_ms']:>9.1f} {r['total_s']:>8.3f} {r['video_fps']:>9.2f} "
              f"{(f'{vs:.2f}x' if vs else '-'):>7} {r['tflops_per_gpu']:>11.3g}", flush=True)


if __name__ == "__main__":
    main()
