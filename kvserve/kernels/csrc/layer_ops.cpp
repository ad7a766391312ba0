// A decoder layer's small elementwise steps, each one call instead of the five to ten PyTorch
// ops (and as many dispatches and temporaries) it takes in torch: at decode a layer's norm costs
// PyTorch about 47 us on a 576-wide row, mostly per-op overhead.
//
//   rms_norm(x [T, H], w [H], eps)        w * dtype(x * rsqrt(mean(x^2) + eps))   (sum in fp64)
//   add_rms_norm(x, r [T, H], w, eps)     r += x in place, then rms_norm(r)
//   rope_qkv(qkv [T, (H + 2 KVH) D], cos, sin, H, KVH)
//                                         q, k rotated (as rotate_halves), v a view
//   rotate_halves(x [T, heads, D], cos, sin [T, D/2])
//                                         [x1 cos - x2 sin, x2 cos + x1 sin]   (halves of D)
//   silu_mul(g [T, I], u [T, I])          silu(g) * u
//   silu_mul_halves(gu [T, 2 I])          silu_mul of its two halves
//   store_kv(kc, vc [slots..., KVH, D], slots [T], k, v [T, KVH, D])
//                                         kc[slot[t]] = k[t], vc[slot[t]] = v[t]   (a cache write:
//                                         k, v of any floating dtype and layout, converted as
//                                         .to(cache dtype) converts; fp32 into bf16 rounded as copied)
//   store_kv_int8(kc, ks, vc, vs, slots, k, v)
//                                         the same into an int8 cache [slots..., KVH, D] with a
//                                         scale per token and head (ks, vs [slots..., KVH] fp32):
//                                         s = max(amax|x| / 127, 1e-8), q = round(x / s) in [-127, 127]
//                                         (kv/quant.py's quantize_int8, bit for bit)
//   argmax_rows(x [R, V])                 x.max(-1).indices   (fp32; the AVX-512 build only)
//
// Each rounds where the torch expression it replaces rounds: arithmetic on scalar_t (c10's
// BFloat16 / Half compute in fp32 and round the result, as PyTorch's CPU kernels do), so fp32
// results equal torch's up to the norm's rounding of its sum (torch's order varies with the
// rows' alignment and count; this one does not) and the exp's last ulp, and bf16 ones
// the same with torch's roundings. Rows may be strided (views of a fused product's columns); the
// last dimension must be contiguous. Rows are split over threads only when there are many.
//
// silu_mul has an AVX-512 path for fp32 and bf16 (16 lanes at a time, exp by a polynomial within
// an ulp of libm's, bf16 rounded to nearest even as c10 rounds) and an AVX2 one for fp32 (8 lanes,
// the same polynomial); the AVX2 build also lets the compiler vectorize the other loops. The build
// decides what exists (setup.py builds this file once per instruction-set level); `isa()`
// names the build.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include "kernel_ops.h"
#include "vec_math.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 16;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 2 && x.stride(-1) == 1, name, ": a CPU tensor whose last dimension is contiguous");
}

// One row of rms_norm: o = w * dtype(row * rsqrt(mean(row^2) + eps)).
template <typename scalar_t>
inline void norm_row(const scalar_t* row, const scalar_t* wp, scalar_t* o, int64_t H, float eps) {
  double ss = 0.;  // in fp64: the same sum whatever order the compiler adds in
  for (int64_t i = 0; i < H; ++i) {
    const double v = static_cast<double>(row[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(static_cast<float>(ss / static_cast<double>(H)) + eps);
  for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * static_cast<scalar_t>(static_cast<float>(row[i]) * r);
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type() &&
              w.is_contiguous(), "x [T, H], w [H] of x's dtype");
}

// rms_norm into out ([T, H] of x's dtype, contiguous), on checked operands.
void rms_norm_into(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) norm_row(xp + t * ld, wp, op + t * H, H, static_cast<float>(eps));
    });
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_norm(x, w);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_into(x, w, eps, out);
  return out;
}

// add_rms_norm into out ([T, H] of x's dtype, contiguous, not x), on checked operands.
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, double eps,
                       const at::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* __restrict__ r = rp + t * H;
        const scalar_t* __restrict__ a = xp + t * ld;
        for (int64_t i = 0; i < H; ++i) r[i] = r[i] + a[i];
        norm_row(r, wp, op + t * H, H, static_cast<float>(eps));
      }
    });
  });
}

// residual += x (rounded to the dtype, as torch's add rounds), then rms_norm(residual): the
// residual stream's add and the next norm in one call. residual is updated in place.
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  check_norm(x, w);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
              residual.scalar_type() == x.scalar_type(), "residual: contiguous, of x's shape and dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  add_rms_norm_into(x, residual, w, eps, out);
  return out;
}

