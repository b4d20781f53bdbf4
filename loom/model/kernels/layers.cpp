// A decode step's decoder layers in one call, for q4 Llama-family models on the CPU: the very
// kernels loom/model/decoder.py calls one by one (ops.h), in the same order on the same values,
// so the same bits, without a trip through Python and torch's dispatcher for each (nine a
// layer), and in one parallel region (region.h) rather than one for each kernel. Built at run
// time with blocks.cpp and step.cpp by loom/model/kernels/__init__.py.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "activations.h"
#include "ops.h"
#include "region.h"

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
      TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.numel() == h && norm.is_contiguous() &&
                      norm.device().is_cpu(),
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
                      wq.is_contiguous() && wdm.is_contiguous() &&
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

// What the kernels would check of the step's other tensors, checked once for every layer before
// the region (where nothing may throw): cos and sin float32 of a row per token; the slots, the
// block tables' entries and the lengths in each layer's pool, whose K and V match.
void check_step(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                const at::Tensor& tables, const at::Tensor& lens, at::TensorList k_caches,
                at::TensorList v_caches, int64_t num_heads) {
  const int64_t tokens = slots.numel();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.device().is_cpu() && sin.device().is_cpu() && slots.device().is_cpu() &&
                  tables.device().is_cpu() && lens.device().is_cpu(),
              "cos and sin must be float32, and the slots, block tables and lengths on the CPU");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == tokens, "a block table per token");
  for (int64_t i = 0; i < static_cast<int64_t>(k_caches.size()); ++i) {
    const at::Tensor &k = k_caches[i], &v = v_caches[i];
    TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf) &&
                    k.is_contiguous() && v.is_contiguous() && k.device().is_cpu() &&
                    v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(),
                "layer ", i, ": its K and V caches must match, float32 or float16, contiguous, on the CPU");
    const int64_t blocks = k.size(0), kv_heads = k.size(2), dim = k.size(3);
    TORCH_CHECK((dim == 16 || dim == 32 || dim == 64 || dim == 128) && num_heads % kv_heads == 0 &&
                    cos.numel() == tokens * dim && sin.numel() == tokens * dim,
                "layer ", i, ": head_dim must be 16, 32, 64 or 128 (cos and sin of it a token), and "
                "the heads a multiple of the KV heads");
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slots.data_ptr<int64_t>()[t] >= 0 && slots.data_ptr<int64_t>()[t] < blocks * k.size(1),
                  "slot out of range");
    for (int64_t e = 0; e < tables.numel(); ++e)
      TORCH_CHECK(tables.data_ptr<int64_t>()[e] >= 0 && tables.data_ptr<int64_t>()[e] < blocks,
                  "block table entry out of range");
    loom::check_lengths(lens, tokens, tables.size(1) * k.size(1));
  }
}

// A linear layer's blocks (w[j], w[j + 1]) as the product takes them.
const uint8_t* blocks_of(const at::Tensor* w, int64_t j) {
  return reinterpret_cast<const uint8_t*>(w[j].data_ptr());
}
const uint16_t* scales_of(const at::Tensor* w, int64_t j) {
  return reinterpret_cast<const uint16_t*>(w[j + 1].data_ptr());
}

