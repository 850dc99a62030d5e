"""The compact CPU AdamW (bf16 master with stochastic rounding, 8-bit block-quantised moments) against an
independent float64 reference (compact_reference.py): the codecs and the rounding exactly, and the fused step
of both backends element by element, exact wherever no fp32 error can reach a rounding decision."""
import os
import shutil

import numpy as np
import pytest
import torch

from megaslide.offload import compact, cpu_adam
from megaslide.offload.compact import SIGNED, SQRT, QuantizedMoment
from tests.offload import compact_reference as ref

HAS_COMPILER = any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "c++"))


def _cpp_step(*args, **kwargs):
    if cpu_adam.backend() != "cpp":
        pytest.fail("the C++ AdamW did not build although a compiler is present")
    cpu_adam.adamw_step_(*args, num_threads=3, **kwargs)


BACKENDS = [pytest.param(_cpp_step, id="cpp", marks=pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")),
            pytest.param(cpu_adam.adamw_step_torch_, id="torch")]
FORMATS = [pytest.param(True, False, id="bf16-master"), pytest.param(False, True, id="int8-moments"),
           pytest.param(True, True, id="both")]


@pytest.mark.parametrize("kind", [SIGNED, SQRT])
def test_codes_round_trip_and_are_the_nearest_code(kind):
    top = compact.MAX_CODE[kind]
    codes = torch.arange(top + 1, dtype=torch.int32)
    values = compact.decode_magnitude(codes, kind)
    np.testing.assert_array_equal(values.double().numpy(), ref.codebook(kind))
    assert torch.equal(compact.encode_magnitude(values, kind), codes)
    gen = torch.Generator().manual_seed(1)
    book = ref.codebook(kind)
    midpoints = torch.tensor((book[1:] + book[:-1]) / 2, dtype=torch.float32)          # exact ties
    y = torch.cat([torch.rand(20000, generator=gen) ** 8, midpoints, torch.tensor([0.0, 0.99999994, 2.0 ** -40])])
    code, _ = ref.nearest_code(y.double().numpy(), kind, np.zeros(y.numel()))
    np.testing.assert_array_equal(compact.encode_magnitude(y, kind).numpy(), code)


@pytest.mark.parametrize("kind", [SIGNED, SQRT])
def test_quantize_odd_sizes_and_zero_blocks_exactly(kind):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4 * 64 + 37, generator=gen) * torch.rand(4 * 64 + 37, generator=gen) ** 6
    x[64:128] = 0                                         # an all-zero block: scale 0
    x[128:192] *= 1e-39                                   # below fp32's normals: stored as zeros
    if kind == SQRT:
        x = x.abs()
    codes, scales = compact.quantize(x, kind)
    values = compact.dequantize(codes, scales, kind)
    expected, _ = ref.quantize(x.double().numpy(), kind, np.zeros(x.numel()))
    np.testing.assert_array_equal(values.double().numpy(), expected)
    assert scales[1] == scales[2] == 0 and codes.shape == x.shape and scales.shape == (5,)
    assert torch.equal(torch.frexp(scales[scales > 0]).mantissa, torch.full_like(scales[scales > 0], 0.5))


def test_random_bits_and_stochastic_rounding_match_the_reference():
    key, first, n = compact.rounding_key(7, 3, 11), 1000, 5000
    bits = compact.random_bits(key, first, n)
    np.testing.assert_array_equal(bits.double().numpy(), ref.random_bits(key, first, n))
    assert compact.rounding_key(7, 3, 12) != key and compact.rounding_key(8, 3, 11) != key
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 10.0 ** torch.randint(-20, 20, (n,))
    rounded, _ = ref.round_stochastic_bf16(x.double().numpy(), bits.double().numpy(), np.zeros(n))
    np.testing.assert_array_equal(compact.round_stochastic_bf16(x, bits).double().numpy(), rounded)
    assert torch.isnan(compact.round_stochastic_bf16(torch.tensor([float("nan")]), bits[:1])).all()


def test_stochastic_rounding_is_unbiased():
    n = 1 << 16
    x = torch.full((n,), 1.0 + 2.0 ** -9 + 2.0 ** -12)   # 0.625 of the way from 1 + 2^-9 ... to the next bf16
    mean = compact.round_stochastic_bf16(x, compact.random_bits(12345, 0, n)).double().mean().item()
    spread = 2.0 ** -7 * 0.5 / n ** 0.5                  # one standard error of a two-point draw
    assert abs(mean - x[0].item()) < 4 * spread
    assert not torch.equal(compact.round_stochastic_bf16(x, compact.random_bits(1, 0, n)), x.bfloat16())


