// Integer dot products of GGUF-style weights with activations rounded to 8 bits per 32 elements,
// once or twice (the second time what the first rounding left)
// (ops/cpu_intdot.py holds the PyTorch reference and the contract).
//
// W[n, k] = q[n, k] * scale[n, g] + offset[n, g], q unsigned codes (4 bits: byte j of a block
// of 32 holds element j in its low nibble and element j + 16 in its high one, as GGUF's Q4
// blocks; 6 bits: per 128 elements GGUF's Q6_K order, 64 bytes of low nibbles (byte j < 32:
// elements j and 64 + j, byte 32 + j: elements 32 + j and 96 + j) then 32 bytes whose byte j
// holds the top two bits of elements j, 32 + j, 64 + j and 96 + j from its lowest bits up, and
// the last K % 128 elements per block of 32, 16 bytes of low nibbles as 4-bit codes, then 8
// bytes whose byte j holds the top two bits of elements j, j + 8, j + 16 and j + 24; 8 bits:
// one byte an element), scale and offset fp16 per group of 16 or 32 elements, or as GGUF's K
// types hold them: an int8 per group times a factor per super-block of 256 elements (a row's
// int8s, then its factors as float32).
// x[m, k] ~= dx[m, b] * xq[m, k], xq int8 and dx float32 per block b of 32 elements. Then
//   y[m, n] = sum_g scale[n, g] * dx[m, b(g)] * sum_{k in g} q xq + sum_g offset[n, g] * xs[m, g]
// with xs[m, g] = dx[m, b(g)] * sum_{k in g} xq: one unsigned-by-signed byte dot product per
// group (AVX-512 VNNI / AVX-VNNI `vpdpbusd`, else AVX2 `vpmaddubsw`, else scalar), weights read
// once for all rows, output rows split across ATen's threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "skyline_cpu.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;  // activation elements per int8 scale
constexpr int kAhead = 2048;  // weight bytes prefetched ahead of the loads (rows contiguous)
constexpr int kWide6 = 128;  // elements of a 6-bit row in Q6_K's order, before the last blocks
constexpr int kMaxRows = 8;  // rows a weight group is reused for before it is read again
constexpr int64_t kMaxK = 65536;  // longest row (scales of a row are converted on the stack)
constexpr int64_t kMaxGroups = kMaxK / 16;
constexpr int64_t kSuper = 256;  // elements per factor of int8 scales

struct Quantized {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K / 32]
  std::vector<float> sum;  // [M, K / group]: d * sum of the group's codes
  // 4-bit codes in groups of 32, K a multiple of 64: per pair of blocks (2p, 2p + 1), the
  // activations in the order a 32-byte load of the pair's codes holds their nibbles (the low
  // ones: elements 0-15 of each block, then the high ones: 16-31), and the pair's two scales
  // each repeated over the 4 lanes that sum its block
  std::vector<int8_t> qp;  // [M, K / 64, 64]
  std::vector<float> d4;   // [M, K / 64, 8]
};

// One row rounded per 32 elements into virtual row `v`: d = max|x| / 127, q = nearbyint(x / d)
// (ties to even), as quantize_activations_ref; writes x - q d to `residual` unless it is null
// (the last round).
void quantize_row(const float* x, int64_t k, int64_t group, Quantized& out, int64_t v,
                  float* residual) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* qb = out.q.data() + v * k + b * kBlock;
