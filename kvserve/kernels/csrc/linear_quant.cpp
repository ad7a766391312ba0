// y = x @ W^T with W kept in ggml's block formats, read packed: the decode-time products stream
// each weight row once (4.5-5 bits a weight instead of 16 or 32), dequantizing in registers.
//
//   x [M, K] fp32        W [N, K / 32 * block bytes] uint8, each row its blocks in order
//   y [M, N] fp32        bias [N] fp32 or absent
//
// Formats (ggml type ids), 32 weights a block:
//   Q8_0 (8)  fp16 d, 32 int8 q              w = d * q
//   Q4_0 (2)  fp16 d, 16 bytes of nibbles    w = d * (q - 8)    low nibbles: weights 0..15
//   Q4_1 (3)  fp16 d, fp16 m, 16 bytes       w = d * q + m      high nibbles: weights 16..31
// Each weight is dequantized in fp32 exactly as the reference does (one product, and for Q4_1
// one sum) and multiplied-added in fp32, so the result is dequantize-then-multiply in fp32 up to
// the order of the sums. Rows of W are split over threads; x is read in groups of up to four
// rows, so up to four rows read each weight once.
//
// Paths: AVX-512 intrinsics (16 weights a register); AVX2 intrinsics (8); a portable loop the
// compiler vectorizes for baseline x86-64. setup.py builds this file once per level and
// picks the best the CPU runs; `isa()` names the build.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include "kernel_ops.h"
#include "linear_operands.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>
#include <string>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;

inline int64_t block_bytes(int64_t fmt) { return fmt == kQ8_0 ? 34 : fmt == kQ4_0 ? 18 : 20; }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// One block's 32 weights in fp32: the reference every path equals.
template <int FMT>
inline void dequant_block(const uint8_t* b, float* out) {
  const float d = half_at(b);
  if (FMT == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
  } else if (FMT == kQ4_0) {
    const uint8_t* q = b + 2;
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>((q[i] & 15) - 8);
      out[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
    }
  } else {
    const float m = half_at(b + 2);
    const uint8_t* q = b + 4;
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(q[i] & 15) + m;
      out[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
    }
  }
}

#if defined(__AVX512F__)
// d (and m, Q4_1) of the block at b, converted by the F16C unit: [d, m, ..] in the low lanes.
inline __m128 block_head(const uint8_t* b) {
  int32_t bits;
  std::memcpy(&bits, b, sizeof bits);  // Q4_0 / Q8_0: the lane after d is the first weights, unused
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

// The block's weights as two registers of 16.
template <int FMT>
inline void weights(const uint8_t* b, __m512& w0, __m512& w1) {
  const __m128 head = block_head(b);
  const __m512 d = _mm512_broadcastss_ps(head);
  if (FMT == kQ8_0) {
    const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
    const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1));
  } else {
    // the block's 16 possible weights, computed as the reference computes each (d * (q - 8), or
    // d * q + m), then looked up by nibble: one product (and sum) a block, not one a weight
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = FMT == kQ4_0 ? _mm512_mul_ps(d, _mm512_sub_ps(levels, _mm512_set1_ps(8.f)))
                                      : _mm512_add_ps(_mm512_mul_ps(d, levels), _mm512_broadcastss_ps(_mm_movehdup_ps(head)));
    // one byte a lane; the lookup reads only an index's low four bits, so the low nibble needs
    // no mask and the high one a shift
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (FMT == kQ4_0 ? 2 : 4))));
    w0 = _mm512_permutexvar_ps(q, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
}

template <int FMT, int M>
inline void dot_row(const uint8_t* row, const float* x, int64_t K, float* out) {
  const int64_t bb = block_bytes(FMT), nb = K / kBlock;
  __m512 a0[M], a1[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    __m512 w0, w1;
    weights<FMT>(row + j * bb, w0, w1);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + j * kBlock;
      a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), a0[m]);
      a1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), a1[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}
#elif defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// d (and m, Q4_1) of the block at b, converted by the F16C unit: [d, m, ..] in the low lanes.
inline __m128 block_head(const uint8_t* b) {
  int32_t bits;
  std::memcpy(&bits, b, sizeof bits);  // Q4_0 / Q8_0: the lane after d is the first weights, unused
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

// The block's weights as four registers of 8.
template <int FMT>
inline void weights(const uint8_t* b, __m256* w) {
  const __m128 head = block_head(b);
  const __m256 d = _mm256_broadcastss_ps(head);
  if (FMT == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    // eight bytes a widening, each giving eight low and eight high nibbles
    const uint8_t* q = b + (FMT == kQ4_0 ? 2 : 4);
    const __m256i low = _mm256_set1_epi32(15);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    const __m256i parts[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low), _mm256_srli_epi32(b0, 4),
                              _mm256_srli_epi32(b1, 4)};
    const __m256 m = FMT == kQ4_1 ? _mm256_broadcastss_ps(_mm_movehdup_ps(head)) : _mm256_setzero_ps();
    const __m256 eight = _mm256_set1_ps(8.f);
    for (int i = 0; i < 4; ++i) {
      const __m256 qf = _mm256_cvtepi32_ps(parts[i]);
      w[i] = FMT == kQ4_0 ? _mm256_mul_ps(d, _mm256_sub_ps(qf, eight)) : _mm256_add_ps(_mm256_mul_ps(d, qf), m);
    }
  }
}

