// Causal attention of a prompt's chunk on CPU: Lq queries over Lk keys, the chunk's positions
// being the last Lq of the Lk (query i sees keys 0 .. Lk - Lq + i), in fp32 over fp32 or bf16
// keys and values (what a dense cache gives back), as flash attention does it: each task takes
// up to 16 positions of one K/V head's query heads and walks the keys in blocks of up to 64 (four
// sub-blocks of 16), the softmax online, never holding more than a block's scores.
//
//   q    [Lq, H, D] fp32      (H = KVH * G query heads; G share one K/V head)
//   k, v [Lk, KVH, D] fp32 or bf16, rows any stride apart (each row's heads contiguous)
//   out  [Lq, H, D] fp32
//
// A key block is turned to fp32 once a task, keys transposed ([D][16] a sub-block: a query's 16
// scores are one vector of multiply-adds over D) and values as rows (a row of weights times the
// block's rows of V). Scores take 8 query rows at a time (AVX2 and portable: 4), the weighted sum
// of V up to 128 channels of 2 rows or 1 (AVX2 and portable: 64), their sums in registers over
// the block. D is a template argument, one of head_dims(): the compiler vectorizes the
// fixed-size loops at the build's level (setup.py builds this file once per level: portable,
// AVX2, AVX-512), and the exponentials use vec_math.h's where the level has them.
//
// Each query's keys are summed in the same order, blocks from position 0, whichever chunk the
// query is in: the kernel gives a query the same numbers in a whole prompt or in any chunk of it
// (built without -fassociative-math, so that the compiler keeps the sums' order: levels.py).
// Tasks are split over threads by their keys (a causal chunk's last positions read the most), as
// evenly as whole tasks allow.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include <pybind11/stl.h>                // head_dims' list
#include "parallel_tasks.h"
#include "vec_math.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int64_t kKeys = 16;       // keys a sub-block (a vector of scores)
constexpr int64_t kSubBlocks = 4;   // sub-blocks a softmax step takes at most (64 keys)
constexpr int64_t kWidth = kKeys * kSubBlocks;
constexpr int64_t kPositions = 16;  // query positions a task
#if defined(__AVX512F__)
constexpr int kScoreRows = 8;   // query rows whose scores are summed together (a vector each)
constexpr int kChannels = 128;  // channels of V a row sums at a time (8 vectors)
#else
constexpr int kScoreRows = 4;   // AVX2: 16 registers, two a row
constexpr int kChannels = 64;
#endif

// The softmax step of one query row over a block's n scores (n a multiple of 16), of which the
// first `seen` are its keys: the row's running max m and sum l updated, the scores made weights
// (e^(s - m), zero past `seen`); returns the factor the row's output is rescaled by.
inline float softmax_step(float* s, int64_t n, int64_t seen, float& m, float& l) {
  const float low = -std::numeric_limits<float>::infinity();
  for (int64_t j = seen; j < n; ++j) s[j] = low;
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(low);
  for (int64_t j = 0; j < n; j += kKeys) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  const float m_new = std::max(m, _mm512_reduce_max_ps(top));
  const __m512 shift = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += kKeys) {
    const __mmask16 keep =
        seen - j >= kKeys ? 0xFFFF : seen <= j ? 0 : static_cast<__mmask16>((1u << (seen - j)) - 1);
    const __m512 p = _mm512_maskz_mov_ps(keep, kvserve::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift)));
    _mm512_storeu_ps(s + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  const float total = _mm512_reduce_add_ps(sum);
#else
  float top = low;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
  const float m_new = std::max(m, top);
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(m_new);
  for (int64_t j = 0; j < n; j += 8)
    _mm256_storeu_ps(s + j, kvserve::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)));
#else
  for (int64_t j = 0; j < n; ++j) s[j] = std::exp(s[j] - m_new);
#endif
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    if (j >= seen) s[j] = 0.f;
    total += s[j];
  }