#if defined(__AVX2__) && defined(__FMA__)
    // the loop below, 8 elements an instruction, the same values (a NaN is skipped as
    // std::max(amax, |x|) skips it: vmaxps returns its second operand, the running maximum)
    __m256 xv[4];
    __m256 mv = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      xv[i] = _mm256_loadu_ps(xb + 8 * i);
      mv = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), xv[i]), mv);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(xv[i], _mm256_set1_ps(id)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      qi[i] = _mm256_cvtps_epi32(r);
      if (residual != nullptr)  // fma(-q, d, x), one rounding
        _mm256_storeu_ps(residual + b * kBlock + 8 * i,
                         _mm256_fnmadd_ps(r, _mm256_set1_ps(d), xv[i]));
    }
    const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                           _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                        _mm256_permutevar8x32_epi32(q16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < kBlock; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));
    // what the rounding left, rounded once (an explicit fma: a compiler may or may not contract
    // x - q * d by itself, and the rounding of the second round depends on it)
    if (residual != nullptr)
      for (int i = 0; i < kBlock; ++i)
        residual[b * kBlock + i] = std::fma(-static_cast<float>(qb[i]), d, xb[i]);
#endif
    out.d[v * (k / kBlock) + b] = d;
    for (int h = 0; h < kBlock / group; ++h) {
      int s = 0;
      for (int i = 0; i < group; ++i) s += qb[h * group + i];
      out.sum[v * (k / group) + b * (kBlock / group) + h] = d * static_cast<float>(s);
    }
  }
}

// Virtual row r's 4-bit pair layout (Quantized::qp, d4) from its int8s and scales
void pair_row(Quantized& xq, int64_t r, int64_t k) {
  const int64_t pairs = k / 64;
  for (int64_t p = 0; p < pairs; ++p) {
    const int8_t* src = xq.q.data() + r * k + p * 64;
    int8_t* dst = xq.qp.data() + r * k + p * 64;
    std::memcpy(dst, src, 16);            // block 2p, elements 0-15 (low nibbles)
    std::memcpy(dst + 16, src + 32, 16);  // block 2p + 1, elements 0-15
    std::memcpy(dst + 32, src + 16, 16);  // block 2p, elements 16-31 (high nibbles)
    std::memcpy(dst + 48, src + 48, 16);  // block 2p + 1, elements 16-31
    for (int i = 0; i < 8; ++i)
      xq.d4[(r * pairs + p) * 8 + i] = xq.d[r * (k / kBlock) + 2 * p + i / 4];
  }
}

// Each row of x as `rounds` virtual rows (rounds * r: x rounded to int8 per 32; with two
// rounds, rounds * r + 1: what that rounding left, rounded the same way), whose products the
// kernel adds: two rounds take x's rounding error from ~1/254 of each block's largest element
// to ~1/254 of that, below bfloat16's, for twice the multiplications. With `pairs`, also the
// 4-bit pair layout. Rows split across ATen's threads.
template <typename T>
Quantized quantize(const T* x, int64_t m, int64_t k, int64_t group, int64_t rounds, bool pairs) {
  Quantized out;
  out.q.resize(rounds * m * k);
  out.d.resize(rounds * m * (k / kBlock));
  out.sum.resize(rounds * m * (k / group));
  if (pairs) {
    out.qp.resize(rounds * m * k);
    out.d4.resize(rounds * m * (k / 64) * 8);
  }
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(k), left(k);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < k; ++i) row[i] = static_cast<float>(x[r * k + i]);
      for (int64_t i = 0; i < rounds; ++i) {
        const bool last = i + 1 == rounds;
        quantize_row(row.data(), k, group, out, rounds * r + i, last ? nullptr : left.data());
        if (pairs) pair_row(out, rounds * r + i, k);
        row.swap(left);
      }
    }
  });
  return out;
}

#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
#endif

// The scales and offsets of the groups of W's rows: fp16 per group, or (`super`) int8 per group
// then the row's float32 factors, one per super-block of 256 elements
struct Scales {
  const uint8_t* scale;  // row n's at scale + n * stride
  const uint8_t* offset;
  int64_t stride;  // bytes a row
  bool super;
};

// the factor of group g's super-block in a row of int8 scales (`groups` in the row, GROUP
// elements each)
template <int GROUP>
inline float super_factor(const uint8_t* row, int64_t g, int64_t groups) {
  float f;
  std::memcpy(&f, row + groups + 4 * (g * GROUP / kSuper), sizeof f);
  return f;
}

