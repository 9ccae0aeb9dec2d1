// The C++ functions one file of the build (ops/csrc) gives the others.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace skyline {

#if defined(__AVX2__)
// the sum of an AVX register's 8 float lanes
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y [M, N] = x [M, K] (float32 or bfloat16, rounded to int8 per 32, `rounds` times) times W^T,
// W = codes * scale + offset per group (ops/cpu_intdot.py's intdot_mm_ref), in x's dtype
at::Tensor intdot_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& offset, int64_t bits, int64_t group, int64_t rounds);

// intdot_mm's product for runs of x's rows, each with its own weight of a stack: rows
// [start[i], start[i + 1]) of x [M, K] and y [M, N] by weight index[i] of codes [E, N, bytes]
// (scale and offset [E, N, ...]; or one weight, [N, ...]), every run in one parallel region
at::Tensor intdot_runs(const at::Tensor& x, const std::vector<int64_t>& start,
                       const std::vector<int64_t>& index, const at::Tensor& codes,
                       const at::Tensor& scale, const at::Tensor& offset, int64_t bits,
                       int64_t group, int64_t rounds);

// y [M, N] = x [M, K] times W^T, x and W [N, K] bfloat16, sums in float32 (cpu_bf16.cpp;
// ops/cpu_bf16.py's bf16_mm_ref)
at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& weight);

// the same product for batches of many rows where the CPU has no bfloat16 GEMM (AVX2): float32
// GEMMs over W converted a slab of rows at a time, the result rounded once to x's dtype
// (cpu_bf16.cpp; ops/cpu_bf16.py's bf16_wide_mm)
at::Tensor bf16_wide_mm(const at::Tensor& x, const at::Tensor& weight);

// one query token per sequence over its paged KV cache (cpu_decode.cpp)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& blocks, const at::Tensor& lens, double scale);

// an MoE MLP of SwiGLU experts on the integer dot kernel (cpu_moe.cpp; ops/cpu_moe.py's
// moe_intdot_ref): x [T, H] through each token's top-k experts (local ids, -1: held elsewhere)
at::Tensor moe_intdot(const at::Tensor& x, const at::Tensor& topk_weights,
                      const at::Tensor& local_ids, const at::Tensor& w13_codes,
                      const at::Tensor& w13_scale, const at::Tensor& w13_offset, int64_t w13_bits,
                      int64_t w13_group, const at::Tensor& w2_codes, const at::Tensor& w2_scale,
                      const at::Tensor& w2_offset, int64_t w2_bits, int64_t w2_group,
                      int64_t rounds);

}  // namespace skyline
