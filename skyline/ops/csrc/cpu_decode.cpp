// A Llama decode step's layers on the CPU with no Python between operations
// (model/layers/cpu_decode.py holds the Python form, `run`, and the contract).
//
// The weight products are the kernels the Python form calls (torch's int4 kernel, the integer
// dot kernel); attention reads the paged cache in place; what lies between them (residual adds,
// RMSNorm, rotary, the KV write, SiLU-and-mul) is loops over bfloat16 or float32 rows (the
// activations' dtype, which the CPU plan picks) that round where the modules' ATen operations
// round, with float32 arithmetic in between: a batch-1 step of a small model spent more time
// dispatching those ~20 operations a layer than computing them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "skyline_cpu.h"

namespace {

using at::Tensor;

// products: kind 0 = torch's int4 kernel, one plane (packed, scales_and_zeros; param: group);
// kind 1 = the integer dot kernel (codes, scale, offset; params: bits, group, rounds); kind 2 =
// the bfloat16 kernel (the plain weight; bfloat16 x: cpu_bf16.cpp); kind 3 = no kernel (rows 0);
// batches of more rows than the kernel takes run the dense weight (oneDNN-packed or plain), as
// quant/gguf.py's _serve_cpu
constexpr int64_t kSpec = 7;  // ints a product takes in `spec`: kind, first tensor, a, b, c,
                              // rows, dense weight (-1: none)

// cpu_linear.packed_linear: oneDNN's product with the weight packed at load
Tensor packed_linear(const Tensor& x, const Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, c10::IValue(), c10::IValue("none"),
                                 c10::IValue(c10::List<std::optional<c10::Scalar>>()),
                                 c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

Tensor product(const Tensor& x, at::TensorList w, at::IntArrayRef spec, int64_t i) {
  const int64_t* s = spec.data() + i * kSpec;
  const int64_t kind = s[0], t = s[1], a = s[2], b = s[3], c = s[4], rows = s[5], dense = s[6];
  if (x.size(0) > rows) {
    TORCH_CHECK(dense >= 0, "decode_layers: more rows than a product without a dense weight takes");
    if (w[dense].is_mkldnn()) return packed_linear(x.contiguous(), w[dense]);
    // a plain bfloat16 weight: oneDNN packs none here, and ATen's bfloat16 product is slow
    if (w[dense].scalar_type() == at::kBFloat16) return skyline::bf16_wide_mm(x, w[dense]);
    return at::linear(x, w[dense]);
  }
  if (kind == 0) {  // through bfloat16, as cpu_int4.planes_linear
    if (x.scalar_type() == at::kBFloat16) return at::_weight_int4pack_mm_for_cpu(x, w[t], a, w[t + 1]);
    return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w[t], a, w[t + 1])
        .to(x.scalar_type());
  }
  if (kind == 2) return skyline::bf16_mm(x.contiguous(), w[t]);
  return skyline::intdot_mm(x.contiguous(), w[t], w[t + 1], w[t + 2], a, b, c);
}

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }
template <>
inline float f32(c10::BFloat16 v) {  // the upper half of a float: vectorizes
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e^x for x <= 0 in arithmetic the compiler vectorizes (libm's expf is a call a lane):
// x = n ln2 + r (Cody-Waite), e^r by its Taylor series to r^7 (|r| <= ln2 / 2: error < 2e-7
// relative), 2^n in the exponent bits; e^x = 0 below -87
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606820309417232e-6f;
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.f ? 0.f : p * two_n;
}

// q . k over d elements and acc += p v: in AVX-512 or AVX2 registers where the build has them
// (left to the compiler, the dot's lanes were summed one by one through memory)
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
  int64_t e = 0;
  if constexpr (!std::is_same_v<T, double>) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; e + 16 <= d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), load16(k + e), acc);
    s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; e + 16 <= d; e += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8(k + e), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), load8(k + e + 8), acc1);
    }
    s = skyline::hsum8(_mm256_add_ps(acc0, acc1));