// group g's value of a row's scales or offsets
template <int GROUP>
inline float group_value(const uint8_t* row, int64_t g, int64_t groups, bool super) {
  if (!super) {
    uint16_t h;
    std::memcpy(&h, row + 2 * g, sizeof h);
    return half_to_float(h);
  }
  return super_factor<GROUP>(row, g, groups) * static_cast<float>(static_cast<int8_t>(row[g]));
}

#if defined(__AVX2__)
// 32 codes of a block (6 bits: one of the last K % 128 elements) as unsigned bytes in element
// order
template <int BITS>
inline __m256i load_codes(const uint8_t* p) {
  if constexpr (BITS == 4 || BITS == 6) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m256i low = _mm256_set_m128i(hi, lo);
    if constexpr (BITS == 4) return low;
    // the top bits: quadword i of the 8 bytes shifted right by 2 i holds elements 8 i .. 8 i + 7
    // in its bytes' lowest two bits
    int64_t h;
    std::memcpy(&h, p + 16, sizeof h);
    const __m256i top = _mm256_and_si256(
        _mm256_srlv_epi64(_mm256_set1_epi64x(h), _mm256_set_epi64x(6, 4, 2, 0)),
        _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
}

// block I of 128 6-bit codes in Q6_K's order as unsigned bytes in element order: the low
// nibbles of bytes 0-31 (I = 0) or 32-63 (I = 1), their high nibbles (I = 2, 3), and bits 2I,
// 2I + 1 of bytes 64-95 as bits 4-5
template <int I>
inline __m256i codes6(const uint8_t* p) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * (I & 1)));
  const __m256i low = I < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
  const __m256i h = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64)),
                                     _mm256_set1_epi8(static_cast<char>(3 << (2 * I))));
  const __m256i top = I < 2 ? _mm256_slli_epi16(h, 4 - 2 * I) : _mm256_srli_epi16(h, 2 * I - 4);
  return _mm256_or_si256(low, top);
}

// the weight bytes kAhead past p into the cache: one core's hardware prefetcher alone keeps too
// few reads in flight to stream a decode step's weights at the memory's rate (a prefetch past
// the codes' end is a hint, never a fault)
inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kAhead, _MM_HINT_T0);
}

// p[0] in lanes 0-3, p[1] in lanes 4-7: the scales of the two halves of a dot product's sums
// (two groups of 16, or two blocks of a 4-bit pair); one load and one permute
inline __m256 two_groups(const float* p) {
  const __m128 v = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// 8 int32 partial sums of u8 codes times s8 activations (4 neighbouring bytes each); without
// VNNI, 8-bit codes as signed ones (see kSigned8; 6-bit codes stay within vpmaddubsw's range:
// 2 * 63 * 128 < 32768)
template <int BITS>
inline __m256i dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS < 8) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  // vpmaddubsw would saturate at 2 * 255 * 127 > 32767: the codes less 128 (q ^ 0x80), whose
  // magnitudes times x's signs stay within 2 * 128 * 127, as llama.cpp's AVX2 dot products
  const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), ones);
#endif
}
#endif

// Whether the AVX2 kernel multiplies 8-bit codes as q - 128 (no VNNI): each group's sum then
// lacks 128 * scale * sum(x q8) = 128 * scale * xs, which the offsets' term adds back
template <int BITS>
constexpr bool kSigned8 =
#if defined(__AVX2__)
    BITS == 8 && !kVnni;
#else
    false;
#endif

#if defined(__AVX2__)
// 8 int32 sums of two u8-by-s8 products (4-bit codes: no saturation on AVX2)
inline __m256i dot2_u4s8(__m256i w0, __m256i x0, __m256i w1, __m256i x1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w0, x0), w1, x1);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w0, x0), w1, x1);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_madd_epi16(
      _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)), ones);
#endif
}
#endif

