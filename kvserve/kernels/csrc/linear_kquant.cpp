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
//                 and the sums of xq per four; a block then contributes
//                   dx * (sum_g scale[g] * S[g] + sum_g offset[g] * sum(xq in g)),  S[g] = sum q xq
//                 with S exact in int32. kvserve.models.packed.linear_int8_reference is the same
//                 in torch.
// Paths: AVX-512 (VNNI's vpdpbusd where built with it, else vpmaddubsw), AVX2 and a portable
// loop, for the fp32 products and the byte dot products. Q4_K, Q6_K and Q5_0 decode in registers
// (see "decoded in registers" below); the other types' decoding is plain C++ into a buffer. setup.py builds this file once per level; `isa()` names the build.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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

// The unsigned form of q the byte products take: q + bias (Q5_0 16, Q6_K 32, Q3_K 4; a power of
// two, `shift` its log2); the lane's sum of x then corrects it: S = S(q + bias) - bias * sum(x).
template <int FMT>
constexpr int bias_shift() { return FMT == kQ5_0 ? 4 : FMT == kQ6_K ? 5 : FMT == kQ3_K ? 2 : -1; }

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

// ---- int8 activations ----

// x [M, K] quantized per block of `values`: xq, dx (one a block), the sums of xq per lane of four
// and per sixteen.
struct QuantizedX {
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int32_t> sums4;
  std::vector<int16_t> sums16;  // llama.cpp's Q8_K bsums
  int64_t M;
  // Blocks are stored block-major (block j of every row, then block j + 1): the rows a block of W
  // meets lie together, not K bytes apart (rows K apart fall in a few cache sets and evict each
  // other). Row m's block j is block `at(m, j)`: its values at at * values, its dx at dx[at].
  int64_t at(int64_t m, int64_t j) const { return j * M + m; }
};

QuantizedX quantize_x(const float* x, int64_t M, int64_t K, int64_t values) {
  const int64_t nb = K / values;
  QuantizedX q;
  q.M = M;
  q.xq.resize(M * K);
  q.dx.resize(M * nb);
  q.sums4.resize(M * K / 4);
  q.sums16.resize(M * K / 16);
  at::parallel_for(0, M * nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xb = x + r * values;  // row r / nb's block r % nb
      const int64_t i = q.at(r / nb, r % nb);
      float amax = 0.f;
      for (int64_t j = 0; j < values; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* qb = q.xq.data() + i * values;
      for (int64_t j = 0; j < values; ++j) qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      q.dx[i] = d;
      int32_t* s4 = q.sums4.data() + i * values / 4;
      for (int64_t s = 0; s < values / 4; ++s) s4[s] = qb[4 * s] + qb[4 * s + 1] + qb[4 * s + 2] + qb[4 * s + 3];
      for (int64_t s = 0; s < values / 16; ++s)
        q.sums16[i * values / 16 + s] = static_cast<int16_t>(s4[4 * s] + s4[4 * s + 1] + s4[4 * s + 2] + s4[4 * s + 3]);
    }
  });
  return q;
}

// A decoded block as the byte products take it: q (or q + bias) as bytes, and each lane's (four
// weights') scale and offset.
struct LaneBlock {
  alignas(64) uint8_t q[kMaxValues];
  alignas(64) float scale[kMaxValues / 4], offset[kMaxValues / 4];
};

template <int FMT>
inline void to_lanes(const Decoded& d, LaneBlock& out) {
  constexpr Layout L = layout<FMT>();
  constexpr int bias = bias_shift<FMT>() < 0 ? 0 : 1 << bias_shift<FMT>();
  for (int64_t i = 0; i < L.values; ++i) out.q[i] = static_cast<uint8_t>(d.q[i] + bias);
  for (int64_t l = 0; l < L.values / 4; ++l) {
    out.scale[l] = d.scale[4 * l / L.group];
    out.offset[l] = d.offset[4 * l / L.group];
  }
}

