// Vector math shared by the compiled CPU kernels (included; each kernel is built on its own).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kvserve {

// e^x, 16 lanes: 2^n * 2^f with |f| <= 1/2, 2^f from a degree-6 Taylor polynomial in f*ln2
// (relative error about 1e-7), 2^n applied exactly by scalef (inf past the float range; inputs
// below -87 are taken as -87, about 1.6e-38).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace kvserve
#endif
