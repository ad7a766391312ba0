// y = x @ W^T with W in GGUF's Q4_0 / Q4_1 / Q8_0 blocks and x quantized to 8 bits per 32-block,
// the products summed as integers: llama.cpp's Q4 x Q8 and Q8 x Q8 dot products, for one row of
// x (decode) or thousands (prefill, big batches). Unpacking nibbles to floats costs more than
// reading them; an integer dot product takes the nibbles as bytes (AVX-512 VNNI: 64 byte products
// summed by fours in one instruction), and a tile of rows of x reuses each weight it loads.
//
// Activations, per row of x and block b of 32 (what llama.cpp's Q8_1 holds, with dx in fp32):
//   dx = max|x| / 127,  xq = round(x / dx) as int8 (0 where dx is 0),  sumq = sum(xq)
// Weights: Q4_1 w = d q + m, Q4_0 w = d (q - 8), q in 0..15; Q8_0 w = d q, q in -128..127.
// A block contributes
//   Q4_1  d dx S + m dx sumq     Q4_0  d dx (S - 8 sumq)     Q8_0  d dx S      S = sum(q xq), exact
// so the result is the float product of W with the rounded x (each x off by at most dx / 2), up
// to the order of the float sums. kvserve.models.packed.linear_q8_reference is the same in torch.
// The unsigned-times-signed byte products take Q4's q as they are. Q8_0's q are signed: the
// AVX-512 VNNI build takes q + 128 (the sign bit flipped as the bytes are loaded) and subtracts
// 128 sumq from each block's sum, the same integer S; the AVX2 build, whose pairs of byte
// products are summed in int16, takes |q| times x with q's sign. SmolLM2's Q8_0 head [49152 x
// 576] on AMD EPYC Zen 4 (2 threads, medians of 11, outputs equal bit for bit): 8 rows 1.73 ms
// against 2.20 with |q| and the sign, 64 rows 8.38 against 10.74, 256 rows 42.4 against 53.7.
//
// Weight layout ("panels"; GGUF's bytes, reordered once at load): the rows of W go in panels of
// 16, and the panels in pairs (a group of 32 rows; the last padded with zero rows). A group holds
// its two panels block by block: block b of the group is one run of bytes,
//   [panel 0's weights: 256 bytes (Q8_0: 512)][panel 1's weights][d: 16 fp16 of panel 0][of 1]
//   [m: 16 fp16 of panel 0][of 1 (Q4_1 only)]
// (cb = 32 * GGUF's block bytes: 640 for Q4_1, 576 Q4_0, 1088 Q8_0; a multiple of 64), so that a
// thread multiplying a group reads one stream of memory. A panel's block's weight bytes are in
// chunks of 64; chunk c holds, for each of the 16 rows n in turn, GGUF bytes 4c..4c+3 of that
// row's block: for Q4, weights 4c..4c+3 in the low nibbles and 16+4c..16+4c+3 in the high ones;
// for Q8_0, weights 4c..4c+3. One 64-byte load is then four weights of each of 16 rows, a VNNI
// lane sums one output (rows of W are the 16 lanes), and the per-block scales of the 16 rows are
// one vector. The four x bytes a lane meets are the same for every lane: a broadcast.
// The pairs are for memory: with each panel's weights, then its d, then its m apart, a thread
// read several streams at once (six for Q4_1 with AVX-512's two panels a unit). A decode step's
// products of SmolLM2 against that layout (`benchmarks/product_bandwidth.py --against`, paired
// passes, each build its own copy of W, whose pages may cost unequally; 2 threads, AMD EPYC Zen
// 4, outputs equal bit for bit): 1 row of x 0.90-1.10 of the time in five runs, 2 to 16 rows
// 0.96-1.03 in two, 64 rows 0.93-1.00 in six. No change these runs resolve at a few rows; at most
// a few percent less at 64. The AVX2 build (on Zen 4): 1 row 0.97, 4 rows 1.00, 64 rows 1.00.
// Offsets: `Layout`.
//
// Paths: AVX-512 VNNI (a vector is a panel), AVX2 (half a panel; the byte dot product takes two
// instructions), and a portable loop over the same layout (setup.py builds this file once
// per level; `isa()` names the build). Runs of W rows (32 with AVX-512, 16 with AVX2) are split
// over threads (one parallel region: each thread its share of the runs, then the runs left in the
// others' shares as it finishes, parallel_tasks.h); each sweeps x's rows (all of them up to
// 256; past that a task is a run by a chunk of 256 rows), four at a time, so a weight loaded
// serves four rows, and the one to three rows left in one more pass (a tile of that many rows,
// not a pass a row).
//
// AMX-INT8 (the amx build; from 32 rows of x, 16 for Q8_0, where it starts to beat VNNI): a
// panel's block is already a B tile of the int8 tile product (8 rows of 64 bytes, 4 K bytes of
// each of 16 W rows): Q8_0's as it lies, Q4's once its nibbles are bytes (a panel's blocks
// unpacked once for every tile of rows of x; Q4_0's less 8, signed, so that the tile sums are
// S - 8 sumq). An A tile is 16 rows of xq, a block's 32 bytes each: one tdpbssd (tdpbsud for
// Q4_1's unsigned q) gives a block's S for 16 x 16 outputs. The scales change every block, so
// each block's int32 C tile is stored and scaled into fp32 sums (16 vectors, in registers over
// all of K) with the VNNI tile's float operations in its order: both give the same products.
// That store and scaling, not the tile product (half used at K = 32), set the speed: about 1.2
// to 1.5 times VNNI's for Q4 from 32 rows, 2.5 times for Q8_0 (measured when VNNI took Q8_0's
// signed bytes as |q| with q's sign; taken as q + 128 they cost VNNI a fifth less time, and the
// 16 rows from which Q8_0 goes to AMX were not measured again). Whole tiles of 16 rows go to
// AMX, the rows left to VNNI; threads split the panels, four at a time, so that each
// tile of rows is read from L1 for four panels.
//
// The amx build has a second product, linear_bf16_tiles: what a dense bf16 copy of W multiplied
// by bf16 x gives (oneDNN's AMX-BF16 product of the copy), without the copy: each call makes a
// panel's bf16 B tiles from its blocks, scales applied (once for each chunk of rows of x, past
// about 1 MiB of them), and every tile of rows of x reuses them, summing in fp32 tiles over the
// whole of K ("bf16 tiles" below).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor arguments (lighter than torch/extension.h)
#include "kernel_ops.h"
#include "linear_operands.h"
#include "parallel_tasks.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32, kPanel = 16;

constexpr int64_t block_bytes(int64_t fmt) { return fmt == kQ8_0 ? 34 : fmt == kQ4_0 ? 18 : 20; }
// A block's weight bytes in a panel (16 rows), and the bytes of its head (d, and m) in GGUF.
inline int64_t quant_bytes(int64_t fmt) { return fmt == kQ8_0 ? 512 : 256; }
inline int64_t head_bytes(int64_t fmt) { return fmt == kQ4_1 ? 4 : 2; }
inline int64_t panels(int64_t n) { return (n + kPanel - 1) / kPanel; }
constexpr int64_t kGroup = 2 * kPanel;  // W rows a group of two panels holds
inline int64_t groups(int64_t n) { return (n + kGroup - 1) / kGroup; }
// The rows W's panels take, the padding included.
inline int64_t panel_rows(int64_t n) { return groups(n) * kGroup; }

