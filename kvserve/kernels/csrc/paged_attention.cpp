// Decode attention over a paged KV cache on CPU: one query token per sequence attends to its
// context, read in place through its block table (no gathered copy of K/V, nothing expanded
// beyond the block being read).
//
//   q        [B, H, D]                  (H = KVH * G query heads; G share one K/V head)
//   cache    [num_blocks, BS, KVH, D]   in one of the formats below
//   tables   [B, max_blocks] int64      ctx_lens [B] int64
//   window   0, or W: each query attends to its context's last W positions only
//   out      [B, H, D]
//
// Each block's rows are turned into fp32 (a pointer into the cache for fp32, or a small buffer
// the block is dequantized into, in registers and L1) and serve all G query heads of their K/V
// head; the AVX-512 path scores bf16 keys as it reads them instead, a group of up to
// kScoreHeads query heads a pass over the block. Scores and accumulation are in fp32. Formats
// (each a Source below):
//
//   dense   fp32 / bf16 / fp16 rows as stored
//   int8    q * s,  s per token and head                        (k_scale, v_scale [nb, BS, KVH] fp32)
//   fp8     value(code) * s,  s per layer and head              (the 256 code values; scales [KVH])
//   int4    nibble * s + z: keys s, z per channel per block     (k_scale, k_zero [nb, KVH, D] fp16)
//           values s, z per token                               (v_scale, v_zero [nb, BS, KVH] fp16)
//           byte c holds channel c (low nibble) and c + D/2 (high); a block still filling
//           (slot_of[block] >= 0) is read from its full-precision residual slot instead
//
// Both paths split each context into parts along its blocks (flash-decoding: batch 1 keeps every
// thread busy), keep each part's softmax apart and merge the parts at the end (merge_parts). The
// portable one, for any shape and any x86-64 (built again for AVX2, where scores take eight rows
// at a time, the exponentials and bf16/fp16 rows 8 lanes, and the output stays in registers while
// a block's rows are added), runs one task a part, streaming whole blocks (every K/V head at
// once) with the softmax online. The AVX-512 one, for head dims 16/32/64/128/256 with up to 8
// query heads per K/V head, runs one task a (part, K/V head) that walks the part's blocks twice
// (K, then V). The build decides which exist
// (setup.py builds this file once per instruction-set level and loads the one the CPU
// runs); `isa()` names the build. Both split their tasks over the threads by the positions each
// reads (parallel_tasks.h), not by their count.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include "context_parts.h"
#include "kernel_ops.h"
#include "parallel_tasks.h"
#include "vec_math.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

namespace {

// The prefetch helpers below are always inlined. A function whose only effect is a prefetch is,
// to GCC, a function without side effects, and where one was not inlined its calls were deleted:
// the AVX-512 build's decode asked the caches for nothing. With them (one layer at 64 contexts of
// 256 tokens out of DRAM, bf16, Xeon with AMX, 2 threads): 0.78 ms against 1.15.
#define KV_ALWAYS_INLINE __attribute__((always_inline)) inline

struct Rows {  // n rows of D floats, row i at ptr + i * stride
  const float* ptr;
  int64_t stride;
};

struct Shape {
  int64_t BS, KVH, D;
  int64_t row(int64_t blk, int64_t i, int64_t kh) const { return (blk * BS + i) * KVH + kh; }  // [nb, BS, KVH]
  // From a position's row of a K/V head to the next position's, in values of D per row.
  int64_t stride() const { return KVH * D; }
};

// Where a block's rows of one KV head lie (row i's bytes at base + i * stride), to ask the caches
// for them. A context's blocks lie anywhere in the pool, so the hardware prefetchers, which follow
// one address stream, lose it at every block: a decode step over a batch of contexts out of DRAM
// stalled on each block's first rows. The sources below prefetch a block's rows before its turn,
// into L2 (the T1 hint, locality 2), not L1: a block's K and V lines asked for into L1 outnumber
// the L1's outstanding misses, and on AMD EPYC Zen 4 one layer at 64 contexts of 256 tokens out
// of DRAM took 0.69 ms against 1.14 with the T0 hint (bf16; int8 0.59 against 0.69).
struct Lines {
  const char* base;
  int64_t row_bytes, stride;
  KV_ALWAYS_INLINE void prefetch_row(int64_t i) const {
    for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(base + i * stride + at, 0, 2);
  }
  KV_ALWAYS_INLINE void prefetch(int64_t n) const {  // rows 0..n-1
    for (int64_t i = 0; i < n; ++i) prefetch_row(i);
  }
};

inline Lines lines_of(const void* p, int64_t row_bytes, int64_t stride_bytes) {
  return {static_cast<const char*>(p), row_bytes, stride_bytes};
}

// fp16 -> fp32 by the F16C instructions where the build has them (c10::Half's own conversion is
// bit arithmetic in software, which made half the cost of an int4 block).
inline float h2f(c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

inline void h2f(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = h2f(src[i]);
}

// ---- sources: one block's rows of K or V for one KV head, as fp32 ----
template <typename T>
struct Dense {
  const T* cache;
  Shape s;
  // Block blk's first row of K/V head kh; row i at + i * s.stride().
  KV_ALWAYS_INLINE const T* block(int64_t blk, int64_t kh) const { return cache + s.row(blk, 0, kh) * s.D; }
  KV_ALWAYS_INLINE Lines lines(int64_t blk, int64_t kh) const {
    return lines_of(block(blk, kh), s.D * sizeof(T), s.stride() * sizeof(T));
  }
  KV_ALWAYS_INLINE void prefetch(int64_t blk, int64_t kh, int64_t n) const { lines(blk, kh).prefetch(n); }
  Rows rows(int64_t blk, int64_t kh, int64_t n, float* buf) const {
    const T* base = block(blk, kh);
    if constexpr (std::is_same_v<T, float>) {
      return {base, s.stride()};
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const T* __restrict__ r = base + i * s.stride();
        float* __restrict__ o = buf + i * s.D;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= s.D; d += 16) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + d));
          if constexpr (std::is_same_v<T, c10::BFloat16>)  // bf16 is the top half of fp32
            _mm512_storeu_ps(o + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
          else if constexpr (std::is_same_v<T, c10::Half>)
            _mm512_storeu_ps(o + d, _mm512_cvtph_ps(raw));
          else
            break;
        }
#elif defined(__AVX2__)
        for (; d + 8 <= s.D; d += 8) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d));
          if constexpr (std::is_same_v<T, c10::BFloat16>)
            _mm256_storeu_ps(o + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
          else if constexpr (std::is_same_v<T, c10::Half>)
            _mm256_storeu_ps(o + d, _mm256_cvtph_ps(raw));
          else
            break;
        }
#endif
        for (; d < s.D; ++d) o[d] = static_cast<float>(r[d]);
      }
      return {buf, s.D};
    }
  }
};

struct Int8 {
  const int8_t* q;
  const float* scale;
  Shape s;
  KV_ALWAYS_INLINE Lines lines(int64_t blk, int64_t kh) const {
    return lines_of(q + s.row(blk, 0, kh) * s.D, s.D, s.stride());
  }
  KV_ALWAYS_INLINE void prefetch(int64_t blk, int64_t kh, int64_t n) const { lines(blk, kh).prefetch(n); }
  Rows rows(int64_t blk, int64_t kh, int64_t n, float* buf) const {
    for (int64_t i = 0; i < n; ++i) {
      const int8_t* __restrict__ r = q + s.row(blk, i, kh) * s.D;
      float* __restrict__ o = buf + i * s.D;
      const float si = scale[s.row(blk, i, kh)];
      int64_t d = 0;
#if defined(__AVX512F__)
      for (; d + 16 <= s.D; d += 16)
        _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d)))), _mm512_set1_ps(si)));
