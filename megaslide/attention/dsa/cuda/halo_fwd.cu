// The halo forward of 3D Deformable Slide Attention in CUDA C++: a tile's scores against its whole halo on tensor
// cores, kept in shared memory, and each sample's score read off them at its 8 trilinear corners.
//
// What. One CTA owns a tile of TILE_T x TILE_Y x TILE_X = BQ queries of one (batch, head) (grid: tiles x
// B * heads). It first checks that every sample of every valid query lies inside the tile's halo (the tile grown
// by kernel // 2 + reach along each axis, moved inside the grid); if one leaves it, the CTA writes path 0 and
// returns (the caller runs the gather forward for those tiles). Otherwise (path 1):
//   1. Q's BQ rows and the halo's K rows go to shared memory (cp.async; rows off the grid and padded head
//      columns are zero-filled), S = Q K^T (BQ x HALO, bf16 wmma 16x16x16, fp32 accumulation) is stored fp32 in
//      shared memory with a padded row stride.
//   2. V's halo rows are copied into K's buffer (cp.async), overlapping the next three steps.
//   3. Every (query, sample) pair, one per thread at a time, is placed once: its lower corner's halo-local index
//      and its three fractions rounded to 16 bits (`Place`, 8 bytes, kept in Q's freed buffer), and its score,
//      the trilinear sum of its corner entries of S with fp32 fractions times qk_scale (log2 units).
//   4. The softmax over each query's K samples, by the kThreadsPerQuery = 8 threads of the query (warp
//      shuffles); lse = max + log2(sum). The CTA zeroes S's buffer.
//   5. W, each query's probabilities times corner weights on the halo: the 8 threads of a query split the halo
//      by the parity of t, y and x, so each W entry has one writer, which adds its samples in sample order: no
//      atomics, and the result is deterministic.
//   (A CTA has 8 threads a query: 128 or 256 threads. Steps 1 and 3-5 use them all; step 6 uses kOutWarps.)
//   6. out = W V / sum on tensor cores: W (fp32, entries in [0, 1]) is split per 16 x 16 block into a bf16 high
//      part and a bf16 low part (W - hi), both multiplied by V's bf16 rows with fp32 accumulation, which keeps
//      W to about 16 bits of mantissa (finer than bf16's rounding of out).
// Why. The gather forward reads 8 corner rows of K and V per (query, sample); here a tile reads its halo's rows
// once and every dot product runs on tensor cores (docs/dsa_kernels.md, the halo's scores in shared memory).
// The per-pair work is done once and spread over every thread: the kernel's time is in these scalar phases.
//
// Positions follow the op's definition: along an axis of size S with kernel k the window of query i starts at
// clamp(i - k / 2, 0, S - k); sample j sits at start + j + offset (fp32), clamped to [0, S - 1], and reads its
// lower neighbour with weight 1 - frac and, where frac > 0, the next one with weight frac (then inside the grid
// and the halo). The scores use frac in fp32; W uses it rounded to a multiple of 2^-16 (at most 2^-17 off, below
// bf16's rounding of out), where a frac rounded to 0 drops the upper neighbour.
//
// Layout: q, k, v, out contiguous bf16 (B, T, H, W, heads, d), d a multiple of 8 (padded here to D_PAD, a
// multiple of 16); offsets contiguous (B, T, H, W, heads, K, 3) in fp32, bf16 or fp16; lse fp32 (B, heads, N)
// in log2 units; path int8 (B * heads, tiles). Plain C ABI, no torch: built at first use and loaded with ctypes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>

