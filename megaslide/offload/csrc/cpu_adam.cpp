// Fused AdamW step over flat CPU buffers: one pass over memory, SIMD inner loop, OpenMP threads.
//
// Per element, in exactly this order (the order of torch.optim.AdamW's single-tensor path on
// CPU, so that exp_avg and exp_avg_sq match it bit for bit):
//   p   = p * decay                                  decay = 1 - lr * weight_decay
//   m   = fma(c, g - m, base)                        torch's vectorised lerp_(g, w), w = 1 - beta1:
//                                                    c = w, base = m when |w| < 0.5, else
//                                                    c = w - 1, base = g
//   v   = fma(one_minus_beta2 * g, g, v * beta2)     torch's mul_(beta2).addcmul_(g, g, 1 - beta2)
//   d   = sqrt(v) / bias_correction2_sqrt + eps
//   p   = p + (neg_step_size * m) / d                neg_step_size = -lr / bias_correction1
//   out = bf16(p), round to nearest even             only when an output buffer is given
// The scalars arrive already rounded to float by the caller, exactly as torch rounds its Python
// scalars. The file is compiled with -ffp-contract=off, so the only fused multiply-adds are the
// two written as std::fma above; sqrt and division are IEEE (correctly rounded).
//
// The loops are plain C++ under `#pragma omp simd`; compiled with -march=native the compiler
// emits AVX-512 on AVX-512 machines and AVX2/FMA elsewhere, with a scalar remainder loop
// (checked with -fopt-info-vec: every inner loop of every variant vectorises, GCC 12).
// megaslide_adamw_step_compact runs the same per-element step over compact state (bf16 master weights
// rounded stochastically, 8-bit block-quantised moments): the section "compact state" below.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Work unit: 16384 elements = 64 KiB of each fp32 stream. A multiple of every SIMD width and
// cache line, so threads never write the same line (false sharing) when buffers are 64 B aligned.
constexpr int64_t kBlock = 1 << 14;
// Inner tile: 1024 elements = 4 KiB of each stream, about 18 KiB in all: stays in L1.
constexpr int64_t kTile = 1 << 10;

struct Scalars {
  float decay;
  float lerp_coeff;
  bool lerp_base_is_m;  // true: m + w * (g - m); false: g + (w - 1) * (g - m)
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;
};

inline float float_of_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline uint32_t bits_of_float(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

inline float to_float(float x) { return x; }

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
inline float to_float(uint16_t x) { return float_of_bits(static_cast<uint32_t>(x) << 16); }

// fp32 -> bf16, round to nearest with ties to even (what torch's .to(torch.bfloat16) does for
// finite and infinite values); every NaN becomes the quiet NaN 0x7FC0.
inline uint16_t to_bf16(float x) {
  const uint32_t bits = bits_of_float(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

// One element's step (the order at the top of this file): updates m and v, returns the new weight and
// sqrt(v) in *root.
inline float adam_element(float p_old, float g, float& m, float& v, float* root, const Scalars& s) {
  const float p = p_old * s.decay;
  m = std::fma(s.lerp_coeff, g - m, s.lerp_base_is_m ? m : g);
  v = std::fma(s.one_minus_beta2 * g, g, v * s.beta2);
  *root = std::sqrt(v);
  const float denom = *root / s.bias_correction2_sqrt + s.eps;
  return p + (s.neg_step_size * m) / denom;
}

template <typename GradT>
void update_tile(float* __restrict__ param, const GradT* __restrict__ grad,
                 float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, int64_t n,
                 const Scalars s) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float m = exp_avg[i], v = exp_avg_sq[i], root;
    param[i] = adam_element(param[i], to_float(grad[i]), m, v, &root, s);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

inline void round_tile_to_bf16(const float* __restrict__ src, uint16_t* __restrict__ dst,
                               int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = to_bf16(src[i]);
  }
}

// Update one block tile by tile; the bf16 copy of a tile is written right after its update,
// while the new weights are still in L1, so it costs no extra trip to memory. (Separate loops
// because GCC 12 does not vectorise a loop that mixes bf16 loads, bf16 stores and fp32 math.)
template <typename GradT, bool kWriteBf16>
void update_block(float* param, const GradT* grad, float* exp_avg, float* exp_avg_sq,
                  uint16_t* param_bf16, int64_t n, const Scalars& s) {
  for (int64_t begin = 0; begin < n; begin += kTile) {
    const int64_t len = std::min(kTile, n - begin);
    update_tile(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin, len, s);
    if constexpr (kWriteBf16) {
      round_tile_to_bf16(param + begin, param_bf16 + begin, len);
    }
  }
}

// Static schedule without a chunk size: each thread owns one contiguous run of blocks, the same
// run on every call (good for hardware prefetchers, and page-local on a multi-socket machine if
// the buffers were first touched with the same split).
template <typename GradT, bool kWriteBf16>
void update(float* param, const GradT* grad, float* exp_avg, float* exp_avg_sq,
            uint16_t* param_bf16, int64_t n, const Scalars& s, int num_threads) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_blocks)));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t begin = b * kBlock;
    const int64_t len = std::min(kBlock, n - begin);
    update_block<GradT, kWriteBf16>(param + begin, grad + begin, exp_avg + begin,
                                    exp_avg_sq + begin,
                                    kWriteBf16 ? param_bf16 + begin : nullptr, len, s);
  }
}