void check_angles(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t D) {
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D / 2 &&
              cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "cos, sin [T, D/2] contiguous, of x's dtype");
}

// out [T, heads, D] (contiguous) = x [T, heads, D] (rows at strides st, sh) rotated.
template <typename scalar_t>
void rotate_into(const scalar_t* xp, int64_t st, int64_t sh, const scalar_t* cp, const scalar_t* sp, scalar_t* op,
                 int64_t T, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* in = xp + t * st + h * sh;
        scalar_t* o = op + (t * heads + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const scalar_t c = cp[t * half + i], s = sp[t * half + i], x1 = in[i], x2 = in[half + i];
          const scalar_t a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
          o[i] = a - b;
          o[half + i] = e + f;
        }
      }
  });
}

at::Tensor rotate_halves(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x [T, heads, D] with D even");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  check_angles(x, cos, sin, T, D);
  auto out = at::empty({T, heads, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotate_halves", [&] {
    rotate_into(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                out.data_ptr<scalar_t>(), T, heads, D);
  });
  return out;
}

void check_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && H > 0 && KVH > 0 && qkv.size(1) % (H + 2 * KVH) == 0 &&
              (qkv.size(1) / (H + 2 * KVH)) % 2 == 0, "qkv [T, (H + 2 KVH) D] with D even");
  check_angles(qkv, cos, sin, qkv.size(0), qkv.size(1) / (H + 2 * KVH));
}

// q [T, H, D] and k [T, KVH, D] (contiguous, qkv's dtype) rotated from qkv, on checked operands.
void rope_qkv_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H,
                   int64_t KVH, const at::Tensor& q, const at::Tensor& k) {
  const int64_t T = qkv.size(0), D = qkv.size(1) / (H + 2 * KVH), ld = qkv.stride(0);
  if (T == 0) return;  // (an empty tensor's data pointer may be null: no offset from it)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qkv", [&] {
    const scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    rotate_into(xp, ld, D, cp, sp, q.data_ptr<scalar_t>(), T, H, D);
    rotate_into(xp + H * D, ld, D, cp, sp, k.data_ptr<scalar_t>(), T, KVH, D);
  });
}

// v [T, KVH, D]: a view of qkv's last columns.
at::Tensor v_of(const at::Tensor& qkv, int64_t H, int64_t KVH) {
  const int64_t T = qkv.size(0), D = qkv.size(1) / (H + 2 * KVH);
  return qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
}

// q, k rotated and v, from a fused q|k|v product [T, (H + 2 KVH) D]: q [T, H, D] and k [T, KVH, D]
// new tensors, v [T, KVH, D] a view of the product's last columns. One call for what took a
// split, three views and two rotate_halves.
std::vector<at::Tensor> rope_qkv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t H, int64_t KVH) {
  check_qkv(qkv, cos, sin, H, KVH);
  const int64_t T = qkv.size(0), D = qkv.size(1) / (H + 2 * KVH);
  auto q = at::empty({T, H, D}, qkv.options());
  auto k = at::empty({T, KVH, D}, qkv.options());
  rope_qkv_into(qkv, cos, sin, H, KVH, q, k);
  return {q, k, v_of(qkv, H, KVH)};
}

#if defined(__AVX512F__)
using kvserve::exp16;  // vec_math.h

// 16 values (lanes outside m read as 0) as fp32.
template <typename T>
inline __m512 load16(const T* p, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {  // bf16 is the top half of fp32
    const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

// fp32 -> bf16 rounded to nearest even, NaN kept a NaN: c10::BFloat16's rounding.
inline __m512 round_bf16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(b, bias), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}

template <typename T>
inline void store16(T* p, __m512 x, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, m, x);
  } else {
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
    _mm256_mask_storeu_epi16(p, m, h);
  }
}

// One row: silu(g) rounded to T, times u, rounded to T (as the scalar loop below rounds).
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = I - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (I - i)) - 1);
    const __m512 v = load16(g + i, m), up = load16(u + i, m);
    __m512 s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
    if constexpr (!std::is_same_v<T, float>) s = round_bf16(s);
    __m512 y = _mm512_mul_ps(s, up);
    if constexpr (!std::is_same_v<T, float>) y = round_bf16(y);
    store16(o + i, y, m);
  }
}
#endif

// fp32 silu(g) * u 8 lanes at a time in the AVX2 build: how many of the row's I it did.
template <typename T>
inline int64_t silu_mul_avx2(const T* g, const T* u, T* o, int64_t I) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 8 <= I; i += 8) {
      const __m256 v = _mm256_loadu_ps(g + i);
      const __m256 e = kvserve::exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
      const __m256 s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
  }