#endif
  const float correction = std::exp(m - m_new);  // 0 for the first block (m = -inf)
  l = l * correction + total;
  m = m_new;
  return correction;
}

template <typename T>
struct Chunk {
  const float* q;
  const T* k;
  const T* v;
  float* out;
  int64_t Lq, Lk, H, KVH, q_stride, k_stride, v_stride;
  float scale;

  int64_t G() const { return H / KVH; }
  int64_t offset() const { return Lk - Lq; }  // the position of query 0
  // the keys a task whose positions start at t0 reads: up to its last position's
  int64_t keys(int64_t t0) const { return offset() + std::min(t0 + kPositions, Lq); }
};

// Query rows padded to whole tiles of kScoreRows.
inline int64_t padded_rows(int64_t rows) { return (rows + kScoreRows - 1) / kScoreRows * kScoreRows; }

// A task's state: its query rows (position-major: row r is position t0 + r / G, head kh * G +
// r % G), scaled and padded to whole tiles of kScoreRows; their running max, sum, output and
// the factor a block rescales the output by; and a block of up to kWidth keys (transposed: kt[d]
// is 16 keys' channel d, a sub-block after another) and values in fp32.
template <int D>
struct TaskBuffers {
  std::vector<float> q, o, m, l, s, correction;
  alignas(64) float kt[kSubBlocks][D][kKeys];
  alignas(64) float vb[kWidth][D];

  void reset(int64_t rows) {
    q.assign(padded_rows(rows) * D, 0.f);
    o.assign(rows * D, 0.f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.f);
    s.assign(padded_rows(rows) * kWidth, 0.f);
    correction.assign(rows, 1.f);
  }
};

// Keys k0 .. k0 + 16 * n - 1 of K/V head kh in fp32 (rows past Lk zero).
template <int D, typename T>
void load_block(const Chunk<T>& c, TaskBuffers<D>& b, int64_t kh, int64_t k0, int64_t n) {
  for (int64_t j = 0; j < n * kKeys; ++j) {
    float(*kt)[kKeys] = b.kt[j / kKeys];
    if (k0 + j < c.Lk) {
      const T* kr = c.k + (k0 + j) * c.k_stride + kh * D;
      const T* vr = c.v + (k0 + j) * c.v_stride + kh * D;
      for (int d = 0; d < D; ++d) kt[d][j % kKeys] = static_cast<float>(kr[d]);
      for (int d = 0; d < D; ++d) b.vb[j][d] = static_cast<float>(vr[d]);
    } else {
      for (int d = 0; d < D; ++d) kt[d][j % kKeys] = 0.f;
      for (int d = 0; d < D; ++d) b.vb[j][d] = 0.f;
    }
  }
}

// 16 floats (a sub-block's scores, or 16 channels of a row): one AVX-512 vector, two AVX2 ones,
// or an array. Sums kept in these stay in registers where a loop over float arrays kept them in
// memory (GCC: an array of sums indexed in loops it did not unroll).
struct F16 {
#if defined(__AVX512F__)
  __m512 v;
  static F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static F16 zero() { return {_mm512_setzero_ps()}; }
  void fma(float a, const float* p) { v = _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_loadu_ps(p), v); }
  void scale(float a) { v = _mm512_mul_ps(v, _mm512_set1_ps(a)); }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 lo, hi;
  static F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void store(float* p) const { _mm256_storeu_ps(p, lo), _mm256_storeu_ps(p + 8, hi); }
  static F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  void fma(float a, const float* p) {
    const __m256 b = _mm256_set1_ps(a);
    lo = _mm256_fmadd_ps(b, _mm256_loadu_ps(p), lo), hi = _mm256_fmadd_ps(b, _mm256_loadu_ps(p + 8), hi);
  }
  void scale(float a) {
    const __m256 b = _mm256_set1_ps(a);
    lo = _mm256_mul_ps(lo, b), hi = _mm256_mul_ps(hi, b);
  }