#endif
  }
  for (; e < d; ++e) s += q[e] * f32(k[e]);
  return s;
}

template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d) {
  int64_t e = 0;
  if constexpr (!std::is_same_v<T, double>) {
#if defined(__AVX512F__)
    const __m512 pv = _mm512_set1_ps(p);
    for (; e + 16 <= d; e += 16)
      _mm512_storeu_ps(acc + e, _mm512_fmadd_ps(pv, load16(v + e), _mm512_loadu_ps(acc + e)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 pv = _mm256_set1_ps(p);
    for (; e + 8 <= d; e += 8)
      _mm256_storeu_ps(acc + e, _mm256_fmadd_ps(pv, load8(v + e), _mm256_loadu_ps(acc + e)));
#endif
  }
  for (; e < d; ++e) acc[e] += p * f32(v[e]);
}

// each of g rows of scores (stride apart, len long) to its softmax, in place
inline void softmax_rows(float* scores, int64_t g, int64_t stride, int64_t len) {
  for (int64_t i = 0; i < g; ++i) {
    float* sc = scores + i * stride;
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < len; ++t) top = sc[t] > top ? sc[t] : top;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) sum += (sc[t] = exp_nonpositive(sc[t] - top));
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
  }
}

#if defined(__AVX512F__)
// a . b over 64 elements as 16 lanes (four products' lanes summed in this order)
inline __m512 dot64_lanes(const __m512* a, __m512 b0, __m512 b1, __m512 b2, __m512 b3) {
  __m512 s = _mm512_fmadd_ps(a[0], b0, _mm512_setzero_ps());
  s = _mm512_fmadd_ps(a[1], b1, s);
  s = _mm512_fmadd_ps(a[2], b2, s);
  return _mm512_fmadd_ps(a[3], b3, s);
}

// The lane sums of 16 vectors as one, in _mm512_reduce_add_ps's order (128-bit quarters 0 + 2
// and 1 + 3, those two, then lanes 0 + 2 and 1 + 3 of the quarter, those two): pairs[j] holds
// vectors 2j and 2j + 1 after the first step (their quarters' sums, 0 + 2 and 1 + 3, side by
// side). Summing one vector alone costs a shuffle and an add per halving; summed together
// each shuffle serves several vectors.
inline __m512 pair_quarters(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

inline __m512 sum_lanes16(const __m512* pairs) {
  __m512 four[4];  // quarter k of four[j]: vector 4j + k's four partial sums
  for (int j = 0; j < 4; ++j) {
    const __m512 a = pairs[2 * j], b = pairs[2 * j + 1];
    four[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // within each quarter k: lanes 0 + 2 and 1 + 3 of vectors k and 4 + k, then of 8 + k, 12 + k
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_ps(four[0], four[1], 0x44),
                                  _mm512_shuffle_ps(four[0], four[1], 0xEE));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_ps(four[2], four[3], 0x44),
                                  _mm512_shuffle_ps(four[2], four[3], 0xEE));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(lo, hi, 0x88), _mm512_shuffle_ps(lo, hi, 0xDD));
  // lane 4k + l holds vector k + 4l's sum
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

// One sequence's cached rows of one KV head, block by block: block `blk` of its table holds
// tokens blk * bs ... (blk + 1) * bs - 1, token i of it K at k + (table[blk] * bs + i) * tok (V
// likewise), rows of 64 elements
template <typename T>
struct PagedRows {
  const T* k;
  const T* v;
  const int64_t* table;
  int64_t bs, tok;
  const T* k_block(int64_t blk) const { return k + table[blk] * bs * tok; }
  const T* v_block(int64_t blk) const { return v + table[blk] * bs * tok; }
};

// the cache lines of n rows of 64 elements, `stride` elements apart, requested ahead of use:
// a block's rows lie wherever the allocator put it, past what a hardware prefetcher predicts,
// and a decode step reads each layer's cache after the other layers' weights have left it cold
template <int HINT, typename T>
inline void prefetch_rows(const T* p, int64_t n, int64_t stride) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b < 64 * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + i * stride) + b,
                   static_cast<decltype(_MM_HINT_T0)>(HINT));
}