// ---- compact state: bf16 master weights with stochastic rounding, 8-bit block-quantised moments ----------
// The formats are stated in megaslide/offload/compact.py (this is their fast path, tested against it). The
// step is the one above on fp32 values: the bf16 master is widened exactly, the moments are dequantised
// exactly; after the step the master is rounded stochastically to bf16, and each block of kMomentBlock
// moments is requantised with a fresh power-of-two scale (exp_avg_sq kept as its square root).

constexpr int64_t kMomentBlock = 64;    // compact.MOMENT_BLOCK
constexpr int kRootRandomBits = 19;      // compact.ROOT_RANDOM_BITS: 23 - the root code's 4 mantissa bits
constexpr uint32_t kRootSalt = 0x9E3779B9u;  // compact._ROOT_SALT

// The 'lowbias32' integer hash (xor-shift, multiply, twice): the random bits of element i are its top half.
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16 bits, the magnitude rounded up with probability (low 16 bits) / 2^16; every NaN -> 0x7FC0.
inline uint16_t to_bf16_stochastic(float x, uint32_t random16) {
  const uint16_t out = static_cast<uint16_t>((bits_of_float(x) + random16) >> 16);
  return x != x ? static_cast<uint16_t>(0x7FC0u) : out;
}

// The normalised magnitude of a code of a 4-exponent-bit, M-mantissa-bit float whose top binade is [1/2, 1).
// A subnormal code (e = 0) decodes as the normal code (1, f) less 2^-15, exactly f * 2^(-15-M) (Sterbenz):
// integer arithmetic instead of a select, which GCC does not vectorise beside byte loads.
template <int M>
inline float decode_magnitude(uint32_t code) {
  const uint32_t e = code >> M, f = code & ((1u << M) - 1u);
  const uint32_t subnormal = e == 0;
  return float_of_bits(((e + subnormal + 111u) << 23) | (f << (23 - M))) - float_of_bits(subnormal * (112u << 23));
}

// The code of a normalised magnitude y in [0, 1): round to nearest even, saturating at kMax.
template <int M, uint32_t kMax>
inline uint32_t encode_magnitude(float y) {
  const uint32_t bits = bits_of_float(y);
  const uint32_t rounded = (bits + ((1u << (22 - M)) - 1u) + ((bits >> (23 - M)) & 1u)) >> (23 - M);
  const uint32_t normal = rounded - (111u << M);
  // y * 2^(15+M) < 2^M is exact; adding 2^23 rounds it to an integer (ties to even) in the low mantissa bits
  const float shifted = y * float_of_bits((127u + 15u + M) << 23) + 8388608.0f;
  const uint32_t subnormal = bits_of_float(shifted) - bits_of_float(8388608.0f);
  const uint32_t code = y < 0x1p-15f ? subnormal : normal;
  return code > kMax ? kMax : code;
}

// The code of a normalised magnitude y in [0, 1), rounded stochastically with the 23 - M random bits r: the fp32
// bits the code drops, plus r, carry into it with probability equal to y's distance from the code below, in
// units of the gap; saturating at kMax. Subnormal codes: y * 2^38 < 2^23 is exact, truncated to an integer.
template <int M, uint32_t kMax>
inline uint32_t encode_magnitude_stochastic(float y, uint32_t r) {
  const uint32_t normal = ((bits_of_float(y) + r) >> (23 - M)) - (111u << M);
  const uint32_t subnormal = (static_cast<uint32_t>(y * 0x1p38f) + r) >> (23 - M);
  const uint32_t code = y < 0x1p-15f ? subnormal : normal;
  return code > kMax ? kMax : code;
}

