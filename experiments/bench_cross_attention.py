"""Cross-attention benchmark: SDPA of a token slice's queries over the caption, forward and forward+backward, with
the queries run whole or split into equal groups run side by side as batch entries that share the caption's keys
(as the model's `CrossAttention` runs them), after a correctness check.

Why groups. In the 2M-token training step the cross-attention's backward (cuDNN's, on an H200) takes several times
its forward (docs/long_clips.md, "Where the step goes at 8-frame slices"). Its queries are a whole slice (65,280
tokens) and its keys a caption (512). If that backward splits its work over key blocks, as flash-attention
backwards do, a caption gives it few to hand out: the hypothesis this benchmark tests. Grouped, each group is a
batch entry of its own, with the same math: a query's softmax runs over the same keys, and each key's gradient
is the sum of its groups' (summed by autograd through the keys' expand). The H200 run said it pays: the model's
`CrossAttention` now runs `megaslide.models.layers.grouped_cross_attention` with `query_groups`' count, and
this benchmark times that function.

Inputs as training's `CrossAttention` makes them under bf16 autocast: q a (B, heads, N, d) view of (B, N, heads,
d), k and v (B, heads, L, d) views of (B, L, heads, d), and a caption mask (B, 1, 1, L) whose last
`masked_keys` keys are padding. Gradients are taken for q, k and v.

Tables of results/cross_attention/<name>.json (rendered by experiments/report.py):
- checks: per group count, the grouped output and q, k, v gradients against plain SDPA in float64 (the truth),
  beside plain SDPA in the tested dtype, by `megaslide.testing.within_tolerance`; fp32 and bf16; `passed` is all
  of them, and nothing is timed unless they pass;
- cells: per model width (heads x head_dim), token count and group count: forward and forward+backward medians
  and spread, and peak memory (CUDA);
- summary: per width and token count, the fastest group count and the whole queries' forward+backward time over
  its time.

    python -m experiments.bench_cross_attention name=h200_cross_attention   # GPU
    python -m experiments.bench_cross_attention smoke=true                  # tiny, CPU
Configuration: experiments/conf/bench_cross_attention.yaml.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig

from experiments.harness import ExperimentRun, check_line
from experiments.hydra_config import script_config, script_main, trial_preset
from megaslide.models.layers import grouped_cross_attention
from megaslide.perf.timing import MIN_REPEATS, measure
from megaslide.testing import rounding_floor, within_tolerance

F64 = torch.float64
CHECK_CASES = [(2, 48, 3, 32, 11, 3), (1, 60, 2, 24, 7, 0)]   # (B, N, heads, d, L, masked keys)
SMOKE = {"widths": [[2, 8]], "tokens": [12], "caption": 5, "masked_keys": 2, "groups": [1, 2, 3], "repeats": 5}


@dataclass(frozen=True)
class BenchCrossAttentionConfig:
    """The keys of experiments/conf/bench_cross_attention.yaml (their meaning is documented there)."""

    name: str
    smoke: bool
    widths: list[list[int]]
    tokens: list[int]
    caption: int
    masked_keys: int
    groups: list[int]
    repeats: int
    wandb_dir: str
    wandb_project: str

    def validate(self) -> None:
        if self.repeats < MIN_REPEATS:
            raise ValueError(f"repeats={self.repeats}: time at least {MIN_REPEATS} calls for a median and a spread")
        if not self.widths or any(len(w) != 2 or min(w) < 1 for w in self.widths):
            raise ValueError(f"widths={self.widths}: give [heads, head_dim] pairs, each >= 1")
        if not self.tokens or min(self.tokens) < 1:
            raise ValueError(f"tokens={self.tokens}: give query counts >= 1")
        if not 0 <= self.masked_keys < self.caption:
            raise ValueError(f"masked_keys={self.masked_keys} must be in [0, caption={self.caption}): at least one "
                             f"key of the caption must be real")
        if not self.groups or min(self.groups) < 1 or 1 not in self.groups:
            raise ValueError(f"groups={self.groups}: give group counts >= 1, including 1 (the whole queries, the "
                             f"baseline)")


def make_inputs(B: int, N: int, heads: int, d: int, L: int, masked: int, device, dtype, seed: int = 0):
    """q (B, heads, N, d), k, v (B, heads, L, d) as strided views of token-major tensors, the caption mask
    (B, 1, 1, L) (None when no key is masked) and an output gradient (B, N, heads, d), the output's layout."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, N, heads, d, generator=g, device=device, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, L, heads, d, generator=g, device=device, dtype=dtype).transpose(1, 2) for _ in range(2))
    mask = None
    if masked:
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=device)
        mask[..., L - masked:] = False
    grad = torch.randn(B, N, heads, d, generator=g, device=device, dtype=dtype)
    return q, k, v, mask, grad


def output_and_grads(q, k, v, mask, grad, groups: int, dtype) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of the cross-attention in `dtype` (groups = 1: plain SDPA)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = grouped_cross_attention(q, k, v, mask, groups)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad.to(dtype))]


