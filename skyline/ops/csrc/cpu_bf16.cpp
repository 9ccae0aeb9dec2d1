// Products of bfloat16 activations and bfloat16 weights for decode-sized batches, sums in
// float32 (ops/cpu_bf16.py holds the PyTorch reference and the contract).
//
// y[m, n] = bf16(sum_k x[m, k] * W[n, k]), W [N, K] row-major as loaded (no packing). Each output
// row's sum is computed the same way whatever the batch's size: a 16-lane float32 accumulator
// fed 32 elements at a time in k's order (AVX-512 BF16 `vdpbf16ps`: lane i takes elements 2i and
// 2i + 1 of each 32), then its lanes summed in a fixed order; without AVX-512 BF16, the same
// pairs in float32 FMAs (AVX-512F), 8 lanes of float32 FMAs (AVX2) or one scalar sum; four
// accumulators' lanes are summed together, each in the same order. Weight rows are split across
// ATen's threads, and each weight load serves every row of x of a pass (8, 4, 2 or 1 rows; the
// weights stay in cache between passes). Short rows (K <= kShortRow) are read one after the
// other, so that a thread's weights are one stream in memory order with the next row prefetched
// (four interleaved short rows start new streams every few hundred bytes: ~22 GB/s where one
// stream reads ~30 on two cores of an AMD EPYC); long rows U = 4 (or 2) at a time, each load used
// for U rows of W too, prefetched within each row.
//
// bf16_wide_mm is the product of many rows where the CPU has no bfloat16 GEMM (AVX2: oneDNN packs
// no bfloat16 there and ATen's product is a loop): ATen's float32 GEMM over slabs of W converted
// into a buffer the calling thread keeps, each slab still in cache when the GEMM reads it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "skyline_cpu.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kAhead = 512;  // elements (1 KiB) of a long row prefetched ahead of its loads
constexpr int64_t kShortRow = 2048;  // elements of a row up to which rows are read one by one

#if defined(__AVX512F__)
// the sums of four 16-lane accumulators' lanes, each in the same order whichever accumulators
// share the call (a row's result must not depend on its batch): halves, then pairs, then quads
inline __m128 sum4_512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto half = [](__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  };
  const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)),
                                  _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr int kStep = 32;  // elements an accumulator takes a step
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
// 32 bf16 of p (the first `n` of them, the rest 0)
inline __m512i load32(const uint16_t* p, int n) {
  if (n >= 32) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
}
inline Acc fma_step(Acc acc, __m512i x, __m512i w) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(x), reinterpret_cast<__m512bh&>(w));
}
inline __m128 acc_sum4(Acc a0, Acc a1, Acc a2, Acc a3) { return sum4_512(a0, a1, a2, a3); }
using Vec = __m512i;
inline Vec load(const uint16_t* p, int n) { return load32(p, n); }
#elif defined(__AVX512F__)
// AVX-512 without BF16 (Skylake-SP, Cascade Lake): vdpbf16ps's pairs in float32 FMAs. A 32-bit
// lane holds elements 2i (low half) and 2i + 1 (high half); shifted left by 16 the low one is its
// float32, masked the high one is: two FMAs a lane, no shuffle to widen
constexpr int kStep = 32;
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
using Vec = __m512i;
// 32 bf16 of p (the first `n` of them, the rest 0)
inline Vec load(const uint16_t* p, int n) {
  if (n >= 32) return _mm512_loadu_si512(p);
  uint16_t tail[32] = {};
  std::memcpy(tail, p, sizeof(uint16_t) * n);
  return _mm512_loadu_si512(tail);
}
inline Acc fma_step(Acc acc, Vec x, Vec w) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto even = [](Vec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); };
  const auto odd = [&](Vec v) { return _mm512_castsi512_ps(_mm512_and_si512(v, high)); };
  return _mm512_fmadd_ps(odd(x), odd(w), _mm512_fmadd_ps(even(x), even(w), acc));
}
inline __m128 acc_sum4(Acc a0, Acc a1, Acc a2, Acc a3) { return sum4_512(a0, a1, a2, a3); }
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: the same pairs, 16 elements a step in 8 lanes
constexpr int kStep = 16;
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
using Vec = __m256i;
// 16 bf16 of p (the first `n`, the rest 0)
inline Vec load(const uint16_t* p, int n) {
  if (n >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  uint16_t tail[16] = {};
  std::memcpy(tail, p, sizeof(uint16_t) * n);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail));
}
inline Acc fma_step(Acc acc, Vec x, Vec w) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto even = [](Vec v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); };
  const auto odd = [&](Vec v) { return _mm256_castsi256_ps(_mm256_and_si256(v, high)); };
  return _mm256_fmadd_ps(odd(x), odd(w), _mm256_fmadd_ps(even(x), even(w), acc));
}
inline __m128 acc_sum4(Acc a0, Acc a1, Acc a2, Acc a3) {
  return _mm_setr_ps(skyline::hsum8(a0), skyline::hsum8(a1), skyline::hsum8(a2), skyline::hsum8(a3));
}
#else
constexpr int kStep = 1;
using Acc = float;
using Vec = float;
inline Acc acc_zero() { return 0.f; }
inline Vec load(const uint16_t* p, int) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline Acc fma_step(Acc acc, Vec x, Vec w) { return acc + x * w; }
struct Sums4 {
  float v[4];
};
inline Sums4 acc_sum4(Acc a0, Acc a1, Acc a2, Acc a3) { return {{a0, a1, a2, a3}}; }
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline void store4(float* out, __m128 v) { _mm_storeu_ps(out, v); }
#else
inline void store4(float* out, Sums4 v) { std::memcpy(out, v.v, sizeof v.v); }
#endif

