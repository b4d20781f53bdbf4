// Matrix products over GGUF-style weight blocks, for x86 CPUs with AVX2, and AVX-512 VNNI where
// the CPU has it. Built at run time by loom/model/kernels/__init__.py.
//
// Weights come in blocks of 32 along the input axis, as in llama.cpp's files:
//   q4: w = d * q + m, q in 0..15. Per block: 16 bytes, byte j holding q[j] (low nibble) and
//       q[j + 16] (high nibble); d and m in float16.
//   q8: w = d * q, q in -127..127. Per block: 32 int8; d in float16.
// Both are repacked 8 outputs at a time (the r8 layout, below).
// Activations are quantised as they come, per row and per block of 32, with one scale
// s = max|x| / 127 to int8 for q4 weights (llama.cpp's Q8_1 for the activations), and
// s = max|x| / 32767 to int16 for q8 weights, so that a block's product is integer arithmetic:
//   sum_i (d q_i + m) (s x_i) = d s sum_i q_i x_i + m (s sum_i x_i)
// q4: AVX2's maddubs (unsigned 8 bit times signed 8 bit, pairs summed in 16 bits: at most
// 2 * 15 * 127, no overflow), 8 of them summed in 16 bits, then madd to 32 bits. q8: madd of
// 16-bit pairs to 32 bits (a block's 32 products at most 32 * 127 * 32767 in a lane).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "activations.h"
#include "ops.h"

namespace {

using namespace loom;  // activations.h

// Both formats are repacked at load (loom/model/blocks.py) for 8 outputs at a time: for each
// group of 8 output rows and each block of 32 inputs, the rows' bytes interleaved in runs, then
// the group's 8 scales (and, for q4, 8 minimums) in float16, as the file holds them. So one
// product of a run against activations broadcast gives, in lane r, row r's partial sum: no
// horizontal sum, the scales applied once per block for 8 outputs, 8 outputs stored at once.
//   q4: runs of 4 bytes, 128 bytes a group's block: run i holds, for each row, the row's bytes
//       4i..4i+3, whose low nibbles are the weights 4i..4i+3 and high nibbles 16+4i..16+4i+3.
//       AVX2: maddubs against 4 int8 activations broadcast, 8 of them summed in int16 (at most
//       8 * 2 * 15 * 127 = 30480), one madd to int32. VNNI: dpbusd straight to int32.
//   q8: runs of 2 bytes, 256 bytes a group's block, widened to int16 and multiplied by madd
//       (VNNI: dpwssd) against 2 int16 activations broadcast.
constexpr int64_t kGroup = 8;

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i dot_u8(__m256i sum, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(sum, w, x); }
inline __m256i dot_s16(__m256i sum, __m256i w, __m256i x) { return _mm256_dpwssd_epi32(sum, w, x); }
inline __m256i widen_u8(__m256i sum) { return sum; }
inline __m256i add_sums(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
#else
inline __m256i dot_u8(__m256i sum, __m256i w, __m256i x) {
  return _mm256_add_epi16(sum, _mm256_maddubs_epi16(w, x));
}
inline __m256i dot_s16(__m256i sum, __m256i w, __m256i x) {
  return _mm256_add_epi32(sum, _mm256_madd_epi16(w, x));
}
inline __m256i widen_u8(__m256i sum) { return _mm256_madd_epi16(sum, _mm256_set1_epi16(1)); }
inline __m256i add_sums(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }  // <= 30480
#endif

inline __m256i broadcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Where the CPU has AVX-512 (the VNNI build), two groups are multiplied at once in 512-bit
// registers: group g's bytes in the low half, g + 1's in the high half, and their 16 outputs,
// adjacent in the output row, stored at once.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LOOM_ZMM 1
inline __m512i broadcast32x16(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512i join(const uint8_t* lo, const uint8_t* hi) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}
inline __m256i join128(const void* lo, const void* hi) {
  const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(low),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}
#else
#define LOOM_ZMM 0
#endif

// The two formats: the bytes and scales of a group's block, and its int32 sums for R rows.
struct Q4 {
  using Act = int8_t;
  static constexpr int64_t kBytes = kGroup * kBlock / 2, kScales = 2 * kGroup;
  static constexpr at::ScalarType kType = at::kByte;
  template <int R>
  static void sums(const uint8_t* wb, const int8_t* const* x, __m256i* sum) {
    // Two sums a row, the low nibbles' and the high ones', so that the chains of dependent
    // dot products are half as long (VNNI's dpbusd has a latency of 5 cycles).
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i high[R];
    for (int t = 0; t < R; ++t) sum[t] = high[t] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
      const __m256i lo = _mm256_and_si256(p, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
      for (int t = 0; t < R; ++t) {
        sum[t] = dot_u8(sum[t], lo, broadcast32(x[t] + 4 * i));
        high[t] = dot_u8(high[t], hi, broadcast32(x[t] + 16 + 4 * i));
      }
    }
    for (int t = 0; t < R; ++t) sum[t] = widen_u8(add_sums(sum[t], high[t]));
  }
#if LOOM_ZMM
  template <int R>
  static void sums2(const uint8_t* w0, const uint8_t* w1, const int8_t* const* x, __m512i* sum) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i high[R];
    for (int t = 0; t < R; ++t) sum[t] = high[t] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const __m512i p = join(w0 + 32 * i, w1 + 32 * i);
      const __m512i lo = _mm512_and_si512(p, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
      for (int t = 0; t < R; ++t) {
        sum[t] = _mm512_dpbusd_epi32(sum[t], lo, broadcast32x16(x[t] + 4 * i));
        high[t] = _mm512_dpbusd_epi32(high[t], hi, broadcast32x16(x[t] + 16 + 4 * i));
      }
    }
    for (int t = 0; t < R; ++t) sum[t] = _mm512_add_epi32(sum[t], high[t]);
  }
#endif
};

struct Q8 {
  using Act = int16_t;
  static constexpr int64_t kBytes = kGroup * kBlock, kScales = kGroup;
  static constexpr at::ScalarType kType = at::kChar;
  template <int R>
  static void sums(const uint8_t* wb, const int16_t* const* x, __m256i* sum) {
    __m256i odd[R];  // two sums a row, as for Q4
    for (int t = 0; t < R; ++t) sum[t] = odd[t] = _mm256_setzero_si256();
    for (int i = 0; i < 16; i += 2) {
      const __m128i* w = reinterpret_cast<const __m128i*>(wb + 16 * i);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w + 1));
      for (int t = 0; t < R; ++t) {
        sum[t] = dot_s16(sum[t], w0, broadcast32(x[t] + 2 * i));
        odd[t] = dot_s16(odd[t], w1, broadcast32(x[t] + 2 * i + 2));
      }
    }
    for (int t = 0; t < R; ++t) sum[t] = _mm256_add_epi32(sum[t], odd[t]);
  }
