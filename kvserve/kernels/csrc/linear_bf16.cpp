// y = x @ W^T (+ bias) for bf16 on CPU when x has only a few rows: the decode-time
// matrix-vector products, which the stock bf16 GEMM runs far below memory bandwidth.
//
//   x    [M, K] bf16 (M <= 8)      W [N, K] bf16 (nn.Linear layout, read as stored)
//   bias [N] bf16 or absent        y [M, N] bf16
//
// Every weight row is streamed from memory once and dotted with all M rows of x using the
// AVX512-BF16 pair dot product (bf16 x bf16 products summed in fp32, as the GEMM does); the
// fp32 sum is rounded to bf16 once. Rows of W are split over threads.
//
// Two paths with the same arithmetic (bf16 products summed in fp32, rounded once): the
// AVX512-BF16 one, and a portable loop for any x86-64 that widens bf16 to fp32 by a shift and
// leaves vectorization to the compiler. The build decides which exists (kvserve/kernels builds
// this file once per instruction-set level); `isa()` names the build.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;

#if defined(__AVX512BF16__)
// R weight rows at a time against all M rows of x: R * M independent fp32 accumulators.
template <int M, int R>
inline void dot_rows(const uint16_t* x, const uint16_t* w, int64_t K, float* sums) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512(w + r * K + k);
      for (int m = 0; m < M; ++m)
        acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)xv[m], (__m512bh)wv);
    }
  }
  if (k < K) {  // tail: masked loads read zeros past K
    const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + r * K + k);
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * K + k);
        acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)xv, (__m512bh)wv);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) sums[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int M>
void linear_rows(const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, c10::BFloat16* y,
                 int64_t N, int64_t K) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  at::parallel_for(0, (N + R - 1) / R, 16, [&](int64_t begin, int64_t end) {
    float sums[R * M];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * R;
      const int64_t rows = std::min<int64_t>(R, N - n0);
      if (rows == R) {
        dot_rows<M, R>(x, w + n0 * K, K, sums);
      } else {
        for (int64_t r = 0; r < rows; ++r) dot_rows<M, 1>(x, w + (n0 + r) * K, K, sums + r * M);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float b = bias ? static_cast<float>(bias[n0 + r]) : 0.f;
        for (int m = 0; m < M; ++m) y[m * N + n0 + r] = c10::BFloat16(sums[r * M + m] + b);
      }
    }
  });
}
#else
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The portable path: x widened to fp32 once, each weight row widened as it is read.
void linear_portable(const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, c10::BFloat16* y,
                     int64_t M, int64_t N, int64_t K) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(x[i]);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(K);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < K; ++k) wf[k] = widen(w[n * K + k]);
      const float b = bias ? static_cast<float>(bias[n]) : 0.f;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xf.data() + m * K;
        float sum = 0.f;
        for (int64_t k = 0; k < K; ++k) sum += xm[k] * wf[k];
        y[m * N + n] = c10::BFloat16(sum + b);
      }
    }
  });
}
#endif

std::string isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#else
  return "portable";
#endif
}

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_bf16 runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 inputs");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and W [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "linear_bf16 takes 1 to 8 rows");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const c10::BFloat16* b = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kBFloat16 && bc.numel() == N, "bias [N] bf16");
    b = bc.data_ptr<c10::BFloat16>();
  }
  auto y = at::empty({M, N}, x.options());
  auto xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  auto wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>());
  auto yp = y.data_ptr<c10::BFloat16>();
#if defined(__AVX512BF16__)
  switch (M) {
    case 1: linear_rows<1>(xp, wp, b, yp, N, K); break;
    case 2: linear_rows<2>(xp, wp, b, yp, N, K); break;
    case 3: linear_rows<3>(xp, wp, b, yp, N, K); break;
    case 4: linear_rows<4>(xp, wp, b, yp, N, K); break;
    case 5: linear_rows<5>(xp, wp, b, yp, N, K); break;
    case 6: linear_rows<6>(xp, wp, b, yp, N, K); break;
    case 7: linear_rows<7>(xp, wp, b, yp, N, K); break;
    default: linear_rows<8>(xp, wp, b, yp, N, K); break;
  }
#else
  linear_portable(xp, wp, b, yp, M, N, K);
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("linear_bf16", &linear_bf16, "bf16 x @ W^T (+ bias) for 1 to 8 rows of x (CPU)");
}
