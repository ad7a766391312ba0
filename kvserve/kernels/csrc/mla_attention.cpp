// Decode attention of multi-head latent attention (MLA: DeepSeek-V2/V3) in its absorbed form,
// over the latent cache read in place through the block table (kvserve/kv/latent.py): no
// gathered copy, nothing expanded to per-head K and V.
//
//   q        [B, H, R + P]          per head: q_latent (W_UK folded in) | q_rope
//   cache    [num_blocks, BS, 1, R + P]  per token: |<- latent c (R) ->|<- k_rope (P) ->|
//   tables   [B, max_blocks] int64   ctx_lens [B] int64
//   window   0, or W: each query attends to its context's last W positions only
//   out      [B, H, R]               sum_j p_j c_j, in latent space (the model applies W_UV)
//
//   score_j = scale * (q_latent . c_j + q_rope . k_rope_j) = scale * (q . row_j)
//
// Every head reads the same row of a token (multi-query attention with one 576-wide key and its
// 512-wide latent as value), so each block's rows are turned into fp32 once (a pointer into the
// cache for fp32, or a small buffer) and serve all H heads. Formats:
//
//   dense   fp32 / bf16 / fp16 rows as stored
//   int8    code * s, s per token: s[0] for the latent, s[1] for the rotary key ([nb, BS, 2] fp32)
//   fp8     value(code) * s, the same two scales per token (the 256 code values in a table)
//
// Each context is split into parts along its blocks (one task a part, so batch 1 keeps every
// thread busy), the softmax kept online within a part (running max m, sum l of e^(s - m), sum acc
// of e^(s - m) c per head) and the parts merged at the end. Scores and accumulation are fp32.
// The tasks are split over the threads by the blocks each reads (parallel_tasks.h).
// Dot products and the weighted sums take 16 lanes (AVX-512), 8 lanes (AVX2) or plain loops
// (portable); setup.py builds this file once per level, `isa()` names the build.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include "context_parts.h"
#include "parallel_tasks.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

// sum of a[d] * b[d] over d < n
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  int64_t d = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (; d + 32 <= n; d += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), s1);
  }
  for (; d + 16 <= n; d += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), s0);
  sum = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  for (; d + 8 <= n; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
  const __m256 s = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  sum = _mm_cvtss_f32(h);
#endif
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// a[d] = a[d] * c + p * v[d] over d < n (c rescales the running sum when the max rises)
inline void scale_add(float* __restrict__ a, float c, float p, const float* __restrict__ v, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 cc = _mm512_set1_ps(c), pp = _mm512_set1_ps(p);
  for (; d + 16 <= n; d += 16)
    _mm512_storeu_ps(a + d, _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + d), _mm512_mul_ps(cc, _mm512_loadu_ps(a + d))));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 cc = _mm256_set1_ps(c), pp = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(a + d, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + d), _mm256_mul_ps(cc, _mm256_loadu_ps(a + d))));
#endif
  for (; d < n; ++d) a[d] = a[d] * c + p * v[d];
}

// ---- sources: a block's n rows [n, W] as fp32 (W = R + P) ----
template <typename T>
struct Dense {
  const T* cache;
  int64_t BS, W;
  const float* rows(int64_t blk, int64_t n, float* buf) const {
    const T* base = cache + blk * BS * W;
    if constexpr (std::is_same_v<T, float>) {
      return base;
    } else {
      for (int64_t i = 0; i < n * W; ++i) buf[i] = static_cast<float>(base[i]);
      return buf;
    }
  }
};

// int8 and fp8 codes: decode(code) * the latent's or the rotary key's scale of the token
template <typename Code, typename Decode>
struct Quant {
  const Code* codes;
  const float* scale;  // [nb, BS, 2]
  int64_t BS, W, R;
  Decode decode;
  const float* rows(int64_t blk, int64_t n, float* buf) const {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = blk * BS + i;
      const Code* __restrict__ r = codes + slot * W;
      float* __restrict__ o = buf + i * W;
      const float sc = scale[2 * slot], sr = scale[2 * slot + 1];
      for (int64_t d = 0; d < R; ++d) o[d] = decode(r[d]) * sc;
      for (int64_t d = R; d < W; ++d) o[d] = decode(r[d]) * sr;
    }
    return buf;
  }
};

