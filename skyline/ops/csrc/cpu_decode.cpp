// A Llama decode step's layers on the CPU with no Python between operations
// (model/layers/cpu_decode.py holds the Python form, `run`, and the contract).
//
// Each operation is the ATen operation `run` dispatches from Python, with the same arguments in
// the same order, so the results are the same bit for bit; only the interpreter between them
// is gone (a batch-1 step of a small model dispatches ~30 operations a layer, each a few
// microseconds of Python around under a microsecond of work).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "skyline_cpu.h"

namespace {

using at::Tensor;

// products: kind 0 = torch's int4 kernel, one plane (packed, scales_and_zeros; param: group);
// kind 1 = the integer dot kernel (codes, scale, offset; params: bits, group)
constexpr int64_t kSpec = 4;  // ints a product takes in `spec`: kind, first tensor, a, b

Tensor product(const Tensor& x, at::TensorList w, at::IntArrayRef spec, int64_t i) {
  const int64_t kind = spec[i * kSpec], t = spec[i * kSpec + 1];
  const int64_t a = spec[i * kSpec + 2], b = spec[i * kSpec + 3];
  if (kind == 0) return at::_weight_int4pack_mm_for_cpu(x, w[t], a, w[t + 1]);
  return skyline::intdot_mm(x.contiguous(), w[t], w[t + 1], w[t + 2], a, b);
}

// ops/norm.py's rms_norm_cpu: LayerNorm of [x, -x], its first half times the weight
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const int64_t d = x.size(-1);
  const Tensor normed = at::layer_norm(at::cat({x, x.neg()}, -1), {2 * d}, {}, {}, eps);
  return normed.slice(-1, 0, d) * weight;
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

// q . k over d elements and acc += p v: in AVX-512 registers where the build has them (left to
// the compiler, the dot's lanes were summed one by one through memory)
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
  int64_t e = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    __m512 acc = _mm512_setzero_ps();
    for (; e + 16 <= d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), load16(k + e), acc);
    s = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; e < d; ++e) s += q[e] * f32(k[e]);
  return s;
}

template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d) {
  int64_t e = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    const __m512 pv = _mm512_set1_ps(p);
    for (; e + 16 <= d; e += 16)
      _mm512_storeu_ps(acc + e, _mm512_fmadd_ps(pv, load16(v + e), _mm512_loadu_ps(acc + e)));
  }
#endif
  for (; e < d; ++e) acc[e] += p * f32(v[e]);
}

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
      for (int64_t t = 0; t < len; ++t) {
        const T* k = token(t) + j * d;
        for (int64_t i = 0; i < g; ++i) scores[i * longest + t] = dot(qf.data() + i * d, k, d);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < g; ++i) {
        float* sc = scores.data() + i * longest;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) top = std::max(top, sc[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) sum += (sc[t] = exp_nonpositive(sc[t] - top));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
      }
      for (int64_t t = 0; t < len; ++t) {
        const T* v = token(t) + v_off + j * d;
        for (int64_t i = 0; i < g; ++i) {
          axpy(scores[i * longest + t], v, acc.data() + i * d, d);
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

// ops/kv_write.py's write_kv of k and v, neighbouring views of one projection
void write_kv(const Tensor& k, const Tensor& kv_cache, const Tensor& slots) {
  const int64_t t = k.size(0), kvh = k.size(1), d = k.size(2);
  const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2);
  const Tensor pair = k.as_strided({2, t, kvh, d}, {kvh * d, k.stride(0), k.stride(1), k.stride(2)});
  kv_cache.view({2, nb * bs, kvh, d}).index_copy_(1, slots, pair);
}

// x [T, hidden] through every layer -> (the last MLP's output, the residual)
std::tuple<Tensor, Tensor> decode_layers(
    Tensor x, const Tensor& cos2, const Tensor& sin2, at::TensorList norms, at::ArrayRef<double> eps,
    at::TensorList w, at::IntArrayRef spec, at::TensorList kv_caches, const Tensor& blocks,
    const Tensor& lens, const Tensor& slots, int64_t h, int64_t kvh, int64_t d, double scale) {
  const int64_t t = x.size(0), layers = kv_caches.size();
  TORCH_CHECK(norms.size() == 2 * layers && eps.size() == 2 * layers &&
                  spec.size() == 4 * kSpec * layers,
              "decode_layers: one input and one post-attention norm and four products a layer");
  Tensor residual;
  for (int64_t l = 0; l < layers; ++l) {
    residual = l == 0 ? x : x + residual;
    const Tensor qkv = product(rms_norm(residual, norms[2 * l], eps[2 * l]), w, spec, 4 * l)
                           .view({t, h + 2 * kvh, d});
    const Tensor q = qkv.slice(1, 0, h), k = qkv.slice(1, h, h + kvh);
    // rotary in place on q and k together (k still neighbours v)
    Tensor qk = q.as_strided({t, h + kvh, d}, q.strides());
    at::addcmul_out(qk, qk * cos2, qk.roll({d / 2}, {-1}), sin2);
    write_kv(k, kv_caches[l], slots);
    const Tensor o = skyline::decode_attention(q, kv_caches[l], blocks, lens, scale);
    residual = product(o.view({t, h * d}), w, spec, 4 * l + 1) + residual;
    const Tensor gate_up = product(rms_norm(residual, norms[2 * l + 1], eps[2 * l + 1]), w, spec,
                                   4 * l + 2);
    const auto halves = gate_up.chunk(2, -1);
    x = product(at::silu(halves[0]) * halves[1], w, spec, 4 * l + 3);
  }
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(skyline_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor cos2, Tensor sin2, Tensor[] norms, float[] eps, "
        "Tensor[] w, int[] spec, Tensor[] kv_caches, Tensor blocks, Tensor lens, Tensor slots, "
        "int h, int kvh, int d, float scale) -> (Tensor, Tensor)");
  m.def("decode_attention(Tensor q, Tensor kv_cache, Tensor blocks, Tensor lens, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(skyline_cpu, CPU, m) {
  m.impl("decode_layers", decode_layers);
  m.impl("decode_attention", skyline::decode_attention);
}
