// The decode step's other kernels, for x86 CPUs with AVX2, float32 (the KV pool float32 or
// float16): decode attention that reads the paged KV pool in place, and the small operations
// fused (residual add + RMSNorm, rotary + the K/V write, SiLU * up). Built at run time with
// blocks.cpp and layers.cpp by loom/model/kernels/__init__.py; declared in ops.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "region.h"
#include "vec.h"

namespace loom {
namespace {  // the helpers; the entry points (ops.h) are loom's

// exp on 8 floats: n = round(x / ln 2), r = x - n ln 2, Cephes' polynomial for exp(r) on
// |r| <= ln 2 / 2, times 2^n. x is clamped to [-87.3, 88.3]: below, exp gives 2^-126 (softmax
// zeroes what it must; SiLU divides by it), above, about 2^127.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Asks for a block's rows of one head (dim values at a stride of row) to be brought into L2.
// Into L2, not L1: a request to L1 holds one of its few miss buffers until the line arrives,
// and a block's rows fill them (16 rows of a 64-dim fp16 head: 16 lines of keys, 16 of values;
// 64 sequences' attention at 192 tokens: 37 ms into L1, 24 ms into L2, on a Zen 4).
template <typename T>
inline void prefetch_block(const T* block, int64_t rows, int64_t row, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t at = 0; at < dim * static_cast<int64_t>(sizeof(T)); at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + r * row) + at, _MM_HINT_T1);
}

// Decode attention for one sequence and one KV head, the G query heads that share it: scores,
// softmax, the weighted sum of values, over keys first .. len - 1 (first > 0: a sliding window;
// the blocks before first's may have been freed, and are never read). Keys and values are read
// in place, a block at a time through the block table. V = head_dim / 8 is a template argument
// so that a row's accumulators stay in registers; T is the pool's element type. softcap > 0
// turns each score s into softcap * tanh(s / softcap) (Gemma 2).
template <typename T, int V>
void attend(const float* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t first,
            int64_t len, int64_t block_size, int64_t row, int64_t group, float scale, float softcap,
            float* out, std::vector<float>& scores) {
  constexpr int64_t dim = 8 * V;
  const int64_t stride = (len + 7) / 8 * 8, start = first / block_size * block_size;
  scores.resize(group * stride);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * dim;
    float* sg = scores.data() + g * stride;
    for (int64_t l0 = start; l0 < len; l0 += block_size) {
      const T* k = k_pool + table[l0 / block_size] * block_size * row;
      const int64_t rows = std::min(block_size, len - l0);
      if (g == 0 && l0 + block_size < len) {  // the next keys' block, this block's values
        prefetch_block(k_pool + table[l0 / block_size + 1] * block_size * row, block_size, row, dim);
        prefetch_block(v_pool + table[l0 / block_size] * block_size * row, block_size, row, dim);
      }
      int64_t r = 0;
      for (; r + 8 <= rows; r += 8, k += 8 * row) {  // 8 keys at once: one sum of 8 vectors
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(k + j * row));
        for (int i = 1; i < V; ++i)
          for (int j = 0; j < 8; ++j)
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * i), load8(k + j * row + 8 * i), acc[j]);
        _mm256_storeu_ps(sg + l0 + r, _mm256_mul_ps(loom::hsum8(acc), _mm256_set1_ps(scale)));
      }
      for (; r < rows; ++r, k += row) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(k));
        for (int i = 1; i < V; ++i)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * i), load8(k + 8 * i), acc);
        sg[l0 + r] = hsum(acc) * scale;
      }
    }
    if (softcap > 0)
      for (int64_t l = first; l < len; ++l) sg[l] = softcap * std::tanh(sg[l] / softcap);
    float max = sg[first];
    for (int64_t l = first + 1; l < len; ++l) max = std::max(max, sg[l]);
    __m256 total = _mm256_setzero_ps();
    const __m256 vmax = _mm256_set1_ps(max);
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lo = _mm256_set1_ps(static_cast<float>(first));
    const __m256 hi = _mm256_set1_ps(static_cast<float>(len));
    for (int64_t l = first / 8 * 8; l < stride; l += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + l), vmax));
      if (l < first || l + 8 > len) {  // zero the lanes before first and past len (stale)
        const __m256 index = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(l)), lanes);
        e = _mm256_and_ps(e, _mm256_and_ps(_mm256_cmp_ps(index, lo, _CMP_GE_OQ),
                                           _mm256_cmp_ps(index, hi, _CMP_LT_OQ)));
      }
      _mm256_storeu_ps(sg + l, e);
      total = _mm256_add_ps(total, e);
    }
    __m256 acc[V];
    for (int i = 0; i < V; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t l0 = start; l0 < len; l0 += block_size) {
      const int64_t skip = std::max<int64_t>(0, first - l0);  // keys before the window
      const T* v = v_pool + table[l0 / block_size] * block_size * row + skip * row;
      const int64_t rows = std::min(block_size, len - l0);
      for (int64_t r = skip; r < rows; ++r, v += row) {
        const __m256 p = _mm256_set1_ps(sg[l0 + r]);
        for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), acc[i]);
      }
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum(total));
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(out + g * dim + 8 * i, _mm256_mul_ps(acc[i], inv));
  }
}

