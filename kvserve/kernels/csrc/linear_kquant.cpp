// y = x @ W^T with W kept in GGUF's K-quant and 5-bit blocks, read packed, and their
// dequantization. The arithmetic is llama.cpp's (ggml-quants.c, dequantize_row_*); the code is
// organized around one idea: every one of these blocks decodes to small integers q and, per
// group of 16 or 32 weights, a float scale and offset, with
//
//   w = scale[g] * q + offset[g]          (scale = d * sc, offset = -(dmin * m) or m or absent)
//
// computed in fp32 exactly as the `gguf` package computes it (the file builds with
// -ffp-contract=off, so the product and the sum are two roundings, never a fused one).
//
//   type (ggml id)  values bytes  layout (GGUF's)                                  q        groups
//   Q5_0   (6)       32    22    d, qh u32, qs[16]                                 -16..15  1 x 32
//   Q5_1   (7)       32    24    d, m, qh u32, qs[16]                              0..31    1 x 32
//   IQ4_NL (20)      32    18    d, qs[16] (nibbles index a 16-value table)         -127..113 1 x 32
//   Q2_K   (10)     256    84    scales[16] (4-bit sc, 4-bit m), qs[64], d, dmin   0..3     16 x 16
//   Q3_K   (11)     256   110    hmask[32], qs[64], scales[12] (6-bit), d          -4..3    16 x 16
//   Q4_K   (12)     256   144    d, dmin, scales[12] (6-bit sc and m), qs[128]     0..15    8 x 32
//   Q5_K   (13)     256   176    d, dmin, scales[12], qh[32], qs[128]              0..31    8 x 32
//   Q6_K   (14)     256   210    ql[128], qh[64], scales[16] int8, d               -32..31  16 x 16
//
// Products:
//   linear_quant  fp32 x [M, K]: each block of a W row is decoded once to fp32 and multiplied
//                 with every row of x (1 to hundreds), so the weights are read once a call.
//   linear_q8     x quantized per block of the weight's size (256 for K-quants, as llama.cpp's
//                 Q8_K; 32 for the others, as its Q8_0): dx = max|x| / 127, xq = round(x / dx),
//                 and the sums of xq per sixteen; a block then contributes
//                   dx * (sum_g scale[g] * S[g] + sum_g offset[g] * sum(xq in g)),  S[g] = sum q xq
//                 with S exact in int32. kvserve.models.packed.linear_int8_reference is the same
//                 in torch.
// Paths: AVX-512 (VNNI's vpdpbusd where built with it, else vpmaddubsw), AVX2 and a portable
// loop. linear_q8 decodes every type's blocks in registers on the vector paths, a tile of W rows
// against a tile of x rows at a time ("int8 activations, vector builds" below); linear_quant does
// so for Q4_K, Q6_K and Q5_0 and decodes the other types in plain C++ into a buffer.
// setup.py builds this file once per level; `isa()` names the build.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include "kernel_ops.h"
#include "linear_operands.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kQ5_0 = 6, kQ5_1 = 7, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20;
constexpr int kMaxValues = 256, kMaxGroups = 16;

struct Layout {
  int64_t values, bytes, group;  // weights a block, bytes a block, weights a scale
};

template <int FMT>
constexpr Layout layout() {
  switch (FMT) {
    case kQ5_0: return {32, 22, 32};
    case kQ5_1: return {32, 24, 32};
    case kIQ4_NL: return {32, 18, 32};
    case kQ2_K: return {256, 84, 16};
    case kQ3_K: return {256, 110, 16};
    case kQ4_K: return {256, 144, 32};
    case kQ5_K: return {256, 176, 32};
    default: return {256, 210, 16};  // Q6_K
  }
}

inline Layout layout_of(int64_t fmt) {
  switch (fmt) {
    case kQ5_0: return layout<kQ5_0>();
    case kQ5_1: return layout<kQ5_1>();
    case kIQ4_NL: return layout<kIQ4_NL>();
    case kQ2_K: return layout<kQ2_K>();
    case kQ3_K: return layout<kQ3_K>();
    case kQ4_K: return layout<kQ4_K>();
    case kQ5_K: return layout<kQ5_K>();
    default: return layout<kQ6_K>();
  }
}

inline bool known(int64_t fmt) {
  return fmt == kQ5_0 || fmt == kQ5_1 || fmt == kIQ4_NL || fmt == kQ2_K || fmt == kQ3_K || fmt == kQ4_K ||
         fmt == kQ5_K || fmt == kQ6_K;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// A decoded block: w[i] = scale[i / group] * q[i] + offset[i / group].
struct Decoded {
  int8_t q[kMaxValues];
  float scale[kMaxGroups], offset[kMaxGroups];
};

const int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q5_0 / Q5_1: weight j's low four bits in nibble j % 16 of qs (low nibbles first), its fifth bit
// bit j of qh.
inline void decode_five_bits(const uint8_t* qh_bytes, const uint8_t* qs, int bias, int8_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - bias);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
  }
}

// Q4_K / Q5_K's twelve bytes of 6-bit scales and minimums (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline void k4_scales(const uint8_t* b, Decoded& out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  for (int g = 0; g < 8; ++g) {
    int sc, m;
    scale_min_k4(b + 4, g, &sc, &m);
    out.scale[g] = d * static_cast<float>(sc);
    out.offset[g] = -(dmin * static_cast<float>(m));
  }
}

inline void decode_q5_0(const uint8_t* b, Decoded& out) {
  out.scale[0] = half_at(b);
  out.offset[0] = 0.f;
  decode_five_bits(b + 2, b + 6, 16, out.q);
}

inline void decode_q5_1(const uint8_t* b, Decoded& out) {
  out.scale[0] = half_at(b);
  out.offset[0] = half_at(b + 2);
  decode_five_bits(b + 4, b + 8, 0, out.q);
}

inline void decode_iq4_nl(const uint8_t* b, Decoded& out) {
  out.scale[0] = half_at(b);
  out.offset[0] = 0.f;
  for (int j = 0; j < 16; ++j) {
    out.q[j] = kIQ4NLValues[b[2 + j] & 15];
    out.q[j + 16] = kIQ4NLValues[b[2 + j] >> 4];
  }
}

inline void decode_q2_k(const uint8_t* b, Decoded& out) {
  const uint8_t *scales = b, *qs = b + 16;
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  for (int g = 0; g < 16; ++g) {
    out.scale[g] = d * static_cast<float>(scales[g] & 15);
    out.offset[g] = -(dmin * static_cast<float>(scales[g] >> 4));
  }
  // weight 128h + 32t + l: bits 2t..2t+1 of qs[32h + l]
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l) out.q[128 * h + 32 * t + l] = static_cast<int8_t>((qs[32 * h + l] >> (2 * t)) & 3);
}

inline void decode_q3_k(const uint8_t* b, Decoded& out) {
  const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
  const float d = half_at(b + 108);
  for (int g = 0; g < 16; ++g) {
    const int low = g < 8 ? s[g] & 15 : s[g - 8] >> 4;
    const int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    out.scale[g] = d * static_cast<float>((low | (high << 4)) - 32);
    out.offset[g] = 0.f;
  }
  // weight 128h + 32t + l: bits 2t..2t+1 of qs[32h + l], minus 4 where bit (4h + t) of
  // hmask[l] is clear
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l) {
        const int low = (qs[32 * h + l] >> (2 * t)) & 3, set = (hmask[l] >> (4 * h + t)) & 1;
        out.q[128 * h + 32 * t + l] = static_cast<int8_t>(low - (set ? 0 : 4));
      }
}

// Q4_K and Q5_K: weights 64c + l and 64c + 32 + l are the low and high nibble of qs[32c + l];
// Q5_K's fifth bit of weight 32g + l is bit g of qh[l].
template <bool FIVE>
inline void decode_k4(const uint8_t* b, Decoded& out) {
  k4_scales(b, out);
  const uint8_t *qs = b + (FIVE ? 48 : 16), *qh = b + 16;
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
      if (FIVE) {
        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      out.q[64 * c + l] = static_cast<int8_t>(lo);
      out.q[64 * c + 32 + l] = static_cast<int8_t>(hi);
    }
}

