// One vector type for the instruction set a build targets, so a kernel is written once against `Vec` and
// compiled per ISA: AVX-512 (16 fp32 lanes), AVX2 + FMA (8 lanes) or, anywhere else, one lane of plain
// C++ that builds with any compiler on any architecture (ARM included). The build picks the ISA by its
// -m flags (kvpack/native_build.py), never -march=native.
//
// Interface (every ISA): Vec::kLanes; Vec::zero(), Vec::splat(x); Vec::load(p) and Vec::load(p, mask)
// (masked-off lanes read as 0 and are never touched: no fault past the end of a buffer); v.store(p) and
// v.store(p, mask); Vec::first(n), the mask of lanes [0, n) for n in [0, kLanes], and Vec::all();
// fma(a, b, c) = a * b + c (one rounding); + - * and max; v.reduce_add(), v.reduce_max(); v.round()
// (to nearest, ties to even); scale_pow2(x, e) = x * 2^e for integral e >= -126; keep_ge(x, a, b) = x
// where a >= b (ordered), else 0.
//
// Code that uses an instruction with no counterpart on the other ISAs (AVX-512's lane permutes, its bf16
// dot products) stays ISA-specific beside this, under #if, with the generic path as its fallback.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace kvpack {

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t n) { return __mmask16((1u << n) - 1); }

struct Vec {
  static constexpr int kLanes = 16;
  using Mask = __mmask16;
  __m512 v;

  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec splat(float x) { return {_mm512_set1_ps(x)}; }
  static Mask first(int64_t n) { return tail_mask(n); }
  static Mask all() { return Mask(0xFFFF); }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const float* p, Mask m) { return {_mm512_maskz_loadu_ps(m, p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(float* p, Mask m) const { _mm512_mask_storeu_ps(p, m, v); }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
  Vec round() const { return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec scale_pow2(Vec x, Vec e) { return {_mm512_scalef_ps(x.v, e.v)}; }
  friend Vec keep_ge(Vec x, Vec a, Vec b) { return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ), x.v)}; }
};

#elif defined(__AVX2__) && defined(__FMA__)
#define KVPACK_AVX2 1
// Lanes [0, n) set, n in [0, 8].
inline __m256i tail_mask8(int64_t n) {
  static const int32_t bits[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 8 - n));
}

inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

struct Vec {
  static constexpr int kLanes = 8;
  using Mask = __m256i;
  __m256 v;

  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec splat(float x) { return {_mm256_set1_ps(x)}; }
  static Mask first(int64_t n) { return tail_mask8(n); }
  static Mask all() { return _mm256_set1_epi32(-1); }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const float* p, Mask m) { return {_mm256_maskload_ps(p, m)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(float* p, Mask m) const { _mm256_maskstore_ps(p, m, v); }
  float reduce_add() const { return hsum8(v); }
  float reduce_max() const { return hmax8(v); }
  Vec round() const { return {_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  // 2^e built in the exponent field: e >= -126, so the biased exponent is >= 1.
  friend Vec scale_pow2(Vec x, Vec e) {
    return {_mm256_mul_ps(x.v, _mm256_castsi256_ps(_mm256_slli_epi32(
                                   _mm256_add_epi32(_mm256_cvtps_epi32(e.v), _mm256_set1_epi32(127)), 23)))};
  }
  friend Vec keep_ge(Vec x, Vec a, Vec b) { return {_mm256_and_ps(_mm256_cmp_ps(a.v, b.v, _CMP_GE_OQ), x.v)}; }
};

#else
struct Vec {
  static constexpr int kLanes = 1;
  using Mask = bool;
  float v;

  static Vec zero() { return {0.f}; }
  static Vec splat(float x) { return {x}; }
  static Mask first(int64_t n) { return n > 0; }
  static Mask all() { return true; }
  static Vec load(const float* p) { return {*p}; }
  static Vec load(const float* p, Mask m) { return {m ? *p : 0.f}; }
  void store(float* p) const { *p = v; }
  void store(float* p, Mask m) const {
    if (m) *p = v;
  }
  float reduce_add() const { return v; }
  float reduce_max() const { return v; }
  Vec round() const { return {std::nearbyint(v)}; }
  friend Vec fma(Vec a, Vec b, Vec c) { return {std::fma(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  friend Vec max(Vec a, Vec b) { return {std::max(a.v, b.v)}; }
  friend Vec scale_pow2(Vec x, Vec e) { return {std::ldexp(x.v, static_cast<int>(e.v))}; }
  friend Vec keep_ge(Vec x, Vec a, Vec b) { return {a.v >= b.v ? x.v : 0.f}; }
};
#endif

}  // namespace kvpack