// Where panel p's block b lies (byte offsets from W's first byte; see the header): its weight
// bytes, its 16 d and its 16 m (Q4_1, kDToM bytes after its d). A panel's next block is `cb`
// bytes on.
struct Layout {
  static constexpr int64_t kDToM = 2 * kPanel * 2;  // past both panels' d (16 fp16 each)
  int64_t nb, qb, cb;  // blocks a row, a panel's weight bytes a block, a group's bytes a block
  Layout(int64_t fmt, int64_t K) : nb(K / kBlock), qb(quant_bytes(fmt)), cb(2 * kPanel * block_bytes(fmt)) {}
  int64_t group(int64_t g, int64_t b) const { return (g * nb + b) * cb; }  // group g's block b
  int64_t weights(int64_t p, int64_t b) const { return group(p / 2, b) + p % 2 * qb; }
  int64_t d(int64_t p, int64_t b) const { return group(p / 2, b) + 2 * qb + p % 2 * 32; }
  int64_t m(int64_t p, int64_t b) const { return d(p, b) + kDToM; }
};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Vectors whose new elements are left unwritten (std::allocator's value-initialize them): a
// call's quantized x is written whole before it is read, and zeroing it first had cost 1.25% of
// a prefill step of 2048 tokens (memset, perf: 3 MB a product at K = 1536).
template <typename T>
struct Unwritten : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Unwritten<U>;
  };
  Unwritten() = default;
  template <typename U>
  Unwritten(const Unwritten<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using Buffer = std::vector<T, Unwritten<T>>;

// x [M, K] quantized per block: xq [M, K] int8 (x's order), dx, sumq and dx * sumq [M, nb].
struct QuantizedX {
  int64_t rows = 0;  // M
  Buffer<int8_t> xq;
  Buffer<float> dx, sx;
  Buffer<int32_t> sumq;
  Buffer<float> dx_tiles, sx_tiles;  // AMX only: dx and sx by tiles of 16 rows, [M / 16, nb, 16]
};

#if defined(__AVX512VNNI__)
// The vector build's primitives: 16 int32 lanes, one panel a vector; a byte dot product sums
// four u8 x s8 products a lane (vpdpbusd).
struct V {
  using I = __m512i;
  using F = __m512;
  static constexpr int kLanes = 16, kRows = 4, kCols = 2;  // a tile: rows of x, vectors of W rows
  static constexpr int kUnit = 2;  // vectors of W rows a thread takes at a time
  static constexpr int kSplitTiles = 6;  // tiles of up to 6 vectors keep two sums a block
  static constexpr int64_t kPrefetchMinRows = 2;  // a single row asks for no panels ahead (below)
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I low(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static I high(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  static I zero() { return _mm512_setzero_si512(); }
  static I dot(I acc, I u8, I s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
  // a block's Q4 sums: the same dot products, whole in int32 already
  static I dot_q4(I acc, I u8, I s8) { return dot(acc, u8, s8); }
  static I finish_q4(I acc) { return acc; }
  static I add_q4(I a, I b) { return _mm512_add_epi32(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  // Q8_0's signed q taken as q + 128 (its sign bit flipped as loaded: unsigned), multiplied as
  // they come and 128 sumq taken off each block's sum (as Q4_0's 8 sumq): the same integer S with
  // one dot product instead of three instructions (vpdpbusd sums four products to int32, nothing
  // to saturate: at most 32 * 255 * 127). Measured in the header.
  static constexpr bool kQ8Biased = true;
  static I q8(I w) { return _mm512_xor_si512(w, _mm512_set1_epi8(-128)); }
  static I dot_q8(I acc, I w, I x) { return dot(acc, w, x); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F tofloat(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};

// One block of 32: xq, and (dx, sumq) returned.
inline float quantize_block(const float* xb, int8_t* q, int32_t* sumq) {
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m512 s = _mm512_set1_ps(inv);
  // cvtps rounds to nearest even, as std::nearbyint does under the default rounding mode; the
  // bytes and their sum agree, within -127..127, whatever x holds (inf, NaN, a subnormal max)
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i qa = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(a, s))));
  const __m512i qb = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(b, s))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sumq = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return d;
}
#elif defined(__AVX2__)
// 8 int32 lanes, half a panel a vector; the byte dot product is two instructions: u8 x s8 pairs
// summed to int16 (at most 2 * 15 * 127, no saturation), then pairs of those to int32.
struct V {
  using I = __m256i;
  using F = __m256;
  static constexpr int kLanes = 8, kRows = 4, kCols = 1;  // 16 registers: 4 x 1 tiles
  static constexpr int kUnit = 2;  // a panel; single rows take both vectors at once
  static constexpr int kSplitTiles = 0;  // 16 registers: one sum a block
  static constexpr int64_t kPrefetchMinRows = 1;  // a single row asks too (measured before the pairs)
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I low(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  static I high(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I dot(I acc, I u8, I s8) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
  }
  // a block's Q4 sums kept in int16 lanes (pairs of products, at most 2 * 15 * 127 = 3810; eight
  // of them 30480) and widened once a block: 9 multiplying instructions instead of 16
  static I dot_q4(I acc, I u8, I s8) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u8, s8)); }
  static I finish_q4(I acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
  // the two halves of a block's Q4 sums, still in int16 (at most 30480 together)
  static I add_q4(I a, I b) { return _mm256_add_epi16(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  // s8 x s8: |w| (at most 128) as the unsigned side, so pairs stay within int16 (q + 128 would
  // not: two products of 255 * 127 saturate the int16 pair sum)
  static constexpr bool kQ8Biased = false;
  static I q8(I w) { return w; }
  static I dot_q8(I acc, I w, I x) { return dot(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w)); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F tofloat(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

inline float quantize_block(const float* xb, int8_t* q, int32_t* sumq) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m256 s = _mm256_set1_ps(inv);
  __m256i qi[4];
  // nearest even, within -127..127 (bytes and sum agree whatever x holds)
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int i = 0; i < 4; ++i)
    qi[i] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], s))));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  // packs work within 128-bit halves: put the four-value groups back in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
  *sumq = _mm_cvtsi128_si32(s4);
  return d;
}
#else
inline float quantize_block(const float* xb, int8_t* q, int32_t* sumq) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const float f = xb[j] * inv;  // within -127..127 (NaN to -127) before it is an integer
    const int v = static_cast<int>(std::nearbyint(f > 127.f ? 127.f : f >= -127.f ? f : -127.f));
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *sumq = sum;
  return d;
}
#endif

// x [M, K] quantized into q (its buffers resized: kept where they are large enough).
void quantize_into(QuantizedX& q, const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  q.rows = M;
  q.xq.resize(M * K);
  q.dx.resize(M * nb);
  q.sx.resize(M * nb);
  q.sumq.resize(M * nb);
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float d = quantize_block(x + i * kBlock, q.xq.data() + i * kBlock, &q.sumq[i]);
      q.dx[i] = d;
      q.sx[i] = d * static_cast<float>(q.sumq[i]);
    }
  });
}

// The quantized x of a call of a few rows, kept by the calling thread between calls: a decode
// step makes about 120 products of one row, and four heap allocations each (then zeroed, as
// vectors were) had cost more than quantizing the row. Up to kKeptX values of x (113 rows of 576, 42
// of 1536); more rows get vectors of their own, freed after the call. A thread runs one product
// at a time, so its kept x is never in use twice. A decode step's products against vectors made each call
// (`benchmarks/product_bandwidth.py --against`, 30 paired passes, AMD EPYC Zen 4, 2 threads):
// 0.989 of the time at 1 row, 0.994 at 4 (qkv and o 1.5-2% less, within one run's noise).
constexpr int64_t kKeptX = 1 << 16;
QuantizedX& kept_x() {
  thread_local QuantizedX q;
  return q;
}

// Where rows of W go in y: `count` columns of an output row from n0, clipped at N, plus bias.
struct Out {
  float* y;
  const float* bias;
  int64_t N;

  // Row m from column n0: `count` values (clipped at N) plus the bias (AVX-512: a vector at a
  // time; a loop of scalars nearly doubled the bf16 tiles' time at 512 rows).
  void store(int64_t m, int64_t n0, const float* v, int64_t count) const {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j < count && n0 + j < N; j += 16) {
      const int64_t left = std::min<int64_t>(count - j, N - n0 - j);
      const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + j) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(y + m * N + n0 + j, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, v + j), b));
    }
#endif
    for (; j < count && n0 + j < N; ++j) y[m * N + n0 + j] = v[j] + (bias ? bias[n0 + j] : 0.f);
  }
  Out from_row(int64_t m) const { return {y + m * N, bias, N}; }
};