inline void decode_q6_k(const uint8_t* b, Decoded& out) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int g = 0; g < 16; ++g) {
    out.scale[g] = d * static_cast<float>(scales[g]);
    out.offset[g] = 0.f;
  }
  // weight 128h + 32t + l: nibble t / 2 of ql[64h + 32 (t % 2) + l], and bits 2t..2t+1 of
  // qh[32h + l] above it, minus 32
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l) {
        const int low = (ql[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
        const int high = (qh[32 * h + l] >> (2 * t)) & 3;
        out.q[128 * h + 32 * t + l] = static_cast<int8_t>((low | (high << 4)) - 32);
      }
}

template <int FMT>
inline void decode(const uint8_t* b, Decoded& out) {
  if constexpr (FMT == kQ5_0) decode_q5_0(b, out);
  else if constexpr (FMT == kQ5_1) decode_q5_1(b, out);
  else if constexpr (FMT == kIQ4_NL) decode_iq4_nl(b, out);
  else if constexpr (FMT == kQ2_K) decode_q2_k(b, out);
  else if constexpr (FMT == kQ3_K) decode_q3_k(b, out);
  else if constexpr (FMT == kQ4_K || FMT == kQ5_K) decode_k4<FMT == kQ5_K>(b, out);
  else decode_q6_k(b, out);
}

// The types whose weights have an offset (the others' is zero and never added: a -0 stays -0).
template <int FMT>
constexpr bool has_offset() { return FMT == kQ5_1 || FMT == kQ2_K || FMT == kQ4_K || FMT == kQ5_K; }

// The decoded block's weights in fp32: the reference every path equals.
template <int FMT>
inline void expand(const Decoded& d, float* w) {
  constexpr Layout L = layout<FMT>();
  for (int64_t g = 0; g < L.values / L.group; ++g) {
    const float s = d.scale[g], o = d.offset[g];
    float* wg = w + g * L.group;
    const int8_t* qg = d.q + g * L.group;
    if constexpr (has_offset<FMT>()) {
      for (int64_t i = 0; i < L.group; ++i) wg[i] = s * static_cast<float>(qg[i]) + o;
    } else {
      for (int64_t i = 0; i < L.group; ++i) wg[i] = s * static_cast<float>(qg[i]);
    }
  }
}

// ---- vectors, per instruction-set level ----
//
// A vector build (AVX2, AVX-512) keeps, per row of x, accumulators of fp32 lanes through a whole
// row of W and adds its lanes up once at the end. Its byte dot products sum four u8 x s8
// products into each int32 lane: vpdpbusd (AVX-512 VNNI), else vpmaddubsw (pairs to int16; q's
// unsigned form is at most 63, so 2 * 63 * 127 stays within int16) and vpmaddwd. IQ4_NL's q are
// signed (to -127): |q| meets x with q's sign.

#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
struct V {
  using F = __m512;
  using I = __m512i;
  static constexpr int kFloats = 16, kBytes = 64;
  static F zerof() { return _mm512_setzero_ps(); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static F tofloat(I v) { return _mm512_cvtepi32_ps(v); }
  static F mulf(F a, F b) { return _mm512_mul_ps(a, b); }
  // bytes 16p..16p + 15 of v as int32 lanes (p = 0, 1)
  static I widen(__m256i v, int p) {
    return _mm512_cvtepi8_epi32(p == 0 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1));
  }
  // N of a vector's 64 bytes (N = 32: a 32-weight block; the rest zero), and as many floats or
  // int32 lanes as those bytes have lanes
  template <int N> static I bytes(const void* p) {
    if constexpr (N == 64) return _mm512_loadu_si512(p);
    else return _mm512_maskz_loadu_epi8(0xFFFFFFFFULL, p);
  }
  template <int N> static F lanesf(const float* p) {
    if constexpr (N == 64) return _mm512_loadu_ps(p);
    else return _mm512_maskz_loadu_ps(0x00FF, p);
  }
  template <int N> static I lanesi(const int32_t* p) {
    if constexpr (N == 64) return _mm512_loadu_si512(p);
    else return _mm512_maskz_loadu_epi32(0x00FF, p);
  }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static I sub_shifted(I s, I xs, int shift) { return _mm512_sub_epi32(s, _mm512_sll_epi32(xs, _mm_cvtsi32_si128(shift))); }
  static I dot_u8(I u, I x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1));
#endif
  }
  static I dot_s8(I q, I x) {
    return dot_u8(_mm512_abs_epi8(q), _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x));
  }
};
#else
struct V {
  using F = __m256;
  using I = __m256i;
  static constexpr int kFloats = 8, kBytes = 32;
  static F zerof() { return _mm256_setzero_ps(); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static F tofloat(I v) { return _mm256_cvtepi32_ps(v); }
  static F mulf(F a, F b) { return _mm256_mul_ps(a, b); }
  // bytes 8p..8p + 7 of v as int32 lanes (p = 0..3)
  static I widen(__m256i v, int p) {
    const __m128i half = p < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
    return _mm256_cvtepi8_epi32(p % 2 ? _mm_srli_si128(half, 8) : half);
  }
  template <int N> static I bytes(const void* p) {
    static_assert(N == 32, "AVX2 vectors are 32 bytes");
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  template <int N> static F lanesf(const float* p) { return _mm256_loadu_ps(p); }
  template <int N> static I lanesi(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static I sub_shifted(I s, I xs, int shift) { return _mm256_sub_epi32(s, _mm256_sll_epi32(xs, _mm_cvtsi32_si128(shift))); }
  static I dot_u8(I u, I x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)); }
  static I dot_s8(I q, I x) { return dot_u8(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)); }
};
#endif
constexpr int kAcc = 4;  // independent accumulators a row of x (FMA latency)

// acc[0..kAcc) += w [values] * x [values], lane by lane.
template <int VALUES>
inline void fma_block(const float* w, const float* x, V::F* acc) {
  for (int i = 0; i < VALUES; i += V::kFloats) {
    const int a = (i / V::kFloats) % kAcc;
    acc[a] = V::fma(V::loadf(w + i), V::loadf(x + i), acc[a]);
  }
}

inline float finish(const V::F* acc) { return V::sum(V::add(V::add(acc[0], acc[1]), V::add(acc[2], acc[3]))); }
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  for (int64_t i = 0; i < n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}
#endif

std::string isa() {
#if defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

// ---- dequantization ----

// Into fp32, or straight into bf16 / fp16 (each fp32 weight rounded once, as .to(dtype) rounds).
template <int FMT, typename out_t>
void dequantize_fmt(const uint8_t* w, out_t* out, int64_t N, int64_t K) {
  constexpr Layout L = layout<FMT>();
  const int64_t nb = K / L.values;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    Decoded d;
    float tmp[kMaxValues];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t j = 0; j < nb; ++j) {
        decode<FMT>(w + (n * nb + j) * L.bytes, d);
        out_t* o = out + n * K + j * L.values;
        if constexpr (std::is_same_v<out_t, float>) {
          expand<FMT>(d, o);
        } else {
          expand<FMT>(d, tmp);
          for (int64_t i = 0; i < L.values; ++i) o[i] = static_cast<out_t>(tmp[i]);
        }
      }
  });
}

// ---- fp32 activations ----

// Every row of x against W's rows: a thread takes runs of W rows, decodes each block once and
// meets it with every row of x.
template <int FMT>
void linear_fmt(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr Layout L = layout<FMT>();
  const int64_t nb = K / L.values;
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    Decoded d;
    alignas(64) float wf[kMaxValues];
#if defined(__AVX512F__) || defined(__AVX2__)
    std::vector<V::F> acc(M * kAcc);
#else
    std::vector<float> acc(M);
#endif
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), decltype(acc)::value_type{});
      for (int64_t j = 0; j < nb; ++j) {
        decode<FMT>(w + (n * nb + j) * L.bytes, d);
        expand<FMT>(d, wf);
        for (int64_t m = 0; m < M; ++m) {
#if defined(__AVX512F__) || defined(__AVX2__)
          fma_block<L.values>(wf, x + m * K + j * L.values, acc.data() + m * kAcc);
#else
          acc[m] += dot(wf, x + m * K + j * L.values, L.values);
#endif
        }
      }
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) {
#if defined(__AVX512F__) || defined(__AVX2__)
        y[m * N + n] = finish(acc.data() + m * kAcc) + b;
#else
        y[m * N + n] = acc[m] + b;
#endif
      }
    }
  });
}