// One block of W against one quantized block of x, before dx: per lane
// scale * S + offset * sum(x), S = sum(q x) (exact in int32).
#if defined(__AVX512F__) || defined(__AVX2__)
template <int FMT>
inline V::F block_q8(const LaneBlock& b, const int8_t* xq, const int32_t* sums4) {
  constexpr Layout L = layout<FMT>();
  constexpr int N = L.values < V::kBytes ? static_cast<int>(L.values) : V::kBytes;  // bytes a step
  V::F t = V::zerof();
  for (int v = 0; v < L.values / N; ++v) {
    const V::I x = V::bytes<N>(xq + v * N), q = V::bytes<N>(b.q + v * N);
    V::I s = FMT == kIQ4_NL ? V::dot_s8(q, x) : V::dot_u8(q, x);
    if constexpr (bias_shift<FMT>() >= 0 || has_offset<FMT>()) {
      const V::I xs = V::lanesi<N>(sums4 + v * N / 4);
      if constexpr (bias_shift<FMT>() >= 0) s = V::sub_shifted(s, xs, bias_shift<FMT>());
      if constexpr (has_offset<FMT>()) t = V::fma(V::tofloat(xs), V::lanesf<N>(b.offset + v * N / 4), t);
    }
    t = V::fma(V::tofloat(s), V::lanesf<N>(b.scale + v * N / 4), t);
  }
  return t;
}
#else
template <int FMT>
inline float block_q8(const LaneBlock& b, const int8_t* xq, const int32_t* sums4) {
  constexpr Layout L = layout<FMT>();
  constexpr int bias = bias_shift<FMT>() < 0 ? 0 : 1 << bias_shift<FMT>();
  float s = 0.f;
  for (int64_t l = 0; l < L.values / 4; ++l) {
    int32_t S = 0;
    for (int t = 0; t < 4; ++t) {
      const int32_t q = FMT == kIQ4_NL ? static_cast<int8_t>(b.q[4 * l + t]) : b.q[4 * l + t];
      S += q * xq[4 * l + t];
    }
    S -= bias * sums4[l];
    s += static_cast<float>(S) * b.scale[l];
    if constexpr (has_offset<FMT>()) s += b.offset[l] * static_cast<float>(sums4[l]);
  }
  return s;
}
#endif

// ---- int8 activations, decoded in registers (Q4_K, Q6_K, Q5_0: a Q4_K_M file's types) ----
//
// As llama.cpp's ggml_vec_dot_q4_K_q8_K / q6_K_q8_K / q5_0_q8_0: each block of W is unpacked in
// 256-bit registers (nibbles, high bits, 6-bit scales), never stored, and met with every row of x
// before the next block is read, so W's bytes are read once a call for all rows. Per sub-block
// the byte products are multiplied by its integer scale in int32 (exact), and a block adds
//   d * dx * sum_g sc[g] * S[g]  -  dmin * dx * sum_g m[g] * sum(x in g)        (Q4_K)
//   d * dx * (sum_g sc[g] * S'[g] - 32 * sum_g sc[g] * sum(x in g))              (Q6_K, q + 32)
//   d * dx * S                                                                  (Q5_0, q signed)
// to fp32 lanes, with the sums of x per sixteen (QuantizedX::sums16) for the min and bias terms.
// The scaled sub-blocks take vpmaddubsw then vpmaddwd with the scale on every level (q at most 63
// unsigned, so pairs of products stay within int16); Q5_0's unscaled blocks take vpdpbusd where
// AVX-512 VNNI is built.
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

// Per int32 lane: scale * (the sum of four products u [0, 63] x x [-127, 127]). vpmaddubsw's pairs
// stay within int16 (2 * 63 * 127), and vpmaddwd applies the scale as it widens: two instructions,
// where VNNI's vpdpbusd would need a vpmulld (two more micro-ops) for the scale.
inline I scaled_dot(I u, I x, I scale) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale); }

// Per int32 lane: the sum of four products q x x, q signed (|q| <= 16): |q| meets x with q's sign.
inline I signed_dot(I q, I x) {
  const I u = _mm256_sign_epi8(q, q), xs = _mm256_sign_epi8(x, q);
#if defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xs);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), _mm256_set1_epi16(1));
#endif
}

inline float sum(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline F scaled(float d, I s, F acc) { return _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), acc); }