#endif
      for (; d < s.D; ++d) o[d] = static_cast<float>(r[d]) * si;
    }
    return {buf, s.D};
  }
};

#if defined(__AVX512F__)
// 16 fp8 codes -> fp32 by bit arithmetic: a normal code (exponent field e > 0) is
// sign | (e + 127 - bias) << 23 | mantissa << (23 - mantissa bits); a subnormal one is
// mantissa * 2^(1 - bias - mantissa bits). e4m3: 3 mantissa bits, bias 7; e5m2: 2 and 15.
// Codes are never NaN or inf: values saturate when written.
template <int MBITS, int BIAS>
inline __m512 fp8x16(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(b, MBITS), _mm512_set1_epi32((0x7F >> MBITS)));
  const __m512i m = _mm512_and_si512(b, _mm512_set1_epi32((1 << MBITS) - 1));
  const __m512i normal = _mm512_or_si512(sign, _mm512_or_si512(
      _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127 - BIAS)), 23), _mm512_slli_epi32(m, 23 - MBITS)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(std::ldexp(1.f, 1 - BIAS - MBITS)));
  const __m512i subbits = _mm512_or_si512(sign, _mm512_castps_si512(sub));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_sub, normal, subbits));
}
#endif

struct Fp8 {
  const uint8_t* q;
  const float* table;  // [256]
  const float* head_scale;  // [KVH]
  bool e4m3;
  Shape s;
  KV_ALWAYS_INLINE Lines lines(int64_t blk, int64_t kh) const {
    return lines_of(q + s.row(blk, 0, kh) * s.D, s.D, s.stride());
  }
  KV_ALWAYS_INLINE void prefetch(int64_t blk, int64_t kh, int64_t n) const { lines(blk, kh).prefetch(n); }
  Rows rows(int64_t blk, int64_t kh, int64_t n, float* buf) const {
    const float hs = head_scale[kh];
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* __restrict__ r = q + s.row(blk, i, kh) * s.D;
      float* __restrict__ o = buf + i * s.D;
      int64_t d = 0;
#if defined(__AVX512F__)
      const __m512 h = _mm512_set1_ps(hs);
      for (; d + 16 <= s.D; d += 16)
        _mm512_storeu_ps(o + d, _mm512_mul_ps(e4m3 ? fp8x16<3, 7>(r + d) : fp8x16<2, 15>(r + d), h));
#endif
      for (; d < s.D; ++d) o[d] = table[r[d]] * hs;
    }
    return {buf, s.D};
  }
};

// int4: keys (per_channel) or values (per token); an open block comes from its residual slot.
template <typename R, bool per_channel>
struct Int4 {
  const uint8_t* q;
  const c10::Half* scale;
  const c10::Half* zero;
  const int64_t* slot_of;
  Dense<R> residual;
  Shape s;
  KV_ALWAYS_INLINE Lines lines(int64_t blk, int64_t kh) const {
    if (slot_of[blk] >= 0) return residual.lines(slot_of[blk], kh);
    return lines_of(q + s.row(blk, 0, kh) * (s.D / 2), s.D / 2, s.KVH * (s.D / 2));
  }
  KV_ALWAYS_INLINE void prefetch(int64_t blk, int64_t kh, int64_t n) const { lines(blk, kh).prefetch(n); }
  Rows rows(int64_t blk, int64_t kh, int64_t n, float* buf) const {
    if (slot_of[blk] >= 0) return residual.rows(slot_of[blk], kh, n, buf);
    const int64_t D = s.D, half = D / 2;
    float sc[256], zc[256];  // per-channel scale and zero of this block (D <= 256)
    if constexpr (per_channel) {
      const int64_t at = (blk * s.KVH + kh) * D;
      h2f(scale + at, sc, D);
      h2f(zero + at, zc, D);
    }
    for (int64_t i = 0; i < n; ++i) {  // restrict: a byte pointer may alias anything, which stops vectorizing
      const uint8_t* __restrict__ r = q + s.row(blk, i, kh) * half;
      float* __restrict__ o = buf + i * D;
#if defined(__AVX512F__)
      if (half % 16 == 0) {  // 16 bytes -> 16 low and 16 high nibbles as fp32, one FMA each
        const __m512 si = _mm512_set1_ps(per_channel ? 0.f : h2f(scale[s.row(blk, i, kh)]));
        const __m512 zi = _mm512_set1_ps(per_channel ? 0.f : h2f(zero[s.row(blk, i, kh)]));
        for (int64_t c = 0; c < half; c += 16) {
          const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + c)));
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
          if constexpr (per_channel) {
            _mm512_storeu_ps(o + c, _mm512_fmadd_ps(lo, _mm512_loadu_ps(sc + c), _mm512_loadu_ps(zc + c)));
            _mm512_storeu_ps(o + c + half, _mm512_fmadd_ps(hi, _mm512_loadu_ps(sc + c + half), _mm512_loadu_ps(zc + c + half)));
          } else {
            _mm512_storeu_ps(o + c, _mm512_fmadd_ps(lo, si, zi));
            _mm512_storeu_ps(o + c + half, _mm512_fmadd_ps(hi, si, zi));
          }
        }
        continue;
      }
#endif
      if constexpr (per_channel) {
        for (int64_t c = 0; c < half; ++c) {
          o[c] = static_cast<float>(r[c] & 15) * sc[c] + zc[c];
          o[c + half] = static_cast<float>(r[c] >> 4) * sc[c + half] + zc[c + half];
        }
      } else {
        const float si = h2f(scale[s.row(blk, i, kh)]), zi = h2f(zero[s.row(blk, i, kh)]);
        for (int64_t c = 0; c < half; ++c) {
          o[c] = static_cast<float>(r[c] & 15) * si + zi;
          o[c + half] = static_cast<float>(r[c] >> 4) * si + zi;
        }
      }
    }
    return {buf, D};
  }
};

// Calls row(t - begin, ptr) for each token t in [begin, L) with ptr its fp32 row; the block
// table is read once per block and each block dequantized once. Blocks before `begin` (behind a
// sliding window, possibly given back: the null block) are never read.
template <typename Src, typename RowFn>
inline void for_each_row(const Src& src, const int64_t* table, int64_t begin, int64_t L, int64_t BS, int64_t kh,
                         float* buf, RowFn&& row) {
  for (int64_t t0 = begin / BS * BS; t0 < L; t0 += BS) {
    const int64_t n = std::min(BS, L - t0);
    if (t0 + BS < L) src.prefetch(table[t0 / BS + 1], kh, std::min(BS, L - t0 - BS));
    const Rows r = src.rows(table[t0 / BS], kh, n, buf);
    for (int64_t i = std::max<int64_t>(0, begin - t0); i < n; ++i) row(t0 + i - begin, r.ptr + i * r.stride);
  }
}

// How contexts are cut into parts: context_parts.h (shared with mla_attention.cpp).
using kvserve::longest_attended;
using kvserve::part_blocks;
using kvserve::parts_per_sequence;
using kvserve::window_begin;