// ---- blocks decoded in registers: helpers ----
//
// Q4_K, Q6_K and Q5_0 (a Q4_K_M file's types) decode straight into 256-bit registers for the fp32
// products; every type does for the int8 ones (below).
#if defined(__AVX2__)
template <int FMT>
constexpr bool in_registers() { return FMT == kQ4_K || FMT == kQ6_K || FMT == kQ5_0; }

namespace reg {
using I = __m256i;
using F = __m256;

inline I bytes(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }

// fp16 to fp32 by F16C's vcvtph2ps (exact, as half_at; one instruction instead of its bit loop).
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// Scale operands of scaled_dot from eight int16 scales s (one xmm, in both halves of `both`):
// s[lo] for the low sixteen bytes' products, s[hi] for the high; one vpshufb each.
inline I lane_scales(I both, int lo, int hi) {
  const auto pick = [](int i) { return _mm_set1_epi16(static_cast<int16_t>(((2 * i + 1) << 8) | (2 * i))); };
  return _mm256_shuffle_epi8(both, _mm256_set_m128i(pick(hi), pick(lo)));
}

inline I both_halves(__m128i v) { return _mm256_broadcastsi128_si256(v); }

inline float sum(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Q4_K's twelve bytes of 6-bit scales and minimums, four at a time (scale_min_k4's layout):
// sc[0..4) and m[0..4) are the low six bits of bytes 0..3 and 4..7; sc[4..8) and m[4..8) the
// low and high nibbles of bytes 8..11 with the top two bits of bytes 0..3 and 4..7 above them.
inline void k4_scales_packed(const uint8_t* s, uint32_t sc[2], uint32_t m[2]) {
  uint32_t a[3];
  std::memcpy(a, s, 12);
  constexpr uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  sc[0] = a[0] & six;
  m[0] = a[1] & six;
  sc[1] = (a[2] & four) | (((a[0] >> 6) & two) << 4);
  m[1] = ((a[2] >> 4) & four) | (((a[1] >> 6) & two) << 4);
}

// Q4_K: weights 64c + l and 64c + 32 + l are the low and high nibble of qs[32c + l].
// q[v]: weights 32v..32v + 31 (0..15).
inline void q4_k_bytes(const uint8_t* b, I q[8]) {
  const I low4 = _mm256_set1_epi8(15);
  for (int c = 0; c < 4; ++c) {
    const I qs = bytes(b + 16 + 32 * c);
    q[2 * c] = _mm256_and_si256(qs, low4);
    q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), low4);
  }
}

// Q6_K: weight 128h + 32t + l is nibble t / 2 of ql[64h + 32 (t % 2) + l] with bits 2t..2t+1 of
// qh[32h + l] above it, minus 32; its group of sixteen is 8h + 2t + l / 16.
// q[v]: weights 32v..32v + 31 plus 32 (0..63).
inline void q6_k_bytes(const uint8_t* b, I q[8]) {
  const I low4 = _mm256_set1_epi8(15), high2 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const I ql0 = bytes(b + 64 * h), ql1 = bytes(b + 64 * h + 32), qh = bytes(b + 128 + 32 * h);
    q[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2));
    q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2));
    q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, high2));
    q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2));
  }
}

// A 32-weight block's sixteen bytes of nibbles as 32 bytes: byte j the low nibble of qs[j], byte
// 16 + j the high one.
inline I nibbles(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}

// Byte j: where bit j of qh (four bytes) is set, `on`, else `off`.
inline I by_bits(const uint8_t* qh_bytes, I on, I off) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_mask_blend_epi8(static_cast<__mmask32>(qh), off, on);
#else
  // byte j: qh's byte j / 8 against bit j % 8
  const I spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                       _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                         0x0101010101010101, 0x0000000000000000));
  const I bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_blendv_epi8(off, on, _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit));
#endif
}

// Q5_0 as signed bytes: the low four bits in nibble j % 16 of qs, and where bit j of qh is clear,
// minus 16 (the byte's top four bits set).
inline I q5_0_signed(const uint8_t* b) {
  const I low = nibbles(b + 6);
  return by_bits(b + 2, low, _mm256_or_si256(low, _mm256_set1_epi8(static_cast<char>(0xF0))));
}

// Q5_1's q (0..31): the low four bits as Q5_0's, plus 16 where bit j of qh is set.
inline I five_bits_unsigned(const uint8_t* qh, const uint8_t* qs) {
  const I low = nibbles(qs);
  return by_bits(qh, _mm256_or_si256(low, _mm256_set1_epi8(16)), low);
}
}  // namespace reg

// ---- fp32 activations, decoded in registers (Q4_K, Q6_K, Q5_0) ----
//
// A block's weights become fp32 vectors straight from its byte vectors (scale * q + offset, two
// roundings as expand's), and meet every row of x from there: no decoded block in memory.
template <int FMT>
inline void weights_in_registers(const uint8_t* b, V::F* w) {
  constexpr Layout L = layout<FMT>();
  constexpr int kVectors = static_cast<int>(L.values) / 32, kParts = 32 / V::kFloats;
  reg::I q[8];
  float scale[kMaxGroups], offset[kMaxGroups] = {};
  if constexpr (FMT == kQ4_K) {
    reg::q4_k_bytes(b, q);
    const float d = reg::half(b), dmin = reg::half(b + 2);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      scale_min_k4(b + 4, g, &sc, &m);
      scale[g] = d * static_cast<float>(sc);
      offset[g] = -(dmin * static_cast<float>(m));
    }
  } else if constexpr (FMT == kQ6_K) {
    reg::q6_k_bytes(b, q);
    for (int v = 0; v < 8; ++v) q[v] = _mm256_sub_epi8(q[v], _mm256_set1_epi8(32));
    const float d = reg::half(b + 208);
    for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[g]);
  } else {
    q[0] = reg::q5_0_signed(b);
    scale[0] = reg::half(b);
  }
  for (int v = 0; v < kVectors; ++v)
    for (int p = 0; p < kParts; ++p) {
      const int i = v * kParts + p, g = i * V::kFloats / static_cast<int>(L.group);
      const V::F qf = V::tofloat(V::widen(q[v], p));
      w[i] = V::mulf(V::set1f(scale[g]), qf);
      if constexpr (has_offset<FMT>()) w[i] = V::add(w[i], V::set1f(offset[g]));
    }
}

template <int FMT>
void linear_fp32_registers(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                           int64_t K) {
  constexpr Layout L = layout<FMT>();
  constexpr int kVectors = static_cast<int>(L.values) / V::kFloats;
  const int64_t nb = K / L.values;
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<V::F> acc(M * kAcc);
    V::F wv[kVectors];
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), V::zerof());
      for (int64_t j = 0; j < nb; ++j) {
        weights_in_registers<FMT>(w + (n * nb + j) * L.bytes, wv);
        for (int64_t m = 0; m < M; ++m) {
          const float* xb = x + m * K + j * L.values;
          V::F* a = acc.data() + m * kAcc;
          for (int i = 0; i < kVectors; ++i) a[i % kAcc] = V::fma(wv[i], V::loadf(xb + i * V::kFloats), a[i % kAcc]);
        }
      }
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = finish(acc.data() + m * kAcc) + b;
    }
  });
}
#else
template <int FMT>
constexpr bool in_registers() { return false; }
#endif

// Every row of x against W: in registers for the types that have that path, else block by block.
template <int FMT>
void linear_fp32(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX2__)
  if constexpr (in_registers<FMT>()) return linear_fp32_registers<FMT>(x, w, bias, y, M, N, K);
#endif
  linear_fmt<FMT>(x, w, bias, y, M, N, K);
}