// The bits of |x|, 0 for a NaN: non-negative floats order as their bits, so a block's largest magnitude is an
// integer max, which vectorises (a float max does not without -ffinite-math-only); NaNs are passed over, as
// std::max(max, NaN) passes them.
inline uint32_t magnitude_bits(float x) {
  const uint32_t bits = bits_of_float(x) & 0x7FFFFFFFu;
  return bits > 0x7F800000u ? 0u : bits;
}

// Per block: scale 2^k, k = floor(log2 absmax) + 1, and 1 / scale; (0, 0) below 2^-126; absmax capped at 2^126.
inline void block_scale(float absmax, float* scale, float* inverse) {
  uint32_t e = (bits_of_float(absmax) >> 23) & 0xFFu;
  e = e > 252u ? 252u : e;
  *scale = e == 0 ? 0.0f : float_of_bits((e + 1u) << 23);
  *inverse = e == 0 ? 0.0f : float_of_bits((253u - e) << 23);
}

struct Fp32Moments {
  float* exp_avg;
  float* exp_avg_sq;
};

struct Int8Moments {  // codes and one scale per kMomentBlock elements; element 0 starts a block
  uint8_t* exp_avg;
  float* exp_avg_scales;
  uint8_t* exp_avg_sq;  // codes of sqrt(exp_avg_sq)
  float* exp_avg_sq_scales;
};

inline void load_moments(const Fp32Moments& st, int64_t begin, int64_t n, float* m, float* v) {
  std::memcpy(m, st.exp_avg + begin, n * sizeof(float));
  std::memcpy(v, st.exp_avg_sq + begin, n * sizeof(float));
}

inline void store_moments(const Fp32Moments& st, int64_t begin, int64_t n, const float* m, const float* v,
                          const float*, uint32_t, uint32_t) {
  std::memcpy(st.exp_avg + begin, m, n * sizeof(float));
  std::memcpy(st.exp_avg_sq + begin, v, n * sizeof(float));
}

// One quantisation block of len <= kMomentBlock elements: decode its codes into m and v (v = root^2).
inline void load_block(const Int8Moments& st, int64_t first, int64_t len, float* __restrict__ m,
                       float* __restrict__ v) {
  const float m_scale = st.exp_avg_scales[first / kMomentBlock];
  const float r_scale = st.exp_avg_sq_scales[first / kMomentBlock];
  const uint8_t* mc = st.exp_avg + first;
  const uint8_t* rc = st.exp_avg_sq + first;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t code = mc[i];
    const float magnitude = decode_magnitude<3>(code & 0x7Fu) * m_scale;
    m[i] = float_of_bits(bits_of_float(magnitude) | ((code & 0x80u) << 24));  // the sign bit
    const float root = decode_magnitude<4>(rc[i]) * r_scale;
    v[i] = root * root;
  }
}

// begin: a multiple of kMomentBlock; the last block may be cut short (n). Whole blocks take the call with a
// constant length, which the compiler unrolls into whole vectors without a remainder loop.
inline void load_moments(const Int8Moments& st, int64_t begin, int64_t n, float* m, float* v) {
  int64_t b = 0;
  for (; b + kMomentBlock <= n; b += kMomentBlock) {
    load_block(st, begin + b, kMomentBlock, m + b, v + b);
  }
  if (b < n) {
    load_block(st, begin + b, n - b, m + b, v + b);
  }
}