// The G query heads of sequence b that share KV head kh, as fp32 times the softmax scale: qf [G, D].
template <typename scalar_t>
inline void scaled_queries(const scalar_t* q, int64_t b, int64_t kh, int64_t H, int64_t G, int64_t D,
                           float scale, float* qf) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[(b * H + kh * G + g) * D + d]) * scale;
}

// sum of a[d] * b[d] over d < n. AVX2: eight lanes, two chains, one horizontal sum (the
// compiler keeps a float reduction in order, so the plain loop would stay scalar).
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  int64_t d = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 16) {
    __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(a + 8), _mm256_loadu_ps(b + 8));
    for (d = 16; d + 16 <= n; d += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    const __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    sum = _mm_cvtss_f32(h);
  }
#endif
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// s[i] = q . k_i for rows i0 <= i < n of r; returns the largest. AVX2: eight rows at a time, their
// eight lane-wise sums reduced together (hadd and one cross-lane add for all eight).
inline float block_scores(const float* __restrict__ q, const Rows& r, int64_t i0, int64_t n, int64_t D,
                          float* __restrict__ s) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = i0;
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (; i + 8 <= n; i += 8) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) {
        const float* k = r.ptr + (i + j) * r.stride;
        a[j] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        for (int64_t d = 8; d < D; d += 8) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a[j]);
      }
      const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      // h0 = [sums of rows 0-3 over lanes 0-3 | the same over lanes 4-7], h1 likewise for rows 4-7
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
      _mm256_storeu_ps(s + i, sums);
      for (int j = 0; j < 8; ++j) mx = std::max(mx, s[i + j]);
    }
  }
#endif
  for (; i < n; ++i) {
    s[i] = dot(q, r.ptr + i * r.stride, D);
    mx = std::max(mx, s[i]);
  }
  return mx;
}

// a += sum of p[i] * v_i over rows i0 <= i < n of r. AVX2: a held in registers eight lanes at a
// time while every row is added to it.
inline void block_accumulate(float* __restrict__ a, const float* __restrict__ p, const Rows& r, int64_t i0, int64_t n,
                             int64_t D) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; d + 32 <= D; d += 32) {
    __m256 x0 = _mm256_loadu_ps(a + d), x1 = _mm256_loadu_ps(a + d + 8);
    __m256 x2 = _mm256_loadu_ps(a + d + 16), x3 = _mm256_loadu_ps(a + d + 24);
    for (int64_t i = i0; i < n; ++i) {
      const float* v = r.ptr + i * r.stride + d;
      const __m256 w = _mm256_set1_ps(p[i]);
      x0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), x0);
      x1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), x1);
      x2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), x2);
      x3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), x3);
    }
    _mm256_storeu_ps(a + d, x0);
    _mm256_storeu_ps(a + d + 8, x1);
    _mm256_storeu_ps(a + d + 16, x2);
    _mm256_storeu_ps(a + d + 24, x3);
  }
  for (; d + 8 <= D; d += 8) {
    __m256 x = _mm256_loadu_ps(a + d);
    for (int64_t i = i0; i < n; ++i) x = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(r.ptr + i * r.stride + d), x);
    _mm256_storeu_ps(a + d, x);
  }
#endif
  for (int64_t i = i0; i < n; ++i) {
    const float* __restrict__ v = r.ptr + i * r.stride;
    for (int64_t e = d; e < D; ++e) a[e] += p[i] * v[e];
  }
}

// s[t] = e^(s[t] - shift) for t < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float shift) {
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = kvserve::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - shift);
    sum += s[t];
  }
  return sum;
}

// Part `part` of P of a context attending to positions [first, len): an equal share of the
// blocks holding them, as the positions [begin, end) (empty where the blocks ran out first).
// E.g. BS 16, first 20, len 100, P 2: blocks 1..6 hold them, 3 a part: [20, 64) and [64, 100).
struct PartSpan {
  int64_t begin, end;
  bool empty() const { return begin >= end; }
};

inline PartSpan part_span(int64_t first, int64_t len, int64_t BS, int64_t P, int64_t part) {
  const auto [pb0, pb1] = part_blocks(first, len, BS, P, part);
  if (pb0 >= pb1) return {0, 0};
  return {std::max(first, pb0 * BS), std::min(len, pb1 * BS)};
}

// What the task of sequence b's part `part` costs a thread, in positions: those it reads, and a
// block's worth for what it does before reading any (its queries, its part's sums).
inline int64_t part_cost(const int64_t* lens, int64_t window, int64_t BS, int64_t P, int64_t b,
                         int64_t part) {
  const PartSpan span = part_span(window_begin(lens[b], window), lens[b], BS, P, part);
  return (span.empty() ? 0 : span.end - span.begin) + BS;
}

// The task a thread runs after the present one, for asking the caches for its first blocks while
// the present one computes: without it each task began by waiting for its first keys from memory.
// Its table is nullptr where there is none (the thread's last task, or an empty part).
struct NextPart {
  const int64_t* table = nullptr;
  PartSpan span{0, 0};
  int64_t kh = 0;
};

// Task idx + 1 of a thread's [.., end), a task being (sequence, part, K/V head) with `heads` K/V heads
// a (sequence, part) (1: the task covers every head).
inline NextPart next_part(int64_t idx, int64_t end, const int64_t* tables, const int64_t* lens,
                          int64_t max_blocks, int64_t window, int64_t BS, int64_t P, int64_t heads) {
  NextPart next;
  if (idx + 1 >= end) return next;
  const int64_t b = (idx + 1) / (P * heads);
  next.span = part_span(window_begin(lens[b], window), lens[b], BS, P, (idx + 1) / heads % P);
  if (!next.span.empty()) next.table = tables + b * max_blocks, next.kh = (idx + 1) % heads;
  return next;
}

// Block b of what a thread reads, counted in the blocks of this task's part (span, K/V head kh):
// past the part's last block, the next task's (block b - last - 1 of its part). Its id, its K/V
// head and its rows (0: there is none).
struct StreamBlock {
  int64_t blk, kh, rows;
};

inline StreamBlock stream_block(const int64_t* table, PartSpan span, int64_t kh, const NextPart& next,
                                int64_t BS, int64_t b) {
  const int64_t last = (span.end - 1) / BS;
  if (b <= last) return {table[b], kh, std::min(BS, span.end - b * BS)};
  const int64_t nb = next.span.begin / BS + (b - last - 1);
  if (next.table != nullptr && nb <= (next.span.end - 1) / BS)
    return {next.table[nb], next.kh, std::min(BS, next.span.end - nb * BS)};
  return {table[last], kh, 0};
}

// Each (sequence, part)'s softmax over its positions, per query head: the largest score m, the
// sum l of e^(s - m) and the unnormalized output acc = sum of e^(s - m) v [D]. A part with no
// positions keeps l = 0 and is skipped by the merge.
struct PartStates {
  int64_t P, H, D;
  std::vector<float> m, l, acc;  // [B, P, H], [B, P, H], [B, P, H, D]
  PartStates(int64_t B, int64_t P, int64_t H, int64_t D)
      : P(P), H(H), D(D), m(B * P * H, -std::numeric_limits<float>::infinity()), l(B * P * H, 0.f),
        acc(B * P * H * D, 0.f) {}
  int64_t at(int64_t b, int64_t part, int64_t h) const { return (b * P + part) * H + h; }
};