// 64-element heads with G <= 4 query heads a KV head (the default model's 9 / 3): each cached
// token's K and V rows loaded and widened once for all G heads, the queries and the values' sums
// held in registers, the scores of 16 tokens summed together (sum_lanes16), the cache walked a
// block at a time; the same operations in the same order as dot and axpy, so the same sums
template <int G, typename T>
void attend_d64(const float* qf, const PagedRows<T>& rows, int64_t len, float* scores,
                int64_t stride, float* out) {
  __m512 q[G][4];
  for (int i = 0; i < G; ++i)
    for (int e = 0; e < 4; ++e) q[i][e] = _mm512_loadu_ps(qf + i * 64 + e * 16);
  const int64_t bs = rows.bs, tok = rows.tok;
  // K two blocks ahead of its scores; V into L2 during the scores, then a block ahead of its sums
  for (int64_t b = 0; b < 2 && b * bs < len; ++b)
    prefetch_rows<_MM_HINT_T0>(rows.k_block(b), std::min(bs, len - b * bs), tok);
  for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, ++blk) {
    const T* kb = rows.k_block(blk);
    const int64_t n = std::min(bs, len - t0);
    if (t0 + 2 * bs < len)
      prefetch_rows<_MM_HINT_T0>(rows.k_block(blk + 2), std::min(bs, len - t0 - 2 * bs), tok);
    prefetch_rows<_MM_HINT_T1>(rows.v_block(blk), n, tok);  // for the values' pass
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {  // 16 tokens' scores a head at a time
      __m512 pairs[G][8];
      for (int j = 0; j < 8; ++j) {
        const T* ka = kb + (i + 2 * j) * tok;
        const T* kc = ka + tok;
        const __m512 a0 = load16(ka), a1 = load16(ka + 16), a2 = load16(ka + 32), a3 = load16(ka + 48);
        const __m512 c0 = load16(kc), c1 = load16(kc + 16), c2 = load16(kc + 32), c3 = load16(kc + 48);
        for (int h = 0; h < G; ++h)
          pairs[h][j] = pair_quarters(dot64_lanes(q[h], a0, a1, a2, a3), dot64_lanes(q[h], c0, c1, c2, c3));
      }
      for (int h = 0; h < G; ++h) _mm512_storeu_ps(scores + h * stride + t0 + i, sum_lanes16(pairs[h]));
    }
    for (; i < n; ++i) {
      const T* k = kb + i * tok;
      const __m512 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
      for (int h = 0; h < G; ++h)
        scores[h * stride + t0 + i] = _mm512_reduce_add_ps(dot64_lanes(q[h], k0, k1, k2, k3));
    }
  }
  softmax_rows(scores, G, stride, len);
  __m512 acc[G][4];
  for (int h = 0; h < G; ++h)
    for (int e = 0; e < 4; ++e) acc[h][e] = _mm512_setzero_ps();
  for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, ++blk) {
    const T* vb = rows.v_block(blk);
    const int64_t n = std::min(bs, len - t0);
    if (t0 + bs < len) prefetch_rows<_MM_HINT_T0>(rows.v_block(blk + 1), std::min(bs, len - t0 - bs), tok);
    for (int64_t i = 0; i < n; ++i) {
      const T* v = vb + i * tok;
      const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
      for (int h = 0; h < G; ++h) {
        const __m512 p = _mm512_set1_ps(scores[h * stride + t0 + i]);
        acc[h][0] = _mm512_fmadd_ps(p, v0, acc[h][0]);
        acc[h][1] = _mm512_fmadd_ps(p, v1, acc[h][1]);
        acc[h][2] = _mm512_fmadd_ps(p, v2, acc[h][2]);
        acc[h][3] = _mm512_fmadd_ps(p, v3, acc[h][3]);
      }
    }
  }
  for (int h = 0; h < G; ++h)
    for (int e = 0; e < 4; ++e) _mm512_storeu_ps(out + h * 64 + e * 16, acc[h][e]);
}
#endif