// ---- int8 activations ----
//
// x [M, K] is quantized once a call, per block of the weight's size (llama.cpp's Q8_K for the
// K-quants, its Q8_0 for the 32-weight types): dx = max|x| / 127, xq = round(x / dx) (nearest
// even, as torch.round), and the sums of xq per sixteen (Q8_K's bsums). Blocks are stored
// block-major (block j of every row, then block j + 1): the rows a block of W meets lie together,
// not K bytes apart. A vector build stores each block's values in the order its weight vectors
// come out of GGUF's bytes (`Placement`), so one load of x meets one decoded vector of W, and
// keeps beside them what a block's fp32 step reads ready-made: the sums times dx (K-quants), and
// AVX-512's vectors of dx (and its other terms) for pairs of 32-weight blocks.
struct QuantizedX {
  int64_t M = 0, values = 0;
  std::unique_ptr<int8_t[]> xq;      // [steps][M][step values]
  std::unique_ptr<int16_t[]> sums;   // [nb][M][values / 16]
  std::unique_ptr<float[]> dx, sx;   // [nb][M]: dx, and dx * sum(xq)
  std::unique_ptr<float[]> lanes;    // [steps][M][kLaneTerms][16]: per-lane terms (see users)
  int64_t at(int64_t m, int64_t j) const { return j * M + m; }
  const int16_t* bsums(int64_t m, int64_t j) const { return sums.get() + at(m, j) * (values / 16); }
};

// Where x's values land: a 256-weight block whole (its 32-byte chunks reordered on AVX-512), or,
// on AVX-512, 32-weight blocks in pairs: [block 2p's 0..15, 2p + 1's 0..15, 2p's 16..31, 2p + 1's
// 16..31], the order a pair's nibbles come out of one 256-bit load and a shift.
template <int FMT>
struct Placement {
  static constexpr int64_t kValues = layout<FMT>().values;
#if defined(__AVX512F__)
  static constexpr bool kPairs = kValues == 32;
#else
  static constexpr bool kPairs = false;
#endif
  static constexpr int64_t kStepValues = kPairs ? 64 : kValues;
  static int64_t steps(int64_t nb) { return kPairs ? (nb + 1) / 2 : nb; }
  // Where natural chunk c (x's values 32c..32c + 31) of a 256-weight block goes. AVX-512's weight
  // vectors hold two chunks that are not neighbours: Q4_K / Q5_K's low nibbles of qs[64p..64p + 63]
  // are sub-blocks 4p and 4p + 2; Q2_K / Q3_K's bits 2t of all 64 qs bytes are chunks t and 4 + t.
  static constexpr int chunk_at(int c) {
#if defined(__AVX512F__)
    constexpr int k4[8] = {0, 2, 1, 3, 4, 6, 5, 7}, k2[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    if (FMT == kQ4_K || FMT == kQ5_K) return k4[c];
    if (FMT == kQ2_K || FMT == kQ3_K) return k2[c];
#endif
    return c;
  }
  // The byte offset of values 16s..16s + 15 of row m's block j.
  static int64_t offset(int64_t M, int64_t m, int64_t j, int s) {
    if constexpr (kPairs) return ((j / 2) * M + m) * 64 + 32 * s + 16 * (j % 2);
    return (j * M + m) * kValues + 32 * chunk_at(s / 2) + 16 * (s % 2);
  }
};

inline float abs_max(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  return _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
#endif
}

// Sixteen values of x times inv, rounded to the nearest (even) int8 into q; returns their sum.
inline int32_t round16(const float* x, float inv, int8_t* q) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(v));
  return _mm512_reduce_add_epi32(v);
#elif defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(inv);
  const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), s));
  const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), s));
  // packs work within 128-bit halves (0..3 8..11 | 4..7 12..15): put them back in order
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
  const __m256i ab = _mm256_add_epi32(a, b);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(ab), _mm256_extracti128_si256(ab, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
#else
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    sum += q[i];
  }
  return sum;
#endif
}

// The per-lane terms a step of the vector products reads (QuantizedX::lanes), 16 floats each:
//   K-quants           dx * sums per sixteen (x's order)
//   AVX-512 pairs      dx per int32 lane; for Q5_0 -16 * (the lane's four xq) as int32; for Q5_1
//                      dx * sum(xq) / 8 (eight lanes a block)
template <int FMT>
constexpr int lane_terms() {
  if constexpr (!Placement<FMT>::kPairs) return layout<FMT>().values == 256 ? 1 : 0;
  else return FMT == kIQ4_NL ? 1 : 2;
}

// Row m's lane terms of a pair of 32-weight blocks (2p, 2p + 1; the second absent: zero).
template <int FMT>
void pair_terms(QuantizedX& q, int64_t m, int64_t p) {
  float* t = q.lanes.get() + (p * q.M + m) * lane_terms<FMT>() * 16;
  const int8_t* xq = q.xq.get() + (p * q.M + m) * 64;
  for (int l = 0; l < 16; ++l) {
    const int64_t j = q.at(m, 2 * p + (l / 4) % 2);  // lanes 4..7 and 12..15: block 2p + 1
    t[l] = q.dx[j];
    if constexpr (FMT == kQ5_0) {
      const int32_t s = -16 * (xq[4 * l] + xq[4 * l + 1] + xq[4 * l + 2] + xq[4 * l + 3]);
      std::memcpy(t + 16 + l, &s, 4);
    } else if constexpr (FMT == kQ5_1) {
      t[16 + l] = q.sx[j] * 0.125f;  // exact: a power of two
    }
  }
}

template <int FMT>
QuantizedX quantize_x(const float* x, int64_t M, int64_t K) {
  using P = Placement<FMT>;
  constexpr int64_t values = P::kValues;
  const int64_t nb = K / values, steps = P::steps(nb), padded = steps * P::kStepValues / values;
  QuantizedX q;
  q.M = M;
  q.values = values;
  q.xq.reset(new int8_t[M * steps * P::kStepValues]);
  q.sums.reset(new int16_t[M * padded * values / 16]);
  q.dx.reset(new float[M * padded]);
  q.sx.reset(new float[M * padded]);
  if constexpr (lane_terms<FMT>() > 0) q.lanes.reset(new float[M * steps * lane_terms<FMT>() * 16]);
  at::parallel_for(0, M * padded, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t m = r / padded, j = r % padded, i = q.at(m, j);
      int16_t* sums = q.sums.get() + i * (values / 16);
      if (j >= nb) {  // the pair's absent block: zero
        for (int s = 0; s < values / 16; ++s) std::memset(q.xq.get() + P::offset(M, m, j, s), 0, 16);
        q.dx[i] = q.sx[i] = 0.f;
        continue;
      }
      const float* xb = x + m * K + j * values;
      const float d = abs_max(xb, values) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int32_t total = 0;
      for (int s = 0; s < values / 16; ++s) {
        sums[s] = static_cast<int16_t>(round16(xb + 16 * s, inv, q.xq.get() + P::offset(M, m, j, s)));
        total += sums[s];
      }
      q.dx[i] = d;
      q.sx[i] = d * static_cast<float>(total);
      if constexpr (values == 256 && lane_terms<FMT>() > 0)
        for (int s = 0; s < 16; ++s) q.lanes[i * 16 + s] = d * static_cast<float>(sums[s]);
    }
  });
  if constexpr (P::kPairs)
    at::parallel_for(0, M * steps, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) pair_terms<FMT>(q, r % M, r / M);
    });
  return q;
}

// The operands of one product, and where its results go.
struct Operands {
  const QuantizedX& x;
  const uint8_t* w;
  const float* bias;
  float* y;
  int64_t M, N, nb, row_bytes;
  void store(int64_t m, int64_t n, float v) const { y[m * N + n] = v + (bias ? bias[n] : 0.f); }
};

