// Matrix products over GGUF-style weight blocks, for x86 CPUs with AVX2 (every CPU this project
// runs on: Zen 3 and Zen 4). Built at run time by loom/model/kernels/__init__.py.
//
// Weights come in blocks of 32 along the input axis, as in llama.cpp's files:
//   q4: w = d * q + m, q in 0..15. Per block: 16 bytes, byte j holding q[j] (low nibble) and
//       q[j + 16] (high nibble), repacked 8 outputs at a time (the r8 layout, below), d and m
//       in float16.
//   q8: w = d * q, q in -127..127. Per block: 32 int8; d in float32 [N, K / 32].
// Activations are quantised as they come, per row and per block of 32, with one scale
// s = max|x| / 127 to int8 for q4 weights (llama.cpp's Q8_1 for the activations), and
// s = max|x| / 32767 to int16 for q8 weights, so that a block's product is integer arithmetic:
//   sum_i (d q_i + m) (s x_i) = d s sum_i q_i x_i + m (s sum_i x_i)
// q4: AVX2's maddubs (unsigned 8 bit times signed 8 bit, pairs summed in 16 bits: at most
// 2 * 15 * 127, no overflow), 8 of them summed in 16 bits, then madd to 32 bits. q8: madd of
// 16-bit pairs to 32 bits (at most 4 * 127 * 32767 over a lane's four products).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 4;  // activation rows sharing one unpacked weight block

using loom::hsum;

// x [M, K] float32 -> q [M, K] int8 (T = int8_t) or int16 (T = int16_t), per block of 32 with
// scale s = max|x| / 127 (or / 32767) in s [M, K / 32], and s * sum q in sx [M, K / 32].
template <typename T>
void quantize_rows(const float* x, int64_t rows, int64_t k, T* q, float* s, float* sx) {
  constexpr float kMax = sizeof(T) == 1 ? 127.0f : 32767.0f;
  const int64_t blocks = k / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
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
  TORCH_CHECK(k % kBlock == 0, "input size ", k, " is not a multiple of ", kBlock);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(sizeof(T) == 1 ? at::kChar : at::kShort));
  at::Tensor s = at::empty({rows, k / kBlock}, x.options());
  at::Tensor sx = at::empty({rows, k / kBlock}, x.options());
  T* q_ptr = reinterpret_cast<T*>(q.data_ptr());
  quantize_rows<T>(x.data_ptr<float>(), rows, k, q_ptr, s.data_ptr<float>(), sx.data_ptr<float>());
  return {q, s, sx, {q_ptr, s.data_ptr<float>(), sx.data_ptr<float>(), k}};
}

// Weights and scales on the CPU, contiguous; a bias of n floats.
void check_weight(const at::Tensor& wq, at::ScalarType q_type, const at::Tensor& scales,
                  at::ScalarType scale_type, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(wq.device().is_cpu() && scales.device().is_cpu(), "block products run on the CPU");
  TORCH_CHECK(wq.is_contiguous() && wq.scalar_type() == q_type && scales.is_contiguous() &&
                  scales.scalar_type() == scale_type,
              "the weight's blocks do not have the expected layout");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == n &&
                                    bias->scalar_type() == at::kFloat && bias->device().is_cpu()),
              "the bias does not match the outputs");
}

// out [M, n] plus the bias, in x_in's shape with n outputs.
at::Tensor finished(at::Tensor out, const at::Tensor& x_in, const c10::optional<at::Tensor>& bias) {
  if (bias.has_value()) out.add_(*bias);
  auto shape = x_in.sizes().vec();
  shape.back() = out.size(1);
  return out.view(shape);
}

// The int32 partial sums (8 lanes) of one block: q8 weights times int16 activations.
inline __m256i block_dot(__m256i w, const int16_t* x) {
  const __m256i w_low = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
  const __m256i w_high = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  return _mm256_add_epi32(_mm256_madd_epi16(w_low, _mm256_loadu_si256(xv)),
                          _mm256_madd_epi16(w_high, _mm256_loadu_si256(xv + 1)));
}

// out[r, n] for rows r0 .. r0 + R - 1 and one output n: q8 weights, int16 activations.
template <int R>
inline void dot_rows(const Activations<int16_t>& a, int64_t r0, const uint8_t* wq,
                     const float* wd, float* out, int64_t out_stride) {
  const int64_t blocks = a.k / kBlock;
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * kBlock));
    const float d = wd[b];
    for (int t = 0; t < R; ++t) {
      const int64_t row = r0 + t;
      const __m256 f = _mm256_cvtepi32_ps(block_dot(w, a.q + row * a.k + b * kBlock));
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.s[row * blocks + b]), f, acc[t]);
    }
  }
  for (int t = 0; t < R; ++t) out[(r0 + t) * out_stride] = hsum(acc[t]);
}

// x [..., K] float32 times a Q8_0 weight, row by row (the LM head): wq [N, K] int8, wd
// [N, K / 32] float32.
at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& wd,
                     const c10::optional<at::Tensor>& bias) {
  const Quantised<int16_t> x = quantise<int16_t>(x_in);
  const Activations<int16_t>& a = x.a;
  const int64_t rows = x.q.size(0), k = a.k, n = wd.size(0), blocks = k / kBlock;
  check_weight(wq, at::kChar, wd, at::kFloat, bias, n);
  TORCH_CHECK(wd.dim() == 2 && wd.size(1) == blocks && wq.numel() == n * k,
              "input size ", k, " does not match the weight");
  at::Tensor out = at::empty({rows, n}, x_in.options());
  const uint8_t* wq_ptr = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const float* wd_ptr = wd.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* wrow = wq_ptr + j * k;
      const float* drow = wd_ptr + j * blocks;
      int64_t r = 0;
      for (; r + kRowTile <= rows; r += kRowTile)
        dot_rows<kRowTile>(a, r, wrow, drow, out_ptr + j, n);
      switch (rows - r) {
        case 3: dot_rows<3>(a, r, wrow, drow, out_ptr + j, n); break;
        case 2: dot_rows<2>(a, r, wrow, drow, out_ptr + j, n); break;
        case 1: dot_rows<1>(a, r, wrow, drow, out_ptr + j, n); break;
        default: break;
      }
    }
  });
  return finished(out, x_in, bias);
}