// One quantisation block of len <= kMomentBlock elements: a fresh scale from its largest magnitudes, then codes;
// the root's rounded stochastically with the bits of lowbias32(index + i + root_key) (compact.root_key).
inline void store_block(const Int8Moments& st, int64_t first, int64_t len, const float* __restrict__ m,
                        const float* __restrict__ root, uint32_t root_key, uint32_t index) {
  uint32_t m_max = 0u, r_max = 0u;  // the bits of the largest magnitudes (a NaN counts as 0)
#pragma omp simd reduction(max : m_max, r_max)
  for (int64_t i = 0; i < len; ++i) {
    m_max = std::max(m_max, magnitude_bits(m[i]));
    r_max = std::max(r_max, magnitude_bits(root[i]));
  }
  float m_inverse, r_inverse;
  block_scale(float_of_bits(m_max), &st.exp_avg_scales[first / kMomentBlock], &m_inverse);
  block_scale(float_of_bits(r_max), &st.exp_avg_sq_scales[first / kMomentBlock], &r_inverse);
  uint8_t* __restrict__ mc = st.exp_avg + first;
  uint8_t* __restrict__ rc = st.exp_avg_sq + first;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t sign = bits_of_float(m[i]) >> 31;
    mc[i] = static_cast<uint8_t>(encode_magnitude<3, 127u>(std::fabs(m[i]) * m_inverse) | (sign << 7));
    const uint32_t random = lowbias32(index + static_cast<uint32_t>(i) + root_key) >> (32 - kRootRandomBits);
    rc[i] = static_cast<uint8_t>(encode_magnitude_stochastic<4, 255u>(root[i] * r_inverse, random));
  }
}

// index: the flat-buffer index of element begin (the random bits' counter).
inline void store_moments(const Int8Moments& st, int64_t begin, int64_t n, const float* m, const float*,
                          const float* root, uint32_t root_key, uint32_t index) {
  int64_t b = 0;
  for (; b + kMomentBlock <= n; b += kMomentBlock) {
    store_block(st, begin + b, kMomentBlock, m + b, root + b, root_key, index + static_cast<uint32_t>(b));
  }
  if (b < n) {
    store_block(st, begin + b, n - b, m + b, root + b, root_key, index + static_cast<uint32_t>(b));
  }
}

// fp32 master: store, and the round-to-nearest bf16 copy when asked for.
inline void store_params(float* param, uint16_t* param_bf16, const float* p, int64_t n, uint32_t, uint32_t) {
  std::memcpy(param, p, n * sizeof(float));
  if (param_bf16) {
    round_tile_to_bf16(p, param_bf16, n);
  }
}

// bf16 master: stochastic rounding with the bits of elements index .. index + n - 1.
inline void store_params(uint16_t* param, uint16_t*, const float* p, int64_t n, uint32_t key, uint32_t index) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    param[i] = to_bf16_stochastic(p[i], lowbias32(index + static_cast<uint32_t>(i) + key) >> 16);
  }
}

// Elements [begin, begin + n) of the call's buffers, n <= kTile, begin a multiple of kMomentBlock; the bits
// of element i are those of index first_index + i of the block's flat buffer.
template <typename GradT, typename ParamT, typename Moments>
void compact_tile(ParamT* param, const GradT* grad, const Moments& st, uint16_t* param_bf16, int64_t begin,
                  int64_t n, const Scalars& s, uint32_t key, uint32_t first_index) {
  alignas(64) float m[kTile], v[kTile], root[kTile], p[kTile];
  load_moments(st, begin, n, m, v);
  const ParamT* __restrict__ param_in = param + begin;
  const GradT* __restrict__ g = grad + begin;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    p[i] = adam_element(to_float(param_in[i]), to_float(g[i]), m[i], v[i], &root[i], s);
  }
  const uint32_t index = first_index + static_cast<uint32_t>(begin);
  store_params(param + begin, param_bf16 ? param_bf16 + begin : nullptr, p, n, key, index);
  store_moments(st, begin, n, m, v, root, lowbias32(key ^ kRootSalt), index);
}

template <typename GradT, typename ParamT, typename Moments>
void compact_update(ParamT* param, const GradT* grad, const Moments& st, uint16_t* param_bf16, int64_t n,
                    const Scalars& s, uint32_t key, uint32_t first_index, int num_threads) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_blocks)));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * kBlock);
    for (int64_t begin = b * kBlock; begin < end; begin += kTile) {
      compact_tile(param, grad, st, param_bf16, begin, std::min(kTile, end - begin), s, key, first_index);
    }
  }
}

template <typename GradT, typename Moments>
void compact_dispatch(void* param, bool bf16_master, const GradT* grad, const Moments& st,
                      uint16_t* param_bf16, int64_t n, const Scalars& s, uint32_t key, uint32_t first_index,
                      int num_threads) {
  if (bf16_master) {
    compact_update(static_cast<uint16_t*>(param), grad, st, nullptr, n, s, key, first_index, num_threads);
  } else {
    compact_update(static_cast<float*>(param), grad, st, param_bf16, n, s, key, first_index, num_threads);
  }
}

