// Decode attention over a paged KV cache on CPU: one query token per sequence attends to its
// context, read in place through its block table (no gathered copy of K/V).
//
//   q        [B, H, D]                  (H = KVH * G query heads; G share one K/V head)
//   k_cache  [num_blocks, BS, KVH, D]   v_cache likewise
//   tables   [B, max_blocks] int64      ctx_lens [B] int64
//   out      [B, H, D]
//
// Work is split over (sequence, kv head) pairs; each pair streams its K and V rows once and
// serves all G query heads of its group. Scores and accumulation are in fp32.
//
// Two paths: a portable loop for any shape and any x86-64, and an AVX-512 one for the common
// head dims. The build decides which exist (kvserve/kernels builds this file once per
// instruction-set level and loads the one the CPU runs); `isa()` names the build.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// Calls row(t, ptr) for each token t in [0, L), ptr pointing at its K (or V) row for KV head kh;
// the block table is read once per block, not once per token.
template <typename scalar_t, typename RowFn>
inline void for_each_row(const scalar_t* cache, const int64_t* table, int64_t L, int64_t BS, int64_t KVH,
                         int64_t kh, int64_t D, RowFn&& row) {
  for (int64_t t0 = 0; t0 < L; t0 += BS) {
    const scalar_t* block = cache + (table[t0 / BS] * BS * KVH + kh) * D;
    const int64_t n = std::min(BS, L - t0);
    for (int64_t i = 0; i < n; ++i) row(t0 + i, block + i * KVH * D);
  }
}

// The G query heads of sequence b that share KV head kh, as fp32 times the softmax scale:
// qf [G, D].
template <typename scalar_t>
inline void scaled_queries(const scalar_t* q, int64_t b, int64_t kh, int64_t H, int64_t G, int64_t D,
                           float scale, float* qf) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[(b * H + kh * G + g) * D + d]) * scale;
}

template <typename scalar_t>
void decode_impl(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* tables,
                 const int64_t* ctx_lens, scalar_t* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                 int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), kf(D), scores, row_max(G), row_sum(G);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH, L = ctx_lens[b];
      const int64_t* table = tables + b * max_blocks;
      scaled_queries(q, b, kh, H, G, D, scale, qf.data());
      scores.assign(G * L, 0.f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      for_each_row(kc, table, L, BS, KVH, kh, D, [&](int64_t t, const scalar_t* k) {
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * L + t] = s;
          row_max[g] = std::max(row_max[g], s);
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          const float e = std::exp(scores[g * L + t] - row_max[g]);
          scores[g * L + t] = e;
          sum += e;
        }
        row_sum[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(vc, table, L, BS, KVH, kh, D, [&](int64_t t, const scalar_t* v) {
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * kf[d];
        }
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + kh * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d] / row_sum[g]);
    }
  });
}


#if defined(__AVX512F__)
// The same computation with AVX-512 when head_dim is 16, 32, 64 or 128: a K/V row is D/16
// vectors (bf16 widened to fp32 by a shift), each query head's dot product is D/16 FMAs and one
// horizontal sum, and the exponentials are evaluated 16 at a time. Same two passes, same fp32
// arithmetic up to summation order.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for x <= 0: 2^n * 2^f with |f| <= 1/2, 2^f from a degree-6 Taylor polynomial in f*ln2
// (relative error about 1e-7), 2^n applied exactly by scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

template <typename scalar_t, int NV>  // NV = D / 16
void decode_avx512(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* tables,
                   const int64_t* ctx_lens, scalar_t* out, int64_t B, int64_t H, int64_t KVH,
                   int64_t BS, int64_t max_blocks, float scale) {
  constexpr int64_t D = NV * 16;
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH, L = ctx_lens[b];
      const int64_t* table = tables + b * max_blocks;
      scaled_queries(q, b, kh, H, G, D, scale, qf.data());
      const int64_t Lp = (L + 15) / 16 * 16;  // scores padded to whole vectors
      if (static_cast<int64_t>(scores.size()) < G * Lp) scores.resize(G * Lp);
      // pass 1: scores
      for_each_row(kc, table, L, BS, KVH, kh, D, [&](int64_t t, const scalar_t* k) {
        __m512 kv[NV];
        for (int j = 0; j < NV; ++j) kv[j] = load16(k + 16 * j);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          __m512 s = _mm512_mul_ps(load16(qg), kv[0]);
          for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(load16(qg + 16 * j), kv[j], s);
          scores[g * Lp + t] = _mm512_reduce_add_ps(s);
        }
      });
      // softmax numerators, 16 at a time; the padding gets -inf and so weight 0
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * Lp;
        for (int64_t t = L; t < Lp; ++t) sg[t] = -std::numeric_limits<float>::infinity();
        __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < Lp; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + t));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < Lp; t += 16) {
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mx));
          _mm512_storeu_ps(sg + t, e);
          sum = _mm512_add_ps(sum, e);
        }
        const float inv = 1.f / _mm512_reduce_add_ps(sum);
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      // pass 2: weighted sum of V
      __m512 o[8][NV];  // G <= 8 on this path
      for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) o[g][j] = _mm512_setzero_ps();
      for_each_row(vc, table, L, BS, KVH, kh, D, [&](int64_t t, const scalar_t* v) {
        __m512 vv[NV];
        for (int j = 0; j < NV; ++j) vv[j] = load16(v + 16 * j);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * Lp + t]);
          for (int j = 0; j < NV; ++j) o[g][j] = _mm512_fmadd_ps(p, vv[j], o[g][j]);
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        float tmp[D];
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(tmp + 16 * j, o[g][j]);
        for (int64_t d = 0; d < D; ++d) out[(b * H + kh * G + g) * D + d] = static_cast<scalar_t>(tmp[d]);
      }
    }
  });
}

// True when the fast path ran (head_dim 16/32/64/128, at most 8 query heads per K/V head).
template <typename scalar_t>
bool try_avx512(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* tables,
                const int64_t* lens, scalar_t* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                int64_t BS, int64_t max_blocks, float scale) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    if (H / KVH > 8) return false;
    switch (D) {
      case 16: decode_avx512<scalar_t, 1>(q, kc, vc, tables, lens, out, B, H, KVH, BS, max_blocks, scale); return true;
      case 32: decode_avx512<scalar_t, 2>(q, kc, vc, tables, lens, out, B, H, KVH, BS, max_blocks, scale); return true;
      case 64: decode_avx512<scalar_t, 4>(q, kc, vc, tables, lens, out, B, H, KVH, BS, max_blocks, scale); return true;
      case 128: decode_avx512<scalar_t, 8>(q, kc, vc, tables, lens, out, B, H, KVH, BS, max_blocks, scale); return true;
      default: return false;
    }
  }
}
#endif

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && ctx_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "one dtype");
  auto tables = block_tables.contiguous();
  auto lens = ctx_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "shape mismatch");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
#if defined(__AVX512F__)
    if (try_avx512<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                             B, H, KVH, D, BS, tables.size(1), static_cast<float>(scale)))
      return;
#endif
    decode_impl<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                          B, H, KVH, D, BS, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "portable";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (CPU)");
}
