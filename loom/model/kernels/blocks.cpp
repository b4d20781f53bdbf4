// Matrix products over GGUF-style weight blocks, for x86 CPUs with AVX2 (every CPU this project
// runs on: Zen 3 and Zen 4). Built at run time by loom/model/kernels/__init__.py.
//
// Weights come in blocks of 32 along the input axis, as in llama.cpp's files:
//   q4: w = d * q + m, q in 0..15. Per block: 16 bytes, byte j holding q[j] (low nibble) and
//       q[j + 16] (high nibble); d and m in float32 arrays [N, K / 32].
//   q8: w = d * q, q in -127..127. Per block: 32 int8; d in float32 [N, K / 32].
// Activations are quantised as they come, per row and per block of 32, with one scale
// s = max|x| / 127 to int8 for q4 weights (llama.cpp's Q8_1 for the activations), and
// s = max|x| / 32767 to int16 for q8 weights, so that a block's product is integer arithmetic:
//   sum_i (d q_i + m) (s x_i) = d s sum_i q_i x_i + m (s sum_i x_i)
// q4: AVX2's maddubs (unsigned 8 bit times signed 8 bit, pairs summed in 16 bits: at most
// 2 * 15 * 127, no overflow), then madd to 32 bits. q8: madd of 16-bit pairs to 32 bits (at most
// 4 * 127 * 32767 over a lane's four products).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

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

// The 32 weights of a q4 block as bytes 0..15, in element order.
inline __m256i unpack_q4(const uint8_t* block) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
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

// The int32 partial sums (8 lanes) of one block: q4 weights (unpacked) times int8 activations,
// or q8 weights times int16 activations.
inline __m256i block_dot(__m256i w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
}

inline __m256i block_dot(__m256i w, const int16_t* x) {
  const __m256i w_low = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
  const __m256i w_high = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  return _mm256_add_epi32(_mm256_madd_epi16(w_low, _mm256_loadu_si256(xv)),
                          _mm256_madd_epi16(w_high, _mm256_loadu_si256(xv + 1)));
}

// out[r, n] for rows r0 .. r0 + R - 1 and one output n: q4 weights (wm, the minimums, given)
// with int8 activations, or q8 weights (wm null) with int16 activations.
template <int R, typename T>
inline void dot_rows(const Activations<T>& a, int64_t r0, const uint8_t* wq, const float* wd,
                     const float* wm, float* out, int64_t out_stride) {
  constexpr bool kQ4 = sizeof(T) == 1;
  const int64_t blocks = a.k / kBlock;
  __m256 acc[R];
  float msum[R];
  for (int t = 0; t < R; ++t) {
    acc[t] = _mm256_setzero_ps();
    msum[t] = 0.0f;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i w = kQ4 ? unpack_q4(wq + b * (kBlock / 2))
                          : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * kBlock));
    const float d = wd[b];
    for (int t = 0; t < R; ++t) {
      const int64_t row = r0 + t;
      const __m256 f = _mm256_cvtepi32_ps(block_dot(w, a.q + row * a.k + b * kBlock));
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.s[row * blocks + b]), f, acc[t]);
      if constexpr (kQ4) msum[t] += wm[b] * a.sx[row * blocks + b];
    }
  }
  for (int t = 0; t < R; ++t) out[(r0 + t) * out_stride] = hsum(acc[t]) + msum[t];
}

// x [..., K] float32 times a weight in blocks: T = int8_t for q4 (wm given), int16_t for q8.
template <typename T>
at::Tensor block_linear(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& wd,
                        const c10::optional<at::Tensor>& wm, const c10::optional<at::Tensor>& bias) {
  constexpr bool kQ4 = sizeof(T) == 1;
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "activations must be float32");
  TORCH_CHECK(x_in.device().is_cpu() && wq.device().is_cpu(), "block products run on the CPU");
  const at::Tensor x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = wd.size(0);
  TORCH_CHECK(k % kBlock == 0 && wd.dim() == 2 && wd.size(1) == k / kBlock,
              "input size ", k, " does not match the weight");
  TORCH_CHECK(wq.is_contiguous() && wd.is_contiguous() && wd.scalar_type() == at::kFloat &&
                  wq.element_size() == 1 && wq.numel() == n * (kQ4 ? k / 2 : k),
              "the weight's blocks do not have the expected layout");
  TORCH_CHECK(!kQ4 || (wm->is_contiguous() && wm->sizes() == wd.sizes() &&
                       wm->scalar_type() == at::kFloat), "the minimums do not match the scales");
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "the bias does not match the outputs");
  at::Tensor q = at::empty({rows, k}, x.options().dtype(kQ4 ? at::kChar : at::kShort));
  at::Tensor s = at::empty({rows, k / kBlock}, x.options());
  at::Tensor sx = at::empty({rows, k / kBlock}, x.options());
  T* q_ptr = reinterpret_cast<T*>(q.data_ptr());
  quantize_rows<T>(x.data_ptr<float>(), rows, k, q_ptr, s.data_ptr<float>(), sx.data_ptr<float>());
  at::Tensor out = at::empty({rows, n}, x.options());
  const Activations<T> a{q_ptr, s.data_ptr<float>(), sx.data_ptr<float>(), k};
  const uint8_t* wq_ptr = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const float* wd_ptr = wd.data_ptr<float>();
  const float* wm_ptr = kQ4 ? wm->data_ptr<float>() : nullptr;
  const int64_t row_bytes = kQ4 ? k / 2 : k, blocks = k / kBlock;
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* wrow = wq_ptr + j * row_bytes;
      const float* drow = wd_ptr + j * blocks;
      const float* mrow = kQ4 ? wm_ptr + j * blocks : nullptr;
      int64_t r = 0;
      for (; r + kRowTile <= rows; r += kRowTile)
        dot_rows<kRowTile, T>(a, r, wrow, drow, mrow, out_ptr + j, n);
      switch (rows - r) {
        case 3: dot_rows<3, T>(a, r, wrow, drow, mrow, out_ptr + j, n); break;
        case 2: dot_rows<2, T>(a, r, wrow, drow, mrow, out_ptr + j, n); break;
        case 1: dot_rows<1, T>(a, r, wrow, drow, mrow, out_ptr + j, n); break;
        default: break;
      }
    }
  });
  if (bias.has_value()) out.add_(*bias);
  auto shape = x_in.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wd,
                     const at::Tensor& wm, const c10::optional<at::Tensor>& bias) {
  return block_linear<int8_t>(x, wq, wd, wm, bias);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wd,
                     const c10::optional<at::Tensor>& bias) {
  return block_linear<int16_t>(x, wq, wd, c10::nullopt, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("q4_linear(Tensor x, Tensor wq, Tensor wd, Tensor wm, Tensor? bias) -> Tensor", &q4_linear);
  m.def("q8_linear(Tensor x, Tensor wq, Tensor wd, Tensor? bias) -> Tensor", &q8_linear);
}