// rows [n0, n1) of y for M (a multiple of R, <= kMaxRows) virtual activation rows from m_off,
// R to a row of y (M a constant: the accumulators stay in registers)
template <int BITS, int GROUP, int R, int M, typename Y>
void rows_kernel(const Quantized& xq, int64_t m_off, int64_t k, const uint8_t* codes,
                 const Scales& scales, int64_t n0, int64_t n1, Y* y, int64_t ldy) {
  const int64_t row_bytes = k * BITS / 8;
  const int64_t groups = k / GROUP;
  const int64_t blocks = k / kBlock;
  const bool super = scales.super;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wq = codes + n * row_bytes;
    const uint8_t* ws = scales.scale + n * scales.stride;
    const uint8_t* wo = scales.offset + n * scales.stride;
    float off[kMaxRows] = {0};
    float sc[kMaxGroups];  // the row's scales in float32
    // one activation row (a batch-1 step): each group's scale times its block's activation
    // scale, made here 8 groups an instruction instead of a group at a time in the loops below
    // (the same float32 products)
#if defined(__AVX2__)
    float scd[M == 1 ? kMaxGroups : 1];
    const float* xd = xq.d.data() + m_off * blocks;
#endif
    int64_t g = 0;
#if defined(__AVX2__) && defined(__F16C__)
    __m256 offv[kMaxRows];
    for (int r = 0; r < M; ++r) offv[r] = _mm256_setzero_ps();
    // 8 groups' values from g: fp16s, or int8s times their super-block's factor (8 groups
    // never straddle one: a super-block holds 8 or 16)
    auto values8 = [&](const uint8_t* row, int64_t g) {
      if (!super)
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * g)));
      const __m256 ints = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + g))));
      return _mm256_mul_ps(ints, _mm256_set1_ps(super_factor<GROUP>(row, g, groups)));
    };
    for (; g + 8 <= groups; g += 8) {
      __m256 o = values8(wo, g);
      const __m256 sv = values8(ws, g);
      if constexpr (M > 1) _mm256_storeu_ps(sc + g, sv);  // one row reads scd alone
      if constexpr (M == 1) {
        const __m256 dv = GROUP == 32 ? _mm256_loadu_ps(xd + g)  // groups of 16: d twice each
            : _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(xd + g / 2)),
                                       _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        _mm256_storeu_ps(scd + g, _mm256_mul_ps(sv, dv));
      }
      if constexpr (kSigned8<BITS>) o = _mm256_fmadd_ps(sv, _mm256_set1_ps(128.f), o);
      for (int r = 0; r < M; ++r)
        offv[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xq.sum.data() + (m_off + r) * groups + g), offv[r]);
    }
    for (int r = 0; r < M; ++r) off[r] = skyline::hsum8(offv[r]);
#endif
    for (; g < groups; ++g) {
      sc[g] = group_value<GROUP>(ws, g, groups, super);
#if defined(__AVX2__)
      if constexpr (M == 1) scd[g] = sc[g] * xd[g * GROUP / kBlock];
#endif
      const float ov = group_value<GROUP>(wo, g, groups, super);
      const float o = kSigned8<BITS> ? std::fma(sc[g], 128.f, ov) : ov;
      for (int r = 0; r < M; ++r) off[r] += o * xq.sum[(m_off + r) * groups + g];
    }