#endif
  return i;
}

// out [T, I] = silu(g) * u, rows t of g and u at gp + t * lg and up + t * lu.
template <typename scalar_t>
void silu_mul_rows(const scalar_t* gp, const scalar_t* up, int64_t lg, int64_t lu, scalar_t* op, int64_t T,
                   int64_t I) {
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
        silu_mul_row(gp + t * lg, up + t * lu, op + t * I, I);
        continue;
      }
#endif
      int64_t i = silu_mul_avx2(gp + t * lg, up + t * lu, op + t * I, I);  // the rest below
      for (; i < I; ++i) {
        const float v = static_cast<float>(gp[t * lg + i]);
        const scalar_t s = static_cast<scalar_t>(v / (1.f + std::exp(-v)));
        op[t * I + i] = s * up[t * lu + i];
      }
    }
  });
}

// silu(g) * u into out [T, I] (contiguous, g's dtype; a new tensor where none is given), g's rows
// from element g_at of g, u's from u_at of u (each row at its tensor's row stride): what the entries
// below compute, on checked operands.
at::Tensor silu_mul_at(const at::Tensor& g, int64_t g_at, const at::Tensor& u, int64_t u_at, int64_t T,
                       int64_t I, const at::Tensor& into = {}) {
  auto out = into.defined() ? into : at::empty({T, I}, g.options());
  if (T == 0) return out;  // (an empty tensor's data pointer may be null: no offset from it)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "silu_mul", [&] {
    silu_mul_rows(g.data_ptr<scalar_t>() + g_at, u.data_ptr<scalar_t>() + u_at, g.stride(0), u.stride(0),
                  out.data_ptr<scalar_t>(), T, I);
  });
  return out;
}

at::Tensor silu_mul(at::Tensor g, at::Tensor u) {
  check_rows(g, "gate");
  check_rows(u, "up");
  TORCH_CHECK(g.dim() == 2 && g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type(),
              "gate, up [T, I] alike");
  return silu_mul_at(g, 0, u, 0, g.size(0), g.size(1));
}

// silu_mul_halves into out [T, I] where it is given (else a new tensor), on a checked gu.
at::Tensor silu_mul_halves_into(const at::Tensor& gu, const at::Tensor& out) {
  const int64_t I = gu.size(1) / 2;
  return silu_mul_at(gu, 0, gu, I, gu.size(0), I, out);
}

// silu(gate) * up from a fused gate|up product [T, 2 I] (gate the first I columns): one call
// for what took a split and silu_mul. The halves are read in place, not as two narrowed views
// (each view a tensor made): one row of SmolLM2's 2 x 1536 took 3.9 us a call through the views
// and takes 2.0-2.2 in place, from Python (silu_mul of two tensors 1.3-2.3 in the same runs).
at::Tensor silu_mul_halves(at::Tensor gu) {
  check_rows(gu, "gate|up");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "gate|up [T, 2 I]");
  return silu_mul_halves_into(gu, {});
}

// One token's K or V row (n values, `bytes` bytes) into its slot: copied, or with `round` fp32
// rounded into a bf16 cache as c10::BFloat16 rounds (round_bf16 on AVX-512; what
// k.to(torch.bfloat16) and an index_put_ did in two calls a tensor).
inline void store_row(uint8_t* dst, const uint8_t* src, int64_t n, int64_t bytes, bool round) {
  if (!round) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const float* x = reinterpret_cast<const float*>(src);
  c10::BFloat16* y = reinterpret_cast<c10::BFloat16*>(dst);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    store16(y + i, round_bf16(load16(x + i, m)), m);
  }
#endif
  for (; i < n; ++i) y[i] = c10::BFloat16(x[i]);
}

// Whether store_row rounds x's fp32 rows into a bf16 cache as it copies them.
bool rounds_into(const at::Tensor& x, const at::Tensor& cache) {
  return cache.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kFloat;
}

// x as the rows store_row copies: the cache's dtype (or fp32 rows it rounds into bf16), each
// token's heads contiguous. Other dtypes are converted as .to() converts and other layouts copied
// first (what the torch write, .to() and index_put_, does with them).
at::Tensor as_rows(at::Tensor x, const at::Tensor& cache) {
  if (x.scalar_type() != cache.scalar_type() && !rounds_into(x, cache)) x = x.to(cache.scalar_type());
  if (x.stride(2) != 1 || x.stride(1) != x.size(2)) x = x.contiguous();
  return x;
}

