// The activations' side of the block products (blocks.cpp): rows quantised per block of 32 as
// they come, to int8 (q4 weights) or int16 (q8 weights), and the checks and finish every product
// shares. AVX2.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

#include "region.h"

namespace loom {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 4;  // activation rows sharing one unpacked weight block

// x [M, K] float32 -> q [M, K] int8 (T = int8_t) or int16 (T = int16_t), per block of 32 with
// scale s = max|x| / 127 (or / 32767) in s [M, K / 32], and s * sum q in sx [M, K / 32].
template <typename T>
void quantize_rows(const float* x, int64_t rows, int64_t k, T* q, float* s, float* sx) {
  constexpr float kMax = sizeof(T) == 1 ? 127.0f : 32767.0f;
  const int64_t blocks = k / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  share(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = x + i * kBlock;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float max_abs = _mm_cvtss_f32(m4);
      const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? kMax / max_abs : 0.0f);
      __m256i n[4];
      __m256i total = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        n[j] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        total = _mm256_add_epi32(total, n[j]);
      }
      // 32 int32 -> 32 narrower in order: packs work within 128-bit lanes, permutes restore it.
      const __m256i p16a = _mm256_packs_epi32(n[0], n[1]);
      const __m256i p16b = _mm256_packs_epi32(n[2], n[3]);
      __m256i* out = reinterpret_cast<__m256i*>(q + i * kBlock);
      if constexpr (sizeof(T) == 1) {
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        _mm256_storeu_si256(out, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      } else {
        _mm256_storeu_si256(out, _mm256_permute4x64_epi64(p16a, 0xD8));
        _mm256_storeu_si256(out + 1, _mm256_permute4x64_epi64(p16b, 0xD8));
      }
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t = _mm_hadd_epi32(t, t);
      t = _mm_hadd_epi32(t, t);
      s[i] = max_abs / kMax;
      sx[i] = s[i] * static_cast<float>(_mm_cvtsi128_si32(t));
    }
  });
}

// Quantised activations: int8 for q4 weights, int16 for q8 weights (the LM head, whose logits
// decide the token: int8 activations there flip near-ties, measured).
template <typename T>
struct Activations {
  const T* q;
  const float* s;
  const float* sx;
  int64_t k;
};

// Activations [rows, K] quantised per block, with the tensors that hold them.
template <typename T>
struct Quantised {
  at::Tensor q, s, sx;
  Activations<T> a;
};

// x_in [..., K] float32 on the CPU as rows [M, K], quantised (T = int8_t or int16_t).
template <typename T>
Quantised<T> quantise(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "activations must be float32");
  TORCH_CHECK(x_in.device().is_cpu(), "block products run on the CPU");
  const at::Tensor x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0 && k % kBlock == 0, "input size ", k, " is not a multiple of ", kBlock);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(sizeof(T) == 1 ? at::kChar : at::kShort));
  at::Tensor s = at::empty({rows, k / kBlock}, x.options());
  at::Tensor sx = at::empty({rows, k / kBlock}, x.options());
  T* q_ptr = reinterpret_cast<T*>(q.data_ptr());
  quantize_rows<T>(x.data_ptr<float>(), rows, k, q_ptr, s.data_ptr<float>(), sx.data_ptr<float>());
  return {q, s, sx, {q_ptr, s.data_ptr<float>(), sx.data_ptr<float>(), k}};
}

// Weights and scales on the CPU, contiguous; a bias of n floats.
inline void check_weight(const at::Tensor& wq, at::ScalarType q_type, const at::Tensor& scales,
                         at::ScalarType scale_type, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(wq.device().is_cpu() && scales.device().is_cpu(), "block products run on the CPU");
  TORCH_CHECK(wq.is_contiguous() && wq.scalar_type() == q_type && scales.is_contiguous() &&
                  scales.scalar_type() == scale_type,
              "the weight's blocks do not have the expected layout");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == n &&
                                    bias->scalar_type() == at::kFloat && bias->device().is_cpu()),
              "the bias does not match the outputs");
}

// out [M, n] += bias [n], each thread its share of the rows.
inline void add_bias(float* out, int64_t rows, int64_t n, const float* bias) {
  share(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t j = 0; j < n; ++j) out[r * n + j] += bias[j];
  });
}

// out [M, n] in x_in's shape with n outputs.
inline at::Tensor finished(at::Tensor out, const at::Tensor& x_in) {
  auto shape = x_in.sizes().vec();
  shape.back() = out.size(1);
  return out.view(shape);
}

}  // namespace loom