#if defined(__AVX2__)
    __m256 acc[kMaxRows];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    if constexpr (BITS == 4 && GROUP == 32) {
      if (!xq.qp.empty()) {  // two blocks a load: 64 weights, two dot products a row
        const __m256i mask = _mm256_set1_epi8(0x0F);
        for (; b < blocks; b += 2) {
          prefetch(wq + b * 16);
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * 16));
          const __m256i lo = _mm256_and_si256(v, mask);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
          if constexpr (M == 1) {
            const int8_t* x = xq.qp.data() + m_off * k + b * 32;
            const __m256i p = dot2_u4s8(
                lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
                hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
            acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), two_groups(scd + b), acc[0]);
            continue;
          }
          const __m256 s = two_groups(sc + b);
          for (int r = 0; r < M; ++r) {
            const int64_t row = m_off + r;
            const int8_t* x = xq.qp.data() + row * k + b * 32;
            const __m256i p = dot2_u4s8(
                lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
                hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
            const __m256 sd = _mm256_mul_ps(s, _mm256_loadu_ps(xq.d4.data() + (row * blocks / 2 + b / 2) * 8));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sd, acc[r]);
          }
        }
      }
    }
    // block b's codes w times virtual row r's, added to acc[r]: the group's scale (groups of
    // 16: lanes 0-3 the first group's, lanes 4-7 the second's) times the block's activation
    // scale (one row: the products made above), then one fma a row
    auto step = [&](int64_t b, __m256i w) {
      for (int r = 0; r < M; ++r) {
        const __m256i x = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xq.q.data() + (m_off + r) * k + b * kBlock));
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8<BITS>(w, x));
        __m256 sd;
        if constexpr (M == 1) {
          sd = GROUP == 32 ? _mm256_broadcast_ss(scd + b) : two_groups(scd + 2 * b);
        } else {
          const __m256 s = GROUP == 32 ? _mm256_broadcast_ss(sc + b) : two_groups(sc + 2 * b);
          sd = _mm256_mul_ps(s, _mm256_set1_ps(xq.d[(m_off + r) * blocks + b]));
        }
        acc[r] = _mm256_fmadd_ps(p, sd, acc[r]);
      }
    };
    if constexpr (BITS == 6) {  // Q6_K's order: four blocks from three 32-byte loads
      for (; b + 4 <= blocks; b += 4) {
        const uint8_t* p = wq + b * kBlock * 3 / 4;
        prefetch(p);
        prefetch(p + 64);
        step(b, codes6<0>(p));
        step(b + 1, codes6<1>(p));
        step(b + 2, codes6<2>(p));
        step(b + 3, codes6<3>(p));
      }
    }
    for (; b < blocks; ++b) {
      const uint8_t* p = wq + b * kBlock * BITS / 8;
      prefetch(p);
      step(b, load_codes<BITS>(p));
    }
    for (int r = 0; r < M; r += R) {  // a row's virtual rows add up
      __m256 a = acc[r];
      float o = off[r];
      for (int i = 1; i < R; ++i) a = _mm256_add_ps(a, acc[r + i]), o += off[r + i];
      y[r / R * ldy + n] = static_cast<Y>(skyline::hsum8(a) + o);
    }
#else
    float part[kMaxRows];
    for (int r = 0; r < M; ++r) {
      const int64_t row = m_off + r;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int s = 0;
        for (int i = 0; i < GROUP; ++i) {
          const int64_t e = g * GROUP + i;  // element index in the row
          int q;
          if constexpr (BITS == 6) {
            if (e < k / kWide6 * kWide6) {  // Q6_K's order
              const uint8_t* p = wq + e / kWide6 * (kWide6 * 3 / 4);
              const int64_t blk = e % kWide6 / kBlock, j = e % kBlock;
              const uint8_t byte = p[(blk & 1) * 32 + j];
              q = (blk < 2 ? byte & 0x0F : byte >> 4) | ((p[64 + j] >> (2 * blk)) & 3) << 4;
            } else {
              const int64_t b = e / kBlock, j = e % kBlock;
              const uint8_t* block = wq + b * kBlock * 3 / 4;
              const uint8_t byte = block[j & 15];
              q = (j < 16 ? byte & 0x0F : byte >> 4) | ((block[16 + (j & 7)] >> (2 * (j / 8))) & 3) << 4;
            }
          } else if constexpr (BITS == 4) {
            const int64_t b = e / kBlock, j = e % kBlock;
            const uint8_t byte = wq[b * kBlock / 2 + (j & 15)];
            q = j < 16 ? (byte & 0x0F) : (byte >> 4);
          } else {
            q = wq[e];
          }
          s += q * xq.q[row * k + e];
        }
        acc += sc[g] * xq.d[row * blocks + g * GROUP / kBlock] * static_cast<float>(s);
      }
      part[r] = acc + off[r];
    }
    for (int r = 0; r < M; r += R) {
      float sum = part[r];
      for (int i = 1; i < R; ++i) sum += part[r + i];
      y[r / R * ldy + n] = static_cast<Y>(sum);
    }