// The pool's K and V: float32 or float16, contiguous, alike, on the CPU.
inline void check_pool(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf,
              "the pool must be float32 or float16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.device().is_cpu() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "the pool's K and V must match, contiguous, on the CPU");
}

// Every sequence's attention over a pool of T (float or at::Half), out [S, H_q, D]: the pool
// [blocks, block_size, H_kv, D], the lengths checked (check_lengths).
template <typename T>
void attend_all(const float* qp, int64_t seqs, int64_t heads, int64_t dim, const T* kp,
                const T* vp, int64_t block_size, int64_t kv_heads, const int64_t* tp,
                int64_t max_blocks, const int64_t* lp, double scale, int64_t window,
                double softcap, float* op) {
  const int64_t group = heads / kv_heads;
  auto* kernel = dim == 16 ? &attend<T, 2> : dim == 32 ? &attend<T, 4> : dim == 64 ? &attend<T, 8>
                                                                       : &attend<T, 16>;
  const int64_t row = kv_heads * dim;
  // Few sequences: a task per query head, so that both cores have work at one sequence; many:
  // a task per KV head, its query heads sharing each key and value as it is read.
  const int64_t per_task = seqs * kv_heads < 2 * threads() ? 1 : group;
  share(0, seqs * heads / per_task, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task * per_task / heads, head = task * per_task % heads, len = lp[s];
      const int64_t at = (s * heads + head) * dim, h = head / group;
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      kernel(qp + at, kp + h * dim, vp + h * dim, tp + s * max_blocks, first, len, block_size, row,
             per_task, static_cast<float>(scale), static_cast<float>(softcap), op + at, scores);
    }
  });
}

}  // namespace

void check_lengths(const at::Tensor& lens, int64_t seqs, int64_t most) {
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == seqs,
              "a length per sequence");
  for (int64_t s = 0; s < seqs; ++s)
    TORCH_CHECK(lens.data_ptr<int64_t>()[s] >= 1 && lens.data_ptr<int64_t>()[s] <= most,
                "sequence length out of range");
}

void attend_into(const float* q, int64_t seqs, int64_t heads, int64_t dim,
                 const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* tables,
                 int64_t max_blocks, const int64_t* lens, double scale, int64_t window,
                 double softcap, float* out) {
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  if (k_cache.scalar_type() == at::kHalf)
    attend_all<at::Half>(q, seqs, heads, dim, k_cache.data_ptr<at::Half>(),
                         v_cache.data_ptr<at::Half>(), block_size, kv_heads, tables, max_blocks,
                         lens, scale, window, softcap, out);
  else
    attend_all<float>(q, seqs, heads, dim, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                      block_size, kv_heads, tables, max_blocks, lens, scale, window, softcap, out);
}