#if defined(__AVX2__)
// ---- int8 activations, vector builds: blocks decoded in registers ----
//
// As llama.cpp's ggml_vec_dot_*_q8_K / *_q8_0: each block of W is unpacked in registers (bits,
// nibbles, scales), never stored, and met with a tile of rows of x. A 256-weight block becomes
// unsigned bytes u (q, or q plus a bias: Q6_K 32, Q3_K 4) and, per 16 weights, an int16 scale;
// vpmaddubsw takes u x xq in pairs (u <= 63: 2 * 63 * 127 stays within int16) and vpmaddwd applies
// the scale as it widens to int32, exact. A block then adds, in fp32,
//   d dx sum_g sc[g] S[g]  +  sum_g (c k[g]) (dx sum(xq in g))
// the second term one multiply-add of 16 lanes: the minimums (Q2_K, Q4_K, Q5_K: c = -dmin,
// k = m) or the bias (Q6_K, Q3_K: c = d, k = -bias sc), against dx times the bsums (kept with x).
// The 32-weight types take one vector a block on AVX2 and two blocks a vector on AVX-512, q
// signed (|q| meets x with q's sign) or, for Q5_0 and Q5_1 on AVX-512, unsigned (Q5_0's q + 16,
// its -16 sum(xq) per lane kept with x); Q5_1 adds m dx sum(xq). Byte products sum by vpdpbusd
// where AVX-512 VNNI is built.
namespace kv {
#if defined(__AVX512F__)
using I = __m512i;
using F = __m512;
constexpr int kBytes = 64, kVectors = 4, kFloatVectors = 1;  // vectors a 256-weight block, a sixteen of floats
inline I load(const void* p) { return _mm512_loadu_si512(p); }
inline F loadf(const float* p) { return _mm512_loadu_ps(p); }
inline I set1(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline I and_(I a, I b) { return _mm512_and_si512(a, b); }
inline I or_(I a, I b) { return _mm512_or_si512(a, b); }
inline I srli(I a, int s) { return _mm512_srli_epi16(a, s); }
inline I slli(I a, int s) { return _mm512_slli_epi16(a, s); }
inline I add(I a, I b) { return _mm512_add_epi32(a, b); }
inline I join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
// The int16 scale of each 16 bytes of a vector: table[g0], table[g1], table[g2], table[g3].
inline I scales(__m256i table, int g0, int g1, int g2, int g3) {
  const __m256i lo = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(g1)), _mm_set1_epi16(static_cast<int16_t>(g0)));
  const __m256i hi = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(g3)), _mm_set1_epi16(static_cast<int16_t>(g2)));
  return _mm512_permutexvar_epi16(join(lo, hi), _mm512_castsi256_si512(table));
}
// Sixteen int16 as fp32 times c.
inline void times(__m256i k, float c, F* out) { out[0] = _mm512_mul_ps(_mm512_set1_ps(c), _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(k))); }
inline I dot_scaled(I u, I x, I s) { return _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), s); }
inline F zerof() { return _mm512_setzero_ps(); }
inline F fma(I s, float f, F acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(f), acc); }
inline F fmaf(F a, F b, F acc) { return _mm512_fmadd_ps(a, b, acc); }
inline float sum(F v) { return _mm512_reduce_add_ps(v); }
constexpr int kRows = 4;  // rows of W a tile (32 registers: 4 x 4 accumulators)
#else
using I = __m256i;
using F = __m256;
constexpr int kBytes = 32, kVectors = 8, kFloatVectors = 2;
inline I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
inline F loadf(const float* p) { return _mm256_loadu_ps(p); }
inline I set1(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline I and_(I a, I b) { return _mm256_and_si256(a, b); }
inline I or_(I a, I b) { return _mm256_or_si256(a, b); }
inline I srli(I a, int s) { return _mm256_srli_epi16(a, s); }
inline I slli(I a, int s) { return _mm256_slli_epi16(a, s); }
inline I add(I a, I b) { return _mm256_add_epi32(a, b); }
// As AVX-512's, for a vector whose halves each hold one group: g0 == g1, g2 == g3, within one
// eight of the table.
inline I scales(__m256i table, int g0, int, int g2, int) {
  const I half = reg::both_halves(g0 < 8 ? _mm256_castsi256_si128(table) : _mm256_extracti128_si256(table, 1));
  return reg::lane_scales(half, g0 % 8, g2 % 8);
}
inline void times(__m256i k, float c, F* out) {
  const F cv = _mm256_set1_ps(c);
  out[0] = _mm256_mul_ps(cv, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(k))));
  out[1] = _mm256_mul_ps(cv, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(k, 1))));
}
inline I dot_scaled(I u, I x, I s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), s); }
inline F zerof() { return _mm256_setzero_ps(); }
inline F fma(I s, float f, F acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(f), acc); }
inline F fmaf(F a, F b, F acc) { return _mm256_fmadd_ps(a, b, acc); }
inline float sum(F v) { return reg::sum(v); }
constexpr int kRows = 2;  // 16 registers
#endif
// Bit k of every byte of v, moved to bit `to` (the rest zero).
inline I bit(I v, int k, int to) { return and_(k <= to ? slli(v, to - k) : srli(v, k - to), set1(1 << to)); }
}  // namespace kv

// An output's arithmetic is the same whichever tile computes it (tile<MR> is compiled once per
// MR), so a row's result does not depend on the rows beside it. The build allows reassociating
// plain float operations (-fassociative-math), which could differ between instantiations: a
// product of two products is taken by an instruction the compiler keeps as written, and the
// lanes are added up out of line, by one copy of the code.
#if defined(__AVX512F__)
inline __m512 exact_order_mul(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_CUR_DIRECTION); }
#endif

// A 256-weight block decoded: u and its scale per vector, d, and c k per sixteen in fp32.
struct KBlock {
  kv::I u[kv::kVectors];
#if defined(__AVX512F__)
  __m256i table;  // the sixteen (Q4_K, Q5_K: eight) int16 scales, GGUF's order
  kv::F sc;       // sc per lane of the products' sums in fp32 (KQuant::product)
#else
  kv::I s[kv::kVectors];
#endif
  kv::F ck[kv::kFloatVectors];
  float d;
};

// Q4_K and Q5_K: sub-block g (32 weights) is nibble g % 2 of qs[32 (g / 2) + l]; Q5_K's fifth
// bit is bit g of qh[l]. Scales and minimums 6 bits each (k4_scales_packed).
template <bool FIVE>
inline void decode_k4_block(const uint8_t* b, KBlock& k) {
  uint32_t sc[2], mn[2];
  reg::k4_scales_packed(b + 4, sc, mn);
  const __m128i s16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
  const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
  kv::times(_mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16)), -reg::half(b + 2), k.ck);
  k.d = reg::half(b);
  const __m256i table = _mm256_castsi128_si256(s16);
  const uint8_t* qs = b + (FIVE ? 48 : 16);
  const kv::I low4 = kv::set1(15);
#if defined(__AVX512F__)
  // qs[64p..64p + 63]: low nibbles sub-blocks 4p and 4p + 2, high ones 4p + 1 and 4p + 3; Q5_K's
  // fifth bits of the upper halves two bits up in qh
  const __m256i qh = reg::bytes(b + 16);
  const kv::I qh2 = kv::join(qh, _mm256_srli_epi16(qh, 2));
  for (int p = 0; p < 2; ++p) {
    const kv::I v = kv::load(qs + 64 * p);
    k.u[2 * p] = kv::and_(v, low4);
    k.u[2 * p + 1] = kv::and_(kv::srli(v, 4), low4);
    if constexpr (FIVE) {
      k.u[2 * p] = kv::or_(k.u[2 * p], kv::bit(qh2, 4 * p, 4));
      k.u[2 * p + 1] = kv::or_(k.u[2 * p + 1], kv::bit(qh2, 4 * p + 1, 4));
    }
  }
  k.table = table;
#else
  const kv::I qh = kv::load(b + 16);
  for (int c = 0; c < 4; ++c) {
    const kv::I v = kv::load(qs + 32 * c);
    k.u[2 * c] = kv::and_(v, low4);
    k.u[2 * c + 1] = kv::and_(kv::srli(v, 4), low4);
    if constexpr (FIVE) {
      k.u[2 * c] = kv::or_(k.u[2 * c], kv::bit(qh, 2 * c, 4));
      k.u[2 * c + 1] = kv::or_(k.u[2 * c + 1], kv::bit(qh, 2 * c + 1, 4));
    }
    k.s[2 * c] = kv::scales(table, 2 * c, 2 * c, 2 * c, 2 * c);
    k.s[2 * c + 1] = kv::scales(table, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1);
  }
#endif
}

