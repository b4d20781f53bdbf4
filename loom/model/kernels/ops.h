// The kernels' entry points that other kernels call (layers.cpp): each is also a torch op,
// `torch.ops.loom.<name>`, registered where it is defined (blocks.cpp, step.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace loom {

// x [T, K] float32 times a Q4_1 weight [n, K] in the r8 layout (blocks.cpp), plus the bias.
at::Tensor q4r8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wdm, int64_t n,
                       const c10::optional<at::Tensor>& bias);

// The decode step's kernels (step.cpp).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  double softcap);
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps);
at::Tensor rotary_write_kv(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                           const at::Tensor& sin_in, const at::Tensor& slots_in,
                           at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads);
at::Tensor silu_mul(const at::Tensor& gate_up_in);

}  // namespace loom