#else
  float v[16];
  static F16 load(const float* p) { F16 f; std::copy(p, p + 16, f.v); return f; }
  void store(float* p) const { std::copy(v, v + 16, p); }
  static F16 zero() { return F16{}; }
  void fma(float a, const float* p) { for (int i = 0; i < 16; ++i) v[i] += a * p[i]; }
  void scale(float a) { for (int i = 0; i < 16; ++i) v[i] *= a; }
#endif
};

// Scores of kScoreRows query rows from r0 against sub-block sb: s[r][16 sb + j] = q[r] . k[j]
template <int D>
inline void score_rows(TaskBuffers<D>& b, int64_t r0, int64_t sb) {
  F16 acc[kScoreRows];
  for (int i = 0; i < kScoreRows; ++i) acc[i] = F16::zero();
  const float* q = b.q.data() + r0 * D;
  const float(*kt)[kKeys] = b.kt[sb];
  for (int d = 0; d < D; ++d)
    for (int i = 0; i < kScoreRows; ++i) acc[i].fma(q[i * D + d], kt[d]);
  for (int i = 0; i < kScoreRows; ++i) acc[i].store(b.s.data() + (r0 + i) * kWidth + sb * kKeys);
}

// The most vectors of 16 channels, at most `most`, that divide a row of n of them.
constexpr int vectors_dividing(int n, int most) {
  int p = most < n ? most : n;
  while (n % p) --p;
  return p;
}

// o[r] = o[r] * correction[r] + sum_j p[r][j] v[j] for NR rows from r0 over n keys, up to
// kChannels channels at a time
template <int D, int NR>
inline void accumulate_rows(TaskBuffers<D>& b, int64_t r0, int64_t n, const float* correction) {
  constexpr int kParts = vectors_dividing(D / 16, kChannels / 16);
  for (int c0 = 0; c0 < D; c0 += 16 * kParts) {
    F16 acc[NR][kParts];
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < kParts; ++c) {
        acc[i][c] = F16::load(b.o.data() + (r0 + i) * D + c0 + 16 * c);
        acc[i][c].scale(correction[i]);
      }
    for (int64_t j = 0; j < n; ++j)
      for (int i = 0; i < NR; ++i) {
        const float p = b.s[(r0 + i) * kWidth + j];
        for (int c = 0; c < kParts; ++c) acc[i][c].fma(p, b.vb[j] + c0 + 16 * c);
      }
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < kParts; ++c) acc[i][c].store(b.o.data() + (r0 + i) * D + c0 + 16 * c);
  }
}

// One task: positions t0 .. t0 + 15 (clipped at Lq) of K/V head kh.
template <int D, typename T>
void run_task(const Chunk<T>& c, TaskBuffers<D>& b, int64_t kh, int64_t t0) {
  const int64_t G = c.G(), npos = std::min(kPositions, c.Lq - t0), rows = npos * G;
  b.reset(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = c.q + (t0 + r / G) * c.q_stride + (kh * G + r % G) * D;
    for (int d = 0; d < D; ++d) b.q[r * D + d] = qr[d] * c.scale;
  }
  const int64_t padded = padded_rows(rows), keys = c.keys(t0);
  for (int64_t k0 = 0; k0 < keys; k0 += kWidth) {
    const int64_t subs = std::min(kSubBlocks, (keys - k0 + kKeys - 1) / kKeys), n = subs * kKeys;
    load_block(c, b, kh, k0, subs);
    for (int64_t sb = 0; sb < subs; ++sb)
      for (int64_t r0 = 0; r0 < padded; r0 += kScoreRows) score_rows(b, r0, sb);
    for (int64_t r = 0; r < rows; ++r) {
      // the keys of this block the row's position sees
      const int64_t seen = std::min(n, c.offset() + t0 + r / G - k0 + 1);
      float* s = b.s.data() + r * kWidth;
      if (seen <= 0) {  // none: its weights are zero, its state unchanged
        std::fill(s, s + n, 0.f);
        b.correction[r] = 1.f;
        continue;
      }
      b.correction[r] = softmax_step(s, n, seen, b.m[r], b.l[r]);
    }
    constexpr int kPair = D <= kChannels / 2 ? 2 : 1;
    int64_t r = 0;
    for (; r + kPair <= rows; r += kPair) accumulate_rows<D, kPair>(b, r, n, b.correction.data() + r);
    for (; r < rows; ++r) accumulate_rows<D, 1>(b, r, n, b.correction.data() + r);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = c.out + ((t0 + r / G) * c.H + kh * G + r % G) * D;
    const float inv = 1.f / b.l[r];
    for (int d = 0; d < D; ++d) out[d] = b.o[r * D + d] * inv;
  }
}