#if defined(__AVX2__)
// How far ahead of the panels it reads a tile of a few rows of x asks for W (software prefetch):
// those rows stream W, a byte of it serving few rows, so each core reads it at the rate of its
// memory, and more lines in flight than the hardware prefetcher keeps help.
// Two groups (four panels, 23 KB of Q4_1 at K = 576) cover the latency from memory at ~25 GB/s a
// core.
// The lines go to L2 (the T1 hint), not L1, whose outstanding misses they would fill: one batch-1
// decode step's products of SmolLM2 (30 layers and the head, out of DRAM, 2 threads, AMD EPYC
// Zen 4) took 3.98 ms against 5.10 with the T0 hint (three rows of x: 5.04 against 6.78); two
// and six panels ahead gave the same as four (those figures, and the ones below, are from panels
// that lay apart: each panel's weights, then its scales).
constexpr int64_t kPrefetchGroups = 2;
// Up to how many rows of x the tiles ask for the panels ahead. A decode step's products of SmolLM2
// (2 threads, Zen 4, benchmarks/product_bandwidth.py) at 4 / 6 / 8 / 12 / 16 / 32 rows of x took
// 6.3-7.3 / 7.7 / 8.6-9.3 / 14.1-16.5 / 11.8-14.5 / 19.8-23.1 ms where only tiles of one to three
// rows asked, and 4.1-4.9 / 5.8 / 5.6-6.5 / 7.4-8.2 / 9.6-10.8 / 19.2-20.0 with every tile asking
// in turn (one row: 3.7-4.5). From 48 rows on, whose tiles compute many times longer than W takes
// to read, asking changed nothing beyond the noise (48 to 128 rows, three interleaved runs); 33 to
// 47 were not measured. (The AMX build's rows left after its tiles of 16, fewer than 16, ask too.)
// With the panels in pairs (one stream a thread), AVX-512 asks from 2 rows (V::kPrefetchMinRows):
// at 1 row asking took 1.03 of the time of not asking (one run, within the spread of runs), and
// at 16 rows not asking took 1.125 of the time of the panels apart (the head 1.35) where asking
// took 0.95-1.00; 2 rows 0.94 asking, 0.98 not (one run each); 4 to 32 not measured again. The
// AVX2 build still asks at 1 row (30 layers of a single row: 3.1 -> 2.0 ms on a Zen 3 EPYC with
// the panels apart; not measured there since).
constexpr int64_t kPrefetchRows = 32;

// Block b of the group kPrefetchGroups after group g: over the nb blocks of a tile, exactly that
// group, each line once.
// Always inlined: a function whose only effect is a prefetch has no side effects to GCC, which
// deletes calls to it where it is not inlined (it did so to paged_attention.cpp's helpers).
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* w, const Layout& L, int64_t g,
                                                         int64_t b) {
  const uint8_t* at = w + L.group(g + kPrefetchGroups, b);
  for (int64_t o = 0; o < L.cb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(at + o), _MM_HINT_T1);
}

// Rows m0..m0+MR of x times the NV vectors of W rows from row n0 (a multiple of the lanes).
// Row n's bytes sit in panel n / 16 at lane n % 16: 4 bytes a chunk, 2 of each scale.
template <int FMT, int MR, int NV>
inline void tile(const uint8_t* w, const QuantizedX& q, int64_t m0, int64_t K, const Out& out, int64_t n0) {
  const Layout L(FMT, K);
  const int64_t nb = L.nb, cb = L.cb;
  const uint8_t *col[NV], *scale[NV];  // block 0's nibbles and d of each vector's lanes
  for (int v = 0; v < NV; ++v) {
    const int64_t n = n0 + v * V::kLanes;
    col[v] = w + L.weights(n / kPanel, 0) + n % kPanel * 4;
    scale[v] = w + L.d(n / kPanel, 0) + n % kPanel * 2;
  }
  // Where x has V::kPrefetchMinRows to kPrefetchRows rows, the tiles of its rows over these panels
  // ask for the group ahead (the tiles from a group's first row, for the whole group; none past
  // W's last group), by turns: the tile of rows m0.. for the blocks b with b % tiles == m0 / kRows, so that
  // the lines are asked for while every tile computes, not only while the first one reads.
  const int64_t tiles = std::max<int64_t>(1, (q.rows + V::kRows - 1) / V::kRows), turn = m0 / V::kRows;
  const bool ahead = n0 % kGroup == 0 && q.rows >= V::kPrefetchMinRows && q.rows <= kPrefetchRows &&
                     n0 / kGroup + kPrefetchGroups < groups(out.N);
  // two sums a block (weights 0..15 and 16..31) halve the chains of dependent dot products
  // where the registers hold them: two and three rows of x take a third less time (AVX-512)
  constexpr bool kSplit = MR * NV <= V::kSplitTiles;
  typename V::F acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = V::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    constexpr int kSums = kSplit ? 2 : 1;
    typename V::I S[kSums][MR][NV];
    for (int h = 0; h < kSums; ++h)
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < NV; ++v) S[h][m][v] = V::zero();
    if (ahead && b % tiles == turn) prefetch_ahead(w, L, n0 / kGroup, b);
    for (int c = 0; c < 4; ++c) {
      // weights 4c..4c+3 and 16+4c..16+4c+3 of the block: nibbles of one load, or two loads
      typename V::I lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) {
        if (FMT == kQ8_0) {
          lo[v] = V::q8(V::load(col[v] + b * cb + c * 64));
          hi[v] = V::q8(V::load(col[v] + b * cb + (c + 4) * 64));
        } else {
          const typename V::I bytes = V::load(col[v] + b * cb + c * 64);
          lo[v] = V::low(bytes);
          hi[v] = V::high(bytes);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* xb = q.xq.data() + (m0 + m) * K + b * kBlock;
        int32_t xl, xh;
        std::memcpy(&xl, xb + 4 * c, 4);
        std::memcpy(&xh, xb + 16 + 4 * c, 4);
        const typename V::I bl = V::set1(xl), bh = V::set1(xh);
        for (int v = 0; v < NV; ++v) {
          typename V::I &sl = S[0][m][v], &sh = S[kSums - 1][m][v];
          sl = FMT == kQ8_0 ? V::dot_q8(sl, lo[v], bl) : V::dot_q4(sl, lo[v], bl);
          sh = FMT == kQ8_0 ? V::dot_q8(sh, hi[v], bh) : V::dot_q4(sh, hi[v], bh);
        }
      }
    }
    typename V::F d[NV], mn[NV];
    for (int v = 0; v < NV; ++v) {
      d[v] = V::halves(scale[v] + b * cb);
      mn[v] = FMT == kQ4_1 ? V::halves(scale[v] + b * cb + Layout::kDToM) : V::zerof();
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * nb + b;
      const typename V::F dx = V::set1f(q.dx[at]), sx = V::set1f(q.sx[at]);
      // what the q's offset adds to S: Q4_0's 8 sumq, biased Q8_0's 128 sumq
      constexpr bool kOffset = FMT == kQ4_0 || (FMT == kQ8_0 && V::kQ8Biased);
      const typename V::I offset_sumq = V::set1((FMT == kQ4_0 ? 8 : 128) * q.sumq[at]);
      for (int v = 0; v < NV; ++v) {
        typename V::I sum = S[0][m][v];
        if constexpr (kSplit) sum = FMT == kQ8_0 ? V::add(sum, S[1][m][v]) : V::add_q4(sum, S[1][m][v]);
        const typename V::I whole = FMT == kQ8_0 ? sum : V::finish_q4(sum);
        const typename V::I s = kOffset ? V::sub(whole, offset_sumq) : whole;
        acc[m][v] = V::fma(V::tofloat(s), V::mul(d[v], dx), acc[m][v]);
        if (FMT == kQ4_1) acc[m][v] = V::fma(mn[v], sx, acc[m][v]);
      }
    }
  }
  float vals[V::kLanes];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      V::store(vals, acc[m][v]);
      out.store(m0 + m, n0 + v * V::kLanes, vals, V::kLanes);
    }
}
constexpr int kLanes = V::kLanes, kRowTile = V::kRows, kColTile = V::kCols, kUnit = V::kUnit;
#else
// The portable loop: one panel a vector.
template <int FMT, int MR, int NV>
inline void tile(const uint8_t* w, const QuantizedX& q, int64_t m0, int64_t K, const Out& out, int64_t n0) {
  const Layout L(FMT, K);
  const int64_t nb = L.nb, cb = L.cb;
  for (int r = 0; r < NV; ++r) {
    const uint8_t *p = w + L.weights(n0 / kPanel + r, 0), *scales = w + L.d(n0 / kPanel + r, 0);
    float acc[MR][kPanel] = {};
    for (int64_t b = 0; b < nb; ++b) {
      int32_t S[MR][kPanel] = {};
      for (int c = 0; c < 4; ++c)
        for (int n = 0; n < kPanel; ++n)
          for (int t = 0; t < 4; ++t) {
            const uint8_t byte = p[b * cb + c * 64 + n * 4 + t];
            // the weights meeting x[4c + t] and x[16 + 4c + t]
            const int32_t lo = FMT == kQ8_0 ? static_cast<int8_t>(byte) : byte & 15;
            const int32_t hi =
                FMT == kQ8_0 ? static_cast<int8_t>(p[b * cb + (c + 4) * 64 + n * 4 + t]) : byte >> 4;
            for (int m = 0; m < MR; ++m) {
              const int8_t* xb = q.xq.data() + (m0 + m) * K + b * kBlock;
              S[m][n] += lo * xb[4 * c + t] + hi * xb[16 + 4 * c + t];
            }
          }
      const uint8_t* d = scales + b * cb;
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (m0 + m) * nb + b;
        for (int n = 0; n < kPanel; ++n) {
          int32_t s = S[m][n];
          if (FMT == kQ4_0) s -= 8 * q.sumq[at];
          acc[m][n] += static_cast<float>(s) * (half_at(d + 2 * n) * q.dx[at]);
          if (FMT == kQ4_1) acc[m][n] += half_at(d + Layout::kDToM + 2 * n) * q.sx[at];
        }
      }
    }
    for (int m = 0; m < MR; ++m) out.store(m0 + m, n0 + r * kPanel, acc[m], kPanel);
  }
}
constexpr int kLanes = kPanel, kRowTile = 4, kColTile = 1, kUnit = 2;
#endif