#if LOOM_ZMM
  template <int R>
  static void sums2(const uint8_t* w0, const uint8_t* w1, const int16_t* const* x, __m512i* sum) {
    __m512i odd[R];
    for (int t = 0; t < R; ++t) sum[t] = odd[t] = _mm512_setzero_si512();
    for (int i = 0; i < 16; i += 2) {
      const __m256i both = join128(w0 + 16 * i, w1 + 16 * i);
      const __m256i next = join128(w0 + 16 * i + 16, w1 + 16 * i + 16);
      const __m512i v0 = _mm512_cvtepi8_epi16(both), v1 = _mm512_cvtepi8_epi16(next);
      for (int t = 0; t < R; ++t) {
        sum[t] = _mm512_dpwssd_epi32(sum[t], v0, broadcast32x16(x[t] + 2 * i));
        odd[t] = _mm512_dpwssd_epi32(odd[t], v1, broadcast32x16(x[t] + 2 * i + 2));
      }
    }
    for (int t = 0; t < R; ++t) sum[t] = _mm512_add_epi32(sum[t], odd[t]);
  }
#endif
};

// out[r0 .. r0 + R - 1, the group's `valid` outputs] for one group of weights.
template <typename F, int R>
inline void dot_group(const Activations<typename F::Act>& a, int64_t r0, const uint8_t* wq,
                      const uint16_t* wdm, float* out, int64_t out_stride, int64_t valid) {
  const int64_t blocks = a.k / kBlock;
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const typename F::Act* x[R];
    for (int t = 0; t < R; ++t) x[t] = a.q + (r0 + t) * a.k + b * kBlock;
    __m256i sum[R];
    F::template sums<R>(wq + b * F::kBytes, x, sum);
    const uint16_t* dm = wdm + b * F::kScales;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm)));
    for (int t = 0; t < R; ++t) {
      const int64_t at = (r0 + t) * blocks + b;
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.s[at])),
                               _mm256_cvtepi32_ps(sum[t]), acc[t]);
    }
    if constexpr (F::kScales == 2 * kGroup) {  // the minimums' term: m * (s * sum x)
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + kGroup)));
      for (int t = 0; t < R; ++t) acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sx[(r0 + t) * blocks + b]), acc[t]);
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