// Block j of every row of x.
struct Rows {
  const QuantizedX& q;
  int64_t M, values, j;
  const int8_t* xq(int64_t m) const { return q.xq.data() + q.at(m, j) * values; }
  const int16_t* sums16(int64_t m) const { return q.sums16.data() + q.at(m, j) * values / 16; }
  float dx(int64_t m) const { return q.dx[q.at(m, j)]; }
};

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

inline void q4_k_block(const uint8_t* b, const Rows& r, F* acc) {
  uint32_t sc[2], mn[2];
  k4_scales_packed(b + 4, sc, mn);
  const uint8_t* s = reinterpret_cast<const uint8_t*>(sc);
  const float d = half(b), dmin = half(b + 2);
  I q[8];
  q4_k_bytes(b, q);
  // each sub-block's minimum twice, against the sums of x per sixteen
  const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
  const I mins = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
  const I sc16 = both_halves(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
  I scale[8];
  for (int g = 0; g < 8; ++g) scale[g] = lane_scales(sc16, g, g);
  for (int64_t m = 0; m < r.M; ++m) {
    const int8_t* x = r.xq(m);
    I t = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) t = _mm256_add_epi32(t, scaled_dot(q[g], bytes(x + 32 * g), scale[g]));
    const I xm = _mm256_madd_epi16(mins, bytes(r.sums16(m)));
    const float dx = r.dx(m);
    acc[m] = scaled(-(dmin * dx), xm, scaled(d * dx, t, acc[m]));
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

inline void q6_k_block(const uint8_t* b, const Rows& r, F* acc) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  I q[8];
  q6_k_bytes(b, q);
  const I scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  const I low = both_halves(_mm_cvtepi8_epi16(sc8)), high = both_halves(_mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8)));
  I scale[8];
  for (int v = 0; v < 8; ++v) scale[v] = lane_scales(v < 4 ? low : high, 2 * (v % 4), 2 * (v % 4) + 1);
  for (int64_t m = 0; m < r.M; ++m) {
    const int8_t* x = r.xq(m);
    I t = _mm256_setzero_si256();
    for (int v = 0; v < 8; ++v) t = _mm256_add_epi32(t, scaled_dot(q[v], bytes(x + 32 * v), scale[v]));
    const I bias = _mm256_madd_epi16(scales16, bytes(r.sums16(m)));  // sum_g sc[g] * sum(x in g)
    acc[m] = scaled(d * r.dx(m), _mm256_sub_epi32(t, _mm256_slli_epi32(bias, 5)), acc[m]);
  }
}

// Q5_0 as signed bytes: the low four bits in nibble j % 16 of qs, and where bit j of qh is clear,
// minus 16 (the byte's top four bits set).
inline I q5_0_signed(const uint8_t* b) {
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
  const I low = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(15));
  const I top = _mm256_set1_epi8(static_cast<char>(0xF0));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_mask_blend_epi8(static_cast<__mmask32>(~qh), low, _mm256_or_si256(low, top));
#else
  // byte j: qh's byte j / 8 against bit j % 8, set where the bit is
  const I spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                       _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                         0x0101010101010101, 0x0000000000000000));
  const I bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const I set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(low, _mm256_andnot_si256(set, top));
#endif
}

inline void q5_0_block(const uint8_t* b, const Rows& r, F* acc) {
  const I q = q5_0_signed(b);
  const float d = half(b);
  for (int64_t m = 0; m < r.M; ++m) acc[m] = scaled(d * r.dx(m), signed_dot(q, bytes(r.xq(m))), acc[m]);
}

template <int FMT>
inline void block(const uint8_t* b, const Rows& r, F* acc) {
  if constexpr (FMT == kQ4_K) q4_k_block(b, r, acc);
  else if constexpr (FMT == kQ6_K) q6_k_block(b, r, acc);
  else q5_0_block(b, r, acc);
}
}  // namespace reg

// Rows of W in the outer loop: each block is decoded once and met with every row of x.
template <int FMT>
void linear_q8_registers(const QuantizedX& q, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                         int64_t K) {
  constexpr Layout L = layout<FMT>();
  const int64_t nb = K / L.values;
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<reg::F> acc(M);
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
      for (int64_t j = 0; j < nb; ++j)
        reg::block<FMT>(w + (n * nb + j) * L.bytes, reg::Rows{q, M, L.values, j}, acc.data());
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = reg::sum(acc[m]) + b;
    }
  });
}

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
template <int FMT>
void linear_q8_registers(const QuantizedX&, const uint8_t*, const float*, float*, int64_t, int64_t, int64_t) {}
#endif

