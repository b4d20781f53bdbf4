// A decode step's decoder layers in one call, for q4 Llama-family models on the CPU: the very
// kernels loom/model/llama.py calls one by one (ops.h), in the same order on the same tensors,
// so the same bits, without a trip through Python and torch's dispatcher for each (nine a
// layer). Built at run time with blocks.cpp and step.cpp by loom/model/kernels/__init__.py.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "ops.h"

namespace {

constexpr int64_t kWeights = 10;  // a layer's tensors in `weights`, in this order:
// input norm, qkv blocks and scales, o's, post-attention norm, gate_up's, down's.
constexpr int64_t kSizes = 4;  // a layer's linear layers' output sizes in `sizes` and biases
// in `biases`: qkv, o, gate_up, down.

// hidden [S, H] (the step's one token a sequence, embedded) through every layer, in place;
// cos, sin [S, 1, D]; slots [S]; block_tables [S, B] and seq_lens [S] as paged_decode_attention
// takes them; k_caches, v_caches a layer each. Returns hidden, the last layer's residual stream.
at::Tensor llama_layers(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, at::TensorList weights, at::IntArrayRef sizes,
                        const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList k_caches, at::TensorList v_caches, int64_t num_heads,
                        double eps, double scale) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == num_layers &&
                  static_cast<int64_t>(weights.size()) == kWeights * num_layers &&
                  static_cast<int64_t>(sizes.size()) == kSizes * num_layers &&
                  static_cast<int64_t>(biases.size()) == kSizes * num_layers,
              "llama_layers takes ", kWeights, " weights, ", kSizes, " sizes and biases and a K and V "
              "cache a layer");
  c10::optional<at::Tensor> delta;  // what the last MLP adds to the residual stream
  for (int64_t i = 0; i < num_layers; ++i) {
    const at::Tensor* w = weights.data() + kWeights * i;
    const int64_t* n = sizes.data() + kSizes * i;
    const auto bias = [&](int64_t j) -> c10::optional<at::Tensor> { return biases.get(kSizes * i + j); };
    at::Tensor x = loom::add_rms_norm(hidden, delta, w[0], eps);
    const at::Tensor qkv = loom::q4r8_linear(x, w[1], w[2], n[0], bias(0));
    const at::Tensor q = loom::rotary_write_kv(qkv, cos, sin, slots, k_caches[i], v_caches[i], num_heads);
    const at::Tensor attended =
        loom::paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, seq_lens, scale);
    const at::Tensor o = loom::q4r8_linear(attended.view({q.size(0), -1}), w[3], w[4], n[1], bias(1));
    x = loom::add_rms_norm(hidden, o, w[5], eps);
    const at::Tensor gate_up = loom::q4r8_linear(x, w[6], w[7], n[2], bias(2));
    delta = loom::q4r8_linear(loom::silu_mul(gate_up), w[8], w[9], n[3], bias(3));
  }
  return delta.has_value() ? hidden.add_(*delta) : hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("llama_layers(Tensor(a!) hidden, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor seq_lens, Tensor[] weights, int[] sizes, Tensor?[] biases, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, "
        "int num_heads, float eps, float scale) -> Tensor(a!)", &llama_layers);
}