// out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M) per (sequence, query head), M the
// largest m_p: the parts' softmaxes merged into the one over the whole context (flash-decoding).
template <typename scalar_t>
void merge_parts(const PartStates& st, scalar_t* out, int64_t B) {
  const int64_t P = st.P, H = st.H, D = st.D;
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float M = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t p = 0; p < P; ++p) M = std::max(M, st.m[st.at(b, p, h)]);
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t at = st.at(b, p, h);
        if (st.l[at] == 0.f) continue;  // a part with no positions
        const float w = std::exp(st.m[at] - M);
        sum += st.l[at] * w;
        const float* a = st.acc.data() + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      for (int64_t d = 0; d < D; ++d) out[bh * D + d] = static_cast<scalar_t>(o[d] / sum);
    }
  });
}

// One pass over the blocks of a part, K and V of a block together (every K/V head of the block:
// the rows of a block are contiguous, so each task streams whole blocks), with the softmax kept
// online: per query head a running max m, sum l of e^(s - m) and sum acc of e^(s - m) v, rescaled
// by e^(m_old - m_new) when a block raises the max. Same fp32 arithmetic as the two-pass softmax
// up to summation order.
template <typename scalar_t, typename KSrc, typename VSrc>
void decode_portable(const scalar_t* q, const KSrc& ks, const VSrc& vs, const int64_t* tables, const int64_t* lens,
                     scalar_t* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks,
                     float scale, int64_t window) {
  const int64_t G = H / KVH, P = parts_per_sequence(B, longest_attended(lens, B, window));
  PartStates st(B, P, H, D);
  const auto cost = [&](int64_t idx) { return part_cost(lens, window, BS, P, idx / P, idx % P); };
  kvserve::parallel_by_cost(B * P, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), kbuf(BS * D), vbuf(BS * D), sc(G * BS);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / P, part = idx % P;
      const PartSpan span = part_span(window_begin(lens[b], window), lens[b], BS, P, part);
      if (span.empty()) continue;
      const int64_t* table = tables + b * max_blocks;
      float* m = st.m.data() + st.at(b, part, 0);
      float* l = st.l.data() + st.at(b, part, 0);
      float* acc = st.acc.data() + st.at(b, part, 0) * D;
      for (int64_t kh = 0; kh < KVH; ++kh) scaled_queries(q, b, kh, H, G, D, scale, qf.data() + kh * G * D);
      const NextPart next = next_part(idx, end, tables, lens, max_blocks, window, BS, P, 1);
      for (int64_t t0 = span.begin / BS * BS; t0 < span.end; t0 += BS) {
        const int64_t i0 = std::max<int64_t>(0, span.begin - t0), n = std::min(BS, span.end - t0);
        // the next block's rows, or at the last block the next task's first ones
        const StreamBlock ahead = stream_block(table, span, 0, next, BS, t0 / BS + 1);
        if (ahead.rows > 0)
          for (int64_t kh = 0; kh < KVH; ++kh) {
            ks.prefetch(ahead.blk, kh, ahead.rows);
            vs.prefetch(ahead.blk, kh, ahead.rows);
          }
        for (int64_t kh = 0; kh < KVH; ++kh) {
          const Rows kr = ks.rows(table[t0 / BS], kh, n, kbuf.data());
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kh * G + g;
            float* s = sc.data() + g * BS;
            const float bmax = block_scores(qf.data() + h * D, kr, i0, n, D, s);
            const float mn = std::max(m[h], bmax), c = std::exp(m[h] - mn);  // c = 0 on the first block
            l[h] = l[h] * c + exp_shifted(s + i0, n - i0, mn);
            m[h] = mn;
            float* a = acc + h * D;
            if (c != 1.f)
              for (int64_t d = 0; d < D; ++d) a[d] *= c;
          }
          const Rows vr = vs.rows(table[t0 / BS], kh, n, vbuf.data());
          for (int64_t g = 0; g < G; ++g) block_accumulate(acc + (kh * G + g) * D, sc.data() + g * BS, vr, i0, n, D);
        }
      }
    }
  });
  merge_parts(st, out, B);
}

#if defined(__AVX512F__)
// The same computation with AVX-512 when head_dim is 16, 32, 64, 128 or 256: a row is D/16
// vectors, each query head's dot product is D/16 FMAs and one horizontal sum, and the
// exponentials are evaluated 16 at a time. Contexts are cut into the same parts (one task a
// (sequence, part, K/V head)); within a part the softmax takes two passes over its blocks (all
// scores, then the weighted sum of V), and the parts are merged as above.

using kvserve::exp16;  // vec_math.h

// hsum16's first level: v0 and v1's pairs of lanes added within 128-bit lanes (lanes 0, 2 of
// each 4: v0's, 1, 3: v1's).
inline __m512 pair_sums(__m512 v0, __m512 v1) {
  return _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
}

// The rest of hsum16's tree, from the eight pair_sums of v[0, 1], v[2, 3], ... v[14, 15].
inline __m512 hsum_pairs(const __m512* a) {
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i], 128-bit lane L: the lane-L sums of v[4i .. 4i+3]
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// r[i] = sum of the 16 lanes of v[i], for 16 vectors at once: pairs, then quads, are added within
// 128-bit lanes and the four lanes transposed by shuffles (45 instructions for 16 sums, against
// about 8 each for separate reductions).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i) a[i] = pair_sums(v[2 * i], v[2 * i + 1]);
  return hsum_pairs(a);
}

// How this path reads each format. Keys: fp32's rows in place, and the other formats' but bf16
// converted into a buffer, scored 16 rows at a time against each of the G query heads; a format
// may leave a factor per row out of its rows (KeyRows::row_scale, applied to the scores: int8).
// bf16 keeps each 32 channels as the 16 even ones, then the 16 odd ones (kSplit: one instruction
// converts 16 values; the queries are put in the same order, so each dot product has the same
// terms), and its keys are scored from the cache as each row is split, up to kScoreHeads query
// heads a pass (split_scores). Values: a row at a time into registers, bf16 and int8 straight from the
// cache (no buffer), the other formats from the rows their source converts, with a factor the
// row's weights take; bf16's in the same split order (kSplit: the sums go back to channel
// order as they are stored). Converting a block into a buffer and reading it back had cost bf16
// more than its products (perf: 35% of the values' pass).
struct KeyRows {
  Rows r;
  const float* row_scale;  // a factor per row (rows i..i+15 score with row_scale[i..i+15]), or nullptr: none
};

// What a block's turn of part_scores asks the caches for: the keys of the block kAheadBlocks on
// and this block's values (for the values' pass that follows). The paths that read keys row by
// row (bf16's split_scores, int8's key_block) ask for row i of both as they read row i, the
// others for all of them first (bf16, SmolLM2's shapes, 64 contexts of 192 tokens out of DRAM,
// Zen 4, 2 threads: split_scores asking for all at once took 1.05-1.07 of the converting
// path's time, row by row 0.92-0.97).
// Spread so, one layer at 64 contexts of 256 tokens out of DRAM took 0.75 ms against 0.78 all at
// once (bf16, Xeon with AMX; int8 0.64 against 0.68). Two blocks ahead rather than one: 0.66 ms
// against 0.69 (bf16, Zen 4, the T1 hint; int8 0.55 against 0.59); three gave 0.67 (int8 0.53).
// Past a part's last block the blocks ahead are the next task's (NextPart): a task no longer
// starts by waiting for its first keys. Builds with the same flags, interleaved (Zen 4, huge
// pages, 8 layers' caches in turn): 64 contexts of 64..384 tokens, bf16, 2-8% less time in six
// runs (e.g. 0.557 ms a layer against 0.591); 256 contexts of 4..40 tokens 13% less (0.311
// against 0.359); int8 the same within the noise; the AVX2 path (the next block only) 5% less
// (1.19-1.27 against 1.25-1.33).
constexpr int64_t kAheadBlocks = 2;