template <typename GradT>
void compact_moments(void* param, bool bf16_master, const GradT* grad, void* exp_avg, float* exp_avg_scales,
                     void* exp_avg_sq, float* exp_avg_sq_scales, uint16_t* param_bf16, int64_t n,
                     const Scalars& s, uint32_t key, uint32_t first_index, int num_threads) {
  if (exp_avg_scales) {
    const Int8Moments st{static_cast<uint8_t*>(exp_avg), exp_avg_scales, static_cast<uint8_t*>(exp_avg_sq),
                         exp_avg_sq_scales};
    compact_dispatch(param, bf16_master, grad, st, param_bf16, n, s, key, first_index, num_threads);
  } else {
    const Fp32Moments st{static_cast<float*>(exp_avg), static_cast<float*>(exp_avg_sq)};
    compact_dispatch(param, bf16_master, grad, st, param_bf16, n, s, key, first_index, num_threads);
  }
}

Scalars make_scalars(float decay, float one_minus_beta1, float beta2, float one_minus_beta2,
                     float bias_correction2_sqrt, float eps, float neg_step_size) {
  const bool small_weight = std::fabs(one_minus_beta1) < 0.5f;
  return Scalars{decay, small_weight ? one_minus_beta1 : one_minus_beta1 - 1.0f, small_weight,
                 beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size};
}

}  // namespace

extern "C" {

// The vector ISA this library was compiled for.
const char* megaslide_cpu_adam_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2-fma";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

// One AdamW step over n elements. grad is fp32 (grad_is_bf16 = 0) or bf16 bits (1);
// param_bf16 may be null. Scalars as described at the top of this file.
void megaslide_adamw_step(float* param, const void* grad, int grad_is_bf16, float* exp_avg,
                          float* exp_avg_sq, uint16_t* param_bf16, int64_t n, float decay,
                          float one_minus_beta1, float beta2, float one_minus_beta2,
                          float bias_correction2_sqrt, float eps, float neg_step_size,
                          int num_threads) {
  const Scalars s = make_scalars(decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
                                 neg_step_size);
  const auto* g16 = static_cast<const uint16_t*>(grad);
  const auto* g32 = static_cast<const float*>(grad);
  if (grad_is_bf16 && param_bf16) {
    update<uint16_t, true>(param, g16, exp_avg, exp_avg_sq, param_bf16, n, s, num_threads);
  } else if (grad_is_bf16) {
    update<uint16_t, false>(param, g16, exp_avg, exp_avg_sq, nullptr, n, s, num_threads);
  } else if (param_bf16) {
    update<float, true>(param, g32, exp_avg, exp_avg_sq, param_bf16, n, s, num_threads);
  } else {
    update<float, false>(param, g32, exp_avg, exp_avg_sq, nullptr, n, s, num_threads);
  }
}

// The compact step: param is fp32 (bf16_master = 0) or bf16 bits (1, stochastic rounding with the bits of
// lowbias32(first_index + i + key)); exp_avg_scales null: fp32 moments, else int8 codes with their scales
// (exp_avg_sq as the codes of its square root). param_bf16 (fp32 master only) may be null.
void megaslide_adamw_step_compact(void* param, int bf16_master, const void* grad, int grad_is_bf16,
                                  void* exp_avg, float* exp_avg_scales, void* exp_avg_sq,
                                  float* exp_avg_sq_scales, uint16_t* param_bf16, int64_t n, float decay,
                                  float one_minus_beta1, float beta2, float one_minus_beta2,
                                  float bias_correction2_sqrt, float eps, float neg_step_size, uint32_t key,
                                  uint32_t first_index, int num_threads) {
  const Scalars s = make_scalars(decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
                                 neg_step_size);
  if (grad_is_bf16) {
    compact_moments(param, bf16_master, static_cast<const uint16_t*>(grad), exp_avg, exp_avg_scales, exp_avg_sq,
                    exp_avg_sq_scales, param_bf16, n, s, key, first_index, num_threads);
  } else {
    compact_moments(param, bf16_master, static_cast<const float*>(grad), exp_avg, exp_avg_scales, exp_avg_sq,
                    exp_avg_sq_scales, param_bf16, n, s, key, first_index, num_threads);
  }
}

}  // extern "C"
