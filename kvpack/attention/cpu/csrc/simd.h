// One vector type for the instruction set a build targets, so a kernel is written once against `Vec` and
// compiled per ISA: AVX-512 (16 fp32 lanes), AVX2 + FMA (8 lanes) or, anywhere else, one lane of plain
// C++ that builds with any compiler on any architecture (ARM included). The build picks the ISA by its
// -m flags (kvpack/native_build.py), never -march=native.
//
// Interface (every ISA): Vec::kLanes; Vec::zero(), Vec::splat(x); Vec::load(p) and Vec::load(p, mask)
// (masked-off lanes read as 0 and are never touched: no fault past the end of a buffer); v.store(p) and
// v.store(p, mask); Vec::first(n), the mask of lanes [0, n) for n in [0, kLanes], and Vec::all();
// fma(a, b, c) = a * b + c and fms(a, b, c) = a * b - c (one rounding each); + - * and max;
// v.reduce_add(), v.reduce_max(); v.round() (to nearest, ties to even); scale_pow2(x, e) = x * 2^e for
// integral e >= -126; keep_ge(x, a, b) = x where a >= b (ordered), else 0.
// Widening loads: Vec::load(p) of kLanes consecutive bf16 / fp16 elements as fp32.
// Code lookups: Vec::Table, up to 16 fp32 entries held for lookup (Vec::table(entries, scale): the entries
// times scale); Vec::decode<BITS>(codes, m, table) = table[code] for codes m kLanes .. (m + 1) kLanes - 1
// of a packed row (BITS 2 or 4, the first code in a byte's lowest bits), reading only their bytes;
// Vec::unpack<W>(codes, k) = codes k kLanes .. (k + 1) kLanes - 1 of a little-endian W-bit stream (code i at
// bits [i W, (i + 1) W), W = 1..8) as floats, reading only their bytes.
// v.hadamard(): the unnormalised Walsh-Hadamard transform across the lanes (lane i becomes
// sum_j (-1)^popcount(i & j) v_j; the identity for one lane), the in-vector stages of a transform whose
// other stages run between vectors. v.pin(): an empty asm that takes v in a register (keeps the compiler
// from folding a hoisted load into, and repeating it in, every use). Vec::kRegisters: the ISA's vector
// registers (0: scalar, none).
//
// Code that uses an instruction with no counterpart on the other ISAs (AVX-512's lane permutes, its bf16
// dot products) stays ISA-specific beside this, under #if, with the generic path as its fallback.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace kvpack {

// Code i of a little-endian W-bit stream (code i at bits [i W, (i + 1) W), W = 1..8), read on its own: the
// one-lane build's Vec::decode / Vec::unpack and every vector reader's leftover codes use it. A code spans
// at most two bytes; the second is read only where the code has one (nothing past the stream).
template <int W>
inline unsigned stream_code(const uint8_t* codes, int64_t i) {
  static_assert(1 <= W && W <= 8, "codes of 1 to 8 bits");
  const int64_t bit = i * W;
  const uint8_t* p = codes + (bit >> 3);
  const int shift = int(bit & 7);
  unsigned v = p[0];
  if (shift + W > 8) v |= unsigned(p[1]) << 8;
  return (v >> shift) & ((1u << W) - 1);
}

// The sign of lane i in an in-vector butterfly STRIDE apart: -1 where it takes the pair's difference.
template <int STRIDE>
constexpr float butterfly_sign(int i) { return (i & STRIDE) ? -1.f : 1.f; }

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t n) { return __mmask16((1u << n) - 1); }