struct Ahead {
  Lines ahead_k, this_v;
  int64_t ahead_n, this_n;  // their rows (ahead_n = 0: the part has no block that far on)
  KV_ALWAYS_INLINE void row(int64_t i) const {  // row i of each (where it has one)
    if (i < ahead_n) ahead_k.prefetch_row(i);
    if (i < this_n) this_v.prefetch_row(i);
  }
  KV_ALWAYS_INLINE void all() const {
    ahead_k.prefetch(ahead_n);
    this_v.prefetch(this_n);
  }
};

template <typename Src, int NV>
constexpr bool kSplit = false;  // rows kept as each 32 channels' 16 even ones, then the 16 odd ones
template <int NV>
constexpr bool kSplit<Dense<c10::BFloat16>, NV> = NV % 2 == 0;

template <int NV, typename Src>
inline KeyRows key_block(const Src& src, int64_t blk, int64_t kh, int64_t n, float* buf, float*,
                         const Ahead& ahead) {
  ahead.all();
  return {src.rows(blk, kh, n, buf), nullptr};
}

// 32 bf16 values -> the 16 even ones and the 16 odd ones as fp32, one instruction each (a bf16
// value is the top half of its fp32 value: the even ones are shifted there, the odd ones are
// there already with their neighbour's bits masked off).
inline void split_bf16(const c10::BFloat16* p, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int NV>
inline KeyRows key_block(const Int8& src, int64_t blk, int64_t kh, int64_t n, float* buf, float* row_scale,
                         const Ahead& ahead) {
  constexpr int64_t D = NV * 16;
  for (int64_t i = 0; i < n; ++i) {
    ahead.row(i);
    const int8_t* r = src.q + src.s.row(blk, i, kh) * D;
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(buf + i * D + 16 * j, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * j)))));
    row_scale[i] = src.scale[src.s.row(blk, i, kh)];
  }
  for (int64_t i = n; i < src.s.BS; ++i) ahead.row(i);
  return {{buf, D}, row_scale};
}

// The blocks holding [begin, L) in turn, each asked for one block ahead: body(blk, t0, i0, n) for
// its rows i0 <= i < n (position t0 + i).
template <typename Src, typename BlockFn>
inline void each_block(const Src& src, const int64_t* table, int64_t begin, int64_t L, int64_t BS, int64_t kh,
                       BlockFn&& body) {
  for (int64_t t0 = begin / BS * BS; t0 < L; t0 += BS) {
    if (t0 + BS < L) src.prefetch(table[t0 / BS + 1], kh, std::min(BS, L - t0 - BS));
    body(table[t0 / BS], t0, std::max<int64_t>(0, begin - t0), std::min(BS, L - t0));
  }
}

// Calls row(t - begin, vv, f) for each position t in [begin, L): vv its V row as NV vectors, f a
// factor its weights take. Generic: the block's rows from the source, loaded.
template <int NV, typename Src, typename RowFn>
inline void each_value_row(const Src& src, const int64_t* table, int64_t begin, int64_t L, int64_t BS, int64_t kh,
                           float* buf, RowFn&& row) {
  each_block(src, table, begin, L, BS, kh, [&](int64_t blk, int64_t t0, int64_t i0, int64_t n) {
    const Rows r = src.rows(blk, kh, n, buf);
    for (int64_t i = i0; i < n; ++i) {
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = _mm512_loadu_ps(r.ptr + i * r.stride + 16 * j);
      row(t0 + i - begin, vv, 1.f);
    }
  });
}

template <int NV, typename RowFn>
inline void each_value_row(const Dense<c10::BFloat16>& src, const int64_t* table, int64_t begin, int64_t L,
                           int64_t BS, int64_t kh, float* buf, RowFn&& row) {
  if constexpr (!kSplit<Dense<c10::BFloat16>, NV>) {
    each_value_row<NV, Dense<c10::BFloat16>>(src, table, begin, L, BS, kh, buf, row);
  } else {
    constexpr int64_t D = NV * 16;
    const int64_t stride = src.s.stride();
    each_block(src, table, begin, L, BS, kh, [&](int64_t blk, int64_t t0, int64_t i0, int64_t n) {
      const c10::BFloat16* base = src.block(blk, kh);
      for (int64_t i = i0; i < n; ++i) {
        __m512 vv[NV];
        for (int j = 0; j < NV; j += 2) split_bf16(base + i * stride + 16 * j, vv[j], vv[j + 1]);
        row(t0 + i - begin, vv, 1.f);
      }
    });
  }
}

template <int NV, typename RowFn>
inline void each_value_row(const Int8& src, const int64_t* table, int64_t begin, int64_t L, int64_t BS, int64_t kh,
                           float*, RowFn&& row) {
  constexpr int64_t D = NV * 16;
  each_block(src, table, begin, L, BS, kh, [&](int64_t blk, int64_t t0, int64_t i0, int64_t n) {
    for (int64_t i = i0; i < n; ++i) {
      const int8_t* r = src.q + src.s.row(blk, i, kh) * D;
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j)
        vv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * j))));
      row(t0 + i - begin, vv, src.scale[src.s.row(blk, i, kh)]);
    }
  });
}

// The G query heads of K/V head kh as read against keys stored split (kSplit): each 32
// channels as the 16 even ones, then the 16 odd ones.
inline void split_queries(float* qf, int64_t G, int64_t D) {
  float tmp[32];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < D; c += 32) {
      float* x = qf + g * D + c;
      for (int i = 0; i < 16; ++i) {
        tmp[i] = x[2 * i];
        tmp[16 + i] = x[2 * i + 1];
      }
      std::copy(tmp, tmp + 32, x);
    }
}

// Scores of 16 consecutive tokens (rows of one block) against query head qg: one vector.
template <int NV>
inline __m512 scores16(const float* qg, const Rows& r, int64_t n) {
  __m512 q[NV], acc[16];
  for (int j = 0; j < NV; ++j) q[j] = _mm512_loadu_ps(qg + 16 * j);
  for (int64_t i = 0; i < 16; ++i) {
    if (i >= n) {
      acc[i] = _mm512_setzero_ps();
      continue;
    }
    const float* k = r.ptr + i * r.stride;
    __m512 s = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
    for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(q[j], _mm512_loadu_ps(k + 16 * j), s);
    acc[i] = s;
  }
  return hsum16(acc);
}

// fn(g0, std::integral_constant<int, GC>) for groups of GC <= kMax of the G query heads from g0
// (a compile-time count: what the group keeps is registers, not a runtime-sized array).
template <int kMax, typename Fn>
inline void by_head_groups(int64_t G, const Fn& fn) {
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t gc = std::min<int64_t>(kMax, G - g0);
    switch (gc) {
      case 1: fn(g0, std::integral_constant<int, 1>{}); break;
      case 2: fn(g0, std::integral_constant<int, std::min(2, kMax)>{}); break;
      case 3: fn(g0, std::integral_constant<int, std::min(3, kMax)>{}); break;
      default: fn(g0, std::integral_constant<int, kMax>{}); break;
    }
    g0 += gc;
  }
}