#endif
  }
}

// The runs of a product (intdot_runs): run i multiplies activation rows [start[i], start[i + 1])
// by weight index[i] of a stack, whose weight e's codes are at codes + e * codes_stride and
// scales at `scales` moved by e * scales_stride
struct Runs {
  std::vector<int64_t> start, index;
  int64_t codes_stride, scales_stride;
};

// y in x's dtype: a bfloat16 output rounds each float32 sum once, as a cast after would. Every
// run's weight rows split the same way across ATen's threads, all in one parallel region (the
// rows of a run, one token's experts say, need no region of their own)
template <int BITS, int GROUP, int R, typename Y>
void run(const Quantized& xq, const Runs& runs, int64_t n, int64_t k, const uint8_t* codes,
         const Scales& scales, Y* y) {
  // grain: rows of W per task, about 16 KB of codes
  const int64_t grain = std::max<int64_t>(16, 16384 / std::max<int64_t>(1, k * BITS / 8));
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / grain));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * n / parts, n1 = (p + 1) * n / parts;
      for (size_t i = 0; i + 1 < runs.start.size(); ++i) {
        const int64_t e = runs.index[i];
        const Scales s{scales.scale + e * runs.scales_stride,
                       scales.offset + e * runs.scales_stride, scales.stride, scales.super};
        const uint8_t* c = codes + e * runs.codes_stride;
        // the run's virtual rows, R a row of y, in passes of 8 (kMaxRows), 4, 2 or 1 (the
        // part's weights stay in cache between passes; with R = 2 every pass is even)
        const int64_t first = R * runs.start[i], m = R * runs.start[i + 1];
        for (int64_t m0 = first; m0 < m;) {
          const int64_t left = m - m0;
          const int64_t rows = left >= kMaxRows ? kMaxRows : left >= 4 ? 4 : left >= 2 ? 2 : 1;
          Y* ym = y + m0 / R * n;
          switch (rows) {
#define ROWS(M)                                                                     \
  case M:                                                                           \
    if constexpr (M % R == 0) rows_kernel<BITS, GROUP, R, M, Y>(xq, m0, k, c, s, n0, n1, ym, n); \
    break;
            ROWS(1) ROWS(2) ROWS(4) ROWS(8)
#undef ROWS
          }
          m0 += rows;
        }
      }
    }
  });
}

}  // namespace

