"""megaslide.offload.cpu_adam against torch.optim.AdamW and a float64 reference."""
import os
import shutil
import warnings

os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import torch

from megaslide.offload import cpu_adam
from megaslide.offload.csrc import build

HAS_COMPILER = any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "c++"))


def _cpp_step(*args, **kwargs):
    if cpu_adam.backend() != "cpp":
        pytest.fail("the C++ AdamW did not build although a compiler is present")
    cpu_adam.adamw_step_(*args, **kwargs)


BACKENDS = {
    "cpp": pytest.param(_cpp_step, id="cpp",
                        marks=pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")),
    "torch": pytest.param(cpu_adam.adamw_step_torch_, id="torch"),
}


def _adamw_fp64(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay):
    """Textbook AdamW (Loshchilov & Hutter, torch's bias correction) in float64, in place."""
    p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    p.sub_(lr / (1 - beta1**step) * m / denom)


def _bf16_bits_reference(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even fp32 -> bf16 in integer arithmetic, as int16 bits."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(torch.int32).to(torch.int16)


CASES = [  # (numel, beta1, beta2): odd sizes; beta1 < 0.5 takes torch lerp's other branch
    (1, 0.9, 0.999),
    (7, 0.9, 0.999),
    (4099, 0.3, 0.95),
    (1_000_003, 0.9, 0.999),
]


@pytest.mark.parametrize("step_fn", BACKENDS.values())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "g16"])
@pytest.mark.parametrize("numel,beta1,beta2", CASES)
def test_matches_torch_adamw(step_fn, grad_dtype, numel, beta1, beta2):
    gen = torch.Generator().manual_seed(numel)
    eps, weight_decay = 1e-8, 0.1
    p0 = torch.randn(numel, generator=gen)
    ours = [p0.clone(), torch.zeros(numel), torch.zeros(numel)]  # param, exp_avg, exp_avg_sq
    ref64 = [p0.double(), torch.zeros(numel, dtype=torch.float64),
             torch.zeros(numel, dtype=torch.float64)]
    torch_param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([torch_param], lr=1.0, betas=(beta1, beta2), eps=eps,
                            weight_decay=weight_decay, foreach=False, fused=False)
    out_bf16 = torch.empty(numel, dtype=torch.bfloat16)
    for step in range(1, 7):
        lr = 1e-3 * (1 + step) * (1 if step % 2 else 3)  # changes every step
        grad = (torch.randn(numel, generator=gen) * 10.0 ** (step % 3 - 2)).to(grad_dtype)
        step_fn(ours[0], grad, ours[1], ours[2], step=step, lr=lr, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=weight_decay, param_bf16=out_bf16)
        torch_param.grad = grad.float()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        _adamw_fp64(*ref64[:1], grad.double(), *ref64[1:], step=step, lr=lr, beta1=beta1,
                    beta2=beta2, eps=eps, weight_decay=weight_decay)
        state = opt.state[torch_param]
        assert torch.equal(ours[1], state["exp_avg"]), f"exp_avg differs at step {step}"
        assert torch.equal(ours[2], state["exp_avg_sq"]), f"exp_avg_sq differs at step {step}"
        assert torch.equal(out_bf16.view(torch.int16), ours[0].to(torch.bfloat16).view(torch.int16))
        err_ours = (ours[0].double() - ref64[0]).abs().max().item()
        err_torch = (torch_param.detach().double() - ref64[0]).abs().max().item()
        one_ulp = torch.finfo(torch.float32).eps * ref64[0].abs().max().item()
        assert err_ours <= 2 * max(err_torch, one_ulp), (step, err_ours, err_torch)
        if step_fn is cpu_adam.adamw_step_torch_:  # same torch ops: identical bits
            assert torch.equal(ours[0], torch_param.detach())


def _edge_values() -> torch.Tensor:
    """fp32 values that stress bf16 rounding: ties to even both ways, overflow to inf,
    subnormals, signed zeros, infinities, and random bit patterns."""
    bits = [0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7F_FFFF, 0xFF7F_FFFF,
            0x7F7F_7FFF, 0x0000_0001, 0x8000_8000, 0x0001_8000, 0x0000_0000, 0x8000_0000,
            0x7F80_0000, 0xFF80_0000, 0x3F80_0000, 0xBF81_8000]
    exact = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(1)
    noise = torch.randint(-2**31, 2**31, (4093,), dtype=torch.int64, generator=gen)
    noise = noise.to(torch.int32).view(torch.float32)
    noise = noise[torch.isfinite(noise)]
    return torch.cat([exact, noise])