// Rows m_begin..m_end of x times NV vectors of W rows from n0: kRowTile rows at a time by
// kColTile vectors; the one to three rows left in one more pass (a single row by all NV at once).
template <int FMT, int NV>
void sweep_rows(const uint8_t* w, const QuantizedX& q, int64_t m_begin, int64_t m_end, int64_t K,
                const Out& out, int64_t n0) {
  static_assert(NV % kColTile == 0 || NV < kColTile, "a unit is whole tiles");
  constexpr int kTile = NV < kColTile ? NV : kColTile;
  int64_t m0 = m_begin;
  for (; m0 + kRowTile <= m_end; m0 += kRowTile)
    for (int v = 0; v < NV; v += kTile) tile<FMT, kRowTile, kTile>(w, q, m0, K, out, n0 + v * kLanes);
  static_assert(kRowTile == 4, "the rows left are one to three");
  switch (m_end - m0) {
    case 1: tile<FMT, 1, NV>(w, q, m0, K, out, n0); break;
    case 2: for (int v = 0; v < NV; v += kTile) tile<FMT, 2, kTile>(w, q, m0, K, out, n0 + v * kLanes); break;
    case 3: for (int v = 0; v < NV; v += kTile) tile<FMT, 3, kTile>(w, q, m0, K, out, n0 + v * kLanes); break;
    default: break;
  }
}

// Rows of x a task sweeps where x has more (a multiple of kRowTile). A task that swept every row
// read all of x for each run of W rows: 1.2 MB at 2048 rows of 576, more than a core's L2 here,
// so from L3 each time, and the last task of a call (0.27 ms at 2048 rows) left the other thread
// waiting. With tasks of a run by 256 rows, x's rows stay in L2 across the runs of one thread's
// tasks and the threads finish within a smaller task of each other. SmolLM2's four Q4_1
// products of a layer (K = 576 and 1536; AMD EPYC Zen 4, 2 threads, each the median of 5-9
// calls): 2048 rows 26.5 ms against 27.5 with every row a task's, 512 rows 6.16 against 6.43;
// 64 rows unchanged. (At K = 8192 a chunk's x is 2 MB: not measured.)
constexpr int64_t kChunkRows = 256;
static_assert(kChunkRows % kRowTile == 0, "a chunk's rows are whole tiles but in the last one");

template <int FMT>
void linear_fmt(const QuantizedX& q, const uint8_t* w, const Out& out, int64_t M, int64_t K) {
  const int64_t vectors = panels(out.N) * kPanel / kLanes;
  const int64_t units = (vectors + kUnit - 1) / kUnit;
  // a few rows stream the weights: ranges of at least several units; many rows compute
  const int64_t grain = M <= 8 ? 4 : 1;
  // Units taken by the threads as they finish (parallel_stealing), not a fixed share each: with
  // fixed shares the two threads of a batch-1 decode step's calls ended 1.1-3.8 us apart on
  // average (53 us for the head; timestamps at each thread's end, a build instrumented for it).
  // A decode step's products of SmolLM2 against the fixed split (2 threads, AMD EPYC Zen 4,
  // `benchmarks/product_bandwidth.py --against`, each run the median of 20-30 paired passes;
  // outputs equal), time over the fixed split's: 1 row of x 0.93-1.02 in nine runs (median
  // 0.99: within one run's noise), 4 rows 0.95-0.99, 16 rows 0.97-1.00, 64 rows 0.93-1.00
  // (six runs each), 512 rows 0.98 (one); measured before the chunks of rows below.
  // Past kChunkRows rows a task is a unit by a chunk of rows, the units of a chunk consecutive.
  const int64_t chunks = M > kChunkRows ? (M + kChunkRows - 1) / kChunkRows : 1;
  const int64_t chunk_rows = chunks > 1 ? kChunkRows : M;
  kvserve::parallel_stealing(units * chunks, grain, [&](int64_t task) {
    const int64_t u = task % units, m_begin = task / units * chunk_rows;
    const int64_t m_end = std::min(M, m_begin + chunk_rows), v0 = u * kUnit;
    if (v0 + kUnit <= vectors) {
      sweep_rows<FMT, kUnit>(w, q, m_begin, m_end, K, out, v0 * kLanes);
    } else {
      for (int64_t v = v0; v < vectors; ++v) sweep_rows<FMT, 1>(w, q, m_begin, m_end, K, out, v * kLanes);
    }
  });
}

#if defined(__AMX_INT8__)
constexpr int64_t kTileRows = 16;  // rows of x an A tile holds

// Buffers of tiles start on a cache line: a tile row that straddles two loads at a third of the
// speed (measured: 13 ns a tdpbf16ps with its B tile load, 5 aligned; the int8 tiles' unpacked
// Q4 blocks, aligned, 5-12% less time a product).
struct FreeAligned {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using TileBuffer = std::unique_ptr<T[], FreeAligned>;
template <typename T>
TileBuffer<T> tile_buffer(int64_t count) {
  const size_t bytes = (count * sizeof(T) + 63) / 64 * 64;
  TileBuffer<T> buf(static_cast<T*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64))));
  TORCH_CHECK(buf, "out of memory for ", bytes, " bytes of tiles");
  return buf;
}
constexpr int64_t kAmxPanels = 4;  // panels unpacked together, each tile of rows times all four

// From this many rows of x the AMX tiles run; below, the VNNI path (measured: see the header).
constexpr int64_t amx_min_rows(int fmt) { return fmt == kQ8_0 ? 16 : 32; }

// Linux gives a process the tiles' state (8 KB a thread, saved at each switch) only when asked;
// a refusal (an old kernel, a sandbox) leaves the VNNI path. Asked once a process: torch's
// oneDNN may have asked already, and asking again is harmless.
bool amx_allowed() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
  static const bool allowed = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
  return allowed;
}

// ldtilecfg's 64 bytes: palette 1, then each tile's bytes a row and its rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0, 1: C, 16 x 16 int32; 2, 3: A, 16 rows of x by a block's 32 bytes; 4, 5: B, a block of
// 16 W rows, 8 rows of 64 bytes (4 K bytes of each W row). Two sets (C, A, B), one for each block
// of a pair: tiles are not renamed, so a block's tiles wait only for those of two blocks back.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) {
    cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.rows[2 + t] = kTileRows, cfg.colsb[2 + t] = kBlock;
    cfg.rows[4 + t] = 8, cfg.colsb[4 + t] = 64;
  }
  asm volatile("" ::: "memory");  // the intrinsic tells the compiler it reads 8 bytes, not 64
  _tile_loadconfig(&cfg);
}

// A panel's B tiles: block b's at p + b * stride.
struct BTiles {
  const uint8_t* p;
  int64_t stride;
};