// A cache write's slots and rows: int64 CPU slots [T], each inside the cache's `total`, and k, v
// [T, KVH, D] of a floating dtype on CPU.
void check_write(const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v, int64_t KVH, int64_t D,
                 int64_t total) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
              slots.device().is_cpu(), "int64 CPU slots [T]");
  const int64_t T = slots.size(0);
  for (const auto* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == T && x->size(1) == KVH && x->size(2) == D &&
                x->device().is_cpu() && at::isFloatingType(x->scalar_type()),
                "k, v [T, KVH, D] of a floating dtype on CPU");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < total, "slot ", sp[t], " outside the cache's ", total);
}

// A batch's slots lie in blocks anywhere in the cache, each line written missing the caches:
// copied one after the other, each waited for its line to be read (64 tokens: 62 us a layer).
// Every line asked for first (for writing), their waits overlap. Always inlined: to GCC a
// function whose only effect is a prefetch has no side effects, and calls to one it did not
// inline were deleted (paged_attention.cpp).
__attribute__((always_inline)) inline void prefetch_slots(uint8_t* kd, uint8_t* vd, const int64_t* sp,
                                                         int64_t T, int64_t row_bytes) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t at = 0; at < row_bytes; at += 64) {
      __builtin_prefetch(kd + sp[t] * row_bytes + at, 1);
      __builtin_prefetch(vd + sp[t] * row_bytes + at, 1);
    }
}

void store_kv(at::Tensor kc, at::Tensor vc, at::Tensor slots, at::Tensor k, at::Tensor v) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes() && kc.dim() >= 3
              && kc.scalar_type() == vc.scalar_type() && kc.device().is_cpu(), "contiguous CPU caches alike");
  const int64_t T = slots.size(0), KVH = kc.size(-2), D = kc.size(-1), total = kc.numel() / (KVH * D);
  check_write(slots, k, v, KVH, D, total);
  k = as_rows(k, kc);
  v = as_rows(v, vc);
  const bool round_k = rounds_into(k, kc), round_v = rounds_into(v, vc);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t n = KVH * D, row = n * kc.element_size();
  auto* kd = static_cast<uint8_t*>(kc.data_ptr());
  auto* vd = static_cast<uint8_t*>(vc.data_ptr());
  const auto* ks = static_cast<const uint8_t*>(k.data_ptr());
  const auto* vs = static_cast<const uint8_t*>(v.data_ptr());
  const int64_t lk = k.stride(0) * k.element_size(), lv = v.stride(0) * v.element_size();
  prefetch_slots(kd, vd, sp, T, row);
  for (int64_t t = 0; t < T; ++t) {
    store_row(kd + sp[t] * row, ks + t * lk, n, row, round_k);
    store_row(vd + sp[t] * row, vs + t * lv, n, row, round_v);
  }
}

// One token's head row x [D] (fp32) quantized into q [D] with its scale, as quantize_int8 does
// in torch: s = max(amax|x| / 127, 1e-8) in fp32, q = x / s divided (not multiplied by 1 / s:
// the build's flags leave out -freciprocal-math) and rounded to nearest even, clamped to
// [-127, 127]. Bit for bit for finite rows. A row with a NaN gets a NaN scale, as torch's amax
// gives, and one with an infinity an infinite scale; a quotient that is NaN (inf / inf, NaN / s)
// is stored as 0 in every build (torch leaves its conversion to int8 to the platform).
inline void quantize_row_int8(const float* x, int8_t* q, float* scale, int64_t D) {
  constexpr float kTiny = 1e-8f;  // kv/quant.py's TINY as fp32 (clamp_min takes it so)
  int64_t i = 0;
  float amax = 0.f;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= D; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0;
    m = _mm512_max_ps(m, a);
  }
  amax = _mm512_reduce_max_ps(m);
#endif
  for (int64_t j = i; j < D; ++j) {
    const float a = std::fabs(x[j]);
    nan |= std::isnan(a);
    amax = a > amax ? a : amax;
  }
  float s = amax / 127.f;
  s = nan ? std::numeric_limits<float>::quiet_NaN() : (s < kTiny ? kTiny : s);
  *scale = s;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= D; i += 16) {
    __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);  // NaN: 0
    r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
  }
#endif
  for (; i < D; ++i) {
    const float r = std::nearbyint(x[i] / s);
    q[i] = static_cast<int8_t>(std::isnan(r) ? 0.f : (r < -127.f ? -127.f : (r > 127.f ? 127.f : r)));
  }
}