def check(case: tuple, groups: int, dtype, device) -> dict:
    """The grouped path against plain SDPA in float64, beside plain SDPA in `dtype`, on inputs rounded to dtype."""
    B, N, heads, d, L, masked = case
    q, k, v, mask, grad = (t if t is None or t.dtype == torch.bool else t.to(dtype).to(F64)
                           for t in make_inputs(B, N, heads, d, L, masked, device, F64))
    truth, same, got = (output_and_grads(q, k, v, mask, grad, g, dt)
                        for g, dt in ((1, F64), (1, dtype), (groups, dtype)))
    errors = {}
    for name, want, ref, out in zip(("out", "dq", "dk", "dv"), truth, same, got):
        err = (out.to(F64) - want).abs().max().item()
        ref_err = (ref.to(F64) - want).abs().max().item()
        ok = out.shape == want.shape and out.dtype == ref.dtype and within_tolerance(err, ref_err,
                                                                                     rounding_floor(dtype, want))
        errors[name] = {"err": err, "ref_err": ref_err, "ok": ok}
    return {"case": list(case), "groups": groups, "dtype": str(dtype).removeprefix("torch."),
            "passed": all(e["ok"] for e in errors.values()), "errors": errors}


def cells(cfg: BenchCrossAttentionConfig, heads: int, d: int, tokens: int, device) -> list[dict]:
    """One row per group count that divides `tokens`: forward and forward+backward."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, mask, grad = make_inputs(1, tokens, heads, d, cfg.caption, cfg.masked_keys, device, dtype)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    rows = []
    for groups in (g for g in cfg.groups if tokens % g == 0):
        def forward(groups=groups):
            with torch.no_grad():
                grouped_cross_attention(q, k, v, mask, groups)

        def forward_backward(groups=groups):
            torch.autograd.grad(grouped_cross_attention(q, k, v, mask, groups), leaves, grad)

        row = {"heads": heads, "head_dim": d, "tokens": tokens, "caption": cfg.caption, "groups": groups,
               "dtype": str(dtype).removeprefix("torch.")}
        for key, step in (("fwd", forward), ("fwdbwd", forward_backward)):
            row.update({f"{key}_{name}": value for name, value in measure(lambda step=step: step, cfg.repeats,
                                                                          device).items()})
        rows.append(row)
        print(f"  {heads:3d} x {d:3d} N={tokens:7d} groups {groups:3d}: fwd {row.get('fwd_ms', float('nan')):8.3f} "
              f"ms  fwd+bwd {row.get('fwdbwd_ms', float('nan')):8.3f} ms", flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per (width, tokens): the fastest group count by forward+backward, and whole / fastest."""
    summary = {}
    for key in sorted({(r["heads"], r["head_dim"], r["tokens"]) for r in rows}):
        timed = {r["groups"]: r["fwdbwd_ms"] for r in rows if (r["heads"], r["head_dim"], r["tokens"]) == key
                 and "fwdbwd_ms" in r}
        if 1 in timed:
            best = min(timed, key=timed.get)
            summary[f"{key[0]}x{key[1]}_n{key[2]}"] = {"best_groups": best, "whole_over_best": timed[1] / timed[best]}
    return summary


def bench(cfg: BenchCrossAttentionConfig) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not cfg.smoke:
        print("bench_cross_attention times cuDNN's attention: it needs a CUDA GPU (smoke=true runs it tiny on the "
              "CPU)", file=sys.stderr)
        return 2
    if device.type == "cuda":   # true fp32 references
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    name = cfg.name or ("cross_attention_smoke" if cfg.smoke else "cross_attention")
    run = ExperimentRun("cross_attention", name, asdict(cfg), cfg.wandb_dir, cfg.wandb_project, trial=cfg.smoke)
    checks = [check(case, groups, dtype, device) for case in CHECK_CASES
              for groups in sorted({g for g in cfg.groups if case[1] % g == 0} | {2, 3})
              for dtype in (torch.float32, torch.bfloat16)]
    passed = all(c["passed"] for c in checks)
    payload = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "passed": passed,
               "checks": checks, "tables": {}}
    rows = run.timed_cells(payload, passed, [(h, d, n) for h, d in cfg.widths for n in cfg.tokens],
                           lambda heads, d, tokens: cells(cfg, heads, d, tokens, device))
    payload["summary"] = summarize(rows)
    path = run.finish(payload, {"passed": passed})
    for c in checks:
        print(check_line(c, f"case {c['case']} groups {c['groups']}"))
    print(f"{'PASS' if passed else 'FAIL'}; {payload['summary']}; wrote {path}")
    return 0 if passed else 1


@script_main("bench_cross_attention")
def main(hydra_cfg: DictConfig) -> None:
    """Exit status 0: the check passed and the cells ran; 1: the check failed (nothing timed); 2: no GPU."""
    sys.exit(bench(script_config(BenchCrossAttentionConfig, hydra_cfg, trial_preset(hydra_cfg, smoke=SMOKE))))


if __name__ == "__main__":
    main()