// A panel's blocks as B tiles (block 0's weight bytes at `qs`, a block `cb` bytes after the one
// before): Q8_0's bytes are tiles as they lie; Q4's nibbles become bytes in `buf` (a block's tile
// at b * 512), chunk c's low ones (K 4c..4c+3) tile row c, its high ones (K 16+4c..) row 4 + c,
// and Q4_0's less 8 (signed), so that its tile sums are S - 8 sumq.
template <int FMT>
BTiles b_tiles(const uint8_t* qs, int64_t nb, int64_t cb, uint8_t* buf) {
  if (FMT == kQ8_0) return {qs, cb};
  const __m512i offset = _mm512_set1_epi8(FMT == kQ4_0 ? 8 : 0);
  for (int64_t b = 0; b < nb; ++b)
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes = V::load(qs + b * cb + c * 64);
      _mm512_storeu_si512(buf + b * 512 + c * 64, _mm512_sub_epi8(V::low(bytes), offset));
      _mm512_storeu_si512(buf + b * 512 + (c + 4) * 64, _mm512_sub_epi8(V::high(bytes), offset));
    }
  asm volatile("" ::: "memory");  // tileloadd's intrinsic does not tell the compiler it reads memory
  return {buf, 512};
}

// The tile instructions name their tiles in the instruction itself (the intrinsics paste the
// number in): one of these for each C tile. Only Q4_1's q stay unsigned.
#define KVSERVE_TILE_DOT(FMT, C, A, B) \
  do {                                 \
    _tile_zero(C);                     \
    if constexpr (FMT == kQ4_1)        \
      _tile_dpbsud(C, A, B);           \
    else                               \
      _tile_dpbssd(C, A, B);           \
  } while (0)

// One block's int32 sums, 16 rows of x (xq from `a`, rows K bytes apart) by 16 W rows (the B
// tile at `bt`), into C tile T through A tile 2 + T and B tile 4 + T.
template <int FMT, int T>
inline void block_dot(const int8_t* a, int64_t K, const uint8_t* bt) {
  if constexpr (T == 0) {
    _tile_loadd(2, a, K);
    _tile_loadd(4, bt, 64);
    KVSERVE_TILE_DOT(FMT, 0, 2, 4);
  } else {
    _tile_loadd(3, a, K);
    _tile_loadd(5, bt, 64);
    KVSERVE_TILE_DOT(FMT, 1, 3, 5);
  }
}
#undef KVSERVE_TILE_DOT

// Blocks b and b + 1 (where there is one) into c[0] and c[1]: both products started before
// either is stored, so that their latencies overlap.
template <int FMT>
inline void pair_sums(const int8_t* a, int64_t K, const BTiles& bt, int64_t b, int64_t nb,
                      int32_t (&c)[2][kTileRows * kPanel]) {
  const bool two = b + 1 < nb;
  block_dot<FMT, 0>(a + b * kBlock, K, bt.p + b * bt.stride);
  if (two) block_dot<FMT, 1>(a + (b + 1) * kBlock, K, bt.p + (b + 1) * bt.stride);
  _tile_stored(0, c[0], 64);
  if (two) _tile_stored(1, c[1], 64);
}

// dx and sx of a tile of rows side by side for each block: a block's scaling reads one line,
// and the blocks are stepped through by one pointer, not sixteen.
void tile_scales(QuantizedX& q, int64_t rows, int64_t nb) {
  q.dx_tiles.resize(rows * nb);
  q.sx_tiles.resize(rows * nb);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = (m / kTileRows * nb + b) * kTileRows + m % kTileRows;
      q.dx_tiles[at] = q.dx[m * nb + b];
      q.sx_tiles[at] = q.sx[m * nb + b];
    }
}

// Block b's sums `c` times their scales into acc (a row of x a vector; dx and sx the tile's
// block b; the panel's d of block 0 at `scales`, a block's `cb` bytes after the one before): the
// VNNI tile's float operations in its order, so both paths give the same products.
template <int FMT>
inline void scale_block(const int32_t* c, const float* dx, const float* sx, const uint8_t* scales, int64_t cb,
                        int64_t b, __m512 (&acc)[kTileRows]) {
  const __m512 d = V::halves(scales + b * cb);
  const __m512 mn = FMT == kQ4_1 ? V::halves(scales + b * cb + Layout::kDToM) : V::zerof();
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    const __m512i sums = V::load(reinterpret_cast<const uint8_t*>(c + r * kPanel));
    acc[r] = V::fma(V::tofloat(sums), V::mul(d, V::set1f(dx[r])), acc[r]);
    if (FMT == kQ4_1) acc[r] = V::fma(mn, V::set1f(sx[r]), acc[r]);
  }
}

// Rows m0..m0+15 of x times a panel's 16 rows (W rows from n0), whose B tiles lie at `bt` and
// scales at `scales` (block 0's d; a block's `cb` bytes after the one before). A pair of blocks
// is scaled while the next pair's tiles run (vector loads of a tile store's sums wait for it to
// reach memory: they read sums stored a pair earlier).
template <int FMT>
void amx_tile(const BTiles& bt, const uint8_t* scales, int64_t cb, const QuantizedX& q, int64_t m0, int64_t K,
              const Out& out, int64_t n0) {
  const int64_t nb = K / kBlock;
  const int8_t* a = q.xq.data() + m0 * K;
  const float *dx = q.dx_tiles.data() + m0 * nb, *sx = q.sx_tiles.data() + m0 * nb;
  alignas(64) int32_t c[2][2][kTileRows * kPanel];  // [pair % 2][block % 2]
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (auto& v : acc) v = V::zerof();
  pair_sums<FMT>(a, K, bt, 0, nb, c[0]);
  for (int64_t b = 0; b < nb; b += 2) {
    const int64_t pair = b / 2 % 2;
    if (b + 2 < nb) pair_sums<FMT>(a, K, bt, b + 2, nb, c[1 - pair]);
    scale_block<FMT>(c[pair][0], dx + b * kTileRows, sx + b * kTileRows, scales, cb, b, acc);
    if (b + 1 < nb)
      scale_block<FMT>(c[pair][1], dx + (b + 1) * kTileRows, sx + (b + 1) * kTileRows, scales, cb, b + 1,
                       acc);
  }
  // stored whole first: acc stays in registers only if every index into it is a constant
  float vals[kTileRows][kPanel];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) V::store(vals[r], acc[r]);
  for (int r = 0; r < kTileRows; ++r) out.store(m0 + r, n0, vals[r], kPanel);
}

// Panels split over threads, each of which sets up its own tiles (their state is per thread).
// kAmxPanels panels at a time: their Q4 blocks unpacked once for all the tiles of rows of x, and
// each tile of rows times every one of them while its xq is in L1 (a fifth less time at
// 2048 rows, where xq outgrows L2).
template <int FMT>
void linear_amx(const QuantizedX& q, const uint8_t* w, const Out& out, int64_t M, int64_t K) {
  const Layout L(FMT, K);
  const int64_t nb = L.nb, np = panels(out.N);
  at::parallel_for(0, np, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    const TileBuffer<uint8_t> buf = tile_buffer<uint8_t>(FMT == kQ8_0 ? 0 : kAmxPanels * nb * 512);
    BTiles bt[kAmxPanels];
    for (int64_t p0 = begin; p0 < end; p0 += kAmxPanels) {
      const int64_t count = std::min(kAmxPanels, end - p0);
      for (int64_t g = 0; g < count; ++g)
        bt[g] = b_tiles<FMT>(w + L.weights(p0 + g, 0), nb, L.cb, buf.get() + g * nb * 512);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows)
        for (int64_t g = 0; g < count; ++g)
          amx_tile<FMT>(bt[g], w + L.d(p0 + g, 0), L.cb, q, m0, K, out, (p0 + g) * kPanel);
    }
    _tile_release();
  });
}

// Rows of x by whole tiles of 16 on AMX (M of them, a multiple of 16).
template <int FMT>
void amx_rows(const float* x, const uint8_t* w, const Out& out, int64_t M, int64_t K) {
  QuantizedX q;
  quantize_into(q, x, M, K);
  tile_scales(q, M, K / kBlock);
  linear_amx<FMT>(q, w, out, M, K);
}
#endif

#if defined(__AMX_BF16__)
// bf16 tiles (linear_bf16_tiles): the product a dense bf16 copy of W gives (each weight d q (+ m)
// in fp32 rounded once to bf16, times x rounded to bf16, summed in fp32), made without the copy.
// A panel's weights are dequantized into AMX-BF16 B tiles once a call (once a chunk of rows of
// x, past about 1 MiB of them: chunk_rows), which every tile of rows of x then reuses: the
// scales are applied while dequantizing, so the fp32 C tiles sum over the whole of K and are
// stored once, unlike the int8 tiles' store and rescale every block.
//
// A B tile is a block of 32 K values of a panel's 16 W rows, in pairs of K (what tdpbf16ps
// multiplies): row k2 holds, for each W row n, its bf16 weights 2 k2 and 2 k2 + 1 side by side:
//   tile row k2: [n0: w(2k2) w(2k2+1)][n1: w(2k2) w(2k2+1)] ... [n15: ...]   (64 bytes)
// so a panel's tiles, block after block, are its weights as [K / 2][16][2] bf16.
//
// Threads take pairs of panels (2 x 2 C tiles: two tiles of rows of x by two panels). The tile
// products run on the AMX unit while the vector units are free, so the next pair's blocks are
// dequantized between them, a few after each step of K, and a finished C tile pair's rows are
// stored the same way: at 64 rows the dequantizing (about 0.2 cycles a weight, a fixed cost of
// each call) then mostly hides behind the products instead of adding to them.
constexpr int64_t kPairTile = kBlock * kPanel;  // bf16 values in a B tile

