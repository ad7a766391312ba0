// y = x @ W^T with W in GGUF's Q4_0 / Q4_1 blocks and x quantized to 8 bits per 32-block, the
// products summed as integers: llama.cpp's Q4 x Q8 dot products. Decode reads every weight once
// a step, and unpacking nibbles to floats costs more than reading them; an integer dot product
// takes the nibbles as bytes (AVX-512 VNNI: 64 byte products summed by fours in one instruction).
//
// Activations, per row of x and block b of 32 (what llama.cpp's Q8_1 holds, with dx in fp32):
//   dx = max|x| / 127,  xq = round(x / dx) as int8 (0 where dx is 0),  sumq = sum(xq)
// Weights: Q4_1 w = d q + m, Q4_0 w = d (q - 8), q in 0..15. A block contributes
//   Q4_1   d dx S + m dx sumq       Q4_0   d dx (S - 8 sumq)       S = sum(q xq), exact in int32
// so the result is the float product of W with the rounded x (each x off by at most dx / 2), up
// to the order of the float sums. kvserve.models.packed.linear_q8_reference is the same in torch.
//
// Weight layout ("interleaved"; the same bytes per row as GGUF's, reordered once at load):
//   [nibbles: nb * 16 bytes][d: nb fp16][m: nb fp16, Q4_1 only]
// The nibbles go in groups of up to 16 blocks. In a group of g blocks starting at block s, chunk c
// (0..3) holds, for each block in turn, its GGUF bytes 4c..4c+3 (weights 4c..4c+3 in the low
// nibbles, 16+4c..16+4c+3 in the high ones), at s*16 + c*4g + 4i for the group's i-th block. So
// one 64-byte load holds four bytes of each of 16 blocks, and a VNNI lane sums one block: the 16
// lanes of an accumulator are the group's 16 blocks, and the per-block scales apply as vectors.
// x is interleaved the same way (low chunk c at s*32 + c*4g, high chunk c at s*32 + (4+c)*4g).
//
// Paths: AVX-512 VNNI, and a portable loop over the same layout (kvserve/kernels builds this file
// once per level; `isa()` names the build). Rows of W are split over threads; x is read in groups
// of up to four rows, so up to four rows read each weight once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3;
constexpr int64_t kBlock = 32, kGroup = 16;

inline int64_t block_bytes(int64_t fmt) { return fmt == kQ4_0 ? 18 : 20; }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Where byte `j` (0..15) of block `b`'s nibbles goes in the interleaved row.
inline int64_t nibble_offset(int64_t nb, int64_t b, int64_t j) {
  const int64_t s = b / kGroup * kGroup, g = std::min(kGroup, nb - s);
  return s * 16 + (j / 4) * 4 * g + (b - s) * 4 + j % 4;
}

// The same for x's byte `j` (0..31) of block `b`: low chunks first, then high ones.
inline int64_t x_offset(int64_t nb, int64_t b, int64_t j) {
  const int64_t s = b / kGroup * kGroup, g = std::min(kGroup, nb - s);
  const int64_t chunk = j < 16 ? j / 4 : 4 + (j - 16) / 4;
  return s * 32 + chunk * 4 * g + (b - s) * 4 + j % 4;
}

// x [M, K] quantized per block: xq interleaved [M, K] int8, dx, sumq and dx * sumq [M, nb].
struct QuantizedX {
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
  std::vector<int32_t> sumq;
};

QuantizedX quantize_x(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  QuantizedX q;
  q.xq.resize(M * K);
  q.dx.resize(M * nb);
  q.sx.resize(M * nb);
  q.sumq.resize(M * nb);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * kBlock;
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
        q.xq[m * K + x_offset(nb, b, j)] = static_cast<int8_t>(v);
        sum += v;
      }
      q.dx[m * nb + b] = d;
      q.sumq[m * nb + b] = sum;
      q.sx[m * nb + b] = d * static_cast<float>(sum);
    }
  }
  return q;
}