namespace {

using bf16 = __nv_bfloat16;
namespace wmma = nvcuda::wmma;

constexpr int kThreadsPerQuery = 8;  // one per (t, y, x) parity of the halo in W: 8 x BQ threads a CTA
constexpr int kOutWarps = 4;         // warps of out = W V, each with its own staging tile
constexpr int kRowPad = 8;          // bf16 entries past D_PAD per shared Q / K / V row: rows start on other banks
constexpr int kScorePad = 4;        // fp32 entries past the padded halo per S / W row (wmma wants a multiple of 4)
constexpr int kStageBytes = 1024;   // per warp: a 16 x 16 fp32 tile, or two 16 x 16 bf16 tiles
constexpr float kFracScale = 65536.0f;  // fractions are kept as multiples of 2^-16

// a / b for 0 <= a < 2^21 and 0 < b < 2^12 by a float reciprocal: exact there (the rounding error of (a + 0.5) / b
// stays below 0.5 / b), and a few instructions instead of an integer division.
struct SmallDiv {
    int b;
    float inv;
};

__host__ __device__ inline SmallDiv small_div(int b) { return SmallDiv{b, 1.0f / static_cast<float>(b)}; }

__device__ __forceinline__ int div_of(int a, SmallDiv d) {
    return __float2int_rz((static_cast<float>(a) + 0.5f) * d.inv);
}

struct Geometry {
    int T, H, W, heads, d;
    int kt, kh, kw;                  // window
    int tile_t, tile_y, tile_x;      // queries per tile along each axis (powers of two)
    int shift_yx, shift_x;           // log2(tile_y * tile_x), log2(tile_x)
    int reach;                       // whole tokens of offset the halo covers
    int et, ey, ex;                  // halo extent
    int halo_pad;                    // et * ey * ex rounded up to 16
    int tiles_y, tiles_x;            // tiles along y and x
    int offsets_dtype;               // 0 fp32, 1 bf16, 2 fp16
    int store_lse;
    float qk_scale;                  // scale * log2(e)
    SmallDiv by_khw, by_kw;          // samples -> window position
    SmallDiv by_exy, by_ex;          // halo rows -> halo position
    SmallDiv by_samples;             // (query, sample) pairs -> query
};

__host__ __device__ constexpr long round_up(long x, long m) { return (x + m - 1) / m * m; }

// Dynamic shared memory of a CTA, in bytes, and the offsets of its parts: K then V rows, S then W, the Q rows
// (then each pair's Place, then the warps' staging tiles), the (query, sample) scores then probabilities, the
// softmax sums.
struct Layout {
    long kv, s, stage, scores, sums, total;
    __host__ __device__ Layout(int bq, int d_pad, int halo_pad, int samples) {
        kv = 0;
        s = kv + round_up((long)halo_pad * (d_pad + kRowPad) * 2, 128);
        long reused = (long)bq * (d_pad + kRowPad) * 2;
        if (reused < (long)bq * samples * 8) reused = (long)bq * samples * 8;
        if (reused < kOutWarps * kStageBytes) reused = kOutWarps * kStageBytes;
        stage = s + round_up((long)bq * (halo_pad + kScorePad) * 4, 128);
        scores = stage + round_up(reused, 128);
        sums = scores + round_up((long)bq * samples * 4, 128);
        total = sums + round_up((long)bq * 4, 128);
    }
};

struct Query {
    int t, y, x;     // grid coordinates, clamped onto the grid
    long n;          // token index
    bool valid;      // inside the grid (else a repeat of an edge token: computed, never stored)
};

__device__ __forceinline__ Query tile_query(int i, int t0, int y0, int x0, const Geometry& g) {
    Query q;
    int t = t0 + (i >> g.shift_yx), y = y0 + ((i >> g.shift_x) & (g.tile_y - 1)), x = x0 + (i & (g.tile_x - 1));
    q.valid = t < g.T && y < g.H && x < g.W;
    q.t = min(t, g.T - 1);
    q.y = min(y, g.H - 1);
    q.x = min(x, g.W - 1);
    q.n = ((long)q.t * g.H + q.y) * g.W + q.x;
    return q;
}

__device__ __forceinline__ int window_start(int i, int kernel, int size) {
    return min(max(i - kernel / 2, 0), size - kernel);
}

__device__ __forceinline__ int halo_origin(int first, int kernel, int reach, int extent, int size) {
    return max(min(first - kernel / 2 - reach, size - extent), 0);
}

__device__ __forceinline__ float load_offset(const void* __restrict__ offsets, long index, int dtype) {
    if (dtype == 1) return __bfloat162float(static_cast<const bf16*>(offsets)[index]);
    if (dtype == 2) return __half2float(static_cast<const __half*>(offsets)[index]);
    return static_cast<const float*>(offsets)[index];
}

// One axis of a sample: the halo-local lower neighbour (moved into [0, extent - 1]; a query past the grid may
// sample off the halo and is never stored), the fraction towards the next one (fp32, and in units of 2^-16),
// and whether the clamped position lies in the halo.
struct Axis {
    int lower;
    float frac;
    unsigned steps;
    bool inside;
};

__device__ __forceinline__ Axis sample_axis(int start, int j, float offset, int size, int origin, int extent) {
    Axis a;
    float raw = static_cast<float>(start + j) + offset;
    float pos = fminf(fmaxf(raw, 0.0f), static_cast<float>(size) - 1.0f);
    float lower_f = floorf(pos);
    a.frac = pos - lower_f;
    a.steps = min(__float2uint_rn(a.frac * kFracScale), 65535u);
    a.inside = pos >= static_cast<float>(origin) && pos <= static_cast<float>(origin + extent - 1);
    a.lower = min(max(static_cast<int>(lower_f) - origin, 0), extent - 1);
    return a;
}

struct Sample {
    Axis t, y, x;
};

// Sample j of a query: its three axes against the halo at origin (ht0, hy0, hx0).
__device__ __forceinline__ Sample query_sample(const Query& q, int j, const void* __restrict__ offsets,
                                               long off_base, int ht0, int hy0, int hx0, const Geometry& g) {
    const int it = div_of(j, g.by_khw), jr = j - it * g.by_khw.b, iy = div_of(jr, g.by_kw), ix = jr - iy * g.kw;
    const long o = off_base + 3L * j;
    Sample s;
    s.t = sample_axis(window_start(q.t, g.kt, g.T), it, load_offset(offsets, o, g.offsets_dtype), g.T, ht0, g.et);
    s.y = sample_axis(window_start(q.y, g.kh, g.H), iy, load_offset(offsets, o + 1, g.offsets_dtype), g.H, hy0,
                      g.ey);
    s.x = sample_axis(window_start(q.x, g.kw, g.W), ix, load_offset(offsets, o + 2, g.offsets_dtype), g.W, hx0,
                      g.ex);
    return s;
}

// A placed sample, 8 bytes: its lower corner's halo-local index and its fractions along t (in `lower_t`'s high
// half), y and x, each in units of 2^-16. An axis with fraction 0 has no upper corner.
struct Place {
    unsigned lower_t;   // lower corner index (low 16 bits), t fraction (high 16 bits)
    unsigned yx;        // y fraction (low 16 bits), x fraction (high 16 bits)
};

__device__ __forceinline__ Place make_place(const Sample& s, const Geometry& g) {
    return Place{static_cast<unsigned>((s.t.lower * g.ey + s.y.lower) * g.ex + s.x.lower) | (s.t.steps << 16),
                 s.y.steps | (s.x.steps << 16)};
}

// The lower corner's halo-local coordinates of a sample and its weights toward the upper corner (an upper corner
// exists where its weight is above 0).
struct Corner {
    int t, y, x;
    float ft, fy, fx;
};

// A sample's corner with its fp32 fractions, for its score.
__device__ __forceinline__ Corner exact_corner(const Sample& s) {
    return Corner{s.t.lower, s.y.lower, s.x.lower, s.t.frac, s.y.frac, s.x.frac};
}

__device__ __forceinline__ Corner open_place(Place p, const Geometry& g) {
    Corner c;
    const int index = p.lower_t & 0xffff;
    c.t = div_of(index, g.by_exy);
    const int rest = index - c.t * g.by_exy.b;
    c.y = div_of(rest, g.by_ex);
    c.x = rest - c.y * g.ex;
    constexpr float unit = 1.0f / kFracScale;
    c.ft = static_cast<float>(p.lower_t >> 16) * unit;
    c.fy = static_cast<float>(p.yx & 0xffff) * unit;
    c.fx = static_cast<float>(p.yx >> 16) * unit;
    return c;
}

// The trilinear sum over a place's corners of row[corner] (corners with weight 0 are not read).
__device__ __forceinline__ float corner_sum(const float* row, const Corner& c, const Geometry& g) {
    const int base = (c.t * g.ey + c.y) * g.ex + c.x, dt = c.ft > 0.0f ? g.ey * g.ex : 0;
    const int dy = c.fy > 0.0f ? g.ex : 0, dx = c.fx > 0.0f ? 1 : 0;
    const float x0 = (1.0f - c.fx) * row[base] + c.fx * row[base + dx];
    const float x1 = (1.0f - c.fx) * row[base + dy] + c.fx * row[base + dy + dx];
    const float x2 = (1.0f - c.fx) * row[base + dt] + c.fx * row[base + dt + dx];
    const float x3 = (1.0f - c.fx) * row[base + dt + dy] + c.fx * row[base + dt + dy + dx];
    return (1.0f - c.ft) * ((1.0f - c.fy) * x0 + c.fy * x1) + c.ft * ((1.0f - c.fy) * x2 + c.fy * x3);
}

// Along one axis, the corner of a place with the given parity (the lower one or the upper one) and its weight;
// weight 0 where the place has no corner of that parity.
__device__ __forceinline__ void pick_parity(int lower, float frac, int parity, int& at, float& weight) {
    const bool lower_is = (lower & 1) == parity;
    at = lower_is ? lower : lower + 1;
    weight = lower_is ? 1.0f - frac : frac;
}

// 16 bytes global -> shared without registers; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
    unsigned dst_shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void copy_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// The halo's rows of K or V (halo_pad x D_PAD bf16, row stride D_PAD + kRowPad) into dst: rows past the halo or
// off the grid and head columns past d are zero.
template <int D_PAD, int THREADS>
__device__ __forceinline__ void copy_halo_rows(bf16* dst, const bf16* src, long row0, int ht0, int hy0, int hx0,
                                               const Geometry& g) {
    constexpr int kChunks = D_PAD / 8;
    const int halo = g.et * g.ey * g.ex;
    for (int c = threadIdx.x; c < g.halo_pad * kChunks; c += THREADS) {
        const int r = c / kChunks, col = c % kChunks * 8;
        const int lt = div_of(r, g.by_exy), rest = r - lt * g.by_exy.b, ly = div_of(rest, g.by_ex);
        const int t = ht0 + lt, y = hy0 + ly, x = hx0 + rest - ly * g.ex;
        bool valid = r < halo && t < g.T && y < g.H && x < g.W && col < g.d;
        long n = valid ? ((long)t * g.H + y) * g.W + x : 0;
        copy16(dst + r * (D_PAD + kRowPad) + col, src + (row0 + n * g.heads) * g.d + (valid ? col : 0), valid);
    }
}

// (min 2 CTAs an SM for the register bound: two fit an SM's shared memory at d 64)
template <int BQ, int D_PAD>
__global__ void __launch_bounds__(kThreadsPerQuery * BQ, 2)
    halo_fwd_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                    const void* __restrict__ offsets, bf16* __restrict__ out, float* __restrict__ lse,
                    int8_t* __restrict__ path, Geometry g) {
    constexpr int LD = D_PAD + kRowPad;
    constexpr int THREADS = kThreadsPerQuery * BQ, WARPS = THREADS / 32, TPQ = kThreadsPerQuery;
    extern __shared__ __align__(128) unsigned char smem[];
    const int samples = g.kt * g.kh * g.kw;
    const Layout layout(BQ, D_PAD, g.halo_pad, samples);
    bf16* kv = reinterpret_cast<bf16*>(smem + layout.kv);         // (halo_pad, LD): K rows, then V rows
    float* s = reinterpret_cast<float*>(smem + layout.s);         // (BQ, ls): scores S, then weights W
    bf16* qs = reinterpret_cast<bf16*>(smem + layout.stage);      // (BQ, LD): Q rows, then places, then staging
    Place* places = reinterpret_cast<Place*>(smem + layout.stage);  // (BQ, samples)
    float* sc = reinterpret_cast<float*>(smem + layout.scores);   // (BQ, samples): scores, then probabilities
    float* sums = reinterpret_cast<float*>(smem + layout.sums);   // (BQ,) softmax denominators
    const int ls = g.halo_pad + kScorePad;

    const int p = blockIdx.x, bh = blockIdx.y;
    const int b = bh / g.heads, h = bh % g.heads;
    const long N = (long)g.T * g.H * g.W;
    const long row0 = (long)b * N * g.heads + h;  // row of (b, token 0, h) in units of d
    const int t0 = p / (g.tiles_x * g.tiles_y) * g.tile_t, y0 = p / g.tiles_x % g.tiles_y * g.tile_y;
    const int x0 = p % g.tiles_x * g.tile_x;
    const int ht0 = halo_origin(t0, g.kt, g.reach, g.et, g.T), hy0 = halo_origin(y0, g.kh, g.reach, g.ey, g.H);
    const int hx0 = halo_origin(x0, g.kw, g.reach, g.ex, g.W);

    // path: every sample of every valid query inside the halo (pair e = query * samples + sample: a warp reads
    // consecutive offsets)
    bool inside = true;
    for (int e = threadIdx.x; e < BQ * samples; e += THREADS) {
        const int i = div_of(e, g.by_samples);
        Query qq = tile_query(i, t0, y0, x0, g);
        if (!qq.valid) continue;
        Sample sm = query_sample(qq, e - i * samples, offsets, (row0 + qq.n * g.heads) * samples * 3, ht0, hy0,
                                 hx0, g);
        inside = inside && sm.t.inside && sm.y.inside && sm.x.inside;
    }
    const bool on_halo = __syncthreads_and(inside);
    if (threadIdx.x == 0) path[(long)bh * gridDim.x + p] = on_halo ? 1 : 0;
    if (!on_halo) return;

    // Q rows and K halo rows to shared memory
    for (int c = threadIdx.x; c < BQ * (D_PAD / 8); c += THREADS) {
        int i = c / (D_PAD / 8), col = c % (D_PAD / 8) * 8;
        Query qq = tile_query(i, t0, y0, x0, g);
        bool valid = col < g.d;
        copy16(qs + i * LD + col, q + (row0 + qq.n * g.heads) * g.d + (valid ? col : 0), valid);
    }
    copy_halo_rows<D_PAD, THREADS>(kv, k, row0, ht0, hy0, hx0, g);
    copy_commit();
    copy_wait_all();
    __syncthreads();

    // S = Q K^T (BQ, halo_pad), fp32
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int f = warp; f < (BQ / 16) * (g.halo_pad / 16); f += WARPS) {
        int mi = f % (BQ / 16), ni = f / (BQ / 16);
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < D_PAD / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> bk;
            wmma::load_matrix_sync(a, qs + mi * 16 * LD + kk * 16, LD);
            wmma::load_matrix_sync(bk, kv + ni * 16 * LD + kk * 16, LD);
            wmma::mma_sync(acc, a, bk, acc);
        }
        wmma::store_matrix_sync(s + mi * 16 * ls + ni * 16, acc, ls, wmma::mem_row_major);
    }
    __syncthreads();

    // V halo rows into K's buffer, in flight while the samples are placed, scored and weighed
    copy_halo_rows<D_PAD, THREADS>(kv, v, row0, ht0, hy0, hx0, g);
    copy_commit();

    // every (query, sample): its place (a query past the grid: the lower corner only, inside the halo) and its
    // score from its corners of S with fp32 fractions (the lse stays as exact as the gather forward's), log2 units
    for (int e = threadIdx.x; e < BQ * samples; e += THREADS) {
        const int i = div_of(e, g.by_samples);
        Query qq = tile_query(i, t0, y0, x0, g);
        Sample sm = query_sample(qq, e - i * samples, offsets, (row0 + qq.n * g.heads) * samples * 3, ht0, hy0,
                                 hx0, g);
        if (!qq.valid) {
            sm.t.frac = sm.y.frac = sm.x.frac = 0.0f;
            sm.t.steps = sm.y.steps = sm.x.steps = 0;
        }
        places[e] = make_place(sm, g);
        sc[e] = corner_sum(s + i * ls, exact_corner(sm), g) * g.qk_scale;
    }
    __syncthreads();

    // softmax over each query's samples: the TPQ threads of query i (lanes next to each other) take every
    // TPQ-th sample; S's buffer zeroed for W
    {
        const int i = threadIdx.x / TPQ, r = threadIdx.x % TPQ;
        float* row = sc + i * samples;
        float m = -INFINITY;
        for (int j = r; j < samples; j += TPQ) m = fmaxf(m, row[j]);
#pragma unroll
        for (int w = 1; w < TPQ; w *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, w));
        float l = 0.0f;
        for (int j = r; j < samples; j += TPQ) {
            const float pj = exp2f(row[j] - m);
            row[j] = pj;
            l += pj;
        }