// Decode attention read in place from the paged pool: query [S, H_q, D] (one token per
// sequence), k/v cache [blocks, block_size, H_kv, D], block_tables [S, B] (int64), seq_lens [S]:
// sequence s attends its first seq_lens[s] keys, key l at row l % block_size of block
// block_tables[s][l / block_size]; window > 0: only its last `window` keys (transformers'
// sliding window); softcap > 0: scores soft-capped. D is 16, 32, 64 or 128.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  double softcap) {
  TORCH_CHECK(query.scalar_type() == at::kFloat, "paged_decode_attention takes float32 queries");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  check_pool(k_cache, v_cache);
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "query and pool do not match");
  TORCH_CHECK(q.device().is_cpu() && block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "the queries, block tables and lengths must be on the CPU");
  TORCH_CHECK(tables.size(0) == seqs && lens.numel() == seqs, "a block table and length per sequence");
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(tables.data_ptr<int64_t>()[i] >= 0 && tables.data_ptr<int64_t>()[i] < num_blocks,
                "block table entry out of range");
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128,
              "head_dim must be 16, 32, 64 or 128, not ", dim);
  check_lengths(lens, seqs, tables.size(1) * k_cache.size(1));
  at::Tensor out = at::empty_like(q);
  attend_into(q.data_ptr<float>(), seqs, heads, dim, k_cache, v_cache, tables.data_ptr<int64_t>(),
              tables.size(1), lens.data_ptr<int64_t>(), scale, window, softcap,
              out.data_ptr<float>());
  return out;
}

// RMSNorm of each row of x [T, H] (float32), after adding `delta` to x in place when given (the
// residual stream): x * rsqrt(mean(x^2) + eps) * weight, as transformers' LlamaRMSNorm.
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "add_rms_norm takes contiguous float32 [T, H]");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(h % 8 == 0 && weight.numel() == h, "hidden size must be a multiple of 8");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() &&
                  (!delta.has_value() || delta->device().is_cpu()),
              "add_rms_norm runs on the CPU");
  at::Tensor d;
  if (delta.has_value()) d = delta->contiguous();
  TORCH_CHECK(!delta.has_value() || (d.sizes() == x.sizes() && d.scalar_type() == at::kFloat),
              "delta must match x");
  const float* dp = delta.has_value() ? d.data_ptr<float>() : nullptr;
  const at::Tensor w = weight.contiguous();
  const float* wp = w.data_ptr<float>();
  at::Tensor out = at::empty_like(x);
  rms_norm_into(x.data_ptr<float>(), dp, wp, rows, h, eps, out.data_ptr<float>());
  return out;
}

void rms_norm_into(float* xp, const float* dp, const float* wp, int64_t rows, int64_t h,
                   double eps, float* op) {
  share(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * h;
      __m256 squares = _mm256_setzero_ps();
      for (int64_t i = 0; i < h; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        if (dp != nullptr) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(dp + r * h + i));
          _mm256_storeu_ps(xr + i, v);
        }
        squares = _mm256_add_ps(squares, _mm256_mul_ps(v, v));
      }
      const float inv = 1.0f / std::sqrt(hsum(squares) / static_cast<float>(h) + static_cast<float>(eps));
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int64_t i = 0; i < h; i += 8)
        _mm256_storeu_ps(op + r * h + i, _mm256_mul_ps(_mm256_loadu_ps(wp + i),
                                                       _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv)));
    }
  });
}

namespace {

// rotary_write_kv's rows, into a pool of T (float or at::Half) of kv_heads heads of dim.
template <typename T>
void rotary_rows(const float* in, int64_t tokens, const float* cp, const float* sp,
                 const int64_t* slot, T* kp, T* vp, int64_t kv_heads, int64_t dim,
                 int64_t num_heads, float* qp) {
  const int64_t half = dim / 2, width = (num_heads + 2 * kv_heads) * dim;
  share(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = in + t * width;
      const float* c = cp + t * dim;
      const float* sn = sp + t * dim;
      for (int64_t head = 0; head < num_heads + kv_heads; ++head) {
        const float* x = row + head * dim;
        for (int64_t i = 0; i < dim; i += 8) {
          const int64_t j = i < half ? i + half : i - half;  // roll by half
          const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(c + i));
          const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(sn + i));
          if (head < num_heads)
            _mm256_storeu_ps(qp + (t * num_heads + head) * dim + i, _mm256_add_ps(a, b));
          else
            store8(kp + (slot[t] * kv_heads + head - num_heads) * dim + i, _mm256_add_ps(a, b));
        }
      }
      const float* v = row + (num_heads + kv_heads) * dim;
      for (int64_t i = 0; i < kv_heads * dim; i += 8)
        store8(vp + slot[t] * kv_heads * dim + i, _mm256_loadu_ps(v + i));
    }
  });
}

}  // namespace