// bf16 keys stored split (kSplit): the scores of m <= 16 consecutive rows (row i at rows + i *
// stride) against GC query heads (qf [GC, D], split), s[g * Lp + i] for g < GC, i < m. The queries
// are loaded once for the 16 rows (GC * NV <= 16 vectors; the pair sums beside them may spill
// to L1), each row is split as it is read and its sums reduced in pairs as the rows come
// (hsum16's first level), the rest of the tree once for the 16: no converted copy of the block
// is written and read back once a head. The same products and sums in the same order as scores16
// over a converted block (outputs equal bit for bit). Against that path, built the same and run
// in one process by turns (SmolLM2's 9 / 3 heads of 64, bf16, AMD EPYC Zen 4, medians of 30):
// 64 contexts of 192 tokens, 30 layers' caches out of DRAM, 2 threads, 0.400-0.411 ms a layer
// against 0.421-0.436 (of 512 tokens 1.03 against 1.07); one context of 192 8.2 us against 9.3.
// Measured at 3 query heads a K/V head of 64 only (one pass); with more heads than kScoreHeads
// each pass reads and splits the rows again.
template <int NV, int GC>
KV_ALWAYS_INLINE void split_scores16(const float* qf, const c10::BFloat16* rows, int64_t stride, int64_t m,
                                    float* s, int64_t Lp, const Ahead* ahead, int64_t row0) {
  constexpr int64_t D = NV * 16;
  __m512 q[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j) q[g][j] = _mm512_loadu_ps(qf + g * D + 16 * j);
  // rows past m score row m - 1 again (their lanes are not stored) rather than branch around them
  __m512 a[GC][8];
  for (int64_t i = 0; i < 16; i += 2) {
    __m512 t[2][GC];
    for (int64_t r = 0; r < 2; ++r) {
      const int64_t row = std::min<int64_t>(i + r, m - 1);
      if (ahead != nullptr && i + r < m) ahead->row(row0 + i + r);
      __m512 kv[NV];
      for (int j = 0; j < NV; j += 2) split_bf16(rows + row * stride + 16 * j, kv[j], kv[j + 1]);
      for (int g = 0; g < GC; ++g) {
        __m512 x = _mm512_mul_ps(q[g][0], kv[0]);
        for (int j = 1; j < NV; ++j) x = _mm512_fmadd_ps(q[g][j], kv[j], x);
        t[r][g] = x;
      }
    }
    for (int g = 0; g < GC; ++g) a[g][i / 2] = pair_sums(t[0][g], t[1][g]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
  for (int g = 0; g < GC; ++g) _mm512_mask_storeu_ps(s + g * Lp, valid, hsum_pairs(a[g]));
}

// The most query heads split_scores16 scores in one pass: at most 16 vectors of queries.
template <int NV>
constexpr int kScoreHeads = std::max(1, std::min(4, 16 / NV));

// split_scores16 for the G query heads, kScoreHeads of them a pass; the first pass asks the
// caches for `ahead`'s rows row0.. as it reads its own (as int8's key_block does).
template <int NV>
inline void split_scores(const float* qf, const c10::BFloat16* rows, int64_t stride, int64_t m, int64_t G,
                         float* s, int64_t Lp, const Ahead& ahead, int64_t row0) {
  constexpr int64_t D = NV * 16;
  by_head_groups<kScoreHeads<NV>>(G, [&](int64_t g0, auto gc) {
    const Ahead* first_pass = g0 == 0 ? &ahead : nullptr;
    split_scores16<NV, decltype(gc)::value>(qf + g0 * D, rows, stride, m, s + g0 * Lp, Lp, first_pass, row0);
  });
}

// The scores of a part's positions against the G query heads of K/V head kh (qf [G, D], scaled,
// split where the keys are): s[g * Lp + t] for position span.begin + t, 16 rows of a block at a time
// (row_scale: room for BS + 16 factors). The keys asked for ahead run on into the next task's
// blocks (`next`) once this part's run out.
template <int NV, typename KSrc, typename VSrc>
void part_scores(const float* qf, const KSrc& ks, const VSrc& vs, const int64_t* table, PartSpan span, int64_t BS,
                 int64_t kh, int64_t G, int64_t Lp, float* buf, float* row_scale, float* s,
                 const NextPart& next) {
  constexpr int64_t D = NV * 16;
  const int64_t first = span.begin / BS;  // the part's first block
  for (int64_t b = first; b < first + kAheadBlocks; ++b) {  // the first blocks' keys, at once
    const StreamBlock a = stream_block(table, span, kh, next, BS, b);
    ks.prefetch(a.blk, a.kh, a.rows);
  }
  for (int64_t t0 = first * BS; t0 < span.end; t0 += BS) {
    const int64_t n = std::min(BS, span.end - t0);
    const StreamBlock a = stream_block(table, span, kh, next, BS, t0 / BS + kAheadBlocks);
    const Ahead ahead{ks.lines(a.blk, a.kh), vs.lines(table[t0 / BS], kh), a.rows, n};
    const int64_t skipped = std::max<int64_t>(0, span.begin - t0);  // the block's rows before the part
    if constexpr (kSplit<KSrc, NV>) {  // bf16 keys: scored as they are read (split_scores)
      const c10::BFloat16* base = ks.block(table[t0 / BS], kh);
      const int64_t stride = ks.s.stride();
      for (int64_t i = 0; i < skipped; ++i) ahead.row(i);
      for (int64_t i0 = skipped; i0 < n; i0 += 16)
        split_scores<NV>(qf, base + i0 * stride, stride, std::min<int64_t>(16, n - i0), G,
                         s + t0 + i0 - span.begin, Lp, ahead, i0);
      for (int64_t i = n; i < BS; ++i) ahead.row(i);
    } else {
      const KeyRows k = key_block<NV>(ks, table[t0 / BS], kh, n, buf, row_scale, ahead);
      for (int64_t i0 = skipped; i0 < n; i0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - i0);
        const Rows rows16{k.r.ptr + i0 * k.r.stride, k.r.stride};
        for (int64_t g = 0; g < G; ++g) {
          __m512 sc = scores16<NV>(qf + g * D, rows16, m);
          if (k.row_scale != nullptr) sc = _mm512_mul_ps(sc, _mm512_loadu_ps(k.row_scale + i0));
          _mm512_mask_storeu_ps(s + g * Lp + t0 + i0 - span.begin, static_cast<__mmask16>((1u << m) - 1), sc);
        }
      }
    }
  }
}

// s[t] = e^(s[t] - m) for t < L, 16 at a time (s has room for Lp, a multiple of 16: the padding
// gets -inf and so weight 0); returns m, the largest score, and l, the sum of the e^(s[t] - m).
inline std::pair<float, float> part_softmax(float* s, int64_t L, int64_t Lp) {
  for (int64_t t = L; t < Lp; ++t) s[t] = -std::numeric_limits<float>::infinity();
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < Lp; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  const float mx = _mm512_reduce_max_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < Lp; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(mx)));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  return {mx, _mm512_reduce_add_ps(sum)};
}

