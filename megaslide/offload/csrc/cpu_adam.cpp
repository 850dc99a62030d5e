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

inline float load_grad(float g) { return g; }

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
inline float load_grad(uint16_t g) {
  const uint32_t bits = static_cast<uint32_t>(g) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// fp32 -> bf16, round to nearest with ties to even (what torch's .to(torch.bfloat16) does for
// finite and infinite values); every NaN becomes the quiet NaN 0x7FC0.
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

template <typename GradT>
void update_tile(float* __restrict__ param, const GradT* __restrict__ grad,
                 float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, int64_t n,
                 const Scalars s) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = load_grad(grad[i]);
    const float p = param[i] * s.decay;
    const float m_old = exp_avg[i];
    const float m = std::fma(s.lerp_coeff, g - m_old, s.lerp_base_is_m ? m_old : g);
    const float v = std::fma(s.one_minus_beta2 * g, g, exp_avg_sq[i] * s.beta2);
    const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    param[i] = p + (s.neg_step_size * m) / denom;
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
  const bool small_weight = std::fabs(one_minus_beta1) < 0.5f;
  const Scalars s{decay, small_weight ? one_minus_beta1 : one_minus_beta1 - 1.0f, small_weight,
                  beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size};
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

}  // extern "C"