// Q6_K: weight 128h + 32t + l is nibble t / 2 of ql[64h + 32 (t % 2) + l] with bits 2t..2t+1 of
// qh[32h + l] above it; u = q + 32. Sixteen int8 scales, x's order.
inline void decode_q6_k_block(const uint8_t* b, KBlock& k) {
  const __m256i table = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  k.d = reg::half(b + 208);
  kv::times(_mm256_slli_epi16(_mm256_sub_epi16(_mm256_setzero_si256(), table), 5), k.d, k.ck);  // -32 sc
#if defined(__AVX512F__)
  // ql[64h..64h + 63]: low nibbles weights 128h + 0..63, high ones 128h + 64..127 (x's order)
  const kv::I low4 = kv::set1(15), high2 = kv::set1(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i qh = reg::bytes(b + 128 + 32 * h);
    const kv::I qh2 = kv::join(qh, _mm256_srli_epi16(qh, 2)), ql = kv::load(b + 64 * h);
    k.u[2 * h] = kv::or_(kv::and_(ql, low4), kv::and_(kv::slli(qh2, 4), high2));
    k.u[2 * h + 1] = kv::or_(kv::and_(kv::srli(ql, 4), low4), kv::and_(qh2, high2));
  }
  k.table = table;
#else
  reg::q6_k_bytes(b, k.u);
  for (int v = 0; v < 8; ++v) k.s[v] = kv::scales(table, 2 * v, 2 * v, 2 * v + 1, 2 * v + 1);
#endif
}

// Q2_K and Q3_K: weight 128h + 32t + l is bits 2t..2t+1 of qs[32h + l]; Q3_K's third bit (u =
// q + 4) is bit 4h + t of hmask[l]. AVX-512's vector t holds both h: chunks t and 4 + t of x.
template <bool THREE>
inline void decode_low_bits(const uint8_t* qs, const uint8_t* hmask, const __m256i table, KBlock& k) {
  const kv::I three = kv::set1(3);
#if defined(__AVX512F__)
  const kv::I q = kv::load(qs);
  kv::I hm = q;
  if constexpr (THREE) {
    const __m256i h = reg::bytes(hmask);
    hm = kv::join(h, _mm256_srli_epi16(h, 4));
  }
  for (int t = 0; t < 4; ++t) {
    k.u[t] = kv::and_(kv::srli(q, 2 * t), three);
    if constexpr (THREE) k.u[t] = kv::or_(k.u[t], kv::bit(hm, t, 2));
  }
  k.table = table;
#else
  const kv::I hm = THREE ? kv::load(hmask) : kv::set1(0);
  for (int h = 0; h < 2; ++h) {
    const kv::I q = kv::load(qs + 32 * h);
    for (int t = 0; t < 4; ++t) {
      kv::I u = kv::and_(kv::srli(q, 2 * t), three);
      if constexpr (THREE) u = kv::or_(u, kv::bit(hm, 4 * h + t, 2));
      k.u[4 * h + t] = u;
      k.s[4 * h + t] = kv::scales(table, 8 * h + 2 * t, 8 * h + 2 * t, 8 * h + 2 * t + 1, 8 * h + 2 * t + 1);
    }
  }
#endif
}

// Q2_K: scales[16] (4-bit sc, 4-bit m), qs[64], d, dmin.
inline void decode_q2_k_block(const uint8_t* b, KBlock& k) {
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i low4 = _mm_set1_epi8(15);
  const __m256i table = _mm256_cvtepu8_epi16(_mm_and_si128(s8, low4));
  kv::times(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), low4)), -reg::half(b + 82), k.ck);
  k.d = reg::half(b + 80);
  decode_low_bits<false>(b + 16, nullptr, table, k);
}

// Q3_K: hmask[32], qs[64], twelve bytes of 6-bit scales (minus 32), d. Scale g's low four bits
// are nibble g / 8 of byte g % 8, its top two bits 2 (g / 4) of byte 8 + g % 4.
inline void decode_q3_k_block(const uint8_t* b, KBlock& k) {
  uint32_t a[3], s[4];
  std::memcpy(a, b + 96, 12);
  constexpr uint32_t four = 0x0f0f0f0f, two = 0x03030303;
  s[0] = (a[0] & four) | ((a[2] & two) << 4);
  s[1] = (a[1] & four) | (((a[2] >> 2) & two) << 4);
  s[2] = ((a[0] >> 4) & four) | (((a[2] >> 4) & two) << 4);
  s[3] = ((a[1] >> 4) & four) | (((a[2] >> 6) & two) << 4);
  const __m128i s8 = _mm_sub_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)), _mm_set1_epi8(32));
  const __m256i table = _mm256_cvtepi8_epi16(s8);
  k.d = reg::half(b + 108);
  kv::times(_mm256_slli_epi16(_mm256_sub_epi16(_mm256_setzero_si256(), table), 2), k.d, k.ck);  // -4 sc
  decode_low_bits<true>(b + 32, b, table, k);
}

// The 256-weight types: one accumulator of fp32 lanes a (row of x, row of W).
template <int FMT>
struct KQuant {
  using Block = KBlock;
  using Acc = kv::F;
  static constexpr int64_t kBytes = layout<FMT>().bytes;
  static void decode(const uint8_t* row, int64_t j, int64_t, KBlock& k) {
    const uint8_t* b = row + j * kBytes;
    if constexpr (FMT == kQ4_K || FMT == kQ5_K) decode_k4_block<FMT == kQ5_K>(b, k);
    else if constexpr (FMT == kQ6_K) decode_q6_k_block(b, k);
    else if constexpr (FMT == kQ3_K) decode_q3_k_block(b, k);
    else decode_q2_k_block(b, k);
#if defined(__AVX512F__)
    k.sc = _mm512_permutexvar_ps(group_lanes(), _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(k.table)));
#endif
  }
#if defined(__AVX512F__)
  // The group (index into the scale table) of the 16 bytes that vector v's quarter q holds.
  static constexpr int group(int v, int q) {
    if (FMT == kQ4_K || FMT == kQ5_K) return 4 * (v / 2) + v % 2 + 2 * (q / 2);
    if (FMT == kQ6_K) return 4 * v + q;
    return 2 * v + q % 2 + 8 * (q / 2);  // Q2_K, Q3_K
  }
  // Lane l of the reduced sums (below) holds vector l / 4's quarter l % 4 (l < 8), or vector
  // 2 + (l - 8) / 4's (l >= 8): its group, a lane.
  static __m512i group_lanes() {
    alignas(64) static constexpr int32_t lanes[16] = {
        group(0, 0), group(0, 1), group(0, 2), group(0, 3), group(1, 0), group(1, 1), group(1, 2), group(1, 3),
        group(2, 0), group(2, 1), group(2, 2), group(2, 3), group(3, 0), group(3, 1), group(3, 2), group(3, 3)};
    return _mm512_load_si512(lanes);
  }
  // Each vector's byte products summed by fours (vpdpbusd), then the four vectors' lanes added
  // in fours of neighbours (two rounds of even + odd lanes): lane l is the sum over the 16 bytes
  // of one group (group_lanes), exact, times that group's sc d dx in fp32.
  static Acc product(const KBlock& k, const QuantizedX& x, int64_t m, int64_t j, Acc acc) {
    const int64_t at = x.at(m, j);
    const int8_t* xq = x.xq.get() + at * 256;
    __m512i s[4];
    for (int v = 0; v < 4; ++v) s[v] = dot4(k.u[v], kv::load(xq + v * 64));
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const auto pairs = [&](__m512i a, __m512i b) {
      return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
    };
    const __m512i sums = pairs(pairs(s[0], s[1]), pairs(s[2], s[3]));
    acc = _mm512_fmadd_ps(k.ck[0], _mm512_loadu_ps(x.lanes.get() + at * 16), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), exact_order_mul(k.sc, _mm512_set1_ps(k.d * x.dx[at])), acc);
  }
  // Per int32 lane, the sum of four products u x x (u <= 63).
  static __m512i dot4(__m512i u, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1));
#endif
  }
#else
  static Acc product(const KBlock& k, const QuantizedX& x, int64_t m, int64_t j, Acc acc) {
    const int64_t at = x.at(m, j);
    const int8_t* xq = x.xq.get() + at * 256;
    kv::I t = kv::dot_scaled(k.u[0], kv::load(xq), k.s[0]);
    for (int v = 1; v < kv::kVectors; ++v) t = kv::add(t, kv::dot_scaled(k.u[v], kv::load(xq + v * kv::kBytes), k.s[v]));
    const float* dsums = x.lanes.get() + at * 16;
    for (int f = 0; f < kv::kFloatVectors; ++f) acc = kv::fmaf(k.ck[f], kv::loadf(dsums + 8 * f), acc);
    return kv::fma(t, k.d * x.dx[at], acc);
  }