// One query token per sequence over its paged context, softmax in float32, read straight from
// the cache (ops/cpu_attention.py's decode_attention_cpu is the reference): for each sequence
// and KV head, the query heads that share it score every cached token, then sum the values.
template <typename T>
void attention_kernel(const T* q, int64_t q_row, const T* cache, const int64_t* blocks,
                      int64_t nblk, const int64_t* lens, int64_t b, int64_t h, int64_t kvh,
                      int64_t d, int64_t nb, int64_t bs, float scale, T* out) {
  const int64_t g = h / kvh;
  const int64_t tok = kvh * d;                  // a cached token's elements, per K or V
  const int64_t v_off = nb * bs * tok;          // V follows K in the cache
  int64_t longest = 0;
  for (int64_t s = 0; s < b; ++s) longest = std::max(longest, lens[s]);
  const int64_t work = b * kvh;
  const bool pow2 = (bs & (bs - 1)) == 0;
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(bs));
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, longest * d * g));
  at::parallel_for(0, work, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(g * longest), acc(g * d), qf(g * d);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t s = w / kvh, j = w % kvh, len = lens[s];
      // token t's K in the cache (a shift and a mask where the block size is a power of two,
      // as it is by default: an integer division a token costs more than its dot products)
      const int64_t* table = blocks + s * nblk;
      auto token = [&](int64_t t) {
        const int64_t blk = pow2 ? t >> shift : t / bs, off = pow2 ? t & (bs - 1) : t % bs;
        return cache + (table[blk] * bs + off) * tok;
      };
      for (int64_t i = 0; i < g; ++i)
        for (int64_t e = 0; e < d; ++e) qf[i * d + e] = f32(q[s * q_row + (j * g + i) * d + e]) * scale;
      auto key = [&](int64_t t) { return token(t) + j * d; };
      auto value = [&](int64_t t) { return token(t) + v_off + j * d; };
      bool fast = false;
#if defined(__AVX512F__)
      if constexpr (!std::is_same_v<T, double>) {
        fast = d == 64 && g <= 4;
        const PagedRows<T> rows{cache + j * d, cache + v_off + j * d, table, bs, tok};
        switch (fast ? g : 0) {
#define G_CASE(G) \
  case G: attend_d64<G, T>(qf.data(), rows, len, scores.data(), longest, acc.data()); break;
          G_CASE(1) G_CASE(2) G_CASE(3) G_CASE(4)
#undef G_CASE
          default: break;
        }
      }
#endif
      if (!fast) {
        for (int64_t t = 0; t < len; ++t) {
          const T* k = key(t);
          for (int64_t i = 0; i < g; ++i) scores[i * longest + t] = dot(qf.data() + i * d, k, d);
        }
        softmax_rows(scores.data(), g, longest, len);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const T* v = value(t);
          for (int64_t i = 0; i < g; ++i) axpy(scores[i * longest + t], v, acc.data() + i * d, d);
        }
      }
      for (int64_t i = 0; i < g; ++i)
        for (int64_t e = 0; e < d; ++e) out[(s * h + j * g + i) * d + e] = static_cast<T>(acc[i * d + e]);
    }
  });
}

}  // namespace