#if LOOM_ZMM
// dot_group for groups g and g + 1 at once (w1, d1: g + 1's), their `valid` (up to 16) outputs.
template <typename F, int R>
inline void dot_pair(const Activations<typename F::Act>& a, int64_t r0, const uint8_t* w0,
                     const uint16_t* d0, const uint8_t* w1, const uint16_t* d1, float* out,
                     int64_t out_stride, int64_t valid) {
  const int64_t blocks = a.k / kBlock;
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const typename F::Act* x[R];
    for (int t = 0; t < R; ++t) x[t] = a.q + (r0 + t) * a.k + b * kBlock;
    __m512i sum[R];
    F::template sums2<R>(w0 + b * F::kBytes, w1 + b * F::kBytes, x, sum);
    const int64_t at = b * F::kScales;
    const __m512 d = _mm512_cvtph_ps(join128(d0 + at, d1 + at));
    for (int t = 0; t < R; ++t) {
      const __m512 s = _mm512_set1_ps(a.s[(r0 + t) * blocks + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, s), _mm512_cvtepi32_ps(sum[t]), acc[t]);
    }
    if constexpr (F::kScales == 2 * kGroup) {
      const __m512 m = _mm512_cvtph_ps(join128(d0 + at + kGroup, d1 + at + kGroup));
      for (int t = 0; t < R; ++t)
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sx[(r0 + t) * blocks + b]), acc[t]);
    }
  }
  const __mmask16 lanes = valid >= 2 * kGroup ? 0xFFFF : (1u << valid) - 1;
  for (int t = 0; t < R; ++t) _mm512_mask_storeu_ps(out + (r0 + t) * out_stride, lanes, acc[t]);
}
#endif

// Rows r0 .. r_end - 1 of W groups' outputs (W = 2: g and g + 1, `next` bytes and scales on).
template <typename F, int W, int R>
inline void dot_tile(const Activations<typename F::Act>& a, int64_t r, const uint8_t* wg,
                     const uint16_t* dg, int64_t next_q, int64_t next_dm, float* og, int64_t n,
                     int64_t valid) {
  static_assert(W == 1 || LOOM_ZMM, "two groups at once need the 512-bit registers");
#if LOOM_ZMM
  if constexpr (W == 2) {
    dot_pair<F, R>(a, r, wg, dg, wg + next_q, dg + next_dm, og, n, valid);
    return;
  }
#endif
  dot_group<F, R>(a, r, wg, dg, og, n, valid);
}

template <typename F, int W>
inline void dot_rows(const Activations<typename F::Act>& a, int64_t r, int64_t r_end,
                     const uint8_t* wg, const uint16_t* dg, int64_t next_q, int64_t next_dm,
                     float* og, int64_t n, int64_t valid) {
  for (; r + kRowTile <= r_end; r += kRowTile)
    dot_tile<F, W, kRowTile>(a, r, wg, dg, next_q, next_dm, og, n, valid);
  switch (r_end - r) {
    case 3: dot_tile<F, W, 3>(a, r, wg, dg, next_q, next_dm, og, n, valid); break;
    case 2: dot_tile<F, W, 2>(a, r, wg, dg, next_q, next_dm, og, n, valid); break;
    case 1: dot_tile<F, W, 1>(a, r, wg, dg, next_q, next_dm, og, n, valid); break;
    default: break;
  }
}