#if defined(__AVX512VNNI__)
// 512-bit lanes for a group of 9..16 blocks, 256-bit ones for a group of up to 8 (a row's last
// group: 576 = 16 + 2 blocks), whose instructions cost half as much.
struct V512 {
  using I = __m512i;
  using F = __m512;
  using Mask = __mmask16;
  static I zero() { return _mm512_setzero_si512(); }
  static F zerof() { return _mm512_setzero_ps(); }
  static I load(Mask k, const void* p) { return _mm512_maskz_loadu_epi32(k, p); }
  static F loadf(Mask k, const float* p) { return _mm512_maskz_loadu_ps(k, p); }
  static F halves(Mask k, const uint8_t* p) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }
  static I nibbles_low(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static I nibbles_high(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I minus8(I S, I sumq) { return _mm512_sub_epi32(S, _mm512_slli_epi32(sumq, 3)); }
  static F tofloat(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};

struct V256 {
  using I = __m256i;
  using F = __m256;
  using Mask = __mmask8;
  static I zero() { return _mm256_setzero_si256(); }
  static F zerof() { return _mm256_setzero_ps(); }
  static I load(Mask k, const void* p) { return _mm256_maskz_loadu_epi32(k, p); }
  static F loadf(Mask k, const float* p) { return _mm256_maskz_loadu_ps(k, p); }
  static F halves(Mask k, const uint8_t* p) { return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, p)); }
  static I nibbles_low(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  static I nibbles_high(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  static I dot(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static I minus8(I S, I sumq) { return _mm256_sub_epi32(S, _mm256_slli_epi32(sumq, 3)); }
  static F tofloat(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};

// One group of g blocks from block s, added to acc[m] (one lane a block).
template <class V, int FMT, int M>
inline void dot_group(const uint8_t* row, const QuantizedX& q, int64_t m0, int64_t K, int64_t s, int64_t g,
                      typename V::F* acc) {
  const int64_t nb = K / kBlock;
  const uint8_t* dw = row + nb * 16;
  const typename V::Mask lanes = static_cast<typename V::Mask>((1u << g) - 1);
  typename V::I sums[M];
  for (int m = 0; m < M; ++m) sums[m] = V::zero();
  for (int c = 0; c < 4; ++c) {
    const typename V::I v = V::load(lanes, row + s * 16 + c * 4 * g);
    const typename V::I lo = V::nibbles_low(v), hi = V::nibbles_high(v);
    for (int m = 0; m < M; ++m) {
      const int8_t* xg = q.xq.data() + (m0 + m) * K + s * 32;
      sums[m] = V::dot(sums[m], lo, V::load(lanes, xg + c * 4 * g));
      sums[m] = V::dot(sums[m], hi, V::load(lanes, xg + (4 + c) * 4 * g));
    }
  }
  const typename V::F d = V::halves(lanes, dw + s * 2);
  const typename V::F mn = FMT == kQ4_1 ? V::halves(lanes, dw + nb * 2 + s * 2) : V::zerof();
  for (int m = 0; m < M; ++m) {
    const int64_t at = (m0 + m) * nb + s;
    typename V::I S = sums[m];
    if (FMT == kQ4_0) S = V::minus8(S, V::load(lanes, q.sumq.data() + at));
    acc[m] = V::fma(V::tofloat(S), V::mul(d, V::loadf(lanes, q.dx.data() + at)), acc[m]);
    if (FMT == kQ4_1) acc[m] = V::fma(mn, V::loadf(lanes, q.sx.data() + at), acc[m]);
  }
}

template <int FMT, int M>
inline void dot_row(const uint8_t* row, const QuantizedX& q, int64_t m0, int64_t K, float* out) {
  const int64_t nb = K / kBlock;
  __m512 wide[M];
  __m256 narrow[M];
  for (int m = 0; m < M; ++m) {
    wide[m] = _mm512_setzero_ps();
    narrow[m] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < nb; s += kGroup) {
    const int64_t g = std::min(kGroup, nb - s);
    if (g > 8) dot_group<V512, FMT, M>(row, q, m0, K, s, g, wide);
    else dot_group<V256, FMT, M>(row, q, m0, K, s, g, narrow);
  }
  for (int m = 0; m < M; ++m) out[m] = V512::sum(wide[m]) + V256::sum(narrow[m]);
}
#else
template <int FMT, int M>
inline void dot_row(const uint8_t* row, const QuantizedX& q, int64_t m0, int64_t K, float* out) {
  const int64_t nb = K / kBlock;
  const uint8_t* dw = row + nb * 16;
  const uint8_t* mw = dw + nb * 2;
  float acc[M] = {};
  int32_t qb[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 16; ++j) {
      const uint8_t byte = row[nibble_offset(nb, b, j)];
      qb[j] = byte & 15;
      qb[j + 16] = byte >> 4;
    }
    const float d = half_at(dw + b * 2), mn = FMT == kQ4_1 ? half_at(mw + b * 2) : 0.f;
    for (int m = 0; m < M; ++m) {
      const int8_t* xm = q.xq.data() + (m0 + m) * K;
      int32_t S = 0;
      for (int j = 0; j < kBlock; ++j) S += qb[j] * xm[x_offset(nb, b, j)];
      const int64_t at = (m0 + m) * nb + b;
      if (FMT == kQ4_0) S -= 8 * q.sumq[at];
      acc[m] += static_cast<float>(S) * (d * q.dx[at]);
      if (FMT == kQ4_1) acc[m] += mn * q.sx[at];
    }
  }
  for (int m = 0; m < M; ++m) out[m] = acc[m];
}
#endif

template <int FMT, int M>
void linear_rows(const QuantizedX& q, int64_t m0, const uint8_t* w, const float* bias, float* y, int64_t N,
                 int64_t K) {
  const int64_t row_bytes = K / kBlock * block_bytes(FMT);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float out[M];
    for (int64_t n = begin; n < end; ++n) {
      dot_row<FMT, M>(w + n * row_bytes, q, m0, K, out);
      const float b = bias ? bias[n] : 0.f;
      for (int m = 0; m < M; ++m) y[(m0 + m) * N + n] = out[m] + b;
    }
  });
}

template <int FMT>
void linear_fmt(const QuantizedX& q, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: linear_rows<FMT, 1>(q, m0, w, bias, y, N, K); break;
      case 2: linear_rows<FMT, 2>(q, m0, w, bias, y, N, K); break;
      case 3: linear_rows<FMT, 3>(q, m0, w, bias, y, N, K); break;
      default: linear_rows<FMT, 4>(q, m0, w, bias, y, N, K); break;
    }
  }
}