def test_stochastic_root_codes_match_the_reference():
    """Normalised magnitudes over every binade of the root's code, subnormal ones, the largest code's own
    and exact code values, each with fresh random bits: the same codes as the reference."""
    gen = torch.Generator().manual_seed(9)
    y = torch.cat([2.0 ** -torch.rand(4000, generator=gen) * 22,                  # 2^-22 .. 1, log-uniform
                   torch.rand(500, generator=gen) * 2.0 ** -15,                    # subnormal codes
                   1 - torch.rand(100, generator=gen) * 2.0 ** -6,                 # at and above the largest code
                   torch.tensor([0.0, 2.0 ** -15, 0.5, 2.0 ** -19])]).clamp(max=1 - 2.0 ** -24)
    r = torch.randint(0, 2 ** compact.ROOT_RANDOM_BITS, y.shape, generator=gen)
    want, _ = ref.stochastic_code(y.double().numpy(), SQRT, r.double().numpy(), np.zeros(y.numel()))
    np.testing.assert_array_equal(compact.encode_magnitude(y, SQRT, r).numpy(), want)


@pytest.mark.parametrize("step_fn", BACKENDS)
def test_quantized_second_moment_follows_small_steps(step_fn):
    """beta2 = 0.999 moves the root by about 0.05% a step, far below half a code step: the stored second moment
    must still follow it. Gradients 4x smaller than the ones that filled it: over 700 steps v decays by 0.999^t
    toward the new level; the dequantised root tracks float64's within 1% on average over the buffer, and
    also while v grows back after the gradients return."""
    n = 64 * 64
    gen = torch.Generator().manual_seed(2)
    param, m, v = _state(n, False, True, gen)
    exact = np.zeros(n)
    scale = torch.rand(n, generator=gen) + 0.5
    for step in range(1, 1401):
        grad = torch.randn(n, generator=gen) * scale * (0.25 if 300 < step <= 1000 else 1.0)
        exact = 0.999 * exact + 0.001 * grad.double().numpy() ** 2
        step_fn(param, grad, m, v, step=step, lr=1e-6, rounding_key=compact.rounding_key(1, 0, step))
        if step in (300, 1000, 1400):
            ratio = v.values().double().numpy() / np.sqrt(exact)
            assert abs(ratio.mean() - 1) < 0.01, (step, ratio.mean())


def _state(numel: int, bf16_master: bool, int8: bool, gen: torch.Generator):
    param = torch.randn(numel, generator=gen).to(torch.bfloat16 if bf16_master else torch.float32)
    if int8:
        return param, QuantizedMoment.zeros(numel, SIGNED), QuantizedMoment.zeros(numel, SQRT)
    return param, torch.zeros(numel), torch.zeros(numel)


def _as_float64(param, exp_avg, exp_avg_sq):
    """The exact float64 values of a state, the second moment itself (int8: the square of its stored root)."""
    if isinstance(exp_avg, QuantizedMoment):
        return param.double().numpy(), exp_avg.values().double().numpy(), exp_avg_sq.values().double().numpy() ** 2
    return param.double().numpy(), exp_avg.double().numpy(), exp_avg_sq.double().numpy()


def _check(name: str, fast: np.ndarray, value: np.ndarray, tol: np.ndarray, near: np.ndarray, discrete: bool):
    """Discrete outputs equal the reference but where `near`, there within one rounding step; continuous
    (fp32) ones lie within the fp32 error `tol`."""
    if not discrete:
        assert (np.abs(fast - value) <= tol + 1e-45).all(), f"{name}: max error {np.abs(fast - value).max()}"
        return
    far = ~near
    np.testing.assert_array_equal(fast[far], value[far], err_msg=name)
    step = 2.0 ** -3 * np.maximum(np.abs(fast[near]), np.abs(value[near]))
    assert (np.abs(fast[near] - value[near]) <= step).all(), name


