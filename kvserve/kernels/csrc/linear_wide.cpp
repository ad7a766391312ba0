// y = x @ W^T (+ bias) with W kept in 16 bits (a GGUF's F16 or BF16 matrices) and x in fp32:
// the products of an fp32 model whose checkpoint stores 16-bit weights, reading half the bytes
// of the fp32 copy they would otherwise be cast to.
//
//   x [M, K] fp32        W [N, 2 K] uint8: each row its K fp16 or bf16 weights, little-endian
//   y [M, N] fp32        bias [N] fp32 or absent
//
// Formats (ggml type ids): F16 (1), BF16 (30). Widening either to fp32 is exact (bf16: the bits
// shifted left by 16; fp16: the F16C conversion), and the products are summed in fp32 by FMA, so
// the result is `x @ W.float().T` up to the order of the sums. Rows of W are split over threads;
// x is read in groups of up to eight rows, so up to eight rows read each weight once.
//
// The functions are those every packed format's kernel has (`linear_quant`, `dequantize`), so
// models/packed.py's PackedLinear runs these weights as it runs blocks.
//
// Paths: AVX-512 (16 weights a register, a masked last step for K % 16); AVX2 (8 a register, a
// scalar tail); a portable loop the compiler vectorizes for baseline x86-64. setup.py builds this
// file once per level and kvserve picks the best the CPU runs; `isa()` names the build.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include "kernel_ops.h"
#include "linear_operands.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <string>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kF16 = 1, kBF16 = 30;
constexpr int kGroup = 8;  // rows of x that share one read of W

// One weight in fp32: the reference every path equals (exact for both formats).
template <int FMT>
inline float widen(uint16_t h) {
  if constexpr (FMT == kBF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return c10::detail::fp16_ieee_to_fp32_value(h);
  }
}

#if defined(__AVX512F__)
template <int FMT>
inline __m512 widen16(__m256i h) {
  if constexpr (FMT == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}

template <int FMT>
inline __m512 load16(const uint16_t* p) {
  return widen16<FMT>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One row of W against M rows of x: 32 weights a step in two registers, two accumulators a row
// (M = 8: 16 accumulators of the 32 registers); the last K % 32 by masked steps of 16.
template <int FMT, int M>
inline void dot_row(const uint16_t* w, const float* x, int64_t K, float* out) {
  __m512 a0[M], a1[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = load16<FMT>(w + k), w1 = load16<FMT>(w + k + 16);
    for (int m = 0; m < M; ++m) {
      a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), a0[m]);
      a1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), a1[m]);
    }
  }
  for (; k < K; k += 16) {  // masked loads read zeros past K
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, K - k)) - 1);
    const __m512 wv = widen16<FMT>(_mm256_maskz_loadu_epi16(mask, w + k));
    for (int m = 0; m < M; ++m) a0[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), a0[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}
#elif defined(__AVX2__)
template <int FMT>
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (FMT == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row of W against M rows of x: U registers of 8 weights a step, U accumulators a row (two
// up to four rows, one beyond: at most 8 of the 16 registers); the last K % 8 one by one.
template <int FMT, int M>
inline void dot_row(const uint16_t* w, const float* x, int64_t K, float* out) {
  constexpr int U = M <= 4 ? 2 : 1;
  __m256 a[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) a[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U)
    for (int u = 0; u < U; ++u) {
      const __m256 wv = load8<FMT>(w + k + 8 * u);
      for (int m = 0; m < M; ++m) a[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * u), a[m][u]);
    }
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = load8<FMT>(w + k);
    for (int m = 0; m < M; ++m) a[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), a[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    __m256 s = a[m][0];
    for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, a[m][u]);
    out[m] = hsum(s);
  }
  for (; k < K; ++k) {
    const float wk = widen<FMT>(w[k]);
    for (int m = 0; m < M; ++m) out[m] += wk * x[m * K + k];
  }
}
#else
// One row of W against M rows of x: a chunk of the row widened into a buffer, then multiplied
// into 16 fp32 partial sums a row of x (loops the compiler vectorizes).
template <int FMT, int M>
inline void dot_row(const uint16_t* w, const float* x, int64_t K, float* out) {
  constexpr int64_t kChunk = 256, kLanes = 16;
  float acc[M][kLanes] = {};
  float wf[kChunk];
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t len = std::min(kChunk, K - k0);
    for (int64_t i = 0; i < len; ++i) wf[i] = widen<FMT>(w[k0 + i]);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + k0;
      int64_t i = 0;
      for (; i + kLanes <= len; i += kLanes)
        for (int64_t j = 0; j < kLanes; ++j) acc[m][j] += wf[i + j] * xm[i + j];
      for (; i < len; ++i) acc[m][0] += wf[i] * xm[i];
    }
  }
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
    for (int64_t j = 0; j < kLanes; ++j) s += acc[m][j];
    out[m] = s;
  }
}
#endif