#endif
};

// Per int32 lane, the sum of four products u x x, u unsigned (pairs of products within int16).
inline __m256i dot_u8(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

// q signed (|q| <= 127): |q| meets x with q's sign.
inline __m256i dot_s8(__m256i q, __m256i x) { return dot_u8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)); }

// A 32-weight block's q as bytes: signed (Q5_0, IQ4_NL) or, for Q5_1, unsigned.
template <int FMT>
inline __m256i small_bytes(const uint8_t* b) {
  if constexpr (FMT == kQ5_0) return reg::q5_0_signed(b);
  else if constexpr (FMT == kQ5_1) return reg::five_bits_unsigned(b + 4, b + 8);
  else return _mm256_shuffle_epi8(reg::both_halves(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NLValues))),
                                  reg::nibbles(b + 2));
}

#if !defined(__AVX512F__)
// The 32-weight types on AVX2: a block a vector.
struct SBlock {
  __m256i q;
  float d, m;
};

template <int FMT>
struct Small {
  using Block = SBlock;
  using Acc = __m256;
  static constexpr int64_t kBytes = layout<FMT>().bytes;
  static void decode(const uint8_t* row, int64_t j, int64_t, SBlock& s) {
    const uint8_t* b = row + j * kBytes;
    s.d = reg::half(b);
    if constexpr (FMT == kQ5_1) s.m = reg::half(b + 2);
    s.q = small_bytes<FMT>(b);
  }
  static Acc product(const SBlock& s, const QuantizedX& x, int64_t m, int64_t j, Acc acc) {
    const int64_t at = x.at(m, j);
    const __m256i xq = reg::bytes(x.xq.get() + at * 32);
    const __m256i S = FMT == kQ5_1 ? dot_u8(s.q, xq) : dot_s8(s.q, xq);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_set1_ps(s.d * x.dx[at]), acc);
    if constexpr (FMT == kQ5_1) acc = _mm256_add_ps(acc, _mm256_zextps128_ps256(_mm_set_ss(s.m * x.sx[at])));
    return acc;
  }
};
#else
// The 32-weight types on AVX-512: blocks 2p and 2p + 1 a vector, in x's pair order (Placement):
// one 256-bit load of both blocks' nibbles, and that shifted, give [2p's low, 2p + 1's low, 2p's
// high, 2p + 1's high]. q as unsigned bytes (Q5_0 q + 16, Q5_1 q), IQ4_NL's |q| with q's signs.
struct PBlock {
  __m512i u;
  __mmask64 negative;
  __m512 d, m;  // per int32 lane: its block's d (and m)
};

// Two fp16 values as fp32 lanes in the pair's order: a, a, a, a, b, b, b, b, a, ...
inline __m512 pair_lanes(const uint8_t* a, const uint8_t* b) {
  uint16_t ha, hb = 0;
  std::memcpy(&ha, a, 2);
  if (b) std::memcpy(&hb, b, 2);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(ha | (uint32_t{hb} << 16))));
  const __m512i order = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(order, _mm512_castps128_ps512(f));
}

template <int FMT>
struct Small {
  using Block = PBlock;
  using Acc = __m512;
  static constexpr int64_t kBytes = layout<FMT>().bytes;
  static constexpr int kQs = FMT == kQ5_0 ? 6 : FMT == kQ5_1 ? 8 : 2, kQh = FMT == kQ5_0 ? 2 : 4;
  static void decode(const uint8_t* row, int64_t p, int64_t nb, PBlock& s) {
    const uint8_t* a = row + 2 * p * kBytes;
    const uint8_t* b = 2 * p + 1 < nb ? a + kBytes : nullptr;
    const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + kQs));
    const __m256i qs = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQs)) : _mm_setzero_si128(), 1);
    const __m512i low = _mm512_and_si512(kv::join(qs, _mm256_srli_epi16(qs, 4)), _mm512_set1_epi8(15));
    s.d = pair_lanes(a, b);
    if constexpr (FMT == kIQ4_NL) {
      const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NLValues)));
      const __m512i q = _mm512_shuffle_epi8(table, low);
      s.u = _mm512_abs_epi8(q);
      s.negative = _mm512_movepi8_mask(q);
    } else {
      // fifth bits: bit i of qh is weight i; the pair's byte order takes 16 bits of each in turn
      uint32_t ha, hb = 0;
      std::memcpy(&ha, a + kQh, 4);
      if (b) std::memcpy(&hb, b + kQh, 4);
      const uint64_t lo = (ha & 0xFFFFu) | (hb << 16), hi = (ha >> 16) | (hb & 0xFFFF0000u);
      s.u = _mm512_mask_add_epi8(low, static_cast<__mmask64>(lo | (hi << 32)), low, _mm512_set1_epi8(16));
      if constexpr (FMT == kQ5_1) s.m = pair_lanes(a + 2, b ? b + 2 : nullptr);
    }
  }
  static Acc product(const PBlock& s, const QuantizedX& x, int64_t m, int64_t p, Acc acc) {
    const int64_t at = p * x.M + m;
    const __m512i xq = _mm512_loadu_si512(x.xq.get() + at * 64);
    const float* t = x.lanes.get() + at * lane_terms<FMT>() * 16;
    __m512i S = FMT == kQ5_0 ? _mm512_loadu_si512(t + 16) : _mm512_setzero_si512();
    const __m512i xs = FMT == kIQ4_NL ? _mm512_mask_sub_epi8(xq, s.negative, _mm512_setzero_si512(), xq) : xq;
#if defined(__AVX512VNNI__)
    S = _mm512_dpbusd_epi32(S, s.u, xs);
#else
    S = _mm512_add_epi32(S, _mm512_madd_epi16(_mm512_maddubs_epi16(s.u, xs), _mm512_set1_epi16(1)));
#endif
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), exact_order_mul(s.d, _mm512_loadu_ps(t)), acc);
    if constexpr (FMT == kQ5_1) acc = _mm512_fmadd_ps(s.m, _mm512_loadu_ps(t + 16), acc);
    return acc;
  }
};
#endif

template <int FMT>
using Product = std::conditional_t<layout<FMT>().values == 256, KQuant<FMT>, Small<FMT>>;

__attribute__((noinline)) float lanes_sum(__m256 v) { return reg::sum(v); }
#if defined(__AVX512F__)
__attribute__((noinline)) float lanes_sum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// Rows m0.. of x (MR of them) times rows n0.. of W (kv::kRows): each step (a block, or AVX-512's
// pair of 32-weight blocks) of a W row is decoded once and met with the MR rows of x, whose
// accumulators stay in registers. Rows past the end repeat the last one (results not stored).
template <int FMT, int MR>
void tile(const Operands& o, int64_t m0, int64_t n0) {
  using P = Product<FMT>;
  constexpr int R = kv::kRows;
  const uint8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = o.w + std::min(n0 + r, o.N - 1) * o.row_bytes;
  int64_t m[MR];
  for (int i = 0; i < MR; ++i) m[i] = std::min(m0 + i, o.M - 1);
  typename P::Acc acc[MR][R];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = typename P::Acc{};
  const int64_t steps = Placement<FMT>::steps(o.nb);
  for (int64_t j = 0; j < steps; ++j)
    for (int r = 0; r < R; ++r) {
      typename P::Block b;
      P::decode(w[r], j, o.nb, b);
      for (int i = 0; i < MR; ++i) acc[i][r] = P::product(b, o.x, m[i], j, acc[i][r]);
    }
  for (int i = 0; i < MR && m0 + i < o.M; ++i)
    for (int r = 0; r < R && n0 + r < o.N; ++r) o.store(m0 + i, n0 + r, lanes_sum(acc[i][r]));
}

// Every row of x against rows n0..n0 + kv::kRows of W, four rows of x at a time.
template <int FMT>
void sweep(const Operands& o, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= o.M; m0 += 4) tile<FMT, 4>(o, m0, n0);
  const int64_t left = o.M - m0;
  if (left == 1) tile<FMT, 1>(o, m0, n0);
  else if (left == 2) tile<FMT, 2>(o, m0, n0);
  else if (left == 3) tile<FMT, 4>(o, m0, n0);
}