// a's rows times a weight [n, K] in the r8 layout of format F (wq [ceil(n / 8), K / 32,
// F::kBytes], wdm [ceil(n / 8), K / 32, F::kScales] float16) into out [rows, n], each thread its
// share of the groups. n is the weight's own: the layout fixes only its group count, and the
// rows padded beyond n are never written. Rows are taken in chunks whose activations stay in L1,
// groups in blocks whose weights stay in L2, so that a large batch reads each from the nearest
// cache.
template <typename F>
void r8_product(const Activations<typename F::Act>& a, int64_t rows, const uint8_t* wq_ptr,
                const uint16_t* wdm_ptr, int64_t n, float* out_ptr) {
  const int64_t k = a.k, blocks = k / kBlock, groups = (n + kGroup - 1) / kGroup;
  const int64_t act_bytes = k * static_cast<int64_t>(sizeof(typename F::Act));
  const int64_t chunk = std::max<int64_t>(kRowTile, (16384 / act_bytes) / kRowTile * kRowTile);
  const int64_t group_block = std::max<int64_t>(1, 131072 / (blocks * F::kBytes));
  share(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g0 = begin; g0 < end; g0 += group_block) {
      for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t r_end = std::min(rows, r0 + chunk);
        const int64_t g_end = std::min(end, g0 + group_block);
        for (int64_t g = g0; g < g_end;) {
          const uint8_t* wg = wq_ptr + g * blocks * F::kBytes;
          const uint16_t* dg = wdm_ptr + g * blocks * F::kScales;
          const int64_t next_q = blocks * F::kBytes, next_dm = blocks * F::kScales;
          float* og = out_ptr + g * kGroup;
          if constexpr (LOOM_ZMM) {
            if (g + 1 < g_end) {
              const int64_t valid = std::min(2 * kGroup, n - g * kGroup);
              dot_rows<F, 2>(a, r0, r_end, wg, dg, next_q, next_dm, og, n, valid);
              g += 2;
              continue;
            }
          }
          const int64_t valid = std::min(kGroup, n - g * kGroup);
          dot_rows<F, 1>(a, r0, r_end, wg, dg, next_q, next_dm, og, n, valid);
          g += 1;
        }
      }
    }
  });
}

// x [..., K] float32 times a weight [n, K] in the r8 layout of format F (r8_product), plus the
// bias.
template <typename F>
at::Tensor r8_linear(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& wdm,
                     int64_t n, const c10::optional<at::Tensor>& bias) {
  const Quantised<typename F::Act> x = quantise<typename F::Act>(x_in);
  const int64_t rows = x.q.size(0), blocks = x.a.k / kBlock;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  check_weight(wq, F::kType, wdm, at::kHalf, bias, n);
  TORCH_CHECK(wq.dim() == 3 && wq.size(0) == groups && wq.size(2) == F::kBytes &&
                  wdm.dim() == 3 && wdm.size(0) == groups && wdm.size(2) == F::kScales,
              "the weight's blocks do not have the r8 layout for ", n, " outputs");
  TORCH_CHECK(wq.size(1) == blocks && wdm.size(1) == blocks, "input size ", x.a.k,
              " does not match the weight");
  at::Tensor out = at::empty({rows, n}, x_in.options());
  r8_product<F>(x.a, rows, reinterpret_cast<const uint8_t*>(wq.data_ptr()),
                reinterpret_cast<const uint16_t*>(wdm.data_ptr()), n, out.data_ptr<float>());
  if (bias.has_value()) add_bias(out.data_ptr<float>(), rows, n, bias->contiguous().data_ptr<float>());
  return finished(out, x_in);
}

}  // namespace

at::Tensor loom::q4r8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wdm,
                             int64_t n, const c10::optional<at::Tensor>& bias) {
  return r8_linear<Q4>(x, wq, wdm, n, bias);
}

void loom::q4r8_into(const float* x, int64_t rows, int64_t k, int8_t* q, float* s, float* sx,
                     const uint8_t* wq, const uint16_t* wdm, int64_t n, const float* bias,
                     float* out) {
  quantize_rows<int8_t>(x, rows, k, q, s, sx);
  r8_product<Q4>({q, s, sx, k}, rows, wq, wdm, n, out);
  if (bias != nullptr) add_bias(out, rows, n, bias);
}

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("q4r8_linear(Tensor x, Tensor wq, Tensor wdm, int n, Tensor? bias) -> Tensor",
        &loom::q4r8_linear);
  m.def("q8r8_linear(Tensor x, Tensor wq, Tensor wdm, int n, Tensor? bias) -> Tensor",
        &r8_linear<Q8>);
}
