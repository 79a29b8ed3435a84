// The vector helpers the plugin's CPU kernels (verify_attention.cpp, hydra_level.cpp) are written in: `vf`, a vector
// of W float32 lanes, with loads of float32 or bfloat16 (uint16_t bits) as float32, arithmetic, reductions, a mask
// of the first lanes, and exp for x <= 0. Built for AVX-512F (W = 16) where the compiler targets it (-mavx512f),
// else for AVX2 with FMA (W = 8): vllm_entmtp/cpp_build.py picks the flags by the CPU. The same arithmetic on both,
// but for the order of a reduction's sums.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#define ENTMTP_AVX512 1
using vf = __m512;
constexpr int W = 16;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
static inline vf vfmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }  // a * b - c
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vmaxr(vf v) { return _mm512_reduce_max_ps(v); }
// v with the lanes from n on zeroed (n <= 0: all, n >= W: none)
static inline vf vfirst(vf v, int64_t n) {
  const __mmask16 k = n >= W ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
  return _mm512_maskz_mov_ps(k, v);
}
// whether some lane of a is greater than the same lane of b
static inline bool vany_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n in [-126, 127]
static inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
#else
using vf = __m256;
constexpr int W = 8;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfmsub(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }
static inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float vmaxr(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline vf vfirst(vf v, int64_t n) {
  const int k = n >= W ? W : n <= 0 ? 0 : (int)n;
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_and_ps(v, _mm256_castsi256_ps(keep));
}
static inline bool vany_gt(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

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
static inline vf vexp(vf x) {
  x = vmax(x, vset1(-87.3f));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfmadd(n, vset1(-0.693359375f), x);
  r = vfmadd(n, vset1(2.12194440e-4f), r);
  vf p = vset1(1.9875691500E-4f);
  p = vfmadd(p, r, vset1(1.3981999507E-3f));
  p = vfmadd(p, r, vset1(8.3334519073E-3f));
  p = vfmadd(p, r, vset1(4.1665795894E-2f));
  p = vfmadd(p, r, vset1(1.6666665459E-1f));
  p = vfmadd(p, r, vset1(5.0000001201E-1f));
  p = vfmadd(p, vmul(r, r), vadd(r, vset1(1.f)));
  return vscale2(p, n);
}