inline void prefetch(const uint16_t* p) {
#if defined(__AVX2__)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  (void)p;
#endif
}

// y[m, n] for M rows of x from `x` (row stride ldx) and U weight rows from n: the M x U sums
template <int M, int U>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k, int64_t n,
          at::BFloat16* y, int64_t ldy) {
  Acc acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = acc_zero();
  const uint16_t* rows[U];
  for (int u = 0; u < U; ++u) rows[u] = w + (n + u) * k;
  // short rows (U = 1): the next row's same offset; long ones: a little ahead within each row
  const int64_t ahead = k <= kShortRow ? U * k : kAhead;
  for (int64_t k0 = 0; k0 < k; k0 += kStep) {
    const int left = static_cast<int>(std::min<int64_t>(kStep, k - k0));
    Vec wv[U];
    for (int u = 0; u < U; ++u) {
      if (k0 % 32 == 0) prefetch(rows[u] + k0 + ahead);
      wv[u] = load(rows[u] + k0, left);
    }
    for (int m = 0; m < M; ++m) {
      const Vec xv = load(x + m * ldx + k0, left);
      for (int u = 0; u < U; ++u) acc[m][u] = fma_step(acc[m][u], xv, wv[u]);
    }
  }
  // four sums at a time (a tile of one or two rows of W repeats them: the same arithmetic)
  Acc* all = &acc[0][0];
  for (int i = 0; i < M * U; i += 4) {
    const int c = std::min(4, M * U - i);
    float out[4];
    store4(out, acc_sum4(all[i], all[i + (c > 1)], all[i + 2 * (c > 2)], all[i + 3 * (c > 3)]));
    for (int j = 0; j < c; ++j) y[(i + j) / U * ldy + n + (i + j) % U] = c10::BFloat16(out[j]);
  }
}

// weight rows [n0, n1) for M rows of x: long rows U at a time, then one at a time
template <int M>
void rows_pass(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k, int64_t n0,
               int64_t n1, at::BFloat16* y, int64_t ldy) {
  constexpr int U = M <= 4 ? 4 : 2;  // M x U accumulators, at most 16
  int64_t n = n0;
  if (k > kShortRow)
    for (; n + U <= n1; n += U) tile<M, U>(x, ldx, w, k, n, y, ldy);
  for (; n < n1; ++n) tile<M, 1>(x, ldx, w, k, n, y, ldy);
}

