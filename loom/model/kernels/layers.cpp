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

// Every layer's tensors checked before any layer runs, so that a malformed layer is refused
// before the first writes the residual stream (the kernels check again as they run, the slots
// and block tables among them): each layer's K cache 4-dimensional; its norms float32 of the
// hidden size; each linear layer's blocks in the r8 layout for its output size and the input it
// gets; biases float32 of the output size; all on the CPU.
void check_layers(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef sizes,
                  const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList k_caches,
                  int64_t num_heads) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.device().is_cpu(),
              "hidden must be float32 [S, H] on the CPU");
  const int64_t h = hidden.size(1);
  for (int64_t i = 0; i < static_cast<int64_t>(k_caches.size()); ++i) {
    const at::Tensor* w = weights.data() + kWeights * i;
    const int64_t* n = sizes.data() + kSizes * i;
    TORCH_CHECK(k_caches[i].dim() == 4, "layer ", i, ": its K cache must be [blocks, block_size, H_kv, D]");
    for (const at::Tensor& norm : {w[0], w[5]})
      TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.numel() == h && norm.device().is_cpu(),
                  "layer ", i, ": its norms must be float32 of the hidden size on the CPU");
    const int64_t q_size = num_heads * k_caches[i].size(3);
    TORCH_CHECK(n[2] % 2 == 0, "layer ", i, ": gate_up's outputs must be gate's and up's");
    const int64_t inputs[kSizes] = {h, q_size, h, n[2] / 2};  // qkv, o, gate_up, down
    const int64_t outputs[kSizes] = {q_size + 2 * k_caches[i].size(2) * k_caches[i].size(3), h,
                                     n[2], h};
    const int64_t place[kSizes] = {1, 3, 6, 8};  // where each linear layer's blocks are in w
    for (int64_t j = 0; j < kSizes; ++j) {
      const at::Tensor &wq = w[place[j]], &wdm = w[place[j] + 1];
      TORCH_CHECK(n[j] == outputs[j] && inputs[j] % 32 == 0 &&
                      wq.scalar_type() == at::kByte && wq.dim() == 3 && wq.device().is_cpu() &&
                      wq.size(0) == (n[j] + 7) / 8 && wq.size(1) == inputs[j] / 32 &&
                      wq.size(2) == 128 && wdm.scalar_type() == at::kHalf && wdm.dim() == 3 &&
                      wdm.device().is_cpu() && wdm.size(0) == wq.size(0) &&
                      wdm.size(1) == wq.size(1) && wdm.size(2) == 16,
                  "layer ", i, ": linear layer ", j, " is not in Q4_1 blocks (r8) for ", inputs[j],
                  " inputs and ", outputs[j], " outputs");
      const c10::optional<at::Tensor> bias = biases.get(kSizes * i + j);
      TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                        bias->numel() == n[j] && bias->device().is_cpu()),
                  "layer ", i, ": linear layer ", j, "'s bias must be float32 of its outputs, on the CPU");
    }
  }
}

// hidden [S, H] (the step's one token a sequence, embedded) through every layer, in place;
// cos, sin [S, 1, D]; slots [S]; block_tables [S, B] and seq_lens [S] as paged_decode_attention
// takes them; k_caches, v_caches a layer each. Returns hidden, the last layer's residual stream.
at::Tensor llama_layers(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, at::TensorList weights, at::IntArrayRef sizes,
                        const c10::List<c10::optional<at::Tensor>>& biases,
                        at::TensorList k_caches, at::TensorList v_caches, int64_t num_heads,
                        double eps, double scale) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == num_layers &&
                  static_cast<int64_t>(weights.size()) == kWeights * num_layers &&
                  static_cast<int64_t>(sizes.size()) == kSizes * num_layers &&
                  static_cast<int64_t>(biases.size()) == kSizes * num_layers,
              "llama_layers takes ", kWeights, " weights, ", kSizes, " sizes and biases and a K and V "
              "cache a layer");
  check_layers(hidden, weights, sizes, biases, k_caches, num_heads);
  c10::optional<at::Tensor> delta;  // what the last MLP adds to the residual stream
  for (int64_t i = 0; i < num_layers; ++i) {
    const at::Tensor* w = weights.data() + kWeights * i;
    const int64_t* n = sizes.data() + kSizes * i;
    const auto bias = [&](int64_t j) { return biases.get(kSizes * i + j); };
    at::Tensor x = loom::add_rms_norm(hidden, delta, w[0], eps);
    const at::Tensor qkv = loom::q4r8_linear(x, w[1], w[2], n[0], bias(0));
    const at::Tensor q =
        loom::rotary_write_kv(qkv, cos, sin, slots, k_caches[i], v_caches[i], num_heads);
    const at::Tensor attended =
        loom::paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, seq_lens, scale,
                                     0, 0.0);
    const at::Tensor o =
        loom::q4r8_linear(attended.view({q.size(0), -1}), w[3], w[4], n[1], bias(1));
    x = loom::add_rms_norm(hidden, o, w[5], eps);
    const at::Tensor gate_up = loom::q4r8_linear(x, w[6], w[7], n[2], bias(2));
    delta = loom::q4r8_linear(loom::silu_mul(gate_up), w[8], w[9], n[3], bias(3));
  }
  return delta.has_value() ? hidden.add_(*delta) : hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("llama_layers(Tensor(a!) hidden, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor seq_lens, Tensor[] weights, int[] sizes, Tensor?[] biases, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, int num_heads, float eps, float scale) -> Tensor(a!)",
        &llama_layers);
}