struct Int8Code {
  float operator()(int8_t c) const { return static_cast<float>(c); }
};

struct Fp8Code {
  const float* table;  // [256]
  float operator()(uint8_t c) const { return table[c]; }
};

// How contexts are cut into parts: context_parts.h (shared with paged_attention.cpp).
using kvserve::longest_attended;
using kvserve::part_blocks;
using kvserve::parts_per_sequence;
using kvserve::window_begin;

struct Dims {
  int64_t B, H, W, R, BS, max_blocks, window;
};

// One part of one sequence: blocks [pb0, pb1) of positions [first, len), every head, online
// softmax into m [H], l [H], acc [H, R].
template <typename Src>
void attend_part(const float* qf, const Src& src, const int64_t* table, int64_t first, int64_t len, int64_t pb0,
                 int64_t pb1, const Dims& d, float* buf, float* s, float* m, float* l, float* acc) {
  for (int64_t blk = pb0; blk < pb1; ++blk) {
    const int64_t t0 = blk * d.BS, i0 = std::max<int64_t>(0, first - t0), n = std::min(d.BS, len - t0);
    const float* rows = src.rows(table[blk], n, buf);
    for (int64_t h = 0; h < d.H; ++h) {
      float bmax = -std::numeric_limits<float>::infinity();
      for (int64_t i = i0; i < n; ++i) {
        s[i] = dot(qf + h * d.W, rows + i * d.W, d.W);
        bmax = std::max(bmax, s[i]);
      }
      const float mn = std::max(m[h], bmax);
      float c = std::exp(m[h] - mn);  // 0 on the first block
      float* a = acc + h * d.R;
      for (int64_t i = i0; i < n; ++i) {
        const float p = std::exp(s[i] - mn);
        l[h] = l[h] * c + p;
        scale_add(a, c, p, rows + i * d.W, d.R);
        c = 1.f;
      }
      m[h] = mn;
    }
  }
}

template <typename scalar_t, typename Src>
void decode(const scalar_t* q, const Src& src, const int64_t* tables, const int64_t* lens, scalar_t* out,
            const Dims& d, float scale) {
  const int64_t P = parts_per_sequence(d.B, longest_attended(lens, d.B, d.window)), H = d.H, R = d.R, W = d.W;
  std::vector<float> part_m(d.B * P * H), part_l(d.B * P * H), part_acc(d.B * P * H * R);
  // a task's cost: the blocks it reads, and one for what it does before reading any
  const auto cost = [&](int64_t idx) {
    const int64_t b = idx / P;
    const auto [pb0, pb1] = part_blocks(window_begin(lens[b], d.window), lens[b], d.BS, P, idx % P);
    return std::max<int64_t>(0, pb1 - pb0) + 1;
  };
  kvserve::parallel_by_cost(d.B * P, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * W), buf(d.BS * W), s(d.BS);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / P, part = idx % P, first = window_begin(lens[b], d.window), len = lens[b];
      float* m = part_m.data() + idx * H;
      float* l = part_l.data() + idx * H;
      float* acc = part_acc.data() + idx * H * R;
      std::fill(m, m + H, -std::numeric_limits<float>::infinity());
      std::fill(l, l + H, 0.f);
      std::fill(acc, acc + H * R, 0.f);
      const auto [pb0, pb1] = part_blocks(first, len, d.BS, P, part);
      if (pb0 >= pb1) continue;
      for (int64_t i = 0; i < H * W; ++i) qf[i] = static_cast<float>(q[b * H * W + i]) * scale;
      attend_part(qf.data(), src, tables + b * d.max_blocks, first, len, pb0, pb1, d, buf.data(), s.data(), m, l,
                  acc);
    }
  });
  // merge: out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M), M the largest m_p
  at::parallel_for(0, d.B * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(R);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float M = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t p = 0; p < P; ++p) M = std::max(M, part_m[(b * P + p) * H + h]);
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t at = (b * P + p) * H + h;
        if (part_l[at] == 0.f) continue;  // a part with no positions
        const float w = std::exp(part_m[at] - M);
        sum += part_l[at] * w;
        scale_add(o.data(), 1.f, w, part_acc.data() + at * R, R);
      }
      for (int64_t e = 0; e < R; ++e) out[bh * R + e] = static_cast<scalar_t>(o[e] / sum);
    }
  });
}