// M rows of x (M <= kGroup) against every row of W.
template <int FMT, int M>
void linear_rows(const float* x, const uint16_t* w, const float* bias, float* y, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float out[M];
    for (int64_t n = begin; n < end; ++n) {
      dot_row<FMT, M>(w + n * K, x, K, out);
      const float b = bias ? bias[n] : 0.f;
      for (int m = 0; m < M; ++m) y[m * N + n] = out[m] + b;
    }
  });
}

template <int FMT>
void linear_fmt(const float* x, const uint16_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (std::min<int64_t>(kGroup, M - m0)) {
      case 1: linear_rows<FMT, 1>(xm, w, bias, ym, N, K); break;
      case 2: linear_rows<FMT, 2>(xm, w, bias, ym, N, K); break;
      case 3: linear_rows<FMT, 3>(xm, w, bias, ym, N, K); break;
      case 4: linear_rows<FMT, 4>(xm, w, bias, ym, N, K); break;
      case 5: linear_rows<FMT, 5>(xm, w, bias, ym, N, K); break;
      case 6: linear_rows<FMT, 6>(xm, w, bias, ym, N, K); break;
      case 7: linear_rows<FMT, 7>(xm, w, bias, ym, N, K); break;
      default: linear_rows<FMT, 8>(xm, w, bias, ym, N, K); break;
    }
  }
}

// Every weight in fp32, split over threads by spans of the flattened [N * K] weights.
template <int FMT>
void widen_all(const uint16_t* w, float* out, int64_t total) {
  at::parallel_for(0, total, 1 << 14, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__)
    for (; i + 16 <= end; i += 16) _mm512_storeu_ps(out + i, load16<FMT>(w + i));
#elif defined(__AVX2__)
    for (; i + 8 <= end; i += 8) _mm256_storeu_ps(out + i, load8<FMT>(w + i));
#endif
    for (; i < end; ++i) out[i] = widen<FMT>(w[i]);
  });
}

void check(const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(fmt == kF16 || fmt == kBF16, "format must be F16 (1) or BF16 (30)");
  TORCH_CHECK(K > 0, "K must be positive");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "W: contiguous uint8 [N, 2 K] on CPU");
  TORCH_CHECK(w.size(1) == 2 * K, "W's rows do not hold K 16-bit weights");
}

const uint16_t* weights_of(const at::Tensor& w) { return reinterpret_cast<const uint16_t*>(w.data_ptr<uint8_t>()); }

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
  if (M == 0 || N == 0) return y;
  if (fmt == kBF16) linear_fmt<kBF16>(xc.data_ptr<float>(), weights_of(w), b, y.data_ptr<float>(), M, N, K);
  else linear_fmt<kF16>(xc.data_ptr<float>(), weights_of(w), b, y.data_ptr<float>(), M, N, K);
  return y;
}

at::Tensor linear_quant(at::Tensor x, at::Tensor w, int64_t fmt, int64_t K, c10::optional<at::Tensor> bias) {
  return linear_quant_into(x, w, fmt, K, bias, {});
}

// [N, K] in fp32, or in bf16 / fp16 (the fp32 weights rounded as .to(dtype) rounds them: for the
// stored format itself, its weights as they are).
at::Tensor dequantize(at::Tensor w, int64_t fmt, int64_t K, const std::string& dtype) {
  check(w, fmt, K);
  TORCH_CHECK(dtype == "float32" || dtype == "bfloat16" || dtype == "float16", "dtype: float32, bfloat16 or float16");
  auto out = at::empty({w.size(0), K}, at::dtype(at::kFloat));
  if (fmt == kBF16) widen_all<kBF16>(weights_of(w), out.data_ptr<float>(), out.numel());
  else widen_all<kF16>(weights_of(w), out.data_ptr<float>(), out.numel());
  if (dtype == "float32") return out;
  return out.to(dtype == "bfloat16" ? at::kBFloat16 : at::kHalf);
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
  m.def("linear_quant", &linear_quant, "fp32 x @ W^T (+ bias), W [N, K] in fp16 or bf16, as uint8 [N, 2 K] (CPU)");
  m.def("dequantize", &dequantize, "W [N, K] in fp16 or bf16 (uint8 [N, 2 K]) as fp32 (or bf16 / fp16) (CPU)",
        py::arg("w"), py::arg("fmt"), py::arg("K"), py::arg("dtype") = "float32");
  m.def("rows_op", &rows_op,
        "linear_quant with its operands bound, as a kvserve.RowsOp capsule (kernel_ops.h)");
}