// [0, 16, 1, 17, ...]: the words of (16 even weights, 16 odd ones) as 16 pairs.
inline __m512i pair_order() {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(order);
}

// The weights at K 2 k2 (`even`) and 2 k2 + 1 (`odd`) of 16 W rows, a lane a row, rounded to
// bf16 to nearest even (vcvtne2ps2bf16, as torch's .to(torch.bfloat16)) into tile row k2.
inline void pair_row(__m512 even, __m512 odd, __m512i order, uint16_t* row) {
  const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // even's 16 words, then odd's
  _mm512_storeu_si512(row, _mm512_permutexvar_epi16(order, words));
}

// Codes (int32, a lane a W row) -> weights. d q is exact in fp32 (an fp16 d times a code of at
// most 8 bits needs 19 of its 24 bits), so one fused multiply-add rounds only the sum, as torch's
// d * q + m does; Q4_0's d (q - 8) is d q + (-8 d), exact too.
inline __m512 weights(__m512i q, __m512 d, __m512 offset) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, offset); }

// One block of a panel (its weight bytes at `qs`; a chunk c of 64 bytes holds bytes 4c..4c+3 of
// each W row, a dword a row) -> its B tile. Q4: byte j's low nibble is K j, its high one 16 + j;
// Q8_0: byte j is K j, signed.
template <int FMT>
void dequantize_block(const uint8_t* qs, __m512 d, __m512 offset, __m512i order, uint16_t* tile) {
  if constexpr (FMT == kQ8_0) {
    for (int c = 0; c < 8; ++c) {
      const __m512i v = V::load(qs + c * 64);
      __m512 w[4];
      for (int i = 0; i < 4; ++i) w[i] = weights(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24), d, offset);
      pair_row(w[0], w[1], order, tile + 2 * c * 32);
      pair_row(w[2], w[3], order, tile + (2 * c + 1) * 32);
    }
  } else {
    const __m512i mask = _mm512_set1_epi32(15);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = V::load(qs + c * 64);
      __m512 lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        lo[i] = weights(_mm512_and_si512(_mm512_srli_epi32(v, 8 * i), mask), d, offset);
        hi[i] = weights(i == 3 ? _mm512_srli_epi32(v, 28) : _mm512_and_si512(_mm512_srli_epi32(v, 8 * i + 4), mask), d, offset);
      }
      pair_row(lo[0], lo[1], order, tile + 2 * c * 32);
      pair_row(lo[2], lo[3], order, tile + (2 * c + 1) * 32);
      pair_row(hi[0], hi[1], order, tile + (8 + 2 * c) * 32);
      pair_row(hi[2], hi[3], order, tile + (9 + 2 * c) * 32);
    }
  }
}

// The B tiles of a run of panels, made a few blocks at a time (`step`) between tile products.
template <int FMT>
struct PanelTiles {
  const uint8_t* w;  // W's panels
  Layout L;
  int64_t first = 0;  // the run's first panel
  uint16_t* tiles = nullptr;  // [panel][nb][kPairTile]
  int64_t total = 0, done = 0;  // blocks

  void start(int64_t panel, int64_t count, uint16_t* to) {
    first = panel, tiles = to, total = count * L.nb, done = 0;
  }
  void step(int64_t blocks) {
    const __m512i order = pair_order();
    for (const int64_t stop = std::min(total, done + blocks); done < stop; ++done) {
      const int64_t b = done % L.nb, p = first + done / L.nb;
      const uint8_t* scales = w + L.d(p, b);
      const __m512 d = V::halves(scales);
      const __m512 offset = FMT == kQ4_1   ? V::halves(scales + Layout::kDToM)
                            : FMT == kQ4_0 ? V::mul(d, V::set1f(-8.f))
                                           : V::zerof();
      dequantize_block<FMT>(w + L.weights(p, b), d, offset, order, tiles + done * kPairTile);
    }
  }
  void finish() {
    step(total - done);
    asm volatile("" ::: "memory");  // tileloadd's intrinsic does not tell the compiler it reads memory
  }
};

using Bf16Buffer = TileBuffer<uint16_t>;
Bf16Buffer bf16_buffer(int64_t count) { return tile_buffer<uint16_t>(count); }

// x [M, K] fp32 -> bf16 rows (to nearest even), as many as whole tiles of 16 need: the rows past
// M are zeros, so that every A tile is whole (their sums are never stored). A denormal x becomes
// 0 (vcvtne2ps2bf16 flushes it; torch keeps it): a product moves by less than 2^-126 |w|.
Bf16Buffer bf16_rows(const float* x, int64_t M, int64_t K) {
  const int64_t rows = (M + kTileRows - 1) / kTileRows * kTileRows;
  Bf16Buffer a = bf16_buffer(rows * K);
  std::memset(a.get() + M * K, 0, (rows - M) * K * sizeof(uint16_t));
  at::parallel_for(0, M * K / kBlock, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const __m512 lo = _mm512_loadu_ps(x + i * kBlock), hi = _mm512_loadu_ps(x + i * kBlock + 16);
      _mm512_storeu_si512(a.get() + i * kBlock, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  });
  return a;
}

// Tiles 0..3: C, 16 x 16 fp32, [tile of rows][panel]; 4, 5: A, 16 rows of x by 32 bf16 of K;
// 6, 7: B, a panel's block (16 K pairs of 16 W rows).
void configure_bf16_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" ::: "memory");  // the intrinsic tells the compiler it reads 8 bytes, not 64
  _tile_loadconfig(&cfg);
}

// MT tiles of rows of x (bf16 rows from `a`, K apart) times NT panels' B tiles (from `b`, a
// panel `panel` values after the last) over all of K, 2 x 2 C tiles at most: each A and B tile
// loaded serves two products. The sums go to c [MT * 16][32]; `between()` runs after each step
// of K, while the unit works through its products.
template <int MT, int NT, typename Between>
void tile_sums(const uint16_t* a, int64_t K, const uint16_t* b, int64_t panel, float* c, Between&& between) {
  const int64_t lda = K * sizeof(uint16_t), nb = K / kBlock;
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  // each load just before its first product: tiles are not renamed, so a load waits for the
  // products still reading the tile, and loading all four first leaves the unit idle meanwhile
  for (int64_t kb = 0; kb < nb; ++kb) {
    _tile_loadd(4, a + kb * kBlock, lda);
    _tile_loadd(6, b + kb * kPairTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, b + panel + kb * kPairTile, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT == 2) {
      _tile_loadd(5, a + kTileRows * K + kb * kBlock, lda);
      _tile_dpbf16ps(2, 5, 6);
    }
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
    between();
  }
  _tile_stored(0, c, 128);
  if constexpr (NT == 2) _tile_stored(1, c + 16, 128);
  if constexpr (MT == 2) _tile_stored(2, c + 16 * 32, 128);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// Without the tiles (the system refused them): the same products on AVX512-BF16 vectors, one row
// of x times a panel: a broadcast pair of x's K values times a B tile row, K / 2 of them.
void vector_sums(const uint16_t* a, int64_t K, const uint16_t* b, float* c) {
  __m512 acc[2] = {V::zerof(), V::zerof()};  // two chains of dependent sums
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    int32_t pair;
    std::memcpy(&pair, a + 2 * k2, sizeof pair);
    const __m512i row = V::load(reinterpret_cast<const uint8_t*>(b + k2 * 32));
    acc[k2 % 2] = _mm512_dpbf16_ps(acc[k2 % 2], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)row);
  }
  V::store(c, _mm512_add_ps(acc[0], acc[1]));
}