#pragma unroll
        for (int w = 1; w < TPQ; w *= 2) l += __shfl_xor_sync(0xffffffffu, l, w);
        if (r == 0) {
            sums[i] = l;
            Query qq = tile_query(i, t0, y0, x0, g);
            if (g.store_lse && qq.valid) lse[(long)bh * N + qq.n] = m + log2f(l);
        }
    }
    for (int e = threadIdx.x * 4; e < BQ * ls; e += THREADS * 4)
        *reinterpret_cast<float4*>(s + e) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    __syncthreads();

    // W: thread r of query i owns the halo entries whose t, y and x parities are bits 0, 1 and 2 of r, and adds
    // its corner of every sample in sample order; queries past the grid add nothing
    {
        const int i = threadIdx.x / TPQ, r = threadIdx.x % TPQ;
        if (tile_query(i, t0, y0, x0, g).valid) {
            float* wrow = s + i * ls;
            for (int j = 0; j < samples; ++j) {
                const Corner c = open_place(places[i * samples + j], g);
                const float pj = sc[i * samples + j];
                int at_t, at_y, at_x;
                float w_t, w_y, w_x;
                pick_parity(c.t, c.ft, r & 1, at_t, w_t);
                pick_parity(c.y, c.fy, (r >> 1) & 1, at_y, w_y);
                pick_parity(c.x, c.fx, (r >> 2) & 1, at_x, w_x);
                // skip on the weights, not on p x weights: a NaN probability (from a non-finite q or k) times a
                // zero weight is NaN, and the zero-weight corner of a parity may lie one past the halo
                if (w_t == 0.0f || w_y == 0.0f || w_x == 0.0f) continue;
                wrow[(at_t * g.ey + at_y) * g.ex + at_x] += pj * w_t * w_y * w_x;
            }
        }
    }
    copy_wait_all();
    __syncthreads();

    // out = (W_hi + W_lo) V / sum on the first kOutWarps warps (no barrier follows): warp w takes row block
    // w % MB and every (kOutWarps / MB)-th column block
    if (warp >= kOutWarps) return;
    constexpr int MB = BQ / 16, NB = D_PAD / 16, WPR = kOutWarps / MB, NT = (NB + WPR - 1) / WPR;
    const int mi = warp % MB, n_first = warp / MB;
    unsigned char* stage = smem + layout.stage + warp * kStageBytes;
    bf16* w_hi = reinterpret_cast<bf16*>(stage);  // (16, 16)
    bf16* w_lo = w_hi + 256;                      // (16, 16)
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) wmma::fill_fragment(acc[t], 0.0f);
    for (int kc = 0; kc < g.halo_pad / 16; ++kc) {
        const int r = lane / 2, c0 = lane % 2 * 8;
        const float4* src = reinterpret_cast<const float4*>(s + (mi * 16 + r) * ls + kc * 16 + c0);
        const float4 lo4 = src[0], hi4 = src[1];
        const float wv[8] = {lo4.x, lo4.y, lo4.z, lo4.w, hi4.x, hi4.y, hi4.z, hi4.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            bf16 hi = __float2bfloat16_rn(wv[e]);
            w_hi[r * 16 + c0 + e] = hi;
            w_lo[r * 16 + c0 + e] = __float2bfloat16_rn(wv[e] - __bfloat162float(hi));
        }
        __syncwarp();
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a_hi, a_lo;
        wmma::load_matrix_sync(a_hi, w_hi, 16);
        wmma::load_matrix_sync(a_lo, w_lo, 16);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int ni = n_first + t * WPR;
            if (ni < NB) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> bv;
                wmma::load_matrix_sync(bv, kv + kc * 16 * LD + ni * 16, LD);
                wmma::mma_sync(acc[t], a_hi, bv, acc[t]);
                wmma::mma_sync(acc[t], a_lo, bv, acc[t]);
            }
        }
        __syncwarp();
    }
    float* o_stage = reinterpret_cast<float*>(stage);  // (16, 16)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int ni = n_first + t * WPR;
        if (ni >= NB) continue;
        wmma::store_matrix_sync(o_stage, acc[t], 16, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            const int i = mi * 16 + e / 16, col = ni * 16 + e % 16;
            Query qq = tile_query(i, t0, y0, x0, g);
            if (qq.valid && col < g.d)
                out[(row0 + qq.n * g.heads) * g.d + col] = __float2bfloat16_rn(o_stage[e] / sums[i]);
        }
        __syncwarp();
    }
}