// Q4_1 repacked for 8 outputs at once (the r8 layout, made at load by loom/model/blocks.py):
// for each group of 8 output rows and each block of 32 inputs, 128 bytes of nibbles, then the
// group's 8 scales and 8 minimums in float16 (as the file holds them). The nibbles are the
// file's bytes rearranged in runs of 4: chunk i (32 bytes, i = 0..3) holds, for each row r,
// the row's bytes 4i..4i+3, whose low nibbles are the weights 4i..4i+3 and high nibbles the
// weights 16+4i..16+4i+3. So one maddubs of a chunk's low nibbles against 4 activations
// broadcast gives, in lane r, row r's products with them, and no horizontal sum is needed:
// 8 maddubs summed in int16 (at most 8 * 2 * 15 * 127 = 30480), one madd to 8 int32 outputs,
// the scale and the minimum applied once per block for 8 outputs.
constexpr int64_t kGroup = 8;
constexpr int64_t kGroupBlockBytes = kGroup * kBlock / 2;

template <int R>
inline void dot_group(const Activations<int8_t>& a, int64_t r0, const uint8_t* wq,
                      const uint16_t* wdm, float* out, int64_t out_stride, int64_t valid) {
  const int64_t blocks = a.k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = wq + b * kGroupBlockBytes;
    __m256i sum[R];
    for (int t = 0; t < R; ++t) sum[t] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
      const __m256i lo = _mm256_and_si256(p, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
      for (int t = 0; t < R; ++t) {
        const int8_t* xb = a.q + (r0 + t) * a.k + b * kBlock;
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, xb + 4 * i, 4);
        std::memcpy(&x_hi, xb + 16 + 4 * i, 4);
        sum[t] = _mm256_add_epi16(sum[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x_lo)));
        sum[t] = _mm256_add_epi16(sum[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x_hi)));
      }
    }
    const __m128i* dm = reinterpret_cast<const __m128i*>(wdm + b * 2 * kGroup);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(dm));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(dm + 1));
    for (int t = 0; t < R; ++t) {
      const int64_t at = (r0 + t) * blocks + b;
      const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[t], ones));
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.s[at])), f, acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sx[at]), acc[t]);
    }
  }
  for (int t = 0; t < R; ++t) {
    float* row = out + (r0 + t) * out_stride;
    if (valid == kGroup) {
      _mm256_storeu_ps(row, acc[t]);
    } else {
      alignas(32) float lanes[kGroup];
      _mm256_store_ps(lanes, acc[t]);
      std::memcpy(row, lanes, valid * sizeof(float));
    }
  }
}

// x [..., K] float32 times a Q4_1 weight [N, K] in the r8 layout: wq [ceil(N / 8), K / 32, 128]
// uint8, wdm [ceil(N / 8), K / 32, 16] float16 (8 scales, 8 minimums). n is the weight's N:
// the layout fixes only its group count, and the rows padded beyond n are never written.
at::Tensor q4r8_linear(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& wdm,
                       int64_t n, const c10::optional<at::Tensor>& bias) {
  const Quantised<int8_t> x = quantise<int8_t>(x_in);
  const Activations<int8_t>& a = x.a;
  const int64_t rows = x.q.size(0), k = a.k, blocks = k / kBlock;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  check_weight(wq, at::kByte, wdm, at::kHalf, bias, n);
  TORCH_CHECK(wq.dim() == 3 && wq.size(0) == groups && wq.size(2) == kGroupBlockBytes &&
                  wdm.dim() == 3 && wdm.size(0) == groups && wdm.size(2) == 2 * kGroup,
              "the weight's blocks do not have the r8 layout for ", n, " outputs");
  TORCH_CHECK(wq.size(1) == blocks && wdm.size(1) == blocks, "input size ", k,
              " does not match the weight");
  at::Tensor out = at::empty({rows, n}, x_in.options());
  const uint8_t* wq_ptr = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const uint16_t* wdm_ptr = reinterpret_cast<const uint16_t*>(wdm.data_ptr());
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* wg = wq_ptr + g * blocks * kGroupBlockBytes;
      const uint16_t* dg = wdm_ptr + g * blocks * 2 * kGroup;
      const int64_t valid = std::min(kGroup, n - g * kGroup);
      float* og = out_ptr + g * kGroup;
      int64_t r = 0;
      for (; r + kRowTile <= rows; r += kRowTile) dot_group<kRowTile>(a, r, wg, dg, og, n, valid);
      switch (rows - r) {
        case 3: dot_group<3>(a, r, wg, dg, og, n, valid); break;
        case 2: dot_group<2>(a, r, wg, dg, og, n, valid); break;
        case 1: dot_group<1>(a, r, wg, dg, og, n, valid); break;
        default: break;
      }
    }
  });
  return finished(out, x_in, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("q4r8_linear(Tensor x, Tensor wq, Tensor wdm, int n, Tensor? bias) -> Tensor",
        &q4r8_linear);
  m.def("q8_linear(Tensor x, Tensor wq, Tensor wd, Tensor? bias) -> Tensor", &q8_linear);
}