// acc [GC, D] = sum over a part's positions t of p[g * Lp + t] * v_t for GC query heads of K/V
// head kh from g0 on, their sums held in registers (GC * NV of them, a compile-time count: a
// runtime one left them on the stack) while the part's rows are added. Sums of split rows
// (kSplit) are put back in channel order as they are stored.
template <int NV, int GC, typename VSrc>
void part_values_heads(const float* p, const VSrc& vs, const int64_t* table, PartSpan span, int64_t BS, int64_t kh,
                       int64_t Lp, float* buf, float* acc) {
  __m512 o[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j) o[g][j] = _mm512_setzero_ps();
  each_value_row<NV>(vs, table, span.begin, span.end, BS, kh, buf, [&](int64_t t, const __m512 (&vv)[NV], float f) {
    for (int g = 0; g < GC; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * Lp + t] * f);
      for (int j = 0; j < NV; ++j) o[g][j] = _mm512_fmadd_ps(w, vv[j], o[g][j]);
    }
  });
  if constexpr (kSplit<VSrc, NV>) {
    // o[g][j] holds channels 16j + 2i (j even) or 16(j - 1) + 2i + 1 (j odd) in lane i
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < NV; j += 2) {
        _mm512_storeu_ps(acc + (g * NV + j) * 16, _mm512_permutex2var_ps(o[g][j], lo, o[g][j + 1]));
        _mm512_storeu_ps(acc + (g * NV + j + 1) * 16, _mm512_permutex2var_ps(o[g][j], hi, o[g][j + 1]));
      }
  } else {
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (g * NV + j) * 16, o[g][j]);
  }
}

// The most query heads whose sums part_values holds in registers at once: 24 of the 32 vectors.
template <int NV>
constexpr int kHeadsHeld = NV >= 16 ? 1 : std::min(4, 24 / NV);

// acc [G, D] for the G query heads of K/V head kh: as many heads a pass over the part's rows as
// fit in registers (a pass reads the rows again from L1/L2, and only where G * D is large).
template <int NV, typename VSrc>
void part_values(const float* p, const VSrc& vs, const int64_t* table, PartSpan span, int64_t BS, int64_t kh,
                 int64_t G, int64_t Lp, float* buf, float* acc) {
  constexpr int64_t D = NV * 16;
  by_head_groups<kHeadsHeld<NV>>(G, [&](int64_t g0, auto gc) {
    part_values_heads<NV, decltype(gc)::value>(p + g0 * Lp, vs, table, span, BS, kh, Lp, buf, acc + g0 * D);
  });
}

template <typename scalar_t, int NV, typename KSrc, typename VSrc>  // NV = D / 16
void decode_avx512(const scalar_t* q, const KSrc& ks, const VSrc& vs, const int64_t* tables, const int64_t* lens,
                   scalar_t* out, int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t max_blocks, float scale,
                   int64_t window) {
  constexpr int64_t D = NV * 16;
  const int64_t G = H / KVH, P = parts_per_sequence(B, longest_attended(lens, B, window));
  PartStates st(B, P, H, D);
  const auto cost = [&](int64_t idx) {
    return part_cost(lens, window, BS, P, idx / (P * KVH), idx / KVH % P);
  };
  kvserve::parallel_by_cost(B * P * KVH, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), buf(BS * D), row_scale(BS + 16, 0.f), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / (P * KVH), part = idx / KVH % P, kh = idx % KVH;
      const PartSpan span = part_span(window_begin(lens[b], window), lens[b], BS, P, part);
      if (span.empty()) continue;
      const int64_t* table = tables + b * max_blocks;
      const int64_t L = span.end - span.begin, Lp = (L + 15) / 16 * 16;  // scores padded to whole vectors
      if (static_cast<int64_t>(scores.size()) < G * Lp) scores.resize(G * Lp);
      scaled_queries(q, b, kh, H, G, D, scale, qf.data());
      if constexpr (kSplit<KSrc, NV>) split_queries(qf.data(), G, D);
      part_scores<NV>(qf.data(), ks, vs, table, span, BS, kh, G, Lp, buf.data(), row_scale.data(),
                      scores.data(), next_part(idx, end, tables, lens, max_blocks, window, BS, P, KVH));
      const int64_t at = st.at(b, part, kh * G);  // the G heads of kh are consecutive
      for (int64_t g = 0; g < G; ++g)
        std::tie(st.m[at + g], st.l[at + g]) = part_softmax(scores.data() + g * Lp, L, Lp);
      part_values<NV>(scores.data(), vs, table, span, BS, kh, G, Lp, buf.data(), st.acc.data() + at * D);
    }
  });
  merge_parts(st, out, B);
}
#endif

// The fast path where it applies, else the portable one.
template <typename scalar_t, typename KSrc, typename VSrc>
void decode(const scalar_t* q, const KSrc& ks, const VSrc& vs, const int64_t* tables, const int64_t* lens,
            scalar_t* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks,
            float scale, int64_t window) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<scalar_t, double>) {
    if (H / KVH <= 8) {
      const auto args = std::make_tuple(q, ks, vs, tables, lens, out, B, H, KVH, BS, max_blocks, scale, window);
      switch (D) {
        case 16: return std::apply(decode_avx512<scalar_t, 1, KSrc, VSrc>, args);
        case 32: return std::apply(decode_avx512<scalar_t, 2, KSrc, VSrc>, args);
        case 64: return std::apply(decode_avx512<scalar_t, 4, KSrc, VSrc>, args);
        case 128: return std::apply(decode_avx512<scalar_t, 8, KSrc, VSrc>, args);
        case 256: return std::apply(decode_avx512<scalar_t, 16, KSrc, VSrc>, args);
        default: break;
      }
    }
  }
#endif
  decode_portable(q, ks, vs, tables, lens, out, B, H, KVH, D, BS, max_blocks, scale, window);
}

// ---- entry points: one per format; they check shapes and dispatch on the query dtype ----
struct Call {
  at::Tensor q, tables, lens, out;
  int64_t B, H, D, BS, KVH, window;
};

// The call's operands checked; its output `out` where one is given (q's dtype and shape, contiguous),
// else a new tensor.
Call prepare(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
             const at::Tensor& lens, int64_t head_dim, int64_t window, const at::Tensor& out = {}) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4, "q [B, H, D] and a cache [num_blocks, BS, KVH, ...]");
  TORCH_CHECK(cache.is_contiguous(), "a contiguous cache");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 tables and lengths");
  const int64_t B = q.size(0);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.dim() == 1 && lens.size(0) == B,
              "tables [B, max blocks] and lens [B] for q's B rows");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  if (out.defined())
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes() &&
                out.is_contiguous(), "out: q's dtype and shape, contiguous on CPU");
  // out in q's shape, row-major whatever q's strides (empty_like(q) would keep a permuted q's order)
  Call c{q.contiguous(), tables.contiguous(), lens.contiguous(),
         out.defined() ? out : at::empty(q.sizes(), q.options()), q.size(0), q.size(1), q.size(2),
         cache.size(1), cache.size(2), window};
  TORCH_CHECK(c.D == head_dim && c.H % c.KVH == 0 && c.D <= 256, "shape mismatch");
  return c;
}

template <typename KSrc, typename VSrc>
at::Tensor run(Call& c, const KSrc& ks, const VSrc& vs, double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, c.q.scalar_type(), "paged_decode", [&] {
    decode(c.q.data_ptr<scalar_t>(), ks, vs, c.tables.data_ptr<int64_t>(), c.lens.data_ptr<int64_t>(),
           c.out.data_ptr<scalar_t>(), c.B, c.H, c.KVH, c.D, c.BS, c.tables.size(1), static_cast<float>(scale),
           c.window);
  });
  return c.out;
}