at::Tensor skyline::intdot_runs(const at::Tensor& x, const std::vector<int64_t>& start,
                                const std::vector<int64_t>& index, const at::Tensor& codes,
                                const at::Tensor& scale, const at::Tensor& offset, int64_t bits,
                                int64_t group, int64_t rounds) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "intdot_mm: x must be a contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "intdot_mm: x must be float32 or bfloat16");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "intdot_mm: bits must be 4, 6 or 8");
  TORCH_CHECK(group == 16 || group == 32, "intdot_mm: group must be 16 or 32");
  TORCH_CHECK(rounds == 1 || rounds == 2, "intdot_mm: rounds must be 1 or 2");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0 && k <= kMaxK, "intdot_mm: K must be a multiple of 32, at most 65536");
  // one weight [N, ...] or a stack of them [E, N, ...]
  const int64_t dims = codes.dim();
  TORCH_CHECK((dims == 2 || dims == 3) && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous() && codes.size(-1) == k * bits / 8,
              "intdot_mm: codes must be contiguous uint8 [N, K * bits / 8]");
  const int64_t n = codes.size(-2), stacked = dims == 3 ? codes.size(0) : 1;
  const bool super = scale.scalar_type() == at::kChar;
  TORCH_CHECK(scale.dim() == dims && scale.is_contiguous() && offset.is_contiguous() &&
                  scale.size(0) == codes.size(0) && scale.size(-2) == n &&
                  offset.sizes() == scale.sizes() && offset.scalar_type() == scale.scalar_type() &&
                  (super ? k % kSuper == 0 && scale.size(-1) == k / group + 4 * (k / kSuper)
                         : scale.scalar_type() == at::kHalf && scale.size(-1) == k / group),
              "intdot_mm: scale and offset must be contiguous float16 [N, K / group], or int8 "
              "[N, K / group + K / 64] with K a multiple of 256");
  TORCH_CHECK(!start.empty() && start.size() == index.size() + 1 && start.front() == 0 &&
                  start.back() == m,
              "intdot_runs: runs must cover x's rows");
  for (size_t i = 0; i < index.size(); ++i)
    TORCH_CHECK(start[i] <= start[i + 1] && index[i] >= 0 && index[i] < stacked,
                "intdot_runs: run ", i, " is out of order or its weight out of range");
  const bool pairs = bits == 4 && group == 32 && k % 64 == 0;
  Quantized xq = x.scalar_type() == at::kFloat
                     ? quantize(x.data_ptr<float>(), m, k, group, rounds, pairs)
                     : quantize(x.data_ptr<at::BFloat16>(), m, k, group, rounds, pairs);
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* c = codes.data_ptr<uint8_t>();
  const int64_t row_scales = scale.size(-1) * static_cast<int64_t>(scale.element_size());
  const Scales s{static_cast<const uint8_t*>(scale.data_ptr()),
                 static_cast<const uint8_t*>(offset.data_ptr()), row_scales, super};
  const Runs runs{start, index, n * codes.size(-1), n * row_scales};
  auto by_format = [&](auto* out, auto r) {
    using Y = std::remove_pointer_t<decltype(out)>;
    constexpr int R = decltype(r)::value;
    if (bits == 4 && group == 32) run<4, 32, R, Y>(xq, runs, n, k, c, s, out);
    else if (bits == 4) run<4, 16, R, Y>(xq, runs, n, k, c, s, out);
    else if (bits == 6 && group == 32) run<6, 32, R, Y>(xq, runs, n, k, c, s, out);
    else if (bits == 6) run<6, 16, R, Y>(xq, runs, n, k, c, s, out);
    else if (group == 32) run<8, 32, R, Y>(xq, runs, n, k, c, s, out);
    else run<8, 16, R, Y>(xq, runs, n, k, c, s, out);
  };
  auto dispatch = [&](auto* out) {
    if (rounds == 1) by_format(out, std::integral_constant<int, 1>());
    else by_format(out, std::integral_constant<int, 2>());
  };
  if (x.scalar_type() == at::kFloat) dispatch(y.data_ptr<float>());
  else dispatch(y.data_ptr<at::BFloat16>());
  return y;
}

at::Tensor skyline::intdot_mm(const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scale, const at::Tensor& offset, int64_t bits,
                              int64_t group, int64_t rounds) {
  TORCH_CHECK(codes.dim() == 2, "intdot_mm: codes must be contiguous uint8 [N, K * bits / 8]");
  return intdot_runs(x, {0, x.dim() == 2 ? x.size(0) : 0}, {0}, codes, scale, offset, bits,
                     group, rounds);
}

namespace {

// which path this build runs (for tests and benches)
std::string isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512_vnni";
#elif defined(__AVXVNNI__)
  return "avx_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(skyline_cpu, m) {
  m.def("intdot_mm(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits, int group, "
        "int rounds=2) -> Tensor");
  m.def("isa() -> str", isa);
}

TORCH_LIBRARY_IMPL(skyline_cpu, CPU, m) { m.impl("intdot_mm", skyline::intdot_mm); }