// What Int8KVStorage.write does in torch (quantize_int8, then an index_put_ of the values and
// one of the scales, for K and for V) in one call: each token's heads quantized straight into
// their slot. k, v of any floating dtype and layout (taken as fp32, as .float() takes them).
void store_kv_int8(at::Tensor kc, at::Tensor ks, at::Tensor vc, at::Tensor vs, at::Tensor slots, at::Tensor k,
                   at::Tensor v) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes() && kc.dim() >= 3 &&
              kc.scalar_type() == at::kChar && vc.scalar_type() == at::kChar && kc.device().is_cpu(),
              "contiguous int8 CPU caches alike");
  const int64_t KVH = kc.size(-2), D = kc.size(-1), total = kc.numel() / (KVH * D);
  for (const auto* sc : {&ks, &vs})
    TORCH_CHECK(sc->is_contiguous() && sc->scalar_type() == at::kFloat && sc->device().is_cpu() &&
                sc->numel() == total * KVH && sc->size(-1) == KVH, "contiguous fp32 scales [slots..., KVH]");
  check_write(slots, k, v, KVH, D, total);
  const int64_t T = slots.size(0);
  k = k.to(at::kFloat).contiguous();
  v = v.to(at::kFloat).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  auto* kd = kc.data_ptr<int8_t>();
  auto* vd = vc.data_ptr<int8_t>();
  float* kso = ks.data_ptr<float>();
  float* vso = vs.data_ptr<float>();
  const float* kx = k.data_ptr<float>();
  const float* vx = v.data_ptr<float>();
  const int64_t n = KVH * D;
  prefetch_slots(reinterpret_cast<uint8_t*>(kd), reinterpret_cast<uint8_t*>(vd), sp, T, n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t row = sp[t] * KVH + h;
      quantize_row_int8(kx + (t * KVH + h) * D, kd + row * D, kso + row, D);
      quantize_row_int8(vx + (t * KVH + h) * D, vd + row * D, vso + row, D);
    }
}

#if defined(__AVX512F__)
// The index of row x [V]'s largest value, the first of equal ones; a NaN counts as the largest (the
// first NaN's index), as torch's max(-1).indices. 16 lanes keep their own largest and its index
// (a later equal value does not replace it), then the lanes are reduced to the first index of the
// largest; the NaN check rides along, and a row with one is scanned again for its first NaN.
int64_t row_argmax(const float* x, int64_t V) {
  int64_t i = 0, best_i = 0;
  float best = x[0];
  if (V >= 16) {
    __m512 top = _mm512_loadu_ps(x);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = at;
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= V; i += 16) {
      idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 up = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, up, v);
      at = _mm512_mask_mov_epi32(at, up, idx);
    }
    if (nan) {
      for (int64_t j = 0; j < V; ++j)
        if (std::isnan(x[j])) return j;
    }
    best = _mm512_reduce_max_ps(top);
    const __mmask16 tops = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_i = _mm512_mask_reduce_min_epi32(tops, at);
  } else {
    i = 1;
    if (std::isnan(best)) return 0;
  }
  for (; i < V; ++i) {  // the last V % 16 (all of a short row): later than every index above
    if (std::isnan(x[i])) return i;
    if (x[i] > best) best = x[i], best_i = i;
  }
  return best_i;
}

// Each row's argmax: x [R, V] fp32 (rows contiguous) -> int64 [R]; the AVX-512 build only (the
// others leave torch's max(-1), which is faster than a scalar loop).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 &&
              x.stride(1) == 1, "x: fp32 [R, V] on CPU, V > 0, each row contiguous");
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * ld, V);
  });
  return out;
}
#endif

// The tensors a decoder layer's step writes, for T rows (x's dtype, fp32: the products take no
// other): its norms' output h [T, hidden], the q|k|v product [T, (H + 2 KVH) D] with q, k
// rotated [T, H, D], [T, KVH, D] and v its view, the attention's output [T, H, D] (and as rows
// [T, H D]), o's product [T, hidden], gate|up's [T, 2 I] and silu(gate) * up [T, I].
struct LayerTensors {
  at::Tensor h, qkv, q, k, v, attended, attended_rows, o, gate_up, act;

  // Their first T rows (views).
  LayerTensors first(int64_t T) const {
    const auto rows = [T](const at::Tensor& a) { return a.narrow(0, 0, T); };
    LayerTensors t;
    t.h = rows(h), t.qkv = rows(qkv), t.q = rows(q), t.k = rows(k), t.v = rows(v);
    t.attended = rows(attended), t.attended_rows = rows(attended_rows), t.o = rows(o);
    t.gate_up = rows(gate_up), t.act = rows(act);
    return t;
  }
};

// What sizes a decoder layer's tensors: its hidden size, the q|k|v product's columns, heads, K/V
// heads and the gate|up product's columns.
struct LayerShape {
  int64_t hidden, qkv, heads, kv_heads, gate_up;
  bool operator==(const LayerShape& o) const {
    return hidden == o.hidden && qkv == o.qkv && heads == o.heads && kv_heads == o.kv_heads &&
           gate_up == o.gate_up;
  }
};