// The sums of a finished pair of row tiles on their way to y, a few rows at a time (`step`)
// between the next tiles' products (stored all at once, they added an eighth at 512 rows).
struct PendingRows {
  const Out& out;
  const float* sums = nullptr;  // [rows][32]
  int64_t m0 = 0, rows = 0, n0 = 0, count = 0, done = 0;

  void start(const float* s, int64_t m, int64_t r, int64_t n, int64_t c) { sums = s, m0 = m, rows = r, n0 = n, count = c, done = 0; }
  void step(int64_t more) {
    for (const int64_t stop = std::min(rows, done + more); done < stop; ++done) out.store(m0 + done, n0, sums + done * 32, count);
  }
  void finish() { step(rows - done); }
};

// Every row of x (`a`, whole tiles of bf16 rows) times the `count` panels from p0 whose B tiles
// are at `b`, into y; `next`'s blocks are made along the way (all of them by the end). The C
// tiles of a pair of row tiles go to one of two buffers while the other's rows are stored.
template <int FMT>
void rows_times_panels(const uint16_t* a, int64_t M, int64_t K, const uint16_t* b, int64_t count, int64_t p0,
                       bool tiles, const Out& out, PanelTiles<FMT>& next) {
  const int64_t nb = K / kBlock, panel = nb * kPairTile, row_tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t steps = (row_tiles + 1) / 2 * nb, per_step = (next.total + steps - 1) / steps;
  alignas(64) float c[2][2 * kTileRows * 32];
  PendingRows pending{out};
  for (int64_t t = 0; t < row_tiles; t += 2) {
    const int64_t m0 = t * kTileRows, rows = std::min(2 * kTileRows, M - m0), rows_per_step = (pending.rows + nb - 1) / nb;
    const uint16_t* at = a + m0 * K;
    float* sums = c[t / 2 % 2];
    auto between = [&] {
      next.step(per_step);
      pending.step(rows_per_step);
    };
    if (!tiles) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < count; ++g) vector_sums(at + r * K, K, b + g * panel, sums + r * 32 + g * kPanel);
    } else if (t + 1 < row_tiles) {
      count == 2 ? tile_sums<2, 2>(at, K, b, panel, sums, between) : tile_sums<2, 1>(at, K, b, panel, sums, between);
    } else {
      count == 2 ? tile_sums<1, 2>(at, K, b, panel, sums, between) : tile_sums<1, 1>(at, K, b, panel, sums, between);
    }
    pending.finish();
    pending.start(sums, m0, rows, p0 * kPanel, count * kPanel);
  }
  pending.finish();
  next.finish();
}

// Rows of x a thread multiplies by each pair of panels before the next pair: as many as keep
// their bf16 (K values a row) within about half a core's L2 (1 MiB), whole pairs of row tiles,
// at least 64. Past them x is taken in chunks, each chunk times every pair of panels, so that a
// pair's products read x from L2 instead of reading all of it again for every pair (x is 2.4 MB
// at 2048 rows and K = 576). SmolLM2's 120 products of a step at 2048 rows took 360-475 ms with x
// whole, 315-320 ms in chunks (oneDNN's products of a bf16 copy: about 200). A pair's B tiles are
// made again for each chunk, a cost spread over at least the chunk's rows.
constexpr int64_t kChunkBytes = 1 << 20;
inline int64_t chunk_rows(int64_t K) {
  const int64_t rows = kChunkBytes / (K * int64_t(sizeof(uint16_t)));
  return std::max<int64_t>(64, rows / (2 * kTileRows) * (2 * kTileRows));
}

// Pairs of panels split over threads (each sets up its own tiles); each thread goes through its
// pairs once for every chunk of rows of x. A pair's B tiles are made while the pair before it
// (in that order: the last pair of a chunk is before the first of the next) is multiplied, then
// every tile of rows of the chunk multiplies them.
template <int FMT>
void bf16_product(const uint16_t* a, int64_t M, const uint8_t* w, int64_t K, const Out& out) {
  const Layout L(FMT, K);
  const int64_t nb = L.nb, np = panels(out.N);
  const bool tiles = amx_allowed();
  at::parallel_for(0, groups(out.N), 1, [&](int64_t begin, int64_t end) {
    if (tiles) configure_bf16_tiles();
    const Bf16Buffer buffers[2] = {bf16_buffer(2 * nb * kPairTile), bf16_buffer(2 * nb * kPairTile)};
    auto count = [&](int64_t pair) { return std::min<int64_t>(2, np - 2 * pair); };
    // a thread of one pair reads x once whatever the chunks: it takes x whole, its tiles made once
    const int64_t pairs = end - begin, chunk = pairs == 1 ? M : chunk_rows(K);
    const int64_t chunks = (M + chunk - 1) / chunk;
    const int64_t items = chunks * pairs;  // item i: chunk i / pairs, pair begin + i % pairs
    auto pair_of = [&](int64_t i) { return begin + i % pairs; };
    PanelTiles<FMT> next{w, L};
    next.start(2 * begin, count(begin), buffers[0].get());
    next.finish();
    for (int64_t i = 0; i < items; ++i) {
      const int64_t pair = pair_of(i), m0 = i / pairs * chunk, rows = std::min(chunk, M - m0);
      const int64_t after = pair_of(i + 1);
      next.start(2 * after, i + 1 < items ? count(after) : 0, buffers[(i + 1) % 2].get());
      rows_times_panels<FMT>(a + m0 * K, rows, K, buffers[i % 2].get(), count(pair), 2 * pair, tiles,
                             out.from_row(m0), next);
    }
    if (tiles) _tile_release();
  });
}
#endif

// This format's product: where the build and the system allow AMX and there are enough rows,
// their whole tiles on AMX and the fewer than 16 rows left on VNNI (a tile padded with zero rows
// costs a full tile; these rows cost a share of VNNI's).
template <int FMT>
void product(const float* x, const uint8_t* w, const Out& out, int64_t M, int64_t K) {
  int64_t done = 0;
#if defined(__AMX_INT8__)
  if (M >= amx_min_rows(FMT) && amx_allowed()) {
    done = M / kTileRows * kTileRows;
    amx_rows<FMT>(x, w, out, done, K);
  }
#endif
  if (done == M) return;
  QuantizedX own;
  QuantizedX& q = (M - done) * K <= kKeptX ? kept_x() : own;
  quantize_into(q, x + done * K, M - done, K);
  linear_fmt<FMT>(q, w, out.from_row(done), M - done, K);
}

void check(const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0, "format must be Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "K must be a positive multiple of 32");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "W: contiguous uint8 [N, K / 32 * block bytes] on CPU");
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(fmt), "W's rows do not hold K weights of this format");
}

std::string isa() {
#if defined(__AMX_INT8__)
  return "amx";
#elif defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

// Byte offsets, from W's first byte, of row n's block b: its weight byte j (16 of Q4's, 32 of
// Q8_0's), its d and m.
struct PanelOffsets {
  Layout L;
  int64_t quant(int64_t n, int64_t b, int64_t j) const {
    return L.weights(n / kPanel, b) + (j / 4) * 64 + n % kPanel * 4 + j % 4;
  }
  int64_t d(int64_t n, int64_t b) const { return L.d(n / kPanel, b) + n % kPanel * 2; }
  int64_t m(int64_t n, int64_t b) const { return L.m(n / kPanel, b) + n % kPanel * 2; }
};

// GGUF rows [N, row bytes] -> panels [panel_rows(N), row bytes] (zero rows padding the last
// group).
at::Tensor pack_panels(at::Tensor w, int64_t fmt, int64_t K) {
  check(w, fmt, K);
  const int64_t N = w.size(0), rb = w.size(1), nb = K / kBlock, bb = block_bytes(fmt);
  auto out = at::zeros({panel_rows(N), rb}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* p = out.data_ptr<uint8_t>();
  const PanelOffsets at{Layout(fmt, K)};
  const int64_t head = head_bytes(fmt), weight_bytes = bb - head;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = src + n * rb + b * bb;
        std::memcpy(p + at.d(n, b), blk, 2);
        if (fmt == kQ4_1) std::memcpy(p + at.m(n, b), blk + 2, 2);
        for (int64_t j = 0; j < weight_bytes; j += 4) std::memcpy(p + at.quant(n, b, j), blk + head + j, 4);
      }
  });
  return out;
}

