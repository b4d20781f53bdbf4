// Helpers shared by Loom's CPU kernels (blocks.cpp, step.cpp): AVX2, float32.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

namespace loom {

// The sum of 8 floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of 8 vectors, as one: lane j holds the sum of v[j]'s 8 floats.
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The pool holds float32 or float16 (`--kv-cache-dtype`): 8 of its values as floats, and back.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Into float16, saturated at its largest finite value (65504): a key past it is kept as the
// largest rather than made inf, which would turn every score it meets into NaN.
inline void store8(at::Half* p, __m256 v) {
  const __m256 top = _mm256_set1_ps(65504.0f);
  v = _mm256_max_ps(_mm256_min_ps(v, top), _mm256_sub_ps(_mm256_setzero_ps(), top));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace loom