struct Vec {
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;
  using Mask = __mmask16;
  __m512 v;
  struct Table {
    __m512 t;
  };

  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec splat(float x) { return {_mm512_set1_ps(x)}; }
  static Mask first(int64_t n) { return tail_mask(n); }
  static Mask all() { return Mask(0xFFFF); }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const float* p, Mask m) { return {_mm512_maskz_loadu_ps(m, p)}; }
  static Vec load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
    return {_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
  }
  static Vec load(const c10::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Table table(const float* entries, float scale) {
    return {_mm512_mul_ps(_mm512_loadu_ps(entries), _mm512_set1_ps(scale))};
  }
  // The 16 codes' 4 or 8 bytes as one word; lane l takes the 32-bit half holding its code (2-bit: the
  // only one), shifts it down to the code, masks it and looks it up (a lane permute).
  template <int BITS>
  static Vec decode(const uint8_t* codes, int64_t m, const Table& table) {
    static_assert(BITS == 2 || BITS == 4, "codes of 2 or 4 bits");
    constexpr int BYTES = 2 * BITS;
    uint64_t word = 0;
    std::memcpy(&word, codes + m * BYTES, BYTES);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i w;
    if constexpr (BITS == 2) w = _mm512_set1_epi32(int32_t(word));
    else
      w = _mm512_permutexvar_epi32(_mm512_srli_epi32(lane, 3),
                                   _mm512_castsi128_si512(_mm_cvtsi64_si128(int64_t(word))));
    const __m512i shift = BITS == 2 ? _mm512_slli_epi32(lane, 1)
                                    : _mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(7)), 2);
    const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(w, shift), _mm512_set1_epi32((1 << BITS) - 1));
    return {_mm512_permutexvar_ps(code, table.t)};
  }
  // The 16 codes' 2W bytes widened to a lane each; lane l takes the two bytes its code starts in (lane
  // permutes), shifts them down to the code and masks it.
  template <int W>
  static Vec unpack(const uint8_t* codes, int64_t k) {
    static_assert(1 <= W && W <= 8, "codes of 1 to 8 bits");
    const uint8_t* src = codes + k * 2 * W;
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(__mmask16((1u << (2 * W)) - 1), src));
    if constexpr (W == 8) return {_mm512_cvtepi32_ps(wide)};
    const __m512i bit = _mm512_set_epi32(15 * W, 14 * W, 13 * W, 12 * W, 11 * W, 10 * W, 9 * W, 8 * W, 7 * W, 6 * W,
                                         5 * W, 4 * W, 3 * W, 2 * W, W, 0);
    const __m512i first = _mm512_srli_epi32(bit, 3);
    const __m512i lo = _mm512_permutexvar_epi32(first, wide);
    const __m512i hi = _mm512_permutexvar_epi32(_mm512_add_epi32(first, _mm512_set1_epi32(1)), wide);
    const __m512i both = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 8));
    const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(both, _mm512_and_si512(bit, _mm512_set1_epi32(7))),
                                          _mm512_set1_epi32((1 << W) - 1));
    return {_mm512_cvtepi32_ps(code)};
  }
  Vec hadamard() const { return butterfly<8>(butterfly<4>(butterfly<2>(butterfly<1>(*this)))); }
  void pin() { asm("" : "+v"(v)); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(float* p, Mask m) const { _mm512_mask_storeu_ps(p, m, v); }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
  Vec round() const { return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec fms(Vec a, Vec b, Vec c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec scale_pow2(Vec x, Vec e) { return {_mm512_scalef_ps(x.v, e.v)}; }
  friend Vec keep_ge(Vec x, Vec a, Vec b) { return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ), x.v)}; }

 private:
  // One in-vector butterfly stage STRIDE apart: lane i becomes x[i ^ STRIDE] + sign_i x[i], sign_i = -1
  // where bit STRIDE of i is set (the pair's difference), +1 where clear (its sum).
  template <int STRIDE>
  static Vec butterfly(Vec x) {
    __m512 partner;
    if constexpr (STRIDE == 1) partner = _mm512_permute_ps(x.v, 0xB1);
    else if constexpr (STRIDE == 2) partner = _mm512_permute_ps(x.v, 0x4E);
    else if constexpr (STRIDE == 4) partner = _mm512_shuffle_f32x4(x.v, x.v, 0xB1);
    else partner = _mm512_shuffle_f32x4(x.v, x.v, 0x4E);
    alignas(64) static const float sign[16] = {
        butterfly_sign<STRIDE>(0), butterfly_sign<STRIDE>(1), butterfly_sign<STRIDE>(2), butterfly_sign<STRIDE>(3),
        butterfly_sign<STRIDE>(4), butterfly_sign<STRIDE>(5), butterfly_sign<STRIDE>(6), butterfly_sign<STRIDE>(7),
        butterfly_sign<STRIDE>(8), butterfly_sign<STRIDE>(9), butterfly_sign<STRIDE>(10), butterfly_sign<STRIDE>(11),
        butterfly_sign<STRIDE>(12), butterfly_sign<STRIDE>(13), butterfly_sign<STRIDE>(14), butterfly_sign<STRIDE>(15)};
    return {_mm512_fmadd_ps(x.v, _mm512_load_ps(sign), partner)};
  }
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
  static constexpr int kRegisters = 16;
  using Mask = __m256i;
  __m256 v;
  struct Table {
    __m256 lo, hi;  // entries 0-7 and 8-15
  };

  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec splat(float x) { return {_mm256_set1_ps(x)}; }
  static Mask first(int64_t n) { return tail_mask8(n); }
  static Mask all() { return _mm256_set1_epi32(-1); }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const float* p, Mask m) { return {_mm256_maskload_ps(p, m)}; }
  static Vec load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
    return {_mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16))};
  }
  static Vec load(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static Table table(const float* entries, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    return {_mm256_mul_ps(_mm256_loadu_ps(entries), s), _mm256_mul_ps(_mm256_loadu_ps(entries + 8), s)};
  }
  // The 8 codes' 2 or 4 bytes as one 32-bit word in every lane, shifted down to lane l's code, masked and
  // looked up: two 8-entry lane permutes blended on the code's bit 3 where there are 16 entries.
  template <int BITS>
  static Vec decode(const uint8_t* codes, int64_t m, const Table& table) {
    static_assert(BITS == 2 || BITS == 4, "codes of 2 or 4 bits");
    constexpr int BYTES = BITS;
    uint32_t word = 0;
    std::memcpy(&word, codes + m * BYTES, BYTES);
    const __m256i shift = _mm256_set_epi32(7 * BITS, 6 * BITS, 5 * BITS, 4 * BITS, 3 * BITS, 2 * BITS, BITS, 0);
    const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int32_t(word)), shift),
                                          _mm256_set1_epi32((1 << BITS) - 1));
    __m256 out = _mm256_permutevar8x32_ps(table.lo, code);
    if constexpr (BITS == 4)
      out = _mm256_blendv_ps(out, _mm256_permutevar8x32_ps(table.hi, code),
                             _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
    return {out};
  }
  void pin() { asm("" : "+x"(v)); }
  // As the AVX-512 Vec's on 8 lanes: the codes' W bytes (one load of W bytes), two lane permutes.
  template <int W>
  static Vec unpack(const uint8_t* codes, int64_t k) {
    static_assert(1 <= W && W <= 8, "codes of 1 to 8 bits");
    uint64_t word = 0;
    std::memcpy(&word, codes + k * W, W);
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(word)));
    if constexpr (W == 8) return {_mm256_cvtepi32_ps(wide)};
    const __m256i bit = _mm256_set_epi32(7 * W, 6 * W, 5 * W, 4 * W, 3 * W, 2 * W, W, 0);
    const __m256i first = _mm256_srli_epi32(bit, 3);
    const __m256i lo = _mm256_permutevar8x32_epi32(wide, first);
    const __m256i hi = _mm256_permutevar8x32_epi32(wide, _mm256_add_epi32(first, _mm256_set1_epi32(1)));
    const __m256i both = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8));
    const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_and_si256(bit, _mm256_set1_epi32(7))),
                                          _mm256_set1_epi32((1 << W) - 1));
    return {_mm256_cvtepi32_ps(code)};
  }
  Vec hadamard() const { return butterfly<4>(butterfly<2>(butterfly<1>(*this))); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(float* p, Mask m) const { _mm256_maskstore_ps(p, m, v); }
  float reduce_add() const { return hsum8(v); }
  float reduce_max() const { return hmax8(v); }
  Vec round() const { return {_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec fms(Vec a, Vec b, Vec c) { return {_mm256_fmsub_ps(a.v, b.v, c.v)}; }
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

 private:
  template <int STRIDE>  // as the AVX-512 Vec's
  static Vec butterfly(Vec x) {
    __m256 partner;
    if constexpr (STRIDE == 1) partner = _mm256_permute_ps(x.v, 0xB1);
    else if constexpr (STRIDE == 2) partner = _mm256_permute_ps(x.v, 0x4E);
    else partner = _mm256_permute2f128_ps(x.v, x.v, 0x01);
    alignas(32) static const float sign[8] = {
        butterfly_sign<STRIDE>(0), butterfly_sign<STRIDE>(1), butterfly_sign<STRIDE>(2), butterfly_sign<STRIDE>(3),
        butterfly_sign<STRIDE>(4), butterfly_sign<STRIDE>(5), butterfly_sign<STRIDE>(6), butterfly_sign<STRIDE>(7)};
    return {_mm256_fmadd_ps(x.v, _mm256_load_ps(sign), partner)};
  }
};

#else
struct Vec {
  static constexpr int kLanes = 1;
  static constexpr int kRegisters = 0;
  using Mask = bool;
  float v;
  struct Table {
    float t[16];
  };

  static Vec zero() { return {0.f}; }
  static Vec splat(float x) { return {x}; }
  static Mask first(int64_t n) { return n > 0; }
  static Mask all() { return true; }
  static Vec load(const float* p) { return {*p}; }
  static Vec load(const float* p, Mask m) { return {m ? *p : 0.f}; }
  static Vec load(const c10::BFloat16* p) { return {static_cast<float>(*p)}; }
  static Vec load(const c10::Half* p) { return {static_cast<float>(*p)}; }
  static Table table(const float* entries, float scale) {
    Table t;
    for (int i = 0; i < 16; ++i) t.t[i] = entries[i] * scale;
    return t;
  }
  template <int BITS>
  static Vec decode(const uint8_t* codes, int64_t m, const Table& table) {
    static_assert(BITS == 2 || BITS == 4, "codes of 2 or 4 bits");
    return {table.t[stream_code<BITS>(codes, m)]};
  }
  template <int W>
  static Vec unpack(const uint8_t* codes, int64_t k) {
    return {float(stream_code<W>(codes, k))};
  }
  void pin() {}
  Vec hadamard() const { return *this; }
  void store(float* p) const { *p = v; }
  void store(float* p, Mask m) const {
    if (m) *p = v;
  }
  float reduce_add() const { return v; }
  float reduce_max() const { return v; }
  Vec round() const { return {std::nearbyint(v)}; }
  friend Vec fma(Vec a, Vec b, Vec c) { return {std::fma(a.v, b.v, c.v)}; }
  friend Vec fms(Vec a, Vec b, Vec c) { return {std::fma(a.v, b.v, -c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  friend Vec max(Vec a, Vec b) { return {std::max(a.v, b.v)}; }
  friend Vec scale_pow2(Vec x, Vec e) { return {std::ldexp(x.v, static_cast<int>(e.v))}; }
  friend Vec keep_ge(Vec x, Vec a, Vec b) { return {a.v >= b.v ? x.v : 0.f}; }
};
#endif

}  // namespace kvpack