// q [B, H, D] (rows may be strided), kv_cache [2, NB, BS, KVH, D] of q's dtype, blocks [B * nblk]
// (each sequence's block table), lens [B] -> [B, H, D]
Tensor skyline::decode_attention(const Tensor& q, const Tensor& kv_cache, const Tensor& blocks,
                                 const Tensor& lens, double scale) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(4) == d &&
                  kv_cache.scalar_type() == q.scalar_type() && h % kv_cache.size(3) == 0,
              "decode_attention: kv_cache must be a contiguous [2, NB, BS, KVH, D] of q's dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d, "decode_attention: q's heads must be rows");
  const Tensor bl = blocks.to(at::kLong).contiguous(), ln = lens.to(at::kLong).contiguous();
  TORCH_CHECK(ln.numel() == b && b > 0 && bl.numel() % b == 0, "decode_attention: one length "
              "and one block table row a sequence");
  Tensor out = at::empty({b, h, d}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), kv_cache.data_ptr<scalar_t>(),
                               bl.data_ptr<int64_t>(), bl.numel() / b, ln.data_ptr<int64_t>(), b,
                               h, kv_cache.size(3), d, kv_cache.size(1), kv_cache.size(2),
                               static_cast<float>(scale), out.data_ptr<scalar_t>());
  });
  return out;
}

namespace {

using BF16 = c10::BFloat16;

// float -> bfloat16 to nearest even, as c10's conversion (NaN kept a NaN), in arithmetic the
// compiler vectorizes
inline BF16 bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;  // integer compares keep the loop vector
  return BF16(static_cast<uint16_t>(nan ? 0x7fc0u : r), BF16::from_bits());
}

// a float32 result rounded to the activations' dtype (float32: as it is)
template <typename T>
inline T rnd(float v);
template <>
inline BF16 rnd<BF16>(float v) { return bf16(v); }
template <>
inline float rnd<float>(float v) { return v; }

// residual += x (skipped for the first layer, whose residual is x), then out = the residual's
// RMSNorm times the weight: ops/norm.py's rms_norm_cpu rounds x / rms to the activations'
// dtype, then its product with the weight
template <typename T>
void add_rms_norm(const T* x, T* res, bool add, const T* w, float eps, int64_t t, int64_t d,
                  T* out) {
  for (int64_t r = 0; r < t; ++r) {
    T* rr = res + r * d;
    if (add) {
      const T* xr = x + r * d;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) rr[e] = rnd<T>(f32(xr[e]) + f32(rr[e]));
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t e = 0; e < d; ++e) ss += f32(rr[e]) * f32(rr[e]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    T* o = out + r * d;
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) o[e] = rnd<T>(f32(rnd<T>(f32(rr[e]) * inv)) * f32(w[e]));
  }
}

// ops/rotary.py's rotary_cpu in place on each of the `rows` heads of d elements at `x` (q and
// k of a token, neighbours): x * cos2 rounded, plus roll(x, d / 2) * sin2 in float32, rounded
template <typename T>
void rotary(T* x, int64_t rows, int64_t d, const T* cos2, const T* sin2) {
  float row[512];
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * d;
    for (int64_t e = 0; e < d; ++e) row[e] = f32(xr[e]);
    // the two halves apart (rolled: the other half), so that each loop vectorizes
#pragma omp simd
    for (int64_t e = 0; e < half; ++e)
      xr[e] = rnd<T>(f32(rnd<T>(row[e] * f32(cos2[e]))) + row[e + half] * f32(sin2[e]));
#pragma omp simd
    for (int64_t e = half; e < d; ++e)
      xr[e] = rnd<T>(f32(rnd<T>(row[e] * f32(cos2[e]))) + row[e - half] * f32(sin2[e]));
  }
}

// ops/kv_write.py's write_kv: token i's K and V heads (neighbours at kv) into slot slots[i] of
// a [2, NB, BS, KVH, D] cache
template <typename T>
void write_kv(const T* kv, int64_t row, int64_t t, int64_t tok, const int64_t* slots, T* cache,
              int64_t v_off) {
  for (int64_t i = 0; i < t; ++i) {
    if (slots[i] < 0) continue;
    std::memcpy(cache + slots[i] * tok, kv + i * row, tok * sizeof(T));
    std::memcpy(cache + v_off + slots[i] * tok, kv + i * row + tok, tok * sizeof(T));
  }
}