// weight rows [n0, n1) for all of x's rows: a block of weight rows (about 64 KB) at a time, read
// from memory by the first pass and from cache by the others
void rows_all(const uint16_t* x, int64_t m, const uint16_t* w, int64_t k, int64_t n0,
              int64_t n1, at::BFloat16* y, int64_t n) {
  const int64_t block = std::max<int64_t>(4, (65536 / 2) / std::max<int64_t>(1, k) / 4 * 4);
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = std::min(n1, b0 + block);
    for (int64_t m0 = 0; m0 < m;) {
      const int64_t left = m - m0;
      const uint16_t* xm = x + m0 * k;
      at::BFloat16* ym = y + m0 * n;
      if (left >= 8) rows_pass<8>(xm, k, w, k, b0, b1, ym, n), m0 += 8;
      else if (left >= 4) rows_pass<4>(xm, k, w, k, b0, b1, ym, n), m0 += 4;
      else if (left >= 2) rows_pass<2>(xm, k, w, k, b0, b1, ym, n), m0 += 2;
      else rows_pass<1>(xm, k, w, k, b0, b1, ym, n), m0 += 1;
    }
  }
}

}  // namespace

at::Tensor skyline::bf16_mm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "bf16_mm: x must be a contiguous bfloat16 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.size(1) == x.size(1),
              "bf16_mm: weight must be a contiguous bfloat16 [N, K] with x's K");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  if (k == 0) {
    y.zero_();
    return y;
  }
  // parts: about 32 KB of weights at least each, every thread one part
  const int64_t grain = std::max<int64_t>(4, 16384 / k);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / grain));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      rows_all(xp, m, wp, k, p * n / parts, (p + 1) * n / parts, yp, n);
  });
  return y;
}

// Rows of a weight bf16_wide_mm converts at a time: as many as fill this many bytes of float32
// (256 rows of a 4,096-wide weight), which stay in cache for the GEMM that reads them next.
constexpr int64_t kSlabBytes = 4 << 20;

at::Tensor skyline::bf16_wide_mm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1) &&
                  weight.scalar_type() == at::kBFloat16,
              "bf16_wide_mm: x [M, K] and a bfloat16 weight [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = at::empty({m, n}, xf.options());
  if (m == 0 || n == 0) return y.to(x.scalar_type());
  const int64_t slab = std::min(
      n, std::max<int64_t>(16, kSlabBytes / (4 * std::max<int64_t>(k, 1))));
  // the slabs' float32 buffer, kept by the calling thread between calls: a fresh one would
  // fault in its pages at every call, which took 3x the conversion itself
  // (memory, not a tensor: a tensor made inside inference mode could not be written outside it)
  static thread_local std::vector<float> kept;
  if (static_cast<int64_t>(kept.size()) < slab * k) kept.resize(slab * k);
  const at::Tensor wf = at::from_blob(kept.data(), {slab, k}, xf.options());
  for (int64_t i = 0; i < n; i += slab) {
    const int64_t r = std::min(slab, n - i);
    at::Tensor w = wf.narrow(0, 0, r);
    w.copy_(weight.narrow(0, i, r));
    at::Tensor out = y.narrow(1, i, r);
    at::mm_out(out, xf, w.t());
  }
  return y.to(x.scalar_type());
}

namespace {

// which path this build's bf16_mm runs (for tests and benches)
std::string bf16_isa() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(skyline_cpu, m) {
  m.def("bf16_mm(Tensor x, Tensor weight) -> Tensor");
  m.def("bf16_wide_mm(Tensor x, Tensor weight) -> Tensor");
  m.def("bf16_isa() -> str", bf16_isa);
}

TORCH_LIBRARY_IMPL(skyline_cpu, CPU, m) {
  m.impl("bf16_mm", skyline::bf16_mm);
  m.impl("bf16_wide_mm", skyline::bf16_wide_mm);
}