template <int FMT, int M>
inline void dot_row(const uint8_t* row, const float* x, int64_t K, float* out) {
  const int64_t bb = block_bytes(FMT), nb = K / kBlock;
  __m256 a[M][2];
  for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    __m256 w[4];
    weights<FMT>(row + j * bb, w);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + j * kBlock;
      for (int i = 0; i < 4; ++i) a[m][i & 1] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xm + 8 * i), a[m][i & 1]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum(_mm256_add_ps(a[m][0], a[m][1]));
}
#else
template <int FMT, int M>
inline void dot_row(const uint8_t* row, const float* x, int64_t K, float* out) {
  const int64_t bb = block_bytes(FMT), nb = K / kBlock;
  float acc[M][kBlock] = {};
  float w[kBlock];
  for (int64_t j = 0; j < nb; ++j) {
    dequant_block<FMT>(row + j * bb, w);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + j * kBlock;
      for (int i = 0; i < kBlock; ++i) acc[m][i] += w[i] * xm[i];
    }
  }
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
    for (int i = 0; i < kBlock; ++i) s += acc[m][i];
    out[m] = s;
  }
}
#endif

// M rows of x (M <= 4) against every row of W.
template <int FMT, int M>
void linear_rows(const float* x, const uint8_t* w, const float* bias, float* y, int64_t N, int64_t K,
                 int64_t ldy) {
  const int64_t row_bytes = K / kBlock * block_bytes(FMT);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float out[M];
    for (int64_t n = begin; n < end; ++n) {
      dot_row<FMT, M>(w + n * row_bytes, x, K, out);
      const float b = bias ? bias[n] : 0.f;
      for (int m = 0; m < M; ++m) y[m * ldy + n] = out[m] + b;
    }
  });
}

template <int FMT>
void linear_fmt(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: linear_rows<FMT, 1>(xm, w, bias, ym, N, K, N); break;
      case 2: linear_rows<FMT, 2>(xm, w, bias, ym, N, K, N); break;
      case 3: linear_rows<FMT, 3>(xm, w, bias, ym, N, K, N); break;
      default: linear_rows<FMT, 4>(xm, w, bias, ym, N, K, N); break;
    }
  }
}

// Into fp32, or straight into bf16 / fp16 (each fp32 weight rounded once, to nearest even, as
// .to(dtype) rounds it): one pass over the output instead of an fp32 copy and a conversion.
template <int FMT, typename out_t>
void dequantize_fmt(const uint8_t* w, out_t* out, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, bb = block_bytes(FMT);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float tmp[kBlock];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t j = 0; j < nb; ++j) {
        out_t* o = out + n * K + j * kBlock;
        if constexpr (std::is_same_v<out_t, float>) {
          dequant_block<FMT>(w + (n * nb + j) * bb, o);
        } else {
          dequant_block<FMT>(w + (n * nb + j) * bb, tmp);
          for (int64_t i = 0; i < kBlock; ++i) o[i] = static_cast<out_t>(tmp[i]);
        }
      }
  });
}

void check(const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(fmt == kQ8_0 || fmt == kQ4_0 || fmt == kQ4_1, "format must be Q8_0 (8), Q4_0 (2) or Q4_1 (3)");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "K must be a positive multiple of 32");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "W: contiguous uint8 [N, K / 32 * block bytes] on CPU");
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(fmt), "W's rows do not hold K weights of this format");
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

// y = x @ W^T (+ bias), into out where it is given (else a new tensor).
at::Tensor linear_quant_into(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& out) {
  check(w, fmt, K);
  auto xc = kvserve::checked_x(x, K);
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor bc;
  const float* b = kvserve::bias_ptr(bias, N, bc);
  auto y = kvserve::output_rows(out, M, N, x);
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (fmt == kQ8_0) linear_fmt<kQ8_0>(xp, wp, b, yp, M, N, K);
  else if (fmt == kQ4_0) linear_fmt<kQ4_0>(xp, wp, b, yp, M, N, K);
  else linear_fmt<kQ4_1>(xp, wp, b, yp, M, N, K);
  return y;
}

at::Tensor linear_quant(at::Tensor x, at::Tensor w, int64_t fmt, int64_t K, c10::optional<at::Tensor> bias) {
  return linear_quant_into(x, w, fmt, K, bias, {});
}

template <typename out_t>
void dequantize_into(const uint8_t* wp, int64_t fmt, out_t* op, int64_t N, int64_t K) {
  if (fmt == kQ8_0) dequantize_fmt<kQ8_0>(wp, op, N, K);
  else if (fmt == kQ4_0) dequantize_fmt<kQ4_0>(wp, op, N, K);
  else dequantize_fmt<kQ4_1>(wp, op, N, K);
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

// linear_quant with its operands (those it takes after x) bound, for a decoder layer run as one
// call (kernel_ops.h).
pybind11::capsule rows_op(const std::string& name, at::Tensor w, int64_t fmt, int64_t K,
                          c10::optional<at::Tensor> bias) {
  TORCH_CHECK(name == "linear_quant", "this kernel's product is linear_quant, not ", name);
  check(w, fmt, K);
  return kvserve::product_capsule(linear_quant_into, w, fmt, K, bias);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("linear_quant", &linear_quant, "fp32 x @ W^T (+ bias), W packed in Q8_0 / Q4_0 / Q4_1 blocks (CPU)");
  m.def("dequantize", &dequantize, "W packed in Q8_0 / Q4_0 / Q4_1 blocks as [N, K] in fp32 (or bf16 / fp16) (CPU)",
        py::arg("w"), py::arg("fmt"), py::arg("K"), py::arg("dtype") = "float32");
  m.def("rows_op", &rows_op,
        "linear_quant with its operands bound, as a kvserve.RowsOp capsule (kernel_ops.h)");
}