// SiLU(gate) rounded, times up, rounded: [t, 2n] -> [t, n]
// (rows split across threads where there are several thousand elements each)
template <typename T>
void silu_mul(const T* __restrict gate_up, int64_t t, int64_t n, T* __restrict out) {
  at::parallel_for(0, t, std::max<int64_t>(1, 8192 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
#pragma omp simd
      for (int64_t e = 0; e < n; ++e) {
        const float v = f32(g[e]);
        const float z = exp_nonpositive(-std::fabs(v));  // e^-|v|: sigmoid without overflow
        o[e] = rnd<T>(f32(rnd<T>(v * ((v >= 0.f ? 1.f : z) / (1.f + z)))) * f32(u[e]));
      }
    }
  });
}

// A layer's entry in `layer_spec` (kLayer ints): the indices of its input and post-attention
// norms in `norms` / `eps`, of its q and k norms (Qwen3; -1: none), of its first product in
// `spec` (qkv, o, then gate_up and down for a dense MLP), and of its router's weight in `w`
// (-1: a dense MLP); for an MoE MLP the router's top-k and whether it renormalizes, then the
// experts' six stacked tensors in `w` (gate-and-up codes, scale, offset, then down's) from
// the given index, their bits and groups (gate-and-up, down) and rounds
constexpr int64_t kLayer = 14;

// the router's softmax over all experts, its top k and (renorm) those scaled to sum to 1, as
// ops/moe_route.py's route_ref (the same ATen operations: a handful a layer, not loops)
std::tuple<Tensor, Tensor> route(const Tensor& logits, int64_t k, bool renorm) {
  auto [weights, ids] = at::topk(at::softmax(logits.to(at::kFloat), -1), k, -1);
  if (renorm) weights = weights / weights.sum(-1, true);
  return {weights, ids};
}