// ---- entry points: one per format; they check shapes and dispatch on the query dtype ----
struct Call {
  at::Tensor q, tables, lens, out;
  Dims d;
};

Call prepare(const at::Tensor& q, const at::Tensor& cache, int64_t rank, const at::Tensor& tables,
             const at::Tensor& lens, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "mla_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4 && cache.size(2) == 1,
              "q [B, H, R + P] and a latent cache [num_blocks, BS, 1, R + P]");
  TORCH_CHECK(cache.is_contiguous(), "a contiguous latent cache");
  TORCH_CHECK(q.size(2) == cache.size(3), "q's width ", q.size(2), " is not the cache row's ", cache.size(3));
  TORCH_CHECK(rank > 0 && rank <= cache.size(3), "kv_lora_rank ", rank, " outside the row of ", cache.size(3));
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 tables and lengths");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lens.numel() == q.size(0),
              "tables [B, max_blocks] and lengths [B] for B queries");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  at::Tensor qc = q.contiguous();
  Call c{qc, tables.contiguous(), lens.contiguous(), at::empty({q.size(0), q.size(1), rank}, q.options()),
         Dims{q.size(0), q.size(1), q.size(2), rank, cache.size(1), tables.size(1), window}};
  return c;
}

template <typename Src>
at::Tensor run(Call& c, const Src& src, double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, c.q.scalar_type(), "mla_decode", [&] {
    decode(c.q.data_ptr<scalar_t>(), src, c.tables.data_ptr<int64_t>(), c.lens.data_ptr<int64_t>(),
           c.out.data_ptr<scalar_t>(), c.d, static_cast<float>(scale));
  });
  return c.out;
}

at::Tensor mla_decode(at::Tensor q, at::Tensor kv, int64_t rank, at::Tensor tables, at::Tensor lens, double scale,
                      int64_t window) {
  Call c = prepare(q, kv, rank, tables, lens, window);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, kv.scalar_type(), "mla_cache", [&] {
    out = run(c, Dense<scalar_t>{kv.data_ptr<scalar_t>(), c.d.BS, c.d.W}, scale);
  });
  return out;
}

void check_scales(const at::Tensor& kv, const at::Tensor& scale) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 3
              && scale.size(0) == kv.size(0) && scale.size(1) == kv.size(1) && scale.size(2) == 2,
              "fp32 scales [num_blocks, BS, 2] (latent, rotary key) beside the codes");
}

at::Tensor mla_decode_int8(at::Tensor q, at::Tensor kv, at::Tensor scale_t, int64_t rank, at::Tensor tables,
                           at::Tensor lens, double scale, int64_t window) {
  Call c = prepare(q, kv, rank, tables, lens, window);
  TORCH_CHECK(kv.scalar_type() == at::kChar, "int8 latent codes");
  check_scales(kv, scale_t);
  using Src = Quant<int8_t, Int8Code>;
  return run(c, Src{kv.data_ptr<int8_t>(), scale_t.data_ptr<float>(), c.d.BS, c.d.W, rank, Int8Code{}}, scale);
}

at::Tensor mla_decode_fp8(at::Tensor q, at::Tensor kv, at::Tensor scale_t, int64_t rank, at::Tensor table,
                          at::Tensor tables, at::Tensor lens, double scale, int64_t window) {
  Call c = prepare(q, kv, rank, tables, lens, window);
  TORCH_CHECK(kv.scalar_type() == at::kByte, "fp8 latent codes (uint8)");
  TORCH_CHECK(table.numel() == 256 && table.scalar_type() == at::kFloat && table.is_contiguous(),
              "a 256-entry fp32 table of the fp8 code values");
  check_scales(kv, scale_t);
  using Src = Quant<uint8_t, Fp8Code>;
  return run(c, Src{kv.data_ptr<uint8_t>(), scale_t.data_ptr<float>(), c.d.BS, c.d.W, rank,
                    Fp8Code{table.data_ptr<float>()}}, scale);
}

std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("mla_decode", &mla_decode, "absorbed MLA decode over a dense latent paged cache (CPU)");
  m.def("mla_decode_int8", &mla_decode_int8, "absorbed MLA decode over an int8 latent paged cache (CPU)");
  m.def("mla_decode_fp8", &mla_decode_fp8, "absorbed MLA decode over an fp8 latent paged cache (CPU)");
}