// A pre-norm decoder layer's decode step in one call: what the fast path's blocks call one by one
// (kvserve.models.llama: LlamaDecoderLayer, LlamaAttention and LlamaMLP), in the same order on
// the same arguments, so its outputs equal theirs bit for bit:
//   h = rms_norm(x) (the first layer, whose residual is x) or add_rms_norm(x, residual)
//   q, k, v = rope_qkv(qkv(h));  the cache's slots := k, v;  a = decode(q)
//   h = add_rms_norm(o(a), residual);  out = down(silu_mul_halves(gate_up(h)))
// The products and the attention are other kernels' (kernel_ops.h capsules, held here).
class DecodeLayer {
 public:
  DecodeLayer(at::Tensor w1, double eps1, at::Tensor w2, double eps2, pybind11::object qkv,
              pybind11::object o, pybind11::object gate_up, pybind11::object down, pybind11::object decode,
              int64_t heads, int64_t kv_heads, const std::string& store, std::vector<at::Tensor> cache)
      : w1_(std::move(w1)), w2_(std::move(w2)), eps1_(eps1), eps2_(eps2), heads_(heads), kv_heads_(kv_heads),
        int8_(store == "store_kv_int8"), cache_(std::move(cache)),
        held_{qkv, o, gate_up, down, decode},
        qkv_(kvserve::from_capsule<kvserve::RowsOp>(qkv)), o_(kvserve::from_capsule<kvserve::RowsOp>(o)),
        gate_up_(kvserve::from_capsule<kvserve::RowsOp>(gate_up)),
        down_(kvserve::from_capsule<kvserve::RowsOp>(down)),
        decode_(kvserve::from_capsule<kvserve::DecodeOp>(decode)) {
    TORCH_CHECK(store == "store_kv" || store == "store_kv_int8", "the cache is written by store_kv or "
                "store_kv_int8, not ", store);
    TORCH_CHECK(cache_.size() == (int8_ ? 4u : 2u), store, " writes ", int8_ ? 4 : 2, " cache tensors, not ",
                cache_.size());
    TORCH_CHECK(!int8_ || cache_[0].scalar_type() == at::kChar, "store_kv_int8 writes an int8 cache, not ",
                cache_[0].scalar_type());
    TORCH_CHECK(heads_ > 0 && kv_heads_ > 0 && heads_ % kv_heads_ == 0, "heads (", heads_,
                ") must be a positive multiple of kv_heads (", kv_heads_, ")");
    TORCH_CHECK(w1_.dim() == 1 && w1_.is_contiguous() && w2_.is_contiguous() && w2_.sizes() == w1_.sizes() &&
                w2_.scalar_type() == w1_.scalar_type() && w1_.device().is_cpu() && w2_.device().is_cpu(),
                "the two norms' weights: contiguous CPU [hidden], of one dtype");
    const int64_t qkv_n = qkv_->out_features(), hidden = w1_.size(0);
    TORCH_CHECK(qkv_n % (heads_ + 2 * kv_heads_) == 0 && (qkv_n / (heads_ + 2 * kv_heads_)) % 2 == 0,
                "the q|k|v product's ", qkv_n, " columns are not (heads + 2 kv_heads) heads of an even size");
    TORCH_CHECK(o_->out_features() == hidden && down_->out_features() == hidden &&
                gate_up_->out_features() % 2 == 0, "o and down give hidden (", hidden,
                ") columns, gate|up an even number");
  }

  // x [T, hidden]: the previous layer's output (the embeddings for the first layer, residual
  // None); residual is updated in place. slots [T]: the cache slots of the rows' K/V; tables,
  // lens: each row's block table and context length. Returns this layer's output and the stream.
  std::pair<at::Tensor, at::Tensor> forward(at::Tensor x, c10::optional<at::Tensor> residual,
                                            at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                            at::Tensor tables, at::Tensor lens, int64_t window) const {
    const bool first = !(residual.has_value() && residual->defined());
    const at::Tensor r = first ? x : *residual;
    check_x(x);
    TORCH_CHECK(r.is_contiguous() && r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type(),
                "residual: contiguous, of x's shape and dtype");
    const at::Tensor out = at::empty({x.size(0), down_->out_features()}, x.options());
    step(x, r, first, cos, sin, slots, tables, lens, window, tensors(x.size(0), x.options()), out);
    return {out, r};
  }

  LayerShape shape() const {
    return {w1_.size(0), qkv_->out_features(), heads_, kv_heads_, gate_up_->out_features()};
  }