// Every row of x against W: in registers for the types that have that path, else block by block.
template <int FMT>
void linear_fp32(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX2__)
  if constexpr (in_registers<FMT>()) return linear_fp32_registers<FMT>(x, w, bias, y, M, N, K);
#endif
  linear_fmt<FMT>(x, w, bias, y, M, N, K);
}

template <int FMT>
void linear_q8_fmt(const QuantizedX& q, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                   int64_t K) {
  if constexpr (in_registers<FMT>()) return linear_q8_registers<FMT>(q, w, bias, y, M, N, K);
  constexpr Layout L = layout<FMT>();
  const int64_t nb = K / L.values;
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    Decoded d;
    LaneBlock lanes;
#if defined(__AVX512F__) || defined(__AVX2__)
    std::vector<V::F> acc(M);
#else
    std::vector<float> acc(M);
#endif
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), decltype(acc)::value_type{});
      for (int64_t j = 0; j < nb; ++j) {
        decode<FMT>(w + (n * nb + j) * L.bytes, d);
        to_lanes<FMT>(d, lanes);
        for (int64_t m = 0; m < M; ++m) {
          const int64_t at = q.at(m, j) * L.values;
#if defined(__AVX512F__) || defined(__AVX2__)
          acc[m] = V::fma(block_q8<FMT>(lanes, q.xq.data() + at, q.sums4.data() + at / 4), V::set1f(q.dx[q.at(m, j)]), acc[m]);
#else
          acc[m] += q.dx[q.at(m, j)] * block_q8<FMT>(lanes, q.xq.data() + at, q.sums4.data() + at / 4);
#endif
        }
      }
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) {
#if defined(__AVX512F__) || defined(__AVX2__)
        y[m * N + n] = V::sum(acc[m]) + b;
#else
        y[m * N + n] = acc[m] + b;
#endif
      }
    }
  });
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

const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(keep.numel() == N, "bias [N]");
  return keep.data_ptr<float>();
}

at::Tensor checked_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              "x: fp32 [M, K] on CPU");
  return x.contiguous();
}

at::Tensor linear_quant(at::Tensor x, at::Tensor w, int64_t fmt, int64_t K, c10::optional<at::Tensor> bias) {
  check(w, fmt, K);
  auto xc = checked_x(x, K);
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor keep;
  const float* b = bias_ptr(bias, N, keep);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
#define KQ_LINEAR(F) linear_fp32<F>(xp, wp, b, yp, M, N, K)
  KQ_DISPATCH(fmt, KQ_LINEAR)
#undef KQ_LINEAR
  return y;
}

at::Tensor linear_q8(at::Tensor x, at::Tensor w, int64_t fmt, int64_t K, c10::optional<at::Tensor> bias) {
  check(w, fmt, K);
  auto xc = checked_x(x, K);
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor keep;
  const float* b = bias_ptr(bias, N, keep);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedX q = quantize_x(xc.data_ptr<float>(), M, K, layout_of(fmt).values);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
#define KQ_LINEAR_Q8(F) linear_q8_fmt<F>(q, wp, b, yp, M, N, K)
  KQ_DISPATCH(fmt, KQ_LINEAR_Q8)
#undef KQ_LINEAR_Q8
  return y;
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("linear_quant", &linear_quant,
        "fp32 x @ W^T (+ bias), W packed in Q5_0 / Q5_1 / IQ4_NL / Q2_K..Q6_K blocks (CPU)");
  m.def("linear_q8", &linear_q8,
        "fp32 x @ W^T (+ bias), x quantized to 8 bits per block of W's size, integer dot products (CPU)");
  m.def("dequantize", &dequantize, "W packed in Q5_0 / Q5_1 / IQ4_NL / Q2_K..Q6_K blocks as [N, K] in fp32 "
        "(or bf16 / fp16) (CPU)", py::arg("w"), py::arg("fmt"), py::arg("K"), py::arg("dtype") = "float32");
}