@pytest.mark.parametrize("step_fn", BACKENDS)
@pytest.mark.parametrize("bf16_master,int8", FORMATS)
@pytest.mark.parametrize("numel", [1, 63, 65, 4099, 33_001])
def test_step_matches_float64_reference(step_fn, bf16_master, int8, numel):
    gen = torch.Generator().manual_seed(numel)
    param, exp_avg, exp_avg_sq = _state(numel, bf16_master, int8, gen)
    # betas that make no exact ties: 0.9 x a 4-bit code is often a 5-bit midpoint, which fp32 decides either way
    hyper = {"lr": 3e-3, "beta1": 0.91, "beta2": 0.985, "eps": 1e-8, "weight_decay": 0.05}
    flagged = 0
    for step in range(1, 5):
        grad = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 3 * 10.0 ** (step % 3 - 2)
        grad = grad.to(torch.float32 if step % 2 else torch.bfloat16)  # step 1 fp32: 0.1 x a bf16 is often a tie
        key = compact.rounding_key(5, 2, step)
        before = _as_float64(param, exp_avg, exp_avg_sq)
        step_fn(param, grad, exp_avg, exp_avg_sq, step=step, rounding_key=key, first_index=640, **hyper)
        want = ref.step(*before[:1], grad.double().numpy(), *before[1:], step=step, bf16_master=bf16_master,
                        int8=int8, key=key, first_index=640, **hyper)
        fast_p, fast_m, fast_v = _as_float64(param, exp_avg, exp_avg_sq)
        fast_second = np.sqrt(fast_v) if int8 else fast_v
        _check("param", fast_p, want.param, want.param_tol, want.param_near, bf16_master)
        _check("exp_avg", fast_m, want.exp_avg, want.exp_avg_tol, want.exp_avg_near, int8)
        _check("exp_avg_sq", fast_second, want.second, want.second_tol, want.second_near, int8)
        flagged += int(want.param_near.sum() + want.exp_avg_near.sum() + want.second_near.sum())
    assert flagged <= 0.01 * 4 * numel + 2, f"{flagged} decisions lie within fp32 error: the reference is too lax"


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("bf16_master,int8", FORMATS)
def test_threads_and_splits_give_identical_bits(bf16_master, int8):
    """Any thread count, and a buffer updated in two calls cut at a multiple of MOMENT_BLOCK (first_index
    telling the second where it starts), give the bits of one call on one thread."""
    numel, cut = 50_001, 16_384 + 64 * 7
    gen = torch.Generator().manual_seed(4)
    start = _state(numel, bf16_master, int8, gen)
    grads = [torch.randn(numel, generator=gen) * 1e-2 for _ in range(3)]
    results = []
    for threads, split in ((1, False), (4, False), (2, True)):
        param, m, v = (t.clone() for t in start)
        for step, grad in enumerate(grads, 1):
            kw = {"step": step, "lr": 1e-2, "weight_decay": 0.1, "num_threads": threads,
                  "rounding_key": compact.rounding_key(0, 1, step)}
            if split:
                cpu_adam.adamw_step_(param[:cut], grad[:cut], m[:cut], v[:cut], **kw)
                cpu_adam.adamw_step_(param[cut:], grad[cut:], m[cut:], v[cut:], first_index=cut, **kw)
            else:
                cpu_adam.adamw_step_(param, grad, m, v, **kw)
        results.append([t.view(torch.uint8) if isinstance(t, torch.Tensor) else torch.cat([t.codes,
                        t.scales.view(torch.uint8)]) for t in (param, m, v)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_bad_compact_arguments_raise_clear_errors():
    n = 128
    p16, g = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n)
    m, v = QuantizedMoment.zeros(n, SIGNED), QuantizedMoment.zeros(n, SQRT)
    with pytest.raises(ValueError, match="pass rounding_key"):
        cpu_adam.adamw_step_(p16, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="the moments are 8-bit.*pass rounding_key"):
        cpu_adam.adamw_step_(torch.zeros(n), g, m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="no param_bf16 copy"):
        cpu_adam.adamw_step_(p16, g, m, v, step=1, lr=1e-3, rounding_key=1, param_bf16=torch.zeros_like(p16))
    with pytest.raises(ValueError, match="both be fp32 tensors or both QuantizedMoments"):
        cpu_adam.adamw_step_(torch.zeros(n), g, m, torch.zeros(n), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg is a QuantizedMoment of kind 'sqrt'"):
        cpu_adam.adamw_step_(torch.zeros(n), g, v, m, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="cut at multiples of MOMENT_BLOCK=64"):
        m[10:20]
