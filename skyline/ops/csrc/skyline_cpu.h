// The C++ functions one file of the build (ops/csrc) gives the others.
#pragma once

#include <ATen/core/Tensor.h>

namespace skyline {

// y [M, N] = x [M, K] (float32 or bfloat16, rounded to int8 per 32) times W^T, W = codes *
// scale + offset per group (ops/cpu_intdot.py's intdot_mm_ref), in x's dtype
at::Tensor intdot_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& offset, int64_t bits, int64_t group);

// one query token per sequence over its paged KV cache (cpu_decode.cpp)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& blocks, const at::Tensor& lens, double scale);

}  // namespace skyline