// x [T, hidden] (bfloat16 or float32, as every other activation operand) through every layer ->
// (the last MLP's output, the residual)
template <typename T>
std::tuple<Tensor, Tensor> layers_kernel(
    Tensor x, const Tensor& c2, const Tensor& s2, at::TensorList norms, at::ArrayRef<double> eps,
    at::TensorList w, at::IntArrayRef spec, at::IntArrayRef layer_spec, at::TensorList kv_caches,
    const Tensor& blocks, const Tensor& lens, const Tensor& sl, int64_t h, int64_t kvh, int64_t d,
    double scale) {
  const int64_t t = x.size(0), layers = kv_caches.size();
  const int64_t hidden = x.size(1), row = (h + 2 * kvh) * d, tok = kvh * d;
  Tensor residual = x.clone(at::MemoryFormat::Contiguous), normed = at::empty_like(residual);
  T* res = residual.data_ptr<T>();
  T* nrm = normed.data_ptr<T>();
  auto norm_of = [&](int64_t i) {
    TORCH_CHECK(norms[i].scalar_type() == x.scalar_type() && norms[i].is_contiguous(),
                "decode_layers: contiguous norm weights of x's dtype");
    return std::make_pair(norms[i].data_ptr<T>(), static_cast<float>(eps[i]));
  };
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* ls = layer_spec.data() + l * kLayer;
    const int64_t first = ls[4];
    const Tensor& cache = kv_caches[l];
    TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.scalar_type() == x.scalar_type(),
                "decode_layers: a contiguous [2, NB, BS, KVH, D] cache a layer, of x's dtype");
    auto [w_in, e_in] = norm_of(ls[0]);
    add_rms_norm<T>(x.data_ptr<T>(), res, l > 0, w_in, e_in, t, hidden, nrm);
    const Tensor qkv = product(normed, w, spec, first).contiguous();
    T* p = qkv.data_ptr<T>();
    if (ls[2] >= 0) {  // Qwen3: each head of q and of k RMS-normed (its own weight), then rotated
      auto [wq, eq] = norm_of(ls[2]);
      auto [wk, ek] = norm_of(ls[3]);
      for (int64_t i = 0; i < t; ++i) {
        add_rms_norm<T>(nullptr, p + i * row, false, wq, eq, h, d, p + i * row);
        add_rms_norm<T>(nullptr, p + i * row + h * d, false, wk, ek, kvh, d, p + i * row + h * d);
      }
    }
    for (int64_t i = 0; i < t; ++i)
      rotary<T>(p + i * row, h + kvh, d, c2.data_ptr<T>() + i * d, s2.data_ptr<T>() + i * d);
    write_kv<T>(p + h * d, row, t, tok, sl.data_ptr<int64_t>(), cache.data_ptr<T>(),
                cache.size(1) * cache.size(2) * tok);
    const Tensor q = qkv.view({t, h + 2 * kvh, d}).slice(1, 0, h);
    const Tensor o = skyline::decode_attention(q, cache, blocks, lens, scale);
    const Tensor attn_out = product(o.view({t, h * d}), w, spec, first + 1).contiguous();
    auto [w_post, e_post] = norm_of(ls[1]);
    add_rms_norm<T>(attn_out.data_ptr<T>(), res, true, w_post, e_post, t, hidden, nrm);
    if (ls[5] >= 0) {  // an MoE MLP: the router, then the experts on the integer dot kernel
      auto [weights, ids] = route(at::linear(normed, w[ls[5]]), ls[6], ls[7] != 0);
      const int64_t e = ls[8];
      x = skyline::moe_intdot(normed, weights, ids, w[e], w[e + 1], w[e + 2], ls[9], ls[10],
                              w[e + 3], w[e + 4], w[e + 5], ls[11], ls[12], ls[13]);
      continue;
    }
    const Tensor gate_up = product(normed, w, spec, first + 2).contiguous();
    const int64_t n = gate_up.size(1) / 2;
    Tensor act = at::empty({t, n}, x.options());
    silu_mul<T>(gate_up.data_ptr<T>(), t, n, act.data_ptr<T>());
    x = product(act, w, spec, first + 3).contiguous();
  }
  return {x, residual};
}

std::tuple<Tensor, Tensor> decode_layers(
    Tensor x, const Tensor& cos2, const Tensor& sin2, at::TensorList norms, at::ArrayRef<double> eps,
    at::TensorList w, at::IntArrayRef spec, at::IntArrayRef layer_spec, at::TensorList kv_caches,
    const Tensor& blocks, const Tensor& lens, const Tensor& slots, int64_t h, int64_t kvh,
    int64_t d, double scale) {
  const int64_t t = x.size(0), layers = kv_caches.size();
  TORCH_CHECK(layer_spec.size() == kLayer * layers && norms.size() == eps.size(),
              "decode_layers: one layer_spec entry a layer, one eps a norm");
  for (int64_t l = 0; l < layers; ++l) {  // every index in range, once, before any work
    const int64_t* ls = layer_spec.data() + l * kLayer;
    const int64_t products = ls[5] >= 0 ? 2 : 4, nn = norms.size(), nw = w.size();
    bool ok = ls[0] >= 0 && ls[0] < nn && ls[1] >= 0 && ls[1] < nn && ls[2] < nn &&
              (ls[2] < 0 || (ls[3] >= 0 && ls[3] < nn)) && ls[4] >= 0 &&
              (ls[4] + products) * kSpec <= static_cast<int64_t>(spec.size());
    if (ls[5] >= 0) ok = ok && ls[5] < nw && ls[6] > 0 && ls[8] >= 0 && ls[8] + 6 <= nw;
    TORCH_CHECK(ok, "decode_layers: layer ", l, "'s entry points past its arguments");
  }
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && cos2.scalar_type() == dt &&
                  sin2.scalar_type() == dt && x.dim() == 2 && d <= 512,
              "decode_layers: bfloat16 or float32 activations, rotary operands of their dtype, "
              "head_dim <= 512");
  const Tensor c2 = cos2.reshape({t, d}).contiguous(), s2 = sin2.reshape({t, d}).contiguous();
  const Tensor sl = slots.to(at::kLong).contiguous();
  if (dt == at::kFloat)
    return layers_kernel<float>(x, c2, s2, norms, eps, w, spec, layer_spec, kv_caches, blocks,
                                lens, sl, h, kvh, d, scale);
  return layers_kernel<BF16>(x, c2, s2, norms, eps, w, spec, layer_spec, kv_caches, blocks, lens,
                             sl, h, kvh, d, scale);
}