@pytest.mark.parametrize("step_fn", BACKENDS.values())
def test_bf16_output_rounding_edges(step_fn):
    # lr = 0, weight_decay = 0 and zero gradients leave param bit-identical (p + -0 / eps).
    p = _edge_values()
    n = p.numel()
    before = p.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    step_fn(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, param_bf16=out)
    assert torch.equal(p.view(torch.int32), before.view(torch.int32))
    assert torch.equal(out.view(torch.int16), before.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(out.view(torch.int16), _bf16_bits_reference(before))
    nan = torch.tensor([float("nan"), -float("nan")])
    out = torch.empty(2, dtype=torch.bfloat16)
    step_fn(nan, torch.zeros(2), torch.zeros(2), torch.zeros(2), step=1, lr=0.0, param_bf16=out)
    assert torch.isnan(out.float()).all()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "g16"])
def test_threads_and_unaligned_views_give_identical_bits(grad_dtype):
    n = 3 * 16384 + 5  # several work blocks and a remainder
    gen = torch.Generator().manual_seed(2)

    init = [torch.randn(n, generator=gen), torch.randn(n, generator=gen),
            torch.rand(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype)]

    def at_offset(t, offset):  # the same values, starting `offset` elements into an allocation
        buf = torch.empty(n + offset, dtype=t.dtype)
        buf[offset:] = t
        return buf[offset:]

    results = []
    for threads, offset in [(1, 0), (2, 1), (3, 1), (2, 0)]:
        p, m, v, g = (at_offset(t, offset) for t in init)
        out = at_offset(torch.zeros(n, dtype=torch.bfloat16), offset)
        cpu_adam.adamw_step_(p, g, m, v, step=3, lr=1e-2, weight_decay=0.05, param_bf16=out,
                             num_threads=threads)
        results.append([t.clone() for t in (p, m, v, out)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("step_fn", BACKENDS.values())
def test_empty_and_shaped_buffers(step_fn):
    empty = [torch.zeros(0) for _ in range(4)]
    step_fn(*empty, step=1, lr=1e-3)
    # contiguous, any shape: treated as flat. Fresh moments, g = 1: the first step is -lr.
    shaped = [torch.ones(3, 5), torch.ones(3, 5), torch.zeros(3, 5), torch.zeros(3, 5)]
    step_fn(*shaped, step=1, lr=1e-3)
    assert torch.allclose(shaped[0], torch.full((3, 5), 1 - 1e-3))


def _good():
    return {"param": torch.zeros(8), "grad": torch.zeros(8), "exp_avg": torch.zeros(8),
            "exp_avg_sq": torch.zeros(8)}


BAD_TENSORS = [  # (argument to replace, bad value, words the message must contain)
    ("param", torch.zeros(16)[::2], "param must be contiguous"),
    ("exp_avg", torch.zeros(8, 2).t(), "exp_avg must be contiguous"),
    ("param", torch.zeros(8, dtype=torch.float64), "param must have dtype torch.float32"),
    ("grad", torch.zeros(8, dtype=torch.float16), "grad must have dtype"),
    ("exp_avg_sq", torch.zeros(8, dtype=torch.bfloat16), "exp_avg_sq must have dtype"),
    ("param_bf16", torch.zeros(8), "param_bf16 must have dtype torch.bfloat16"),
    ("grad", torch.zeros(8, device="meta"), "grad is on meta but must be on cpu"),
    ("exp_avg", torch.zeros(9), "exp_avg has 9 elements but param has 8"),
    ("param_bf16", torch.zeros(7, dtype=torch.bfloat16), "param_bf16 has 7 elements"),
    ("grad", [0.0] * 8, "grad must be a torch.Tensor"),
]


@pytest.mark.parametrize("name,bad,message", BAD_TENSORS)
def test_bad_tensors_raise_clear_errors(name, bad, message):
    args = _good()
    args[name] = bad
    with pytest.raises(ValueError, match=message):
        cpu_adam.adamw_step_(args.pop("param"), args.pop("grad"), args.pop("exp_avg"),
                             args.pop("exp_avg_sq"), step=1, lr=1e-3, **args)


def test_param_on_another_device_is_rejected_by_the_cpu_step():
    meta = [torch.zeros(8, device="meta") for _ in range(4)]
    with pytest.raises(ValueError, match="param is on meta but must be on cpu"):
        cpu_adam.adamw_step_(*meta, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="grad is on cpu but must be on meta"):
        cpu_adam.adamw_step_torch_(meta[0], torch.zeros(8), *meta[2:], step=1, lr=1e-3)


def test_overlapping_buffers_are_rejected():
    arena = torch.zeros(24)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq overlap"):
        cpu_adam.adamw_step_(arena[:8], torch.zeros(8), arena[8:16], arena[12:20], step=1, lr=1e-3)
    cpu_adam.adamw_step_(arena[:8], torch.zeros(8), arena[8:16], arena[16:], step=1, lr=1e-3)


BAD_SCALARS = [
    ({"step": 0}, "step must be an int >= 1"),
    ({"step": 2.0}, "step must be an int >= 1"),
    ({"lr": -1e-3}, "lr must lie in"),
    ({"lr": float("nan")}, "lr must be a finite"),
    ({"beta1": 1.0}, "beta1 must lie in"),
    ({"beta2": -0.1}, "beta2 must lie in"),
    ({"eps": -1.0}, "eps must lie in"),
    ({"weight_decay": -0.1}, "weight_decay must lie in"),
    ({"num_threads": 0}, "num_threads must be an int >= 1"),
]


@pytest.mark.parametrize("override,message", BAD_SCALARS)
def test_bad_scalars_raise_clear_errors(override, message):
    kwargs = {"step": 1, "lr": 1e-3, **override}
    with pytest.raises(ValueError, match=message):
        cpu_adam.adamw_step_(*_good().values(), **kwargs)


@pytest.fixture
def fresh_backend():
    """Re-run backend selection inside the test and again after it."""
    cpu_adam._library.cache_clear()
    yield
    cpu_adam._library.cache_clear()


def test_failed_build_warns_once_and_falls_back_to_torch(monkeypatch, fresh_backend):
    def broken(_source):
        raise build.BuildError("simulated compiler failure")

    monkeypatch.setattr(build, "load", broken)
    with pytest.warns(RuntimeWarning, match="simulated compiler failure"):
        assert cpu_adam.backend() == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_adam.native_isa() is None
        gen = torch.Generator().manual_seed(3)
        a = [torch.randn(1001, generator=gen).abs() for _ in range(4)]
        b = [t.clone() for t in a]
        cpu_adam.adamw_step_(*a, step=2, lr=1e-2, weight_decay=0.1)
    cpu_adam.adamw_step_torch_(*b, step=2, lr=1e-2, weight_decay=0.1)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_env_forces_torch_backend(monkeypatch, fresh_backend):
    monkeypatch.setenv("MEGASLIDE_CPU_ADAM_BACKEND", "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_adam.backend() == "torch"


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_env_takes_effect_after_the_library_is_loaded(monkeypatch):
    """The variable is read on every step, so a test can switch the backend with monkeypatch.setenv."""
    monkeypatch.delenv("MEGASLIDE_CPU_ADAM_BACKEND", raising=False)
    assert cpu_adam.backend() == "cpp"
    monkeypatch.setenv("MEGASLIDE_CPU_ADAM_BACKEND", "torch")
    assert cpu_adam.backend() == "torch" and cpu_adam.native_isa() is None
    monkeypatch.delenv("MEGASLIDE_CPU_ADAM_BACKEND")
    assert cpu_adam.backend() == "cpp"


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_build_caches_per_machine_and_reports_compiler_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = build.library_path("cpu_adam.cpp")
    assert tmp_path in path.parents and not path.exists()
    lib = build.load("cpu_adam.cpp")
    assert path.exists() and lib.megaslide_cpu_adam_isa
    mtime = path.stat().st_mtime_ns
    build.load("cpu_adam.cpp")
    assert path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    monkeypatch.setattr(build, "compile_flags", lambda: ["-shared", "--no-such-flag"])
    with pytest.raises(build.BuildError, match="no-such-flag"):
        build.load("cpu_adam.cpp")