template <int FMT>
void linear_q8_fmt(const Operands& o) {
  const int64_t tiles = (o.N + kv::kRows - 1) / kv::kRows;
  // tiles of W rows split evenly over the threads, each thread at least ~2^18 products (a tiny
  // product is not worth waking a thread)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (kv::kRows * o.nb * layout<FMT>().values * o.M));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sweep<FMT>(o, t * kv::kRows);
  });
}
#else
// ---- int8 activations, the portable loop ----
//
// Each block of a W row is decoded once (as dequantization decodes it) and met with every row of
// x: per group, S = sum q xq in int32, and the block adds dx (scale S + offset sum(xq in g)).
template <int FMT>
void linear_q8_fmt(const Operands& o) {
  constexpr Layout L = layout<FMT>();
  constexpr int kGroups = L.values / L.group, kSums = L.group / 16;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (o.nb * L.values * o.M));
  at::parallel_for(0, o.N, grain, [&](int64_t begin, int64_t end) {
    Decoded d;
    std::vector<float> acc(o.M);
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < o.nb; ++j) {
        decode<FMT>(o.w + n * o.row_bytes + j * L.bytes, d);
        for (int64_t m = 0; m < o.M; ++m) {
          const int8_t* x = o.x.xq.get() + o.x.at(m, j) * L.values;
          const int16_t* sums = o.x.bsums(m, j);
          float s = 0.f;
          for (int g = 0; g < kGroups; ++g) {
            int32_t S = 0;
            for (int i = 0; i < L.group; ++i) S += d.q[g * L.group + i] * x[g * L.group + i];
            s += d.scale[g] * static_cast<float>(S);
            if constexpr (has_offset<FMT>()) {
              int32_t xs = 0;
              for (int i = 0; i < kSums; ++i) xs += sums[g * kSums + i];
              s += d.offset[g] * static_cast<float>(xs);
            }
          }
          acc[m] += o.x.dx[o.x.at(m, j)] * s;
        }
      }
      for (int64_t m = 0; m < o.M; ++m) o.store(m, n, acc[m]);
    }
  });
}
#endif

template <int FMT>
void linear_q8_typed(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr Layout L = layout<FMT>();
  const QuantizedX q = quantize_x<FMT>(x, M, K);
  linear_q8_fmt<FMT>(Operands{q, w, bias, y, M, N, K / L.values, K / L.values * L.bytes});
}

// ---- entry points ----

#define KQ_DISPATCH(fmt, CALL)                    \
  switch (fmt) {                                  \
    case kQ5_0: CALL(kQ5_0); break;               \
    case kQ5_1: CALL(kQ5_1); break;               \
    case kIQ4_NL: CALL(kIQ4_NL); break;           \
    case kQ2_K: CALL(kQ2_K); break;               \
    case kQ3_K: CALL(kQ3_K); break;               \
    case kQ4_K: CALL(kQ4_K); break;               \
    case kQ5_K: CALL(kQ5_K); break;               \
    default: CALL(kQ6_K); break;                  \
  }

void check(const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(known(fmt), "format must be Q5_0 (6), Q5_1 (7), Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), "
              "Q6_K (14) or IQ4_NL (20), not ", fmt);
  const Layout L = layout_of(fmt);
  TORCH_CHECK(K > 0 && K % L.values == 0, "K must be a positive multiple of ", L.values, " for this format, not ", K);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "W: contiguous uint8 [N, K / block values * block bytes] on CPU");
  TORCH_CHECK(w.size(1) == K / L.values * L.bytes, "W's rows do not hold K weights of this format");
}

using kvserve::bias_ptr;  // linear_operands.h
using kvserve::checked_x;

// y = x @ W^T (+ bias) with fp32 x, into out where it is given (else a new tensor).
at::Tensor linear_quant_into(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& out) {
  check(w, fmt, K);
  auto xc = checked_x(x, K);
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor keep;
  const float* b = bias_ptr(bias, N, keep);
  auto y = kvserve::output_rows(out, M, N, x);
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
#define KQ_LINEAR(F) linear_fp32<F>(xp, wp, b, yp, M, N, K)
  KQ_DISPATCH(fmt, KQ_LINEAR)
#undef KQ_LINEAR
  return y;
}

at::Tensor linear_quant(at::Tensor x, at::Tensor w, int64_t fmt, int64_t K, c10::optional<at::Tensor> bias) {
  return linear_quant_into(x, w, fmt, K, bias, {});
}

// y = x @ W^T (+ bias) with x quantized to 8 bits a block, into out where it is given (else a new
// tensor).
at::Tensor linear_q8_into(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                          const c10::optional<at::Tensor>& bias, const at::Tensor& out) {
  check(w, fmt, K);
  auto xc = checked_x(x, K);
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor keep;
  const float* b = bias_ptr(bias, N, keep);
  auto y = kvserve::output_rows(out, M, N, x);
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
#define KQ_LINEAR_Q8(F) linear_q8_typed<F>(xp, wp, b, yp, M, N, K)
  KQ_DISPATCH(fmt, KQ_LINEAR_Q8)
#undef KQ_LINEAR_Q8
  return y;
}

at::Tensor linear_q8(at::Tensor x, at::Tensor w, int64_t fmt, int64_t K, c10::optional<at::Tensor> bias) {
  return linear_q8_into(x, w, fmt, K, bias, {});
}

template <typename out_t>
void dequantize_into(const uint8_t* wp, int64_t fmt, out_t* op, int64_t N, int64_t K) {
#define KQ_DEQUANT(F) dequantize_fmt<F>(wp, op, N, K)
  KQ_DISPATCH(fmt, KQ_DEQUANT)
#undef KQ_DEQUANT
}

at::Tensor dequantize(at::Tensor w, int64_t fmt, int64_t K, const std::string& dtype) {
  check(w, fmt, K);
  TORCH_CHECK(dtype == "float32" || dtype == "bfloat16" || dtype == "float16", "dtype: float32, bfloat16 or float16");
  const at::ScalarType st = dtype == "float32" ? at::kFloat : dtype == "bfloat16" ? at::kBFloat16 : at::kHalf;
  auto out = at::empty({w.size(0), K}, at::dtype(st));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (st == at::kFloat) dequantize_into(wp, fmt, out.data_ptr<float>(), w.size(0), K);
  else if (st == at::kBFloat16) dequantize_into(wp, fmt, out.data_ptr<at::BFloat16>(), w.size(0), K);
  else dequantize_into(wp, fmt, out.data_ptr<at::Half>(), w.size(0), K);
  return out;
}

// linear_quant or linear_q8 (by name) with its operands (those it takes after x) bound, for a
// decoder layer run as one call (kernel_ops.h).
pybind11::capsule rows_op(const std::string& name, at::Tensor w, int64_t fmt, int64_t K,
                          c10::optional<at::Tensor> bias) {
  TORCH_CHECK(name == "linear_quant" || name == "linear_q8",
              "this kernel's products are linear_quant or linear_q8, not ", name);
  check(w, fmt, K);
  const kvserve::ProductFn fn = name == "linear_q8" ? linear_q8_into : linear_quant_into;
  return kvserve::product_capsule(fn, w, fmt, K, bias);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("linear_quant", &linear_quant,
        "fp32 x @ W^T (+ bias), W packed in Q5_0 / Q5_1 / IQ4_NL / Q2_K..Q6_K blocks (CPU)");
  m.def("linear_q8", &linear_q8,
        "fp32 x @ W^T (+ bias), x quantized to 8 bits per block of W's size, integer dot products (CPU)");
  m.def("dequantize", &dequantize, "W packed in Q5_0 / Q5_1 / IQ4_NL / Q2_K..Q6_K blocks as [N, K] in fp32 "
        "(or bf16 / fp16) (CPU)", py::arg("w"), py::arg("fmt"), py::arg("K"), py::arg("dtype") = "float32");
  m.def("rows_op", &rows_op,
        "linear_quant or linear_q8 with its operands bound, as a kvserve.RowsOp capsule (kernel_ops.h)");
}