void check(const torch::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(fmt == kQ4_0 || fmt == kQ4_1, "format must be Q4_0 (2) or Q4_1 (3)");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "K must be a positive multiple of 32");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "W: contiguous uint8 [N, K / 32 * block bytes] on CPU");
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(fmt), "W's rows do not hold K weights of this format");
}

std::string isa() {
#if defined(__AVX512VNNI__)
  return "avx512_vnni";
#else
  return "portable";
#endif
}

// GGUF rows -> interleaved rows (forward) or back.
torch::Tensor reorder(torch::Tensor w, int64_t fmt, int64_t K, bool forward) {
  check(w, fmt, K);
  auto out = torch::empty_like(w);
  const int64_t nb = K / kBlock, bb = block_bytes(fmt), N = w.size(0), rb = w.size(1);
  const int64_t head = fmt == kQ4_1 ? 4 : 2;  // d (and m) before a GGUF block's nibbles
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* in = src + n * rb;
      uint8_t* o = dst + n * rb;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t gguf = b * bb;
        const int64_t pairs[2][2] = {{gguf, nb * 16 + b * 2}, {gguf + 2, nb * 18 + b * 2}};
        for (int64_t p = 0; p < (fmt == kQ4_1 ? 2 : 1); ++p) {
          if (forward) std::memcpy(o + pairs[p][1], in + pairs[p][0], 2);
          else std::memcpy(o + pairs[p][0], in + pairs[p][1], 2);
        }
        for (int64_t j = 0; j < 16; ++j) {
          if (forward) o[nibble_offset(nb, b, j)] = in[gguf + head + j];
          else o[gguf + head + j] = in[nibble_offset(nb, b, j)];
        }
      }
    }
  });
  return out;
}

torch::Tensor interleave(torch::Tensor w, int64_t fmt, int64_t K) { return reorder(w, fmt, K, true); }
torch::Tensor deinterleave(torch::Tensor w, int64_t fmt, int64_t K) { return reorder(w, fmt, K, false); }

torch::Tensor linear_q8(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, c10::optional<torch::Tensor> bias) {
  check(w, fmt, K);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              "x: fp32 [M, K] on CPU");
  auto xc = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  const float* b = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bc.numel() == N, "bias [N]");
    b = bc.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedX q = quantize_x(xc.data_ptr<float>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (fmt == kQ4_0) linear_fmt<kQ4_0>(q, wp, b, y.data_ptr<float>(), M, N, K);
  else linear_fmt<kQ4_1>(q, wp, b, y.data_ptr<float>(), M, N, K);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("interleave", &interleave, "GGUF Q4_0 / Q4_1 rows -> this kernel's interleaved rows (the same bytes, reordered)");
  m.def("deinterleave", &deinterleave, "interleaved rows -> GGUF rows");
  m.def("linear_q8", &linear_q8, "fp32 x @ W^T (+ bias), x quantized to 8 bits per 32-block, W interleaved Q4_0 / Q4_1");
}