template <int BQ, int D_PAD>
cudaError_t launch(const void* q, const void* k, const void* v, const void* offsets, void* out, float* lse,
                   int8_t* path, int batch_heads, int tiles, const Geometry& g, cudaStream_t stream) {
    const long bytes = Layout(BQ, D_PAD, g.halo_pad, g.kt * g.kh * g.kw).total;
    cudaError_t err = cudaFuncSetAttribute(halo_fwd_kernel<BQ, D_PAD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes));
    if (err != cudaSuccess) return err;
    halo_fwd_kernel<BQ, D_PAD><<<dim3(tiles, batch_heads), kThreadsPerQuery * BQ, bytes, stream>>>(
        static_cast<const bf16*>(q), static_cast<const bf16*>(k), static_cast<const bf16*>(v), offsets,
        static_cast<bf16*>(out), lse, path, g);
    return cudaGetLastError();
}

template <int BQ>
cudaError_t launch_d(int d_pad, const void* q, const void* k, const void* v, const void* offsets, void* out,
                     float* lse, int8_t* path, int batch_heads, int tiles, const Geometry& g, cudaStream_t stream) {
    switch (d_pad) {
        case 16: return launch<BQ, 16>(q, k, v, offsets, out, lse, path, batch_heads, tiles, g, stream);
        case 32: return launch<BQ, 32>(q, k, v, offsets, out, lse, path, batch_heads, tiles, g, stream);
        case 48: return launch<BQ, 48>(q, k, v, offsets, out, lse, path, batch_heads, tiles, g, stream);
        case 64: return launch<BQ, 64>(q, k, v, offsets, out, lse, path, batch_heads, tiles, g, stream);
        case 128: return launch<BQ, 128>(q, k, v, offsets, out, lse, path, batch_heads, tiles, g, stream);
        default: return cudaErrorInvalidValue;
    }
}