// hidden [S, H] (the step's one token a sequence, embedded) through every layer, in place;
// cos, sin [S, 1, D]; slots [S]; block_tables [S, B] and seq_lens [S] as paged_decode_attention
// takes them; k_caches, v_caches a layer each. Returns hidden, the last layer's residual stream.
// The kernels are those of the ops (ops.h), called in the same order on the same values, so the
// same bits as the per-op path; everything is checked and every buffer allocated first, then
// the layers run in one parallel region (region.h), the threads meeting between kernels
// (one_region false: each kernel in a region of its own, as before; `loom bench-step` times
// both in turn).
at::Tensor llama_layers(at::Tensor hidden, const at::Tensor& cos_in, const at::Tensor& sin_in,
                        const at::Tensor& slots_in, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, at::TensorList weights, at::IntArrayRef sizes,
                        const c10::List<c10::optional<at::Tensor>>& biases,
                        at::TensorList k_caches, at::TensorList v_caches, int64_t num_heads,
                        double eps, double scale, bool one_region) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == num_layers &&
                  static_cast<int64_t>(weights.size()) == kWeights * num_layers &&
                  static_cast<int64_t>(sizes.size()) == kSizes * num_layers &&
                  static_cast<int64_t>(biases.size()) == kSizes * num_layers,
              "llama_layers takes ", kWeights, " weights, ", kSizes, " sizes and biases and a K and V "
              "cache a layer");
  check_layers(hidden, weights, sizes, biases, k_caches, num_heads);
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  check_step(cos, sin, slots, tables, lens, k_caches, v_caches, num_heads);
  TORCH_CHECK(hidden.is_contiguous() && hidden.size(1) % 8 == 0 && hidden.size(0) == slots.numel(),
              "hidden must be contiguous, a row per token, its size a multiple of 8");
  const int64_t rows = hidden.size(0), h = hidden.size(1);
  int64_t widest = h, qkv_width = 0, q_width = 0, gate_up_width = 0;  // the buffers' widths
  for (int64_t i = 0; i < num_layers; ++i) {
    const int64_t* n = sizes.data() + kSizes * i;
    q_width = std::max(q_width, num_heads * k_caches[i].size(3));
    qkv_width = std::max(qkv_width, n[0]);
    gate_up_width = std::max(gate_up_width, n[2]);
    widest = std::max({widest, q_width, n[2] / 2});
  }
  const auto buffer = [&](int64_t width) { return at::empty({rows, width}, hidden.options()); };
  at::Tensor x = buffer(h), qkv = buffer(qkv_width), q = buffer(q_width), att = buffer(q_width),
             o = buffer(h), gate_up = buffer(gate_up_width), act = buffer(gate_up_width / 2),
             delta = buffer(h), sx = buffer(widest / loom::kBlock), s = buffer(widest / loom::kBlock);
  at::Tensor qx = at::empty({rows, widest}, hidden.options().dtype(at::kChar));
  std::vector<const float*> bias(kSizes * num_layers, nullptr);
  std::vector<at::Tensor> held;  // the biases' contiguous copies, while the region reads them
  for (int64_t j = 0; j < kSizes * num_layers; ++j)
    if (const c10::optional<at::Tensor> b = biases.get(j); b.has_value())
      bias[j] = held.emplace_back(b->contiguous()).data_ptr<float>();
  float *hp = hidden.data_ptr<float>(), *xp = x.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(),
        *qp = q.data_ptr<float>(), *ap = att.data_ptr<float>(), *op = o.data_ptr<float>(),
        *gp = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>(),
        *dp = delta.data_ptr<float>(), *sp = s.data_ptr<float>(), *sxp = sx.data_ptr<float>();
  int8_t* qxp = qx.data_ptr<int8_t>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const int64_t *slot = slots.data_ptr<int64_t>(), *tp = tables.data_ptr<int64_t>(),
                *lp = lens.data_ptr<int64_t>();
  const auto layers = [&] {
    for (int64_t i = 0; i < num_layers; ++i) {
      const at::Tensor* w = weights.data() + kWeights * i;
      const int64_t* n = sizes.data() + kSizes * i;
      const float* const* b = bias.data() + kSizes * i;
      const int64_t dim = k_caches[i].size(3), q_size = num_heads * dim;
      loom::rms_norm_into(hp, i == 0 ? nullptr : dp, w[0].data_ptr<float>(), rows, h, eps, xp);
      loom::q4r8_into(xp, rows, h, qxp, sp, sxp, blocks_of(w, 1), scales_of(w, 1), n[0], b[0], qkvp);
      loom::rotary_into(qkvp, rows, cp, snp, slot, k_caches[i], v_caches[i], num_heads, qp);
      loom::attend_into(qp, rows, num_heads, dim, k_caches[i], v_caches[i], tp, tables.size(1), lp,
                        scale, 0, 0.0, ap);
      loom::q4r8_into(ap, rows, q_size, qxp, sp, sxp, blocks_of(w, 3), scales_of(w, 3), n[1], b[1], op);
      loom::rms_norm_into(hp, op, w[5].data_ptr<float>(), rows, h, eps, xp);
      loom::q4r8_into(xp, rows, h, qxp, sp, sxp, blocks_of(w, 6), scales_of(w, 6), n[2], b[2], gp);
      loom::silu_mul_into(gp, rows, n[2] / 2, actp);
      loom::q4r8_into(actp, rows, n[2] / 2, qxp, sp, sxp, blocks_of(w, 8), scales_of(w, 8), n[3],
                      b[3], dp);
    }
    if (num_layers > 0)
      loom::share(0, rows * h, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t e = begin; e < end; ++e) hp[e] += dp[e];
      });
  };
  if (!one_region) {  // each kernel in a region of its own (at::parallel_for's), as the ops
    layers();
    return hidden;
  }
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const loom::Region region;
    layers();
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("llama_layers(Tensor(a!) hidden, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor seq_lens, Tensor[] weights, int[] sizes, Tensor?[] biases, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, int num_heads, float eps, float scale, bool one_region=True) -> Tensor(a!)",
        &llama_layers);
}