  at::ScalarType dtype() const { return w1_.scalar_type(); }  // its norms' weights', its input's

  // x as this layer's input: [T, hidden] of its weights' dtype, rows contiguous.
  void check_x(const at::Tensor& x) const { check_norm(x, w1_); }

  // New tensors for a step of T rows (options: x's).
  LayerTensors tensors(int64_t T, const at::TensorOptions& options) const {
    const int64_t hidden = w1_.size(0), qkv_n = qkv_->out_features(), D = qkv_n / (heads_ + 2 * kv_heads_);
    LayerTensors t;
    t.h = at::empty({T, hidden}, options);
    t.qkv = at::empty({T, qkv_n}, options);
    t.q = at::empty({T, heads_, D}, options);
    t.k = at::empty({T, kv_heads_, D}, options);
    t.v = v_of(t.qkv, heads_, kv_heads_);
    t.attended = at::empty({T, heads_, D}, options);
    t.attended_rows = t.attended.view({T, heads_ * D});
    t.o = at::empty({T, hidden}, options);
    t.gate_up = at::empty({T, gate_up_->out_features()}, options);
    t.act = at::empty({T, gate_up_->out_features() / 2}, options);
    return t;
  }

  // forward's step through the tensors t (of x's rows, from tensors()), the output into out [T,
  // hidden]; r (x for the first layer) is the residual stream, updated in place. x is read first
  // and not after, so out may be x.
  void step(const at::Tensor& x, const at::Tensor& r, bool first, const at::Tensor& cos,
            const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens,
            int64_t window, const LayerTensors& t, const at::Tensor& out) const {
    if (first) rms_norm_into(x, w1_, eps1_, t.h);
    else add_rms_norm_into(x, r, w1_, eps1_, t.h);
    qkv_->into(t.h, t.qkv);
    check_qkv(t.qkv, cos, sin, heads_, kv_heads_);
    rope_qkv_into(t.qkv, cos, sin, heads_, kv_heads_, t.q, t.k);
    if (int8_) store_kv_int8(cache_[0], cache_[1], cache_[2], cache_[3], slots, t.k, t.v);
    else store_kv(cache_[0], cache_[1], slots, t.k, t.v);
    decode_->into(t.q, tables, lens, window, t.attended);
    o_->into(t.attended_rows, t.o);
    add_rms_norm_into(t.o, r, w2_, eps2_, t.h);
    gate_up_->into(t.h, t.gate_up);
    silu_mul_halves_into(t.gate_up, t.act);
    down_->into(t.act, out);
  }

 private:
  at::Tensor w1_, w2_;
  double eps1_, eps2_;
  int64_t heads_, kv_heads_;
  bool int8_;
  std::vector<at::Tensor> cache_;
  std::vector<pybind11::object> held_;  // the capsules that own the operations below
  const kvserve::RowsOp *qkv_, *o_, *gate_up_, *down_;
  const kvserve::DecodeOp* decode_;
};

// A step of plain decodes through every decoder layer of a model, each a DecodeLayer, in one
// call: the layers' steps one after the other on the same arguments, each layer's output and
// the residual stream handed to the next, as the model's Python loop hands them (the same
// outputs bit for bit), without a Python call between layers (its frame, the step's metadata
// looked up, eight arguments converted: about 140 us over SmolLM2's 30 layers, docs/weights.md).
//
// The layers write into tensors the stack keeps from step to step, not the ten or so each layer's
// forward makes (each an allocation and a TensorImpl: about 300 a step over 30 layers): one set
// for all the layers of a shape (a model's layers are of one), of the most rows a step has had, a
// step's rows a view of them. A layer's output goes into one kept tensor that the next layer reads
// first (and then overwrites); the last layer's is a new tensor, the caller's to keep.
class DecodeStack {
 public:
  explicit DecodeStack(std::vector<pybind11::object> layers) : held_(std::move(layers)) {
    TORCH_CHECK(!held_.empty(), "a DecodeStack takes one DecodeLayer or more");
    std::vector<LayerShape> shapes;  // one a set of kept tensors
    for (const auto& o : held_) {
      if (!pybind11::isinstance<DecodeLayer>(o))
        throw pybind11::type_error("a DecodeStack takes DecodeLayer objects, not " +
                                   std::string(pybind11::str(pybind11::type::of(o))));
      layers_.push_back(o.cast<const DecodeLayer*>());
      const LayerShape shape = layers_.back()->shape();
      const DecodeLayer& one = *layers_[0];
      TORCH_CHECK(shape.hidden == one.shape().hidden && layers_.back()->dtype() == one.dtype(),
                  "the layers of a stack share one hidden size and dtype, not ", one.shape().hidden, " ",
                  one.dtype(), " and ", shape.hidden, " ", layers_.back()->dtype());
      const auto found = std::find(shapes.begin(), shapes.end(), shape);
      set_.push_back(static_cast<size_t>(found - shapes.begin()));
      if (found == shapes.end()) shapes.push_back(shape);
    }
    kept_.resize(shapes.size());
  }

