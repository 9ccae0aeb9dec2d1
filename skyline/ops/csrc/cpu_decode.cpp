// A Llama decode step's layers on the CPU with no Python between operations
// (model/layers/cpu_decode.py holds the Python form, `run`, and the contract).
//
// Each operation is the ATen operation `run` dispatches from Python, with the same arguments in
// the same order, so the results are the same bit for bit; only the interpreter between them
// is gone (a batch-1 step of a small model dispatches ~30 operations a layer, each a few
// microseconds of Python around under a microsecond of work).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_intdot.h"

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

// ops/cpu_attention.py's decode_attention_cpu (unscaled cache)
Tensor attention(const Tensor& q, const Tensor& kv_cache, const Tensor& blocks, int64_t max_len,
                 const std::optional<Tensor>& valid, double scale) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3);
  Tensor kv = kv_cache.view({2, nb, bs * kvh * d}).index_select(1, blocks);
  kv = kv.view({2, b, -1, kvh, d}).slice(2, 0, max_len).permute({0, 1, 3, 2, 4});
  kv = kv.to(at::kFloat, false, false, at::MemoryFormat::Contiguous);
  std::optional<Tensor> mask;
  if (valid.has_value()) {
    kv = kv.masked_fill(valid->bitwise_not().view({1, b, 1, max_len, 1}), 0);
    mask = valid->view({b, 1, 1, max_len});
  }
  const Tensor qg = q.to(at::kFloat).view({b, kvh, h / kvh, d});
  const Tensor o = at::scaled_dot_product_attention(qg, kv[0], kv[1], mask, 0.0, false, scale);
  return o.view({b, h, d}).to(q.scalar_type());
}

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
    int64_t max_len, const std::optional<Tensor>& valid, const Tensor& slots, int64_t h,
    int64_t kvh, int64_t d, double scale) {
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
    const Tensor o = attention(q, kv_caches[l], blocks, max_len, valid, scale);
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
        "Tensor[] w, int[] spec, Tensor[] kv_caches, Tensor blocks, int max_len, Tensor? valid, "
        "Tensor slots, int h, int kvh, int d, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(skyline_cpu, CPU, m) { m.impl("decode_layers", decode_layers); }