// paged_decode into `into` where it is given (else a new tensor).
at::Tensor paged_decode_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                             const at::Tensor& into) {
  Call c = prepare(q, k, tables, lens, k.size(3), window, into);
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && v.is_contiguous(), "one dtype for K and V");
  const Shape s{c.BS, c.KVH, c.D};
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k.scalar_type(), "dense", [&] {
    out = run(c, Dense<scalar_t>{k.data_ptr<scalar_t>(), s}, Dense<scalar_t>{v.data_ptr<scalar_t>(), s}, scale);
  });
  return out;
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor tables,
                        at::Tensor lens, double scale, int64_t window) {
  return paged_decode_into(q, k, v, tables, lens, scale, window, {});
}

// paged_decode_int8 into `into` where it is given (else a new tensor).
at::Tensor paged_decode_int8_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_scale,
                                  const at::Tensor& v, const at::Tensor& v_scale, const at::Tensor& tables,
                                  const at::Tensor& lens, double scale, int64_t window,
                                  const at::Tensor& into) {
  Call c = prepare(q, k, tables, lens, k.size(3), window, into);
  TORCH_CHECK(k.scalar_type() == at::kChar && v.scalar_type() == at::kChar && k_scale.scalar_type() == at::kFloat
              && v_scale.scalar_type() == at::kFloat && v.is_contiguous() && k_scale.is_contiguous()
              && v_scale.is_contiguous(), "int8 values and fp32 scales");
  const Shape s{c.BS, c.KVH, c.D};
  return run(c, Int8{k.data_ptr<int8_t>(), k_scale.data_ptr<float>(), s},
             Int8{v.data_ptr<int8_t>(), v_scale.data_ptr<float>(), s}, scale);
}

at::Tensor paged_decode_int8(at::Tensor q, at::Tensor k, at::Tensor k_scale, at::Tensor v,
                             at::Tensor v_scale, at::Tensor tables, at::Tensor lens, double scale,
                             int64_t window) {
  return paged_decode_int8_into(q, k, k_scale, v, v_scale, tables, lens, scale, window, {});
}

at::Tensor paged_decode_fp8(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor table,
                            at::Tensor k_scales, at::Tensor v_scales, bool e4m3, at::Tensor tables,
                            at::Tensor lens, double scale, int64_t window) {
  Call c = prepare(q, k, tables, lens, k.size(3), window);
  TORCH_CHECK(k.scalar_type() == at::kByte && v.scalar_type() == at::kByte && v.is_contiguous(), "fp8 codes");
  TORCH_CHECK(table.numel() == 256 && table.scalar_type() == at::kFloat && k_scales.numel() == c.KVH
              && v_scales.numel() == c.KVH && k_scales.scalar_type() == at::kFloat
              && v_scales.scalar_type() == at::kFloat, "a 256-entry fp32 table and one fp32 scale per KV head");
  auto tb = table.contiguous(), ksc = k_scales.contiguous(), vsc = v_scales.contiguous();
  const Shape s{c.BS, c.KVH, c.D};
  return run(c, Fp8{k.data_ptr<uint8_t>(), tb.data_ptr<float>(), ksc.data_ptr<float>(), e4m3, s},
             Fp8{v.data_ptr<uint8_t>(), tb.data_ptr<float>(), vsc.data_ptr<float>(), e4m3, s}, scale);
}

at::Tensor paged_decode_int4(at::Tensor q, at::Tensor k, at::Tensor k_scale, at::Tensor k_zero,
                             at::Tensor v, at::Tensor v_scale, at::Tensor v_zero, at::Tensor slot_of,
                             at::Tensor res_k, at::Tensor res_v, at::Tensor tables, at::Tensor lens,
                             double scale, int64_t window) {
  Call c = prepare(q, k, tables, lens, 2 * k.size(3), window);
  for (const auto& t : {k_scale, k_zero, v_scale, v_zero})
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous(), "fp16 int4 scales and zeros");
  TORCH_CHECK(k.scalar_type() == at::kByte && v.scalar_type() == at::kByte && v.is_contiguous(), "packed int4");
  TORCH_CHECK(slot_of.scalar_type() == at::kLong && slot_of.numel() == k.size(0), "slot_of [num_blocks] int64");
  TORCH_CHECK(res_k.scalar_type() == res_v.scalar_type() && res_k.is_contiguous() && res_v.is_contiguous()
              && res_k.size(1) == c.BS && res_k.size(3) == c.D, "residual slots [slots, BS, KVH, D]");
  auto so = slot_of.contiguous();
  const Shape s{c.BS, c.KVH, c.D};
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, res_k.scalar_type(), "int4", [&] {
    using K = Int4<scalar_t, true>;
    using V = Int4<scalar_t, false>;
    out = run(c,
              K{k.data_ptr<uint8_t>(), k_scale.data_ptr<c10::Half>(), k_zero.data_ptr<c10::Half>(), so.data_ptr<int64_t>(),
                Dense<scalar_t>{res_k.data_ptr<scalar_t>(), s}, s},
              V{v.data_ptr<uint8_t>(), v_scale.data_ptr<c10::Half>(), v_zero.data_ptr<c10::Half>(), so.data_ptr<int64_t>(),
                Dense<scalar_t>{res_v.data_ptr<scalar_t>(), s}, s},
              scale);
  });
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

// paged_decode or paged_decode_int8 over one layer's cache, its tensors and scale bound, for a
// decoder layer run as one call (kernel_ops.h). operands: what the entry takes after q (dense: k,
// v; int8: k, k_scale, v, v_scale).
struct Decode final : kvserve::DecodeOp {
  bool int8;
  std::vector<at::Tensor> cache;
  double scale;
  Decode(bool int8, std::vector<at::Tensor> cache, double scale)
      : int8(int8), cache(std::move(cache)), scale(scale) {}
  at::Tensor operator()(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                        int64_t window) const override {
    return run_into(q, tables, lens, window, {});
  }
  void into(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens, int64_t window,
            const at::Tensor& out) const override {
    run_into(q, tables, lens, window, out);
  }
  at::Tensor run_into(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens, int64_t window,
                      const at::Tensor& out) const {
    const auto& c = cache;
    if (int8) return paged_decode_int8_into(q, c[0], c[1], c[2], c[3], tables, lens, scale, window, out);
    return paged_decode_into(q, c[0], c[1], tables, lens, scale, window, out);
  }
};

pybind11::capsule decode_op(const std::string& kind, std::vector<at::Tensor> operands, double scale) {
  TORCH_CHECK(kind == "dense" || kind == "int8", "a decode op reads a dense or an int8 cache, not ", kind);
  const size_t want = kind == "int8" ? 4 : 2;
  TORCH_CHECK(operands.size() == want, "the decode of a ", kind, " cache takes ", want, " tensors, not ",
              operands.size());
  for (const auto& t : operands)
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "contiguous CPU cache tensors");
  auto op = std::make_unique<Decode>(kind == "int8", std::move(operands), scale);
  return kvserve::to_capsule<kvserve::DecodeOp>(std::move(op));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("decode_op", &decode_op, "paged_decode (dense) or paged_decode_int8 over one layer, its cache "
        "and scale bound, as a kvserve.DecodeOp capsule (kernel_ops.h)");
  m.def("paged_decode", &paged_decode, "decode attention over a dense paged KV cache (CPU)");
  m.def("paged_decode_int8", &paged_decode_int8, "decode attention over an int8 paged KV cache (CPU)");
  m.def("paged_decode_fp8", &paged_decode_fp8, "decode attention over an fp8 paged KV cache (CPU)");
  m.def("paged_decode_int4", &paged_decode_int4, "decode attention over an int4 (KIVI) paged KV cache (CPU)");
}