void rotary_into(const float* qkv, int64_t tokens, const float* cos, const float* sin,
                 const int64_t* slots, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 int64_t num_heads, float* q) {
  const int64_t kv_heads = k_cache.size(2), dim = k_cache.size(3);
  if (k_cache.scalar_type() == at::kHalf)
    rotary_rows<at::Half>(qkv, tokens, cos, sin, slots, k_cache.data_ptr<at::Half>(),
                          v_cache.data_ptr<at::Half>(), kv_heads, dim, num_heads, q);
  else
    rotary_rows<float>(qkv, tokens, cos, sin, slots, k_cache.data_ptr<float>(),
                       v_cache.data_ptr<float>(), kv_heads, dim, num_heads, q);
}

// The attention block's elementwise work between the qkv product and attention, in one pass:
// rotary embedding of q and k (x * cos + roll(x, D / 2) * sin, where sin's first half is
// negated: transformers' rotate_half), then k and v written to the pool at their slots.
// qkv [T, (H_q + 2 H_kv) D]; cos, sin [T, D]; returns q [T, H_q, D].
at::Tensor rotary_write_kv(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                           const at::Tensor& sin_in, const at::Tensor& slots_in,
                           at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads) {
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(qkv.scalar_type() == at::kFloat, "rotary_write_kv takes float32");
  check_pool(k_cache, v_cache);
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t half = dim / 2, width = (num_heads + 2 * kv_heads) * dim;
  TORCH_CHECK(qkv.size(1) == width && half % 8 == 0, "qkv does not match the heads");
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu() &&
                  slots.device().is_cpu(),
              "qkv, cos, sin and the slots must be on the CPU");
  TORCH_CHECK(slots.numel() == tokens && cos.numel() == tokens * dim && sin.numel() == tokens * dim,
              "a slot, cos and sin per token");
  const int64_t num_slots = k_cache.numel() / (kv_heads * dim);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots.data_ptr<int64_t>()[t] >= 0 && slots.data_ptr<int64_t>()[t] < num_slots,
                "slot out of range");
  at::Tensor q = at::empty({tokens, num_heads, dim}, qkv.options());
  rotary_into(qkv.data_ptr<float>(), tokens, cos.data_ptr<float>(), sin.data_ptr<float>(),
              slots.data_ptr<int64_t>(), k_cache, v_cache, num_heads, q.data_ptr<float>());
  return q;
}

// The MLP's activation: gate_up [T, 2I] (gate, then up) -> SiLU(gate) * up [T, I], with
// SiLU(g) = g / (1 + exp(-g)), torch's formula, with exp8 for exp (so within rounding of torch).
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.device().is_cpu(),
              "silu_mul takes float32 [T, 2I] on the CPU");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(width % 8 == 0 && gate_up.size(1) == 2 * width, "intermediate size must be a multiple of 8");
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  silu_mul_into(gate_up.data_ptr<float>(), rows, width, out.data_ptr<float>());
  return out;
}

void silu_mul_into(const float* in, int64_t rows, int64_t width, float* op) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  share(0, rows * (width / 8), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / (width / 8), c = i % (width / 8) * 8;
      const __m256 g = _mm256_loadu_ps(in + r * 2 * width + c);
      const __m256 u = _mm256_loadu_ps(in + r * 2 * width + width + c);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign))));
      _mm256_storeu_ps(op + r * width + c, _mm256_mul_ps(silu, u));
    }
  });
}

}  // namespace loom

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0) -> Tensor",
        &loom::paged_decode_attention);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &loom::silu_mul);
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor", &loom::add_rms_norm);
  m.def("rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int num_heads) -> Tensor", &loom::rotary_write_kv);
}