template <int D, typename T>
void run(const Chunk<T>& c) {
  const int64_t spans = (c.Lq + kPositions - 1) / kPositions, tasks = c.KVH * spans;
  // task i: K/V head i / spans, positions (i % spans) * 16; its cost is its keys
  const auto cost = [&](int64_t i) { return c.keys(i % spans * kPositions); };
  kvserve::parallel_by_cost(tasks, cost, [&](int64_t begin, int64_t end) {
    // on the heap: 128 KiB at D = 256, more than a small OMP_STACKSIZE gives a thread
    const auto buffers = std::make_unique<TaskBuffers<D>>();
    TaskBuffers<D>& b = *buffers;
    for (int64_t i = begin; i < end; ++i) run_task<D>(c, b, i / spans, i % spans * kPositions);
  });
}

// The head dims the kernel is built for: one instantiation of run each.
template <int... Ds>
struct Dims {};
using HeadDims = Dims<16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256>;

template <int... Ds>
std::vector<int64_t> listed(Dims<Ds...>) { return {Ds...}; }
std::vector<int64_t> head_dims() { return listed(HeadDims{}); }

template <typename T, int... Ds>
void dispatch(const Chunk<T>& c, int64_t D, Dims<Ds...>) {
  const bool ran = ((D == Ds && (run<Ds>(c), true)) || ...);
  TORCH_CHECK(ran, "chunk_attention takes the head dims head_dims() lists (16 to 256), not ", D);
}

at::Tensor chunk_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [Lq, H, D], k and v [Lk, KVH, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "fp32 queries, not ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == v.scalar_type()
              && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "fp32 or bf16 keys and values (one dtype), not ", k.scalar_type(), " and ", v.scalar_type());
  const int64_t Lq = q.size(0), H = q.size(1), D = q.size(2), Lk = k.size(0), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == D && KVH > 0 && H % KVH == 0, "H a multiple of KVH and one head dim");
  TORCH_CHECK(Lq <= Lk, "a chunk's ", Lq, " queries are the last of its keys, not more than its ", Lk);
  auto rows = [](const at::Tensor& t) {  // each row's heads contiguous; rows any stride apart
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  at::Tensor qc = rows(q), kc = rows(k), vc = rows(v);
  at::Tensor out = at::empty({Lq, H, D}, q.options());
  if (Lq == 0) return out;
  const int64_t sq = qc.stride(0), sk = kc.stride(0), sv = vc.stride(0);
  float* o = out.data_ptr<float>();
  const float* qp = qc.data_ptr<float>();
  if (k.scalar_type() == at::kFloat) {
    const float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
    const Chunk<float> c{qp, kp, vp, o, Lq, Lk, H, KVH, sq, sk, sv, static_cast<float>(scale)};
    dispatch(c, D, HeadDims{});
  } else {
    using B = c10::BFloat16;
    const B *kp = kc.data_ptr<B>(), *vp = vc.data_ptr<B>();
    const Chunk<B> c{qp, kp, vp, o, Lq, Lk, H, KVH, sq, sk, sv, static_cast<float>(scale)};
    dispatch(c, D, HeadDims{});
  }
  return out;
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
  m.def("chunk_attention", &chunk_attention, "causal attention of a prompt's chunk over its keys (CPU)");
  m.def("head_dims", &head_dims, "the head dims chunk_attention takes");
}
