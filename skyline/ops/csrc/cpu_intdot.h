// The integer dot-product kernel (cpu_intdot.cpp) for the other CPU operations of the build.
#pragma once

#include <ATen/core/Tensor.h>

namespace skyline {

// y [M, N] = x [M, K] (float32 or bfloat16, rounded to int8 per 32) times W^T, W = codes *
// scale + offset per group (ops/cpu_intdot.py's intdot_mm_ref), in x's dtype
at::Tensor intdot_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& offset, int64_t bits, int64_t group);

}  // namespace skyline