// Panels of N rows -> GGUF rows: all N, or those `index` names (an embedding's lookup).
at::Tensor unpack_panels(at::Tensor w, int64_t fmt, int64_t K, int64_t N, c10::optional<at::Tensor> index) {
  check(w, fmt, K);
  TORCH_CHECK(N >= 0 && w.size(0) == panel_rows(N), "panels hold ", w.size(0), " rows, not panels of ", N);
  at::Tensor rows = index.has_value() && index->defined() ? index->to(at::kLong).contiguous().view(-1)
                                                              : at::arange(N, at::kLong);
  const int64_t* ids = rows.data_ptr<int64_t>();
  const int64_t R = rows.numel(), rb = w.size(1), nb = K / kBlock, bb = block_bytes(fmt);
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ids[r] >= 0 && ids[r] < N, "row ", ids[r], " is not in 0..", N - 1);
  auto out = at::empty({R, rb}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const PanelOffsets at{Layout(fmt, K)};
  const int64_t head = head_bytes(fmt), weight_bytes = bb - head;
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* blk = dst + r * rb + b * bb;
        std::memcpy(blk, src + at.d(ids[r], b), 2);
        if (fmt == kQ4_1) std::memcpy(blk + 2, src + at.m(ids[r], b), 2);
        for (int64_t j = 0; j < weight_bytes; j += 4)
          std::memcpy(blk + head + j, src + at.quant(ids[r], b, j), 4);
      }
  });
  return out;
}

// A product's operands, checked (x [M, K] fp32, W's panels of N rows, bias [N] or none), and its
// output y [M, N]: `y` where it is given (fp32 [M, N], contiguous), else a new tensor; `holder`
// keeps a converted bias alive.
struct Operands {
  at::Tensor x, holder, y;
  const float* bias;
  int64_t M;
  Out out(int64_t N) { return {y.data_ptr<float>(), bias, N}; }
};

Operands operands(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K, int64_t N,
                  const c10::optional<at::Tensor>& bias, const at::Tensor& y = {}) {
  check(w, fmt, K);
  TORCH_CHECK(N > 0 && w.size(0) == panel_rows(N), "W holds ", w.size(0), " panel rows, not panels of ", N);
  Operands o;
  o.x = kvserve::checked_x(x, K);
  o.M = x.size(0);
  o.bias = kvserve::bias_ptr(bias, N, o.holder);
  o.y = kvserve::output_rows(y, o.M, N, x);
  return o;
}

// y = x @ W^T (+ bias) into o.y.
void product_into(Operands& o, const at::Tensor& w, int64_t fmt, int64_t K, int64_t N) {
  if (o.M == 0) return;
  const float* xp = o.x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (fmt == kQ4_0) product<kQ4_0>(xp, wp, o.out(N), o.M, K);
  else if (fmt == kQ4_1) product<kQ4_1>(xp, wp, o.out(N), o.M, K);
  else product<kQ8_0>(xp, wp, o.out(N), o.M, K);
}

at::Tensor linear_q8(at::Tensor x, at::Tensor w, int64_t fmt, int64_t K, int64_t N,
                     c10::optional<at::Tensor> bias) {
  Operands o = operands(x, w, fmt, K, N, bias);
  product_into(o, w, fmt, K, N);
  return o.y;
}

#if defined(__AMX_BF16__)
// y = bf16(x) @ bf16(W)^T (+ bias) in fp32: a dense bf16 copy's product, W dequantized tile by
// tile at each call (see "bf16 tiles" above).
at::Tensor linear_bf16_tiles(at::Tensor x, at::Tensor w, int64_t fmt, int64_t K, int64_t N,
                             c10::optional<at::Tensor> bias) {
  Operands o = operands(x, w, fmt, K, N, bias);
  if (o.M == 0) return o.y;
  const Bf16Buffer a = bf16_rows(o.x.data_ptr<float>(), o.M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (fmt == kQ4_0) bf16_product<kQ4_0>(a.get(), o.M, wp, K, o.out(N));
  else if (fmt == kQ4_1) bf16_product<kQ4_1>(a.get(), o.M, wp, K, o.out(N));
  else bf16_product<kQ8_0>(a.get(), o.M, wp, K, o.out(N));
  return o.y;
}
#endif

// linear_q8 with its operands (those it takes after x) bound, for a decoder layer run as one call
// (kernel_ops.h).
struct BoundPanels final : kvserve::RowsOp {
  at::Tensor w;
  int64_t fmt, K, N;
  c10::optional<at::Tensor> bias;
  BoundPanels(at::Tensor w, int64_t fmt, int64_t K, int64_t N, c10::optional<at::Tensor> bias)
      : w(std::move(w)), fmt(fmt), K(K), N(N), bias(std::move(bias)) {}
  at::Tensor operator()(const at::Tensor& x) const override { return linear_q8(x, w, fmt, K, N, bias); }
  int64_t out_features() const override { return N; }
  void into(const at::Tensor& x, const at::Tensor& out) const override {
    Operands o = operands(x, w, fmt, K, N, bias, out);
    product_into(o, w, fmt, K, N);
  }
};

pybind11::capsule rows_op(const std::string& name, at::Tensor w, int64_t fmt, int64_t K, int64_t N,
                          c10::optional<at::Tensor> bias) {
  TORCH_CHECK(name == "linear_q8", "this kernel's product is linear_q8, not ", name);
  check(w, fmt, K);
  TORCH_CHECK(N > 0 && w.size(0) == panel_rows(N), "W holds ", w.size(0), " panel rows, not panels of ", N);
  return kvserve::to_capsule<kvserve::RowsOp>(std::make_unique<BoundPanels>(w, fmt, K, N, bias));
}

// For the tests of parallel_stealing (parallel_tasks.h), which this kernel's threads split by:
// over n tasks of the grain, how many times each ran [n], and how many ran on a thread other than
// the one whose range held it; the tasks of the first thread's range each take `slow_us`
// microseconds (spinning), so that the others take some of them.
std::vector<at::Tensor> stealing_runs(int64_t n, int64_t grain, double slow_us) {
  TORCH_CHECK(n >= 0 && grain >= 1 && slow_us >= 0, "n >= 0, grain >= 1 and slow_us >= 0");
  std::unique_ptr<std::atomic<int64_t>[]> runs(new std::atomic<int64_t>[std::max<int64_t>(n, 1)]());
  std::unique_ptr<std::atomic<int64_t>[]> by(new std::atomic<int64_t>[std::max<int64_t>(n, 1)]());
  const kvserve::StealingSplit split(n, grain);  // the ranges parallel_stealing gives the threads
  const int64_t threads = split.threads, chunk = std::max<int64_t>(1, split.chunk);
  kvserve::parallel_stealing(n, grain, [&](int64_t i) {
    if (i < chunk) {
      const auto slow = std::chrono::duration<double, std::micro>(slow_us);
      const auto until = std::chrono::steady_clock::now() + slow;
      while (std::chrono::steady_clock::now() < until) {
      }
    }
    runs[i].fetch_add(1, std::memory_order_relaxed);
    by[i].store(at::get_thread_num(), std::memory_order_relaxed);
  });
  auto counts = at::zeros({n}, at::kLong);
  int64_t elsewhere = 0;
  for (int64_t i = 0; i < n; ++i) {
    counts.data_ptr<int64_t>()[i] = runs[i].load();
    elsewhere += threads > 1 && by[i].load() != i / chunk;
  }
  return {counts, at::scalar_tensor(elsewhere, at::kLong)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
  m.def("pack_panels", &pack_panels, "GGUF Q4_0 / Q4_1 / Q8_0 rows -> this kernel's panels of 16 rows (the same bytes, reordered)");
  m.def("unpack_panels", &unpack_panels, "panels of N rows -> GGUF rows: all, or those an index names", py::arg("w"),
        py::arg("fmt"), py::arg("K"), py::arg("N"), py::arg("index") = py::none());
  m.def("linear_q8", &linear_q8,
        "fp32 x @ W^T (+ bias), x quantized to 8 bits per 32-block, W in panels of N Q4_0 / Q4_1 / Q8_0 rows");
#if defined(__AMX_BF16__)
  m.def("linear_bf16_tiles", &linear_bf16_tiles,
        "fp32 bf16(x) @ bf16(W)^T (+ bias), W in panels of N Q4_0 / Q4_1 / Q8_0 rows dequantized to bf16 at each call");
#endif
  m.def("stealing_runs", &stealing_runs,
        "for the tests: each task's runs under parallel_stealing, and how many ran off their range's thread");
  m.def("rows_op", &rows_op, "linear_q8 with its operands bound, as a kvserve.RowsOp capsule (kernel_ops.h)");
}
