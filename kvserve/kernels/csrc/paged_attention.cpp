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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(b * H + kh * G + g) * D + d]) * scale;
      scores.assign(G * L, 0.f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < L; ++t) {
        const scalar_t* k = kc + ((table[t / BS] * BS + t % BS) * KVH + kh) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * L + t] = s;
          row_max[g] = std::max(row_max[g], s);
        }
      }
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
      for (int64_t t = 0; t < L; ++t) {
        const scalar_t* v = vc + ((table[t / BS] * BS + t % BS) * KVH + kh) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * kf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + kh * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d] / row_sum[g]);
    }
  });
}

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
    decode_impl<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                          B, H, KVH, D, BS, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (CPU)");
}