// ops/cpu_linear.py's recompute_near_top_ref: in each row of logits [n, V] (float32), the entries
// within margin + |top| * rel of the row's maximum recomputed as x [n, K] . weight [V, K] in
// float32, in place; nothing changes where the rows hold more than limit a row on average
template <typename T, typename W>
void near_top(float* logits, int64_t n, int64_t v, const T* x, const W* weight, int64_t k,
              double margin, double rel, int64_t limit) {
  std::vector<float> floor(n);
  std::vector<int64_t> count(n);
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {  // rows apart: each a scan of V
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = logits + r * v;
      float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
      for (int64_t j = 0; j < v; ++j) top = row[j] > top ? row[j] : top;
      const float f = top - static_cast<float>(margin + std::fabs(top) * rel);
      int64_t c = 0;
#pragma omp simd reduction(+ : c)
      for (int64_t j = 0; j < v; ++j) c += row[j] >= f;
      floor[r] = f;
      count[r] = c;
    }
  });
  int64_t total = 0;
  for (int64_t c : count) total += c;
  if (total > limit * n) return;
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> xf(k);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t e = 0; e < k; ++e) xf[e] = f32(x[r * k + e]);
      float* row = logits + r * v;
      for (int64_t j = 0; j < v; ++j)
        if (row[j] >= floor[r]) row[j] = dot(xf.data(), weight + j * k, k);
    }
  });
}

void near_top_(Tensor& logits, const Tensor& x, const Tensor& weight, double margin, double rel,
               int64_t limit) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  x.dim() == 2 && x.is_contiguous() && x.size(0) == logits.size(0) &&
                  weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1) &&
                  weight.size(0) == logits.size(1),
              "near_top_: float32 logits [n, V], x [n, K], weight [V, K], all contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "near_top_x", [&] {
    using X = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, weight.scalar_type(), "near_top_w", [&] {
      near_top(logits.data_ptr<float>(), logits.size(0), logits.size(1), x.data_ptr<X>(),
               weight.data_ptr<scalar_t>(), x.size(1), margin, rel, limit);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(skyline_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor cos2, Tensor sin2, Tensor[] norms, float[] eps, "
        "Tensor[] w, int[] spec, int[] layer_spec, Tensor[] kv_caches, Tensor blocks, "
        "Tensor lens, Tensor slots, int h, int kvh, int d, float scale) -> (Tensor, Tensor)");
  m.def("decode_attention(Tensor q, Tensor kv_cache, Tensor blocks, Tensor lens, float scale) "
        "-> Tensor");
  m.def("near_top_(Tensor(a!) logits, Tensor x, Tensor weight, float margin, float rel, int limit) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(skyline_cpu, CPU, m) {
  m.impl("decode_layers", decode_layers);
  m.impl("decode_attention", skyline::decode_attention);
  m.impl("near_top_", near_top_);
}

// the weights may include oneDNN-packed tensors (dense weights for batches of many rows), which
// route the call by their backend
TORCH_LIBRARY_IMPL(skyline_cpu, MkldnnCPU, m) { m.impl("decode_layers", decode_layers); }