int padded_head_dim(int d) {
    for (int d_pad : {16, 32, 48, 64, 128})
        if (d <= d_pad) return d_pad;
    return 0;
}

}  // namespace

// Bytes of dynamic shared memory one CTA takes (the Python wrapper checks them against the device's limit).
extern "C" long megaslide_dsa_halo_fwd_shared_bytes(int tile_queries, int head_dim, int halo_pad, int samples) {
    return Layout(tile_queries, padded_head_dim(head_dim), halo_pad, samples).total;
}

// The message of a cudaError_t code returned by megaslide_dsa_halo_fwd.
extern "C" const char* megaslide_dsa_halo_error_string(int code) {
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Launch the halo forward on `stream` (layout in the file's header). lse may be null when store_lse is 0.
// Returns a cudaError_t code: cudaErrorInvalidValue for a head dim (a multiple of 8, at most 128), tile (16 or 32
// queries) or batch x heads (at most 65535, the grid's y) this build does not take.
extern "C" int megaslide_dsa_halo_fwd(const void* q, const void* k, const void* v, const void* offsets,
                                      int offsets_dtype, void* out, float* lse, int8_t* path, int batch, int T,
                                      int H, int W, int heads, int d, int kt, int kh, int kw, int tile_t, int tile_y,
                                      int tile_x, int reach, float qk_scale, int store_lse, cudaStream_t stream) {
    Geometry g;
    g.T = T; g.H = H; g.W = W; g.heads = heads; g.d = d;
    g.kt = kt; g.kh = kh; g.kw = kw;
    g.tile_t = tile_t; g.tile_y = tile_y; g.tile_x = tile_x; g.reach = reach;
    g.et = tile_t + 2 * (kt / 2) + 2 * reach;
    g.ey = tile_y + 2 * (kh / 2) + 2 * reach;
    g.ex = tile_x + 2 * (kw / 2) + 2 * reach;
    g.halo_pad = static_cast<int>(round_up((long)g.et * g.ey * g.ex, 16));
    g.tiles_y = (H + tile_y - 1) / tile_y;
    g.tiles_x = (W + tile_x - 1) / tile_x;
    g.shift_yx = __builtin_ctz(static_cast<unsigned>(tile_y * tile_x));
    g.shift_x = __builtin_ctz(static_cast<unsigned>(tile_x));
    g.offsets_dtype = offsets_dtype;
    g.store_lse = store_lse;
    g.qk_scale = qk_scale;
    g.by_khw = small_div(kh * kw);
    g.by_kw = small_div(kw);
    g.by_exy = small_div(g.ey * g.ex);
    g.by_ex = small_div(g.ex);
    g.by_samples = small_div(kt * kh * kw);
    const int tiles = (T + tile_t - 1) / tile_t * g.tiles_y * g.tiles_x;
    const int d_pad = padded_head_dim(d);
    if (d % 8 != 0 || d_pad == 0 || offsets_dtype < 0 || offsets_dtype > 2 || batch * heads > 65535)
        return cudaErrorInvalidValue;
    const int bq = tile_t * tile_y * tile_x;
    if (bq == 16) return launch_d<16>(d_pad, q, k, v, offsets, out, lse, path, batch * heads, tiles, g, stream);
    if (bq == 32) return launch_d<32>(d_pad, q, k, v, offsets, out, lse, path, batch * heads, tiles, g, stream);
    return cudaErrorInvalidValue;
}
