// AVX-512F helpers shared by the plugin's CPU kernels (verify_attention.cpp, hydra_level.cpp): 16-lane loads of
// float32 or bfloat16 (uint16_t bits) as float32, scalar loads and stores, and exp for x <= 0.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline float ld1(const float* p) { return *p; }
static inline float ld1(const uint16_t* p) {
  const uint32_t u = ((uint32_t)*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// float32 -> bfloat16 bits, rounded to nearest even as torch rounds (a NaN stays a NaN)
static inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static inline void st1(float* p, float x) { *p = x; }
static inline void st1(uint16_t* p, float x) { *p = to_bf16(x); }

// exp for x <= 0: 2^n * p(r); inputs below -87.3 (-inf included) give about 1e-38, masked out by the caller
static inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  x = _mm512_max_ps(x, lo);
  const __m512 l2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, l2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
