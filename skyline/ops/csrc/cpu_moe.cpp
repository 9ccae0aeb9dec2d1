// A mixture-of-experts MLP on the integer dot kernel (cpu_intdot.cpp) with no Python between
// experts: ops/cpu_moe.py's moe_intdot_ref is the contract, computed bit for bit (its ATen
// operations, or loops that give their values: row copies, float32 products): the (token, expert)
// pairs grouped by expert, each expert that has pairs run once on its tokens' rows
// (gate and up, SiLU(gate) * up in the activations' dtype, down), each pair's output scaled by
// its routing weight in float32 and each token's k outputs summed. The experts' gate-and-up
// products are one parallel region (intdot_runs), their down products another, so the threads
// meet twice a layer, not twice an expert.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "skyline_cpu.h"

namespace {

// out[p] = float(y[i]) * w[p] for the i-th pair p of `list`
template <typename T>
void scale_rows(const T* y, const std::vector<int64_t>& list, const float* w, int64_t h,
                float* out) {
  for (size_t i = 0; i < list.size(); ++i) {
    const float wp = w[list[i]];
    const T* yr = y + static_cast<int64_t>(i) * h;
    float* o = out + list[i] * h;
    for (int64_t j = 0; j < h; ++j) o[j] = static_cast<float>(yr[j]) * wp;
  }
}

}  // namespace

at::Tensor skyline::moe_intdot(const at::Tensor& x, const at::Tensor& topk_weights,
                               const at::Tensor& local_ids, const at::Tensor& w13_codes,
                               const at::Tensor& w13_scale, const at::Tensor& w13_offset,
                               int64_t w13_bits, int64_t w13_group, const at::Tensor& w2_codes,
                               const at::Tensor& w2_scale, const at::Tensor& w2_offset,
                               int64_t w2_bits, int64_t w2_group, int64_t rounds) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_intdot: x must be a contiguous [T, H]");
  TORCH_CHECK(local_ids.dim() == 2 && local_ids.scalar_type() == at::kLong &&
                  local_ids.size(0) == x.size(0) && topk_weights.sizes() == local_ids.sizes(),
              "moe_intdot: topk_weights and local_ids must be [T, k], ids int64");
  TORCH_CHECK(w13_codes.dim() == 3 && w2_codes.dim() == 3 &&
                  w13_codes.size(0) == w2_codes.size(0) && w13_codes.size(1) % 2 == 0 &&
                  w2_codes.size(1) == x.size(1),
              "moe_intdot: codes must be stacked [E, 2I, bytes] and [E, H, bytes]");
  const int64_t t = x.size(0), top_k = local_ids.size(1), h = x.size(1);
  const int64_t experts = w13_codes.size(0), inter = w13_codes.size(1) / 2;
  const at::Tensor ids = local_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  // pairs p = token * k + j by expert, in order of p (a stable sort's); -1: held elsewhere
  std::vector<std::vector<int64_t>> pairs(experts);
  for (int64_t p = 0; p < t * top_k; ++p) {
    TORCH_CHECK(id[p] < experts, "moe_intdot: expert id ", id[p], " of ", experts);
    if (id[p] >= 0) pairs[id[p]].push_back(p);
  }
  // the pairs' token rows by expert, each expert's a run of the two products (one parallel
  // region each for all the experts a step routes to)
  std::vector<int64_t> start{0}, index, order;
  for (int64_t e = 0; e < experts; ++e) {
    if (pairs[e].empty()) continue;
    order.insert(order.end(), pairs[e].begin(), pairs[e].end());
    start.push_back(static_cast<int64_t>(order.size()));
    index.push_back(e);
  }
  const int64_t n = static_cast<int64_t>(order.size());
  const at::Tensor weights = topk_weights.reshape({-1}).to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({t * top_k, h}, x.options().dtype(at::kFloat));
  if (n == 0) return out.view({t, top_k, h}).sum(1).to(x.scalar_type());
  at::Tensor rows = at::empty({n, h}, x.options());
  const int64_t row_bytes = h * static_cast<int64_t>(x.element_size());
  auto* dst = static_cast<char*>(rows.data_ptr());
  const auto* src = static_cast<const char*>(x.data_ptr());
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * row_bytes, src + (order[i] / top_k) * row_bytes, row_bytes);
  const at::Tensor gu =
      skyline::intdot_runs(rows, start, index, w13_codes, w13_scale, w13_offset, w13_bits,
                           w13_group, rounds);
  const at::Tensor act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
  const at::Tensor y = skyline::intdot_runs(act, start, index, w2_codes, w2_scale, w2_offset,
                                            w2_bits, w2_group, rounds);
  // out[p] = float(y) * weight[p]: one float32 product an element, as ATen's mul rounds it
  const float* w = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  if (y.scalar_type() == at::kFloat) scale_rows(y.data_ptr<float>(), order, w, h, o);
  else scale_rows(y.data_ptr<at::BFloat16>(), order, w, h, o);
  return out.view({t, top_k, h}).sum(1).to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(skyline_cpu, m) {
  m.def("moe_intdot(Tensor x, Tensor topk_weights, Tensor local_ids, Tensor w13_codes, "
        "Tensor w13_scale, Tensor w13_offset, int w13_bits, int w13_group, Tensor w2_codes, "
        "Tensor w2_scale, Tensor w2_offset, int w2_bits, int w2_group, int rounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(skyline_cpu, CPU, m) { m.impl("moe_intdot", skyline::moe_intdot); }
