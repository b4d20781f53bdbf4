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

// The same kernels' work on memory the caller holds, shared out among the threads (share(),
// region.h): what a decode step's layers call inside their parallel region (layers.cpp). They
// check nothing, so the caller checks everything first (the ops above show what).
void q4r8_into(const float* x, int64_t rows, int64_t k, int8_t* q, float* s, float* sx,
               const uint8_t* wq, const uint16_t* wdm, int64_t n, const float* bias, float* out);
void check_lengths(const at::Tensor& lens, int64_t seqs, int64_t most);
void attend_into(const float* q, int64_t seqs, int64_t heads, int64_t dim,
                 const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* tables,
                 int64_t max_blocks, const int64_t* lens, double scale, int64_t window,
                 double softcap, float* out);
void rms_norm_into(float* x, const float* delta, const float* weight, int64_t rows, int64_t h,
                   double eps, float* out);
void rotary_into(const float* qkv, int64_t tokens, const float* cos, const float* sin,
                 const int64_t* slots, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 int64_t num_heads, float* q);
void silu_mul_into(const float* gate_up, int64_t rows, int64_t width, float* out);

}  // namespace loom