  // x [T, hidden] (contiguous): the embeddings, which become the residual stream (updated in
  // place); returns the last layer's output and the residual stream. The kept tensors are the
  // stack's own state: the call holds the GIL throughout (nothing here releases it), so no two
  // steps run through one stack at once.
  std::pair<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                            at::Tensor tables, at::Tensor lens, int64_t window) {
    layers_[0]->check_x(x);  // (every layer's weights are of its shape and dtype)
    TORCH_CHECK(x.is_contiguous(), "x: contiguous [T, hidden]");
    const int64_t T = x.size(0);
    if (!y_.defined() || kept_rows() < T) keep(T, x.options());
    std::vector<LayerTensors> sets;
    for (const auto& k : kept_) sets.push_back(k.first(T));
    const at::Tensor between = y_.narrow(0, 0, T), last = at::empty_like(x);
    for (size_t i = 0; i < layers_.size(); ++i)
      layers_[i]->step(i == 0 ? x : between, x, i == 0, cos, sin, slots, tables, lens, window, sets[set_[i]],
                       i + 1 == layers_.size() ? last : between);
    return {last, x};
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // The rows the kept tensors hold (0 before the first step).
  int64_t kept_rows() const { return y_.defined() ? y_.size(0) : 0; }

 private:
  // Kept tensors for T rows, a set for each shape of layer.
  void keep(int64_t T, const at::TensorOptions& options) {
    for (size_t j = 0; j < kept_.size(); ++j) {
      const size_t i = std::find(set_.begin(), set_.end(), j) - set_.begin();  // set j's first layer
      kept_[j] = layers_[i]->tensors(T, options);
    }
    y_ = at::empty({T, layers_[0]->shape().hidden}, options);
  }

  std::vector<pybind11::object> held_;  // the DecodeLayer objects, kept alive here
  std::vector<const DecodeLayer*> layers_;
  std::vector<size_t> set_;  // layer i's kept tensors: kept_[set_[i]]
  std::vector<LayerTensors> kept_;
  at::Tensor y_;  // [rows, hidden]: a layer's output, the next one's input
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] {
#if defined(__AVX512F__)
    return std::string("avx512");
#elif defined(__AVX2__)
    return std::string("avx2");
#else
    return std::string("portable");
#endif
  }, "the instruction-set level this build was compiled for");
  m.def("rms_norm", &rms_norm, "w * x / rms(x) over the last dimension (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then w * residual / rms(residual), in one call (CPU)");
  m.def("rotate_halves", &rotate_halves, "RoPE with the halves of head_dim rotating together (CPU)");
  m.def("rope_qkv", &rope_qkv, "q, k rotated and v from a fused q|k|v product (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (CPU)");
  m.def("silu_mul_halves", &silu_mul_halves, "silu(gate) * up from a fused gate|up product (CPU)");
#if defined(__AVX512F__)
  m.def("argmax_rows", &argmax_rows, "each row's first largest value's index, a NaN the largest (CPU, fp32)");
#endif
  m.def("store_kv", &store_kv, "k, v rows into their cache slots, fp32 rounded into a bf16 cache (CPU)");
  m.def("store_kv_int8", &store_kv_int8,
        "k, v rows quantized into an int8 cache's slots with their scales (CPU)");
  pybind11::class_<DecodeLayer>(m, "DecodeLayer", "a pre-norm decoder layer's decode step in one call (CPU)")
      .def(pybind11::init<at::Tensor, double, at::Tensor, double, pybind11::object, pybind11::object,
                          pybind11::object, pybind11::object, pybind11::object, int64_t, int64_t,
                          const std::string&, std::vector<at::Tensor>>())
      .def("forward", &DecodeLayer::forward);
  pybind11::class_<DecodeStack>(m, "DecodeStack",
                                "a step of plain decodes through every decoder layer in one call (CPU)")
      .def(pybind11::init<std::vector<pybind11::object>>())
      .def("forward", &DecodeStack::forward)
      .def("__len__", &DecodeStack::size)
      .def_property_readonly("kept_rows", &DecodeStack::kept_rows,
                             "the rows of the tensors the stack keeps between steps (0 before the first)");
  m.def("is_decode_layer", [](const pybind11::object& o) { return pybind11::isinstance<DecodeLayer>(o); },
        "whether o is a DecodeLayer of this module (what a DecodeStack takes)");
}
