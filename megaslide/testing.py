"""What the tests and the experiments' GPU checks share to judge a kernel and to run ranks.

- `within_tolerance(err, ref_err, floor)`: the one accuracy rule of a kernel against an fp32/fp64 truth;
  `rounding_floor` its floor at rounding level; `TOLERANCE_RULE` the rule in words, for result files.
- `deterministic_algorithms()`: a block under `torch.use_deterministic_algorithms(True)`.
- `check_conv(...)`: the offset net's Triton (or CPU) depthwise Conv3d against F.conv3d by that rule;
  `check_offset_net(...)`: the whole offset net (conv + GELU, Linear, bound) against a plain float64 one;
  `check_qk_rope(...)`: fused QK-norm + RoPE against its eager reference by that rule.
- `spawn(fn, world, args)`: `world` local processes joined in one process group on a free port.

It lives in the library (not in experiments/) so that tests import only `megaslide` and `baselines`.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

F64 = torch.float64


# ----------------------------------------------------------------------------- accuracy
TOLERANCE_RULE = "err <= 2 x same-dtype reference err + floor"


def within_tolerance(err: float, ref_err: float, floor: float) -> bool:
    """The accuracy rule for a kernel (fused, distributed, ...) against an fp32/fp64 truth.

    `err` is the kernel's max error against the truth, `ref_err` the error of the plain PyTorch
    path in the kernel's dtype against the same truth: a kernel may be at most 2x as wrong as
    PyTorch, plus `floor` for outputs whose reference error is at rounding level (where a 2x
    ratio is noise). NaN anywhere fails."""
    return math.isfinite(err) and err <= 2 * ref_err + floor


def rounding_floor(dtype: torch.dtype, reference: torch.Tensor, ulps: float = 2) -> float:
    """`ulps` x eps(dtype) x max(1, max|reference|): the floor of `within_tolerance` at rounding level."""
    return ulps * torch.finfo(dtype).eps * max(1.0, reference.abs().max().item())


@contextlib.contextmanager
def deterministic_algorithms():
    """Run the block under `torch.use_deterministic_algorithms(True)`, restoring the setting after
    (DSA's fused backward then builds its key-tile lists in a fixed order: bitwise repeatable dK / dV)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def conv_and_grads(backend: str, x, weight, bias, grad, frames, dtype, gelu=False):
    """The depthwise conv's (with `gelu`, conv + GELU's) output and its x, weight and bias gradients on one
    backend, x in `dtype`; the weights stay fp32 on the Triton path (as the module keeps them) and take
    `dtype` for F.conv3d, on the torch and cpu paths (as autocast casts them)."""
    from megaslide.attention.dsa.depthwise import depthwise_conv3d  # the kernels build on first import
    wdtype = dtype if backend in ("torch", "cpu") else weight.dtype
    leaves = [x.to(dtype), weight.to(wdtype), bias.to(wdtype)]
    for t in leaves:
        t.requires_grad_()
    y = depthwise_conv3d(*leaves, frames, backend=backend, gelu=gelu)
    return [y.detach(), *torch.autograd.grad(y, leaves, grad.to(y.dtype))]


def check_conv(shape, frames, dtype, device, kernel=(3, 3, 3), seed=0, gelu=False, backend="triton") -> dict:
    """The conv of `backend` (triton, or cpu: depthwise.py's; with `gelu`, conv + GELU) against F.conv3d
    (+ F.gelu) in float64 (the truth) and in `dtype`: per output, both max errors, the rounding floor and
    whether `within_tolerance` holds."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, _, H, W, C = shape
    lo, hi = frames
    x = torch.randn(shape, generator=g, device=device, dtype=F64).to(dtype)
    weight = torch.randn((C, 1, *kernel), generator=g, device=device, dtype=F64).float()
    bias = torch.randn(C, generator=g, device=device, dtype=F64).float()
    grad = torch.randn((B, hi - lo, H, W, C), generator=g, device=device, dtype=F64).to(dtype)
    truth, same, fused = (conv_and_grads(name, x, weight, bias, grad, frames, dt, gelu)
                          for name, dt in (("torch", F64), ("torch", dtype), (backend, dtype)))
    errors = {}
    for name, want, ref, got in zip(("y", "dx", "dweight", "dbias"), truth, same, fused):
        err = (got.to(F64) - want).abs().max().item()
        ref_err = (ref.to(F64) - want).abs().max().item()
        floor = rounding_floor(got.dtype if name in ("y", "dx") else torch.float32, want)
        ok = got.shape == want.shape and within_tolerance(err, ref_err, floor)
        errors[name] = {"err": err, "ref_err": ref_err, "floor": floor, "ok": ok}
    return {"shape": list(shape), "frames": list(frames), "dtype": str(dtype).removeprefix("torch."), "gelu": gelu,
            "passed": all(e["ok"] for e in errors.values()), "errors": errors}


def offset_net_reference(x, conv_weight, conv_bias, proj_weight, proj_bias, grid, frames, max_offset):
    """The DSA module's offset net written out plainly, in x's dtype: Conv3d (zero padding) over the whole
    grid, output frames [lo, hi), exact GELU, Linear, max_offset * tanh. x (B, N, D) -> (B, hi - lo, H, W, F)
    with F = heads * K * 3 (not split into heads)."""
    import torch.nn.functional as F
    B, _, D = x.shape
    lo, hi = frames
    h = x.view(B, *grid, D).permute(0, 4, 1, 2, 3)                              # (B, D, T, H, W)
    h = F.conv3d(h, conv_weight, conv_bias, padding=1, groups=D)[:, :, lo:hi]  # (B, D, hi-lo, H, W)
    h = F.gelu(h.permute(0, 2, 3, 4, 1))                                        # (B, hi-lo, H, W, D)
    return max_offset * torch.tanh(F.linear(h, proj_weight, proj_bias))


def offset_net_and_grads(attn, backend: str, x, grad, grid, frames, dtype):
    """The `dsa` module `attn`'s offsets of output frames `frames` (`read_input`) and the gradients of x and
    the four offset-net parameters, on `backend` ("reference": `offset_net_reference` in float64; "torch" or
    "triton": the module's net_backend, under `dtype` autocast over fp32 weights as training runs it)."""
    params = [attn.offset_conv.weight, attn.offset_conv.bias, attn.offset_proj.weight, attn.offset_proj.bias]
    if backend == "reference":
        leaves = [t.detach().to(F64).requires_grad_() for t in (x, *params)]
        out = offset_net_reference(*leaves, grid, frames, attn.options.max_offset)
    else:
        leaves = [x.detach().to(dtype).requires_grad_(), *params]
        attn.net_backend = backend
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = attn.read_input(leaves[0], grid, *frames)                    # (B, hi-lo, H, W, heads, K, 3)
        out = out.flatten(-3)
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    return [out.detach(), *grads]


def check_offset_net(grid, dim: int, heads: int, frames, dtype, device, seed=0, batch=1) -> dict:
    """The `dsa` module's offset net on its Triton kernels against the plain float64 net (the truth) and the
    module's PyTorch path (F.conv3d, F.gelu, torch.tanh) in `dtype`: per output (offsets and the gradients
    of x, the conv's weight and bias, the Linear's weight and bias), both max errors, the rounding floor and
    whether `within_tolerance` holds, for x (batch, N, dim). The Linear gets random weights (not the zero
    init) so the offsets depend on the conv."""
    from megaslide.attention import build_attention
    g = torch.Generator(device=device).manual_seed(seed)
    attn = build_attention("dsa", dim, heads, kernel_size=(3, 3, 3)).to(device)
    with torch.no_grad():
        attn.offset_proj.weight.copy_(torch.randn(attn.offset_proj.weight.shape, generator=g, device=device)
                                      * dim ** -0.5)
        attn.offset_proj.bias.copy_(0.1 * torch.randn(attn.offset_proj.bias.shape, generator=g, device=device))
    B, (lo, hi) = batch, frames
    x = torch.randn(B, math.prod(grid), dim, generator=g, device=device, dtype=F64).to(dtype)
    grad = torch.randn((B, hi - lo, *grid[1:], attn.offset_proj.out_features), generator=g, device=device,
                       dtype=F64)
    truth, same, fused = (offset_net_and_grads(attn, backend, x, grad, grid, frames, dtype)
                          for backend in ("reference", "torch", "triton"))
    errors = {}
    for name, want, ref, got in zip(("offsets", "dx", "dconv_weight", "dconv_bias", "dproj_weight", "dproj_bias"),
                                    truth, same, fused):
        err = (got.to(F64) - want).abs().max().item()
        ref_err = (ref.to(F64) - want).abs().max().item()
        floor = rounding_floor(dtype, want)  # the parameters' gradients pass through dtype under autocast
        ok = got.shape == want.shape and within_tolerance(err, ref_err, floor)
        errors[name] = {"err": err, "ref_err": ref_err, "floor": floor, "ok": ok}
    return {"grid": list(grid), "batch": batch, "dim": dim, "heads": heads, "frames": list(frames),
            "dtype": str(dtype).removeprefix("torch."), "passed": all(e["ok"] for e in errors.values()),
            "errors": errors}


def qk_rope_and_grads(backend: str, q, k, q_weight, k_weight, cos, sin, grads, heads: int, dtype, eps: float):
    """`qk_norm_rope`'s q, k and the gradients of q, k and the weights present on one backend, q and k in
    `dtype`; the weights stay fp32 (as the module keeps them under autocast), float64 for a float64 run."""
    from megaslide.nn.qk_rope import qk_norm_rope
    x = [t.to(dtype).requires_grad_() for t in (q, k)]
    w = [None if t is None else t.to(F64 if dtype == F64 else torch.float32).requires_grad_()
         for t in (q_weight, k_weight)]
    out = qk_norm_rope(*x, *w, cos, sin, heads=heads, eps=eps, backend=backend)
    leaves = x + [t for t in w if t is not None]
    return [o.detach() for o in out] + list(torch.autograd.grad(out, leaves, [g.to(dtype) for g in grads]))


def check_qk_rope(q, k, q_weight, k_weight, cos, sin, grads, heads: int, dtype, eps: float = 1e-6) -> dict:
    """The fused kernels ("triton") against the eager reference in float64 (the truth) and in `dtype`, on q, k
    (B, N, D) rounded to dtype, weights (D,) or None, cos / sin (N, d/2) and output gradients (B, N, heads, d):
    per output (q, k, dq, dk, dq_weight, dk_weight), both max errors, the rounding floor and whether
    `within_tolerance` holds."""
    q, k = (t.to(dtype).to(F64) for t in (q, k))
    grads = [g.to(dtype).to(F64) for g in grads]
    args = (q, k, q_weight, k_weight, cos, sin, grads, heads)
    truth, same, fused = (qk_rope_and_grads(backend, *args, dt, eps)
                          for backend, dt in (("reference", F64), ("reference", dtype), ("triton", dtype)))
    names = ["q", "k", "dq", "dk"] + ["dq_weight", "dk_weight"][:len(truth) - 4]
    errors = {}
    for name, want, ref, got in zip(names, truth, same, fused):
        err = (got.to(F64) - want).abs().max().item()
        ref_err = (ref.to(F64) - want).abs().max().item()
        floor = rounding_floor(dtype, want)
        ok = got.shape == want.shape and got.dtype == ref.dtype and within_tolerance(err, ref_err, floor)
        errors[name] = {"err": err, "ref_err": ref_err, "floor": floor, "ok": ok}
    return {"shape": list(q.shape), "heads": heads, "dtype": str(dtype).removeprefix("torch."),
            "passed": len(fused) == len(names) and all(e["ok"] for e in errors.values()), "errors": errors}


def dsa_halo_inputs(shape, reach: int, dtype, beyond: dict | None = None, device="cpu", seed: int = 0):
    """q, k, v (B, T, H, W, heads, d) and offsets (B, T, H, W, heads, 27, 3) of a halo-forward check, drawn in
    float64 and rounded to dtype: offsets uniform in +-reach, a quarter of them exactly +-reach (on the bound);
    `beyond` maps (t, y, x) queries to the (dt, dy, dx) of their centre sample in every head (past the bound)."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, T, H, W, heads, d = shape
    q, k, v = (torch.randn(shape, generator=g, dtype=F64, device=device) for _ in range(3))
    offsets = reach * (2 * torch.rand((B, T, H, W, heads, 27, 3), generator=g, dtype=F64, device=device) - 1)
    on_bound = torch.rand(offsets.shape, generator=g, dtype=F64, device=device) < 0.25
    offsets = torch.where(on_bound, reach * offsets.sign(), offsets)
    for (t, y, x), shift in (beyond or {}).items():
        offsets[:, t, y, x, :, 13] = torch.tensor(shift, dtype=F64, device=device)
    return [x.to(dtype) for x in (q, k, v, offsets)]


def check_dsa_halo(q, k, v, offsets, reach: int, tile: tuple[int, int, int]) -> dict:
    """The DSA halo forward (megaslide/attention/dsa/halo.py, 3 x 3 x 3 window) on q, k, v, offsets in one
    dtype against the float64 reference: out and the log-sum-exp, each beside the same-dtype reference's
    error (the lse's at fp32 scores: a low-precision softmax stores none), by `within_tolerance`; and its
    per-tile paths against the plain rule (`reference.halo_paths_reference`). Returns the errors, the path
    counts, `paths_match` and `passed`."""
    from megaslide.attention.dsa import halo
    from megaslide.attention.dsa.launch import HaloConfig
    from megaslide.attention.dsa.reference import (deformable_slide_attention_reference, halo_paths_reference,
                                                   log_sum_exp_reference)
    kernel, scale = (3, 3, 3), q.shape[-1] ** -0.5
    out, lse, path = halo.dsa_halo_forward(q, k, v, offsets, kernel, scale, reach, config=HaloConfig(tuple(tile)))
    wide = [x.to(F64) for x in (q, k, v, offsets)]
    cases = {"out": (out, deformable_slide_attention_reference(*wide, kernel, scale),
                     deformable_slide_attention_reference(q, k, v, offsets, kernel, scale)),
             "lse": (lse, log_sum_exp_reference(wide[0], wide[1], wide[3], kernel, scale),
                     log_sum_exp_reference(q.float(), k.float(), offsets, kernel, scale))}
    errors = {}
    for name, (got, want, ref) in cases.items():
        err = (got.to(F64) - want).abs().max().item()
        ref_err = (ref.to(F64) - want).abs().max().item()
        floor = rounding_floor(got.dtype, want)
        errors[name] = {"err": err, "ref_err": ref_err, "floor": floor,
                        "ok": got.shape == want.shape and within_tolerance(err, ref_err, floor)}
    paths_match = torch.equal(path.cpu(), halo_paths_reference(offsets, kernel, reach, tuple(tile)).cpu())
    return {"shape": list(q.shape), "reach": reach, "tile": list(tile), "dtype": str(q.dtype).removeprefix("torch."),
            "errors": errors, "paths": halo.path_counts(path), "paths_match": paths_match,
            "passed": paths_match and all(e["ok"] for e in errors.values())}


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str | None, timeout_s: float | None, fn, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if backend is None:  # fn joins the group itself, from the torchrun environment set above
        fn(rank, world, *args)
        return
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, args: tuple = (), backend: str | None = "gloo", timeout_s: float | None = 150.0) -> None:
    """Run `fn(rank, world, *args)` in `world` local processes and wait for all of them.

    Each process gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT on a free port) and its share of the CPU threads; with `backend` ("gloo" or
    "nccl", one GPU per rank) it is in the default process group while fn runs, with None fn
    joins itself. Processes fork from a server with torch preloaded (one fork each rather than one
    torch import). A failing rank raises here with its traceback; past `timeout_s` (also the
    collectives' timeout; None: no limit) the rest are stopped and TimeoutError is raised. `fn`
    must be a module-level function."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
    ctx = tmp.start_processes(_worker, args=(world, free_port(), backend, timeout_s, fn, tuple(args)),
                              nprocs=world, join=False, start_method="forkserver")
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):  # True once all exited; raises when one failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world} spawned processes ran past {timeout_s} s")
