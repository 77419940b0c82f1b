// kvpack::anchor_segment_attention on CPU: grouped queries over one AnchorKV segment, read where the
// store keeps it, split-K over 32-token blocks.
//
// Token t of head h: x_t = coef_t * anchor[index_t] + r_t, with r_t its residual when the token's bit is
// set in one tier's mask (2-bit codes, or anchor_plus's 4-bit fine tier): r = unrotate(scale * levels
// [codes]) = factor * (y M) ⊙ signs, M the codec's 0/±1 matrix. Slot of a residual = the prefix count of
// its 32-token block + the set bits before it in the block. Keys are rebuilt one block at a time
// (pre-RoPE, then rotated at position first_position + t); values never: their weighted sum is taken
// on the stored form — sum_t p_t coef_t into one bin per anchor (the [rows, k] x [k, D] product once per
// split) and sum_t p_t y_t in the codecs' shared rotated domain (unrotated once per split).
//
// The rotation: the identity (the naive ablation) is skipped; the paper's Sylvester-Hadamard matrix is
// applied as a fast Walsh-Hadamard transform held in registers (D / 16 vectors: butterflies 16 or more
// apart between vectors, 1, 2, 4 and 8 apart as a lane permute plus one FMA with a +-1 vector), about
// D log2(D) / 16 vector operations; any other 0/+-1 matrix as a D x D product (`combine`: the output row
// held in registers).
// Profiled at D = 128, the D x D product was 70% of the kernel's time.
//
// With AVX-512 and D = 32 / 64 / 128 / 256 (identity or Sylvester rotation) each key lives in registers
// from its anchor row to its dot products (block_key_scores_regs); the value residuals of a block are
// decoded into a small buffer and summed per query row with the accumulator in registers (`combine`),
// as are the anchor bins at the end of a split. Profiled at SmolLM2's shape (D = 64, anchor_plus@0.25,
// 8K tokens) before: the row passes through memory between scale, residual, RoPE and dot (store then
// load, each step) and the value axpys were most of the time; 2.06 -> 1.01 ms per layer call.
// With AVX2 and D = 32 / 64 the same register path on 8-lane vectors (block_key_scores_regs8; at
// D = 128 a key's 16 vectors would fill all 16 registers, so larger heads keep the buffered path).
// SmolLM2's shape on a Zen 1 EPYC (bench_decode_attention.py --shape smollm2, 8K): anchor_plus@0.25
// 3.85 / 4.75 -> 3.02 / 3.76 ms per layer call (two alternating runs each).
#include "common.h"

namespace kvpack {
namespace {

enum class Rotation { Identity, Sylvester, Matrix };

// Entry (i, j) of the unnormalised Sylvester-Hadamard matrix: (-1)^popcount(i & j).
inline float sylvester(int64_t i, int64_t j) { return __builtin_popcountll(uint64_t(i & j)) & 1 ? -1.f : 1.f; }

// Runs once per call (per layer and decode step): each check stops at its first mismatch, so the
// Hadamard codec's matrix is scanned once in full, and the identity's is.
Rotation classify(const at::Tensor& hmat, std::vector<float>& m) {
  const int64_t D = hmat.size(0);
  m.resize(D * D);
  widen_row(hmat.data_ptr<c10::Half>(), m.data(), D * D);
  auto equals = [&](auto entry) {
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j)
        if (m[i * D + j] != entry(i, j)) return false;
    return true;
  };
  if (equals([](int64_t i, int64_t j) { return i == j ? 1.f : 0.f; })) return Rotation::Identity;
#if defined(__AVX512F__) || defined(KVPACK_AVX2)
  if ((D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && equals(sylvester)) return Rotation::Sylvester;
#endif
  return Rotation::Matrix;
}

#if defined(__AVX512F__)
constexpr int LANES = 16;  // floats per vector register

// One in-vector butterfly stage `stride` apart (1, 2, 4, 8): lane i becomes x[i ^ stride] + sign_i x[i],
// sign_i = -1 where bit `stride` of i is set (the pair's difference), +1 where clear (its sum).
template <int STRIDE>
inline __m512 lane_butterfly(__m512 x) {
  __m512 partner;
  if constexpr (STRIDE == 1) partner = _mm512_permute_ps(x, 0xB1);
  else if constexpr (STRIDE == 2) partner = _mm512_permute_ps(x, 0x4E);
  else if constexpr (STRIDE == 4) partner = _mm512_shuffle_f32x4(x, x, 0xB1);
  else partner = _mm512_shuffle_f32x4(x, x, 0x4E);
  alignas(64) static const float sign[16] = {
      (0 & STRIDE) ? -1.f : 1.f, (1 & STRIDE) ? -1.f : 1.f, (2 & STRIDE) ? -1.f : 1.f, (3 & STRIDE) ? -1.f : 1.f,
      (4 & STRIDE) ? -1.f : 1.f, (5 & STRIDE) ? -1.f : 1.f, (6 & STRIDE) ? -1.f : 1.f, (7 & STRIDE) ? -1.f : 1.f,
      (8 & STRIDE) ? -1.f : 1.f, (9 & STRIDE) ? -1.f : 1.f, (10 & STRIDE) ? -1.f : 1.f, (11 & STRIDE) ? -1.f : 1.f,
      (12 & STRIDE) ? -1.f : 1.f, (13 & STRIDE) ? -1.f : 1.f, (14 & STRIDE) ? -1.f : 1.f, (15 & STRIDE) ? -1.f : 1.f};
  return _mm512_fmadd_ps(x, _mm512_load_ps(sign), partner);
}

// out = H y for the unnormalised Sylvester-Hadamard H of order 16 NCH (H is symmetric: y H = H y).
template <int NCH>
inline void fwht_inplace(__m512* v) {
  for (int span = 1; span < NCH; span *= 2)  // butterflies 16 span apart: between vectors
    for (int j = 0; j < NCH; ++j)
      if (!(j & span)) {
        const __m512 a = v[j], b = v[j + span];
        v[j] = _mm512_add_ps(a, b);
        v[j + span] = _mm512_sub_ps(a, b);
      }
  for (int j = 0; j < NCH; ++j)
    v[j] = lane_butterfly<8>(lane_butterfly<4>(lane_butterfly<2>(lane_butterfly<1>(v[j]))));
}

template <int NCH>
inline void fwht_regs(const float* y, float* out) {
  __m512 v[NCH];
  for (int j = 0; j < NCH; ++j) v[j] = _mm512_loadu_ps(y + 16 * j);
  fwht_inplace<NCH>(v);
  for (int j = 0; j < NCH; ++j) _mm512_storeu_ps(out + 16 * j, v[j]);
}
#elif defined(KVPACK_AVX2)
constexpr int LANES = 8;

// The same transform on 8-lane vectors: butterflies 8 or more apart between vectors, 1, 2 and 4 apart
// in-vector (at D = 128 and 256 the 16 / 32 vectors exceed AVX2's registers and the compiler keeps some
// on the stack: still ~D log2(D) / 8 vector operations against the D x D product's D^2 / 8).
template <int STRIDE>
inline __m256 lane_butterfly8(__m256 x) {
  __m256 partner;
  if constexpr (STRIDE == 1) partner = _mm256_permute_ps(x, 0xB1);
  else if constexpr (STRIDE == 2) partner = _mm256_permute_ps(x, 0x4E);
  else partner = _mm256_permute2f128_ps(x, x, 0x01);
  alignas(32) static const float sign[8] = {
      (0 & STRIDE) ? -1.f : 1.f, (1 & STRIDE) ? -1.f : 1.f, (2 & STRIDE) ? -1.f : 1.f, (3 & STRIDE) ? -1.f : 1.f,
      (4 & STRIDE) ? -1.f : 1.f, (5 & STRIDE) ? -1.f : 1.f, (6 & STRIDE) ? -1.f : 1.f, (7 & STRIDE) ? -1.f : 1.f};
  return _mm256_fmadd_ps(x, _mm256_load_ps(sign), partner);
}

template <int NCH>
inline void fwht_inplace(__m256* v) {
  for (int span = 1; span < NCH; span *= 2)
    for (int j = 0; j < NCH; ++j)
      if (!(j & span)) {
        const __m256 a = v[j], b = v[j + span];
        v[j] = _mm256_add_ps(a, b);
        v[j + span] = _mm256_sub_ps(a, b);
      }
  for (int j = 0; j < NCH; ++j) v[j] = lane_butterfly8<4>(lane_butterfly8<2>(lane_butterfly8<1>(v[j])));
}

template <int NCH>
inline void fwht_regs(const float* y, float* out) {
  __m256 v[NCH];
  for (int j = 0; j < NCH; ++j) v[j] = _mm256_loadu_ps(y + 8 * j);
  fwht_inplace<NCH>(v);
  for (int j = 0; j < NCH; ++j) _mm256_storeu_ps(out + 8 * j, v[j]);
}
#endif

struct Codec {
  Rotation rotation;
  std::vector<float> matrix;  // [D, D] 0/±1
  std::vector<float> signs;   // [D]
  std::vector<float> factor_signs;  // [D] factor * signs: the fused path's one FMA per vector
  float factor;
  float levels2[16] = {};  // 4 used (16: one vector load for the lane lookup)
  float levels4[16] = {};
  int64_t D;

  // x[c] += factor * (y M)[c] * signs[c]; y is overwritten.
  void unrotate_add(float* y, float* x, std::vector<float>& tmp) const {
    if (rotation != Rotation::Identity) {
      tmp.resize(D);
      matvec(y, tmp.data());
      std::copy(tmp.begin(), tmp.end(), y);
    }
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) x[c] += factor * y[c] * signs[c];
  }

  // out = y M. The output row stays in registers across the D row updates (a row buffer in memory
  // made every update wait on the previous one's store: the hot spot of the first version).
  void matvec(const float* y, float* out) const {
#if defined(__AVX512F__) || defined(KVPACK_AVX2)
    if (rotation == Rotation::Sylvester) switch (D) {  // fwht_regs' template argument: vectors per row
        case 16: return fwht_regs<16 / LANES>(y, out);
        case 32: return fwht_regs<32 / LANES>(y, out);
        case 64: return fwht_regs<64 / LANES>(y, out);
        case 128: return fwht_regs<128 / LANES>(y, out);
        case 256: return fwht_regs<256 / LANES>(y, out);
        default: break;  // classify() admits no other order
      }
#endif
    std::fill(out, out + D, 0.f);
    combine(y, matrix.data(), D, D, out);  // sum_r y[r] M[r] with the output row in registers
  }
};

struct Tier {  // one residual tier of one side
  const uint8_t* mask = nullptr;     // [H, ceil(n / 8)] bits
  const int32_t* prefix = nullptr;   // [H, ceil(n / 32)]
  const uint8_t* res = nullptr;      // [slots, D * bits / 8]
  const float* scale = nullptr;      // [slots]
  int bits = 0;
  int64_t slots = 0;
  bool present() const { return mask != nullptr; }
};

struct Side {
  const void* index;  // [H, n] uint8 or int16
  bool index_u8;
  const c10::Half* coef;  // [H, n]
  Tier tiers[2];
  int64_t anchor_of(int64_t e) const {
    return index_u8 ? int64_t(static_cast<const uint8_t*>(index)[e]) : int64_t(static_cast<const int16_t*>(index)[e]);
  }
};

Tier make_tier(const at::Tensor& mask, const at::Tensor& prefix, const at::Tensor& res, const at::Tensor& scale,
               int bits, int64_t H, int64_t n, int64_t D, const char* name) {
  Tier t;
  if (!mask.numel()) return t;
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.is_contiguous() && mask.numel() == H * ((n + 7) / 8),
              "anchor_segment_attention: ", name, " mask must be uint8 [H, ceil(n / 8)], got ", mask.sizes());
  TORCH_CHECK(prefix.scalar_type() == at::kInt && prefix.is_contiguous() && prefix.numel() == H * ((n + 31) / 32),
              "anchor_segment_attention: ", name, " prefix must be int32 [H, ceil(n / 32)], got ", prefix.sizes());
  const int64_t row = D * bits / 8;
  TORCH_CHECK(res.scalar_type() == at::kByte && res.is_contiguous() && (res.numel() == 0 || res.size(-1) == row) &&
                  scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() * row == res.numel(),
              "anchor_segment_attention: ", name, " residuals must be uint8 [slots, ", row, "] with fp32 [slots] scales");
  t.mask = mask.data_ptr<uint8_t>();
  t.prefix = prefix.data_ptr<int32_t>();
  t.res = res.data_ptr<uint8_t>();
  t.scale = scale.data_ptr<float>();
  t.bits = bits;
  t.slots = scale.numel();
  return t;
}

#if defined(__AVX512F__)
// y = levels[codes] for the D codes of one residual (`bits` 2 or 4, little-end first within a byte),
// `levels` already times the residual's scale (4 or 16 lanes used). Output vector m, lane l holds code
// 16 m + l: its byte is broadcast to the lane (one permute of the zero-extended bytes), shifted by
// its place in the byte (a variable shift), masked, and looked up in the levels (a lane permute), so
// 16 codes cost five vector operations and come out in order.
template <int BITS>
inline void decode_codes(const uint8_t* r, int64_t D, __m512 levels, float* y) {
  constexpr int PER_BYTE = 8 / BITS;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i byte_of_lane = _mm512_srli_epi32(lane, BITS == 2 ? 2 : 1);  // l / PER_BYTE
  const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(PER_BYTE - 1)),
                                          BITS == 2 ? 1 : 2);           // BITS * (l % PER_BYTE)
  const __m512i code_mask = _mm512_set1_epi32((1 << BITS) - 1);
  const int64_t bytes = D * BITS / 8;
  for (int64_t b0 = 0; b0 < bytes; b0 += 16) {  // 16 bytes: 16 PER_BYTE codes
    const int64_t nb = std::min<int64_t>(16, bytes - b0);
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(__mmask16((1u << nb) - 1), r + b0));
    for (int64_t m = 0; m < nb * PER_BYTE / 16; ++m) {
      const __m512i idx = _mm512_add_epi32(byte_of_lane, _mm512_set1_epi32(int(m * 16 / PER_BYTE)));
      const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(idx, wide), shift), code_mask);
      _mm512_storeu_ps(y + b0 * PER_BYTE + 16 * m, _mm512_permutexvar_ps(code, levels));
    }
  }
}

// The same into registers: y[m] = the residual's codes 16 m .. 16 m + 15 (D = 16 NCH, all compile-time).
template <int BITS, int NCH>
inline void decode_regs(const uint8_t* r, __m512 levels, __m512* y) {
  constexpr int PER_BYTE = 8 / BITS, BYTES = 16 * NCH / PER_BYTE;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i byte_of_lane = _mm512_srli_epi32(lane, BITS == 2 ? 2 : 1);
  const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(PER_BYTE - 1)),
                                          BITS == 2 ? 1 : 2);
  const __m512i code_mask = _mm512_set1_epi32((1 << BITS) - 1);
#pragma GCC unroll 16
  for (int b0 = 0; b0 < BYTES; b0 += 16) {
    const int nb = BYTES - b0 < 16 ? BYTES - b0 : 16;
    const __m512i wide = _mm512_cvtepu8_epi32(
        nb == 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + b0))
                 : _mm_maskz_loadu_epi8(__mmask16((1u << nb) - 1), r + b0));
#pragma GCC unroll 4
    for (int m = 0; m < nb * PER_BYTE / 16; ++m) {
      const __m512i idx = _mm512_add_epi32(byte_of_lane, _mm512_set1_epi32(m * 16 / PER_BYTE));
      const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(idx, wide), shift), code_mask);
      y[b0 * PER_BYTE / 16 + m] = _mm512_permutexvar_ps(code, levels);
    }
  }
}

// 16 consecutive elements widened to fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(KVPACK_AVX2)
// The same on 8 lanes: 8 bytes zero-extended to 8 int32 lanes, each output vector's bytes broadcast
// to its lanes by a lane permute, shifted, masked, and looked up; 16 levels (4-bit) are two 8-entry
// permutes blended on the code's bit 3. Needs D % 8 == 0.
// Output vector m of an 8-byte chunk's codes (`wide`: its bytes zero-extended to the 8 lanes): each
// lane's byte permuted in, shifted to its code, masked, and looked up in the levels.
template <int BITS>
inline __m256 lookup_codes8(__m256i wide, int m, __m256 levels_lo, __m256 levels_hi) {
  constexpr int PER_BYTE = 8 / BITS;
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i byte_of_lane = _mm256_srli_epi32(lane, BITS == 2 ? 2 : 1);
  const __m256i shift = _mm256_slli_epi32(_mm256_and_si256(lane, _mm256_set1_epi32(PER_BYTE - 1)), BITS == 2 ? 1 : 2);
  const __m256i idx = _mm256_add_epi32(byte_of_lane, _mm256_set1_epi32(m * 8 / PER_BYTE));
  const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(wide, idx), shift),
                                        _mm256_set1_epi32((1 << BITS) - 1));
  __m256 v = _mm256_permutevar8x32_ps(levels_lo, code);
  if constexpr (BITS == 4)
    v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(levels_hi, code), _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
  return v;
}

// Up to 8 bytes from r, zero-extended to the 8 int32 lanes (no read past the nb bytes).
inline __m256i load_bytes8(const uint8_t* r, int64_t nb) {
  uint64_t chunk = 0;
  std::memcpy(&chunk, r, size_t(nb));
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(chunk)));
}

template <int BITS>
inline void decode_codes8(const uint8_t* r, int64_t D, __m256 levels_lo, __m256 levels_hi, float* y) {
  constexpr int PER_BYTE = 8 / BITS;
  const int64_t bytes = D * BITS / 8;
  for (int64_t b0 = 0; b0 < bytes; b0 += 8) {  // 8 bytes: 8 PER_BYTE codes
    const int64_t nb = std::min<int64_t>(8, bytes - b0);
    const __m256i wide = load_bytes8(r + b0, nb);
    for (int64_t m = 0; m < nb * PER_BYTE / 8; ++m)
      _mm256_storeu_ps(y + b0 * PER_BYTE + 8 * m, lookup_codes8<BITS>(wide, int(m), levels_lo, levels_hi));
  }
}

// The same into registers: y[m] = the residual's codes 8 m .. 8 m + 7 (D = 8 NCH, all compile-time).
template <int BITS, int NCH>
inline void decode_regs8(const uint8_t* r, __m256 levels_lo, __m256 levels_hi, __m256* y) {
  constexpr int PER_BYTE = 8 / BITS, BYTES = 8 * NCH / PER_BYTE;
#pragma GCC unroll 16
  for (int b0 = 0; b0 < BYTES; b0 += 8) {
    const int nb = BYTES - b0 < 8 ? BYTES - b0 : 8;
    const __m256i wide = load_bytes8(r + b0, nb);
#pragma GCC unroll 4
    for (int m = 0; m < nb * PER_BYTE / 8; ++m)
      y[b0 * PER_BYTE / 8 + m] = lookup_codes8<BITS>(wide, m, levels_lo, levels_hi);
  }
}

// 8 consecutive elements widened to fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// y = scale * levels[codes] of residual `slot` of a tier.
inline void residual_codes(const Tier& t, const Codec& c, int64_t slot, float* y) {
  TORCH_CHECK(slot >= 0 && slot < t.slots, "anchor_segment_attention: residual slot ", slot, " outside [0, ",
              t.slots, "): corrupted mask or prefix");
  const float s = t.scale[slot];
  const int64_t D = c.D;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const __m512 sv = _mm512_set1_ps(s);
    if (t.bits == 2)
      return decode_codes<2>(t.res + slot * (D / 4), D, _mm512_mul_ps(_mm512_loadu_ps(c.levels2), sv), y);
    return decode_codes<4>(t.res + slot * (D / 2), D, _mm512_mul_ps(_mm512_loadu_ps(c.levels4), sv), y);
  }
#elif defined(KVPACK_AVX2)
  if (D % 8 == 0) {
    const __m256 sv = _mm256_set1_ps(s);
    if (t.bits == 2)
      return decode_codes8<2>(t.res + slot * (D / 4), D, _mm256_mul_ps(_mm256_loadu_ps(c.levels2), sv), sv, y);
    return decode_codes8<4>(t.res + slot * (D / 2), D, _mm256_mul_ps(_mm256_loadu_ps(c.levels4), sv),
                            _mm256_mul_ps(_mm256_loadu_ps(c.levels4 + 8), sv), y);
  }
#endif
  if (t.bits == 2) {
    const uint8_t* r = t.res + slot * (D / 4);
    for (int64_t j = 0; j < D / 4; ++j) {
      const int b = r[j];
      y[4 * j] = s * c.levels2[b & 3];
      y[4 * j + 1] = s * c.levels2[(b >> 2) & 3];
      y[4 * j + 2] = s * c.levels2[(b >> 4) & 3];
      y[4 * j + 3] = s * c.levels2[b >> 6];
    }
  } else {
    const uint8_t* r = t.res + slot * (D / 2);
    for (int64_t j = 0; j < D / 2; ++j) {
      const int b = r[j];
      y[2 * j] = s * c.levels4[b & 15];
      y[2 * j + 1] = s * c.levels4[b >> 4];
    }
  }
}

// For each token of block `blk` (tokens [t0, t1)) of head h: the tier and slot of its residual, or -1.
struct BlockSlots {
  int8_t tier[32];
  int64_t slot[32];
};

inline void block_slots(const Side& side, int64_t h, int64_t n, int64_t blk, int64_t t0, int64_t t1, BlockSlots& out) {
  for (int64_t t = t0; t < t1; ++t) out.tier[t - t0] = -1;
  for (int k = 0; k < 2; ++k) {
    const Tier& tier = side.tiers[k];
    if (!tier.present()) continue;
    int64_t slot = tier.prefix[h * ((n + 31) / 32) + blk];
    const uint8_t* bits = tier.mask + h * ((n + 7) / 8);
    for (int64_t t = t0; t < t1; ++t)
      if ((bits[t >> 3] >> (t & 7)) & 1) {
        out.tier[t - t0] = int8_t(k);
        out.slot[t - t0] = slot++;
      }
  }
}

// Scores s[i * 32 + (t - t0)] of the M query rows against the keys of block [t0, t1) of head h, each key
// rebuilt as coef * anchor + residual (pre-RoPE) and rotated by RoPE at its position: one row at a time
// through a buffer (any D, any rotation).
template <typename E>
void block_key_scores(const float* q, int64_t M, int64_t h, int64_t n, int64_t K, int64_t D, const E* anchor_k,
                      const Side& ks, const BlockSlots& slots, const Codec& codec, const float* cos, const float* sin,
                      int64_t W, int64_t first_position, float scaling, int64_t t0, int64_t t1, float* s) {
  std::vector<float> keys((t1 - t0) * D), y(D), tmp;
  for (int64_t t = t0; t < t1; ++t) {
    float* x = keys.data() + (t - t0) * D;
    const int64_t e = h * n + t;
    widen_row(anchor_k + (h * K + ks.anchor_of(e)) * D, x, D);
    const float g = widen(ks.coef[e]);
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) x[c] *= g;
    if (slots.tier[t - t0] >= 0) {
      residual_codes(ks.tiers[slots.tier[t - t0]], codec, slots.slot[t - t0], y.data());
      codec.unrotate_add(y.data(), x, tmp);
    }
    rotate_row(x, cos + (first_position + t) * W, sin + (first_position + t) * W, D, W);
  }
  scores_block(q, keys.data(), M, t1 - t0, D, scaling, s, 32);
}

#if defined(__AVX512F__)
// The same with each key held in NCH registers (D = 16 NCH, NCH even: RoPE's halves are whole vectors)
// from its anchor row to its dot products: widened, scaled, its residual decoded, Hadamard-transformed
// (or not: the identity) and added, rotated, dotted with the query rows, never stored. The buffered
// version spent most of its time on the store-then-load between those steps (perf: the scale, RoPE and
// dot loops, each a pass over the row in memory).
template <int NCH, typename E>
void block_key_scores_regs(const float* q, int64_t M, int64_t h, int64_t n, int64_t K, const E* anchor_k,
                           const Side& ks, const BlockSlots& slots, const Codec& codec, const float* cos,
                           const float* sin, int64_t W, int64_t first_position, float scaling, int64_t t0, int64_t t1,
                           float* s) {
  static_assert(NCH % 2 == 0, "RoPE's halves must be whole vectors");
  constexpr int64_t D = 16 * NCH;
  constexpr int HALF = NCH / 2;
  __m512 fs[NCH];
  for (int j = 0; j < NCH; ++j) fs[j] = _mm512_loadu_ps(codec.factor_signs.data() + 16 * j);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t e = h * n + t;
    const E* a = anchor_k + (h * K + ks.anchor_of(e)) * D;
    const __m512 g = _mm512_set1_ps(widen(ks.coef[e]));
    __m512 x[NCH];
    for (int j = 0; j < NCH; ++j) x[j] = _mm512_mul_ps(g, load16(a + 16 * j));
    if (slots.tier[t - t0] >= 0) {
      const Tier& tier = ks.tiers[slots.tier[t - t0]];
      const int64_t slot = slots.slot[t - t0];
      TORCH_CHECK(slot >= 0 && slot < tier.slots, "anchor_segment_attention: residual slot ", slot, " outside [0, ",
                  tier.slots, "): corrupted mask or prefix");
      const __m512 sv = _mm512_set1_ps(tier.scale[slot]);
      __m512 y[NCH];
      if (tier.bits == 2) decode_regs<2, NCH>(tier.res + slot * (D / 4), _mm512_mul_ps(_mm512_loadu_ps(codec.levels2), sv), y);
      else decode_regs<4, NCH>(tier.res + slot * (D / 2), _mm512_mul_ps(_mm512_loadu_ps(codec.levels4), sv), y);
      if (codec.rotation == Rotation::Sylvester) fwht_inplace<NCH>(y);
      for (int j = 0; j < NCH; ++j) x[j] = _mm512_fmadd_ps(fs[j], y[j], x[j]);
    }
    const float* c = cos + (first_position + t) * W;
    const float* sn = sin + (first_position + t) * W;
    const float* c2 = W == D ? c + D / 2 : c;
    const float* s2 = W == D ? sn + D / 2 : sn;
    for (int j = 0; j < HALF; ++j) {  // rotate_row's rotate_half convention
      const __m512 k1 = x[j], k2 = x[j + HALF];
      x[j] = _mm512_fmsub_ps(k1, _mm512_loadu_ps(c + 16 * j), _mm512_mul_ps(k2, _mm512_loadu_ps(sn + 16 * j)));
      x[j + HALF] = _mm512_fmadd_ps(k1, _mm512_loadu_ps(s2 + 16 * j), _mm512_mul_ps(k2, _mm512_loadu_ps(c2 + 16 * j)));
    }
    for (int64_t i = 0; i < M; ++i) {
      const float* qi = q + i * D;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qi), x[0]);
      for (int j = 1; j < NCH; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * j), x[j], acc);
      s[i * 32 + (t - t0)] = _mm512_reduce_add_ps(acc) * scaling;
    }
  }
}
#elif defined(KVPACK_AVX2)
// block_key_scores_regs on 8-lane vectors (D = 8 NCH, NCH even). AVX2 has 16 registers: the key's NCH
// vectors are the only ones held across the steps (the residual is decoded into them, then the scaled
// anchor and the factor signs, both loaded from L1, are added), so D = 32 and 64 stay in registers.
template <int NCH, typename E>
void block_key_scores_regs8(const float* q, int64_t M, int64_t h, int64_t n, int64_t K, const E* anchor_k,
                            const Side& ks, const BlockSlots& slots, const Codec& codec, const float* cos,
                            const float* sin, int64_t W, int64_t first_position, float scaling, int64_t t0,
                            int64_t t1, float* s) {
  static_assert(NCH % 2 == 0, "RoPE's halves must be whole vectors");
  constexpr int64_t D = 8 * NCH;
  constexpr int HALF = NCH / 2;
  const float* fs = codec.factor_signs.data();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t e = h * n + t;
    const E* a = anchor_k + (h * K + ks.anchor_of(e)) * D;
    const __m256 g = _mm256_set1_ps(widen(ks.coef[e]));
    __m256 x[NCH];
    if (slots.tier[t - t0] >= 0) {
      const Tier& tier = ks.tiers[slots.tier[t - t0]];
      const int64_t slot = slots.slot[t - t0];
      TORCH_CHECK(slot >= 0 && slot < tier.slots, "anchor_segment_attention: residual slot ", slot, " outside [0, ",
                  tier.slots, "): corrupted mask or prefix");
      const __m256 sv = _mm256_set1_ps(tier.scale[slot]);
      if (tier.bits == 2)
        decode_regs8<2, NCH>(tier.res + slot * (D / 4), _mm256_mul_ps(_mm256_loadu_ps(codec.levels2), sv), sv, x);
      else
        decode_regs8<4, NCH>(tier.res + slot * (D / 2), _mm256_mul_ps(_mm256_loadu_ps(codec.levels4), sv),
                             _mm256_mul_ps(_mm256_loadu_ps(codec.levels4 + 8), sv), x);
      if (codec.rotation == Rotation::Sylvester) fwht_inplace<NCH>(x);
      for (int j = 0; j < NCH; ++j)
        x[j] = _mm256_fmadd_ps(_mm256_loadu_ps(fs + 8 * j), x[j], _mm256_mul_ps(g, load8(a + 8 * j)));
    } else {
      for (int j = 0; j < NCH; ++j) x[j] = _mm256_mul_ps(g, load8(a + 8 * j));
    }
    const float* c = cos + (first_position + t) * W;
    const float* sn = sin + (first_position + t) * W;
    const float* c2 = W == D ? c + D / 2 : c;
    const float* s2 = W == D ? sn + D / 2 : sn;
    for (int j = 0; j < HALF; ++j) {  // rotate_row's rotate_half convention
      const __m256 k1 = x[j], k2 = x[j + HALF];
      x[j] = _mm256_fmsub_ps(k1, _mm256_loadu_ps(c + 8 * j), _mm256_mul_ps(k2, _mm256_loadu_ps(sn + 8 * j)));
      x[j + HALF] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(s2 + 8 * j), _mm256_mul_ps(k2, _mm256_loadu_ps(c2 + 8 * j)));
    }
    for (int64_t i = 0; i < M; ++i) {
      const float* qi = q + i * D;
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qi), x[0]);
      for (int j = 1; j < NCH; ++j) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 8 * j), x[j], acc);
      s[i * 32 + (t - t0)] = hsum8(acc) * scaling;
    }
  }
}
#endif

template <typename E>
void segment_blocks(const float* q, int64_t h, int64_t b0, int64_t b1, int64_t n, int64_t K, int64_t D,
                    const E* anchor_k, const E* anchor_v, const Side& ks, const Side& vs, const Codec& codec,
                    const float* cos, const float* sin, int64_t W, int64_t first_position, float scaling,
                    RowsState& st) {
  const int64_t M = st.M;
  // s [M, 32] the block's logits then probabilities; yb [32, D] its value residuals (decoded, rotated
  // domain) and cb [M, 32] their probabilities; bins [M, K] sum p coef per anchor; touched: anchors any
  // value of the split points to.
  std::vector<float> s(M * 32), yb(32 * D), cb(M * 32), bins(M * K, 0.f), acc_rot(M * D, 0.f), m_old(M), tmp;
  std::vector<uint8_t> touched(K, 0);
  bool any_value_residual = false;
  BlockSlots slots{};
  auto key_scores = [&](int64_t t0, int64_t t1) {
#if defined(__AVX512F__)
    if (codec.rotation != Rotation::Matrix) switch (D) {
        case 32: return block_key_scores_regs<2>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W, first_position,
                                                 scaling, t0, t1, s.data());
        case 64: return block_key_scores_regs<4>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W, first_position,
                                                 scaling, t0, t1, s.data());
        case 128: return block_key_scores_regs<8>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W,
                                                  first_position, scaling, t0, t1, s.data());
        case 256: return block_key_scores_regs<16>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W,
                                                   first_position, scaling, t0, t1, s.data());
        default: break;
      }
#elif defined(KVPACK_AVX2)
    if (codec.rotation != Rotation::Matrix) switch (D) {
        case 32: return block_key_scores_regs8<4>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W,
                                                  first_position, scaling, t0, t1, s.data());
        case 64: return block_key_scores_regs8<8>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W,
                                                  first_position, scaling, t0, t1, s.data());
        default: break;
      }
#endif
    block_key_scores(q, M, h, n, K, D, anchor_k, ks, slots, codec, cos, sin, W, first_position, scaling, t0, t1,
                     s.data());
  };
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t t0 = blk * 32, t1 = std::min(n, t0 + 32), B = t1 - t0;
    block_slots(ks, h, n, blk, t0, t1, slots);
    key_scores(t0, t1);
    std::copy(st.m.begin(), st.m.end(), m_old.begin());
    st.absorb(s.data(), B, 32);
    for (int64_t i = 0; i < M; ++i) {  // the value sums kept outside st.o follow its rescaling
      if (m_old[i] == st.m[i]) continue;
      const float alpha = m_old[i] == NEG_INF ? 0.f : exp_approx(m_old[i] - st.m[i]);
      for (int64_t j = 0; j < K; ++j) bins[i * K + j] *= alpha;
      for (int64_t c = 0; c < D; ++c) acc_rot[i * D + c] *= alpha;
    }
    // Values: p coef into the anchor bins; p y summed in the rotated domain (the block's residuals
    // decoded into yb, then one register-held accumulation per query row).
    block_slots(vs, h, n, blk, t0, t1, slots);
    int64_t n_res = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = h * n + t, a = vs.anchor_of(e);
      const float g = widen(vs.coef[e]);
      touched[a] = 1;
      for (int64_t i = 0; i < M; ++i) bins[i * K + a] += s[i * 32 + (t - t0)] * g;
      if (slots.tier[t - t0] >= 0) {
        residual_codes(vs.tiers[slots.tier[t - t0]], codec, slots.slot[t - t0], yb.data() + n_res * D);
        for (int64_t i = 0; i < M; ++i) cb[i * 32 + n_res] = s[i * 32 + (t - t0)];
        ++n_res;
      }
    }
    if (n_res) {
      for (int64_t i = 0; i < M; ++i) combine(cb.data() + i * 32, yb.data(), n_res, D, acc_rot.data() + i * D);
      any_value_residual = true;
    }
  }
  // o += bins @ anchor_v over the anchors the split's values point to (32 rows widened at a time, one
  // register-held accumulation per query row), then + unrotate(acc_rot), once per split.
  std::vector<int64_t> used;
  for (int64_t j = 0; j < K; ++j)
    if (touched[j]) used.push_back(j);
  std::vector<float> rows(32 * D), w(32);
  for (size_t c0 = 0; c0 < used.size(); c0 += 32) {
    const int64_t cnt = int64_t(std::min<size_t>(32, used.size() - c0));
    for (int64_t r = 0; r < cnt; ++r) widen_row(anchor_v + (h * K + used[c0 + r]) * D, rows.data() + r * D, D);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t r = 0; r < cnt; ++r) w[r] = bins[i * K + used[c0 + r]];
      combine(w.data(), rows.data(), cnt, D, st.o.data() + i * D);
    }
  }
  if (any_value_residual)
    for (int64_t i = 0; i < M; ++i) codec.unrotate_add(acc_rot.data() + i * D, st.o.data() + i * D, tmp);
}

Side make_side(const at::Tensor& index, const at::Tensor& coef, int64_t H, int64_t n, int64_t K, const char* name) {
  TORCH_CHECK((index.scalar_type() == at::kByte || index.scalar_type() == at::kShort) && index.is_contiguous() &&
                  index.numel() == H * n,
              "anchor_segment_attention: ", name, " index must be uint8 or int16 [H, n], got ", index.sizes());
  TORCH_CHECK(coef.scalar_type() == at::kHalf && coef.is_contiguous() && coef.numel() == H * n,
              "anchor_segment_attention: ", name, " coef must be fp16 [H, n]");
  Side s{index.data_ptr(), index.scalar_type() == at::kByte, coef.data_ptr<c10::Half>(), {}};
  for (int64_t e = 0; e < H * n; ++e) {
    const int64_t a = s.anchor_of(e);
    TORCH_CHECK(a >= 0 && a < K, "anchor_segment_attention: ", name, " index ", a, " outside the ", K, " anchors");
  }
  return s;
}

}  // namespace

State anchor_segment_attention(
    const at::Tensor& q, const at::Tensor& anchor_k, const at::Tensor& anchor_v, const at::Tensor& hmat,
    const at::Tensor& signs, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& index_k,
    const at::Tensor& coef_k, const at::Tensor& mask_k, const at::Tensor& prefix_k, const at::Tensor& res_k,
    const at::Tensor& scale_k, const at::Tensor& index_v, const at::Tensor& coef_v, const at::Tensor& mask_v,
    const at::Tensor& prefix_v, const at::Tensor& res_v, const at::Tensor& scale_v, const at::Tensor& fine_mask_k,
    const at::Tensor& fine_prefix_k, const at::Tensor& fine_res_k, const at::Tensor& fine_scale_k,
    const at::Tensor& fine_mask_v, const at::Tensor& fine_prefix_v, const at::Tensor& fine_res_v,
    const at::Tensor& fine_scale_v, const at::Tensor& fine_levels, c10::ArrayRef<double> levels, double hfactor,
    double scaling, int64_t first_position, int64_t blocks_per_split) {
  check_queries(q);
  const int64_t H = q.size(0), D = q.size(2), n = index_k.dim() == 2 ? index_k.size(1) : 0;
  TORCH_CHECK(D % 4 == 0, "anchor_segment_attention: head_dim must be a multiple of 4, got ", D);
  for (const auto* a : {&anchor_k, &anchor_v})
    TORCH_CHECK(a->dim() == 3 && a->size(0) == H && a->size(2) == D && a->is_contiguous() &&
                    a->scalar_type() == anchor_k.scalar_type(),
                "anchor_segment_attention: anchors must be contiguous [H, k, D] of one dtype, got ", a->sizes());
  const int64_t K = anchor_k.size(1);
  TORCH_CHECK(anchor_v.size(1) == K, "anchor_segment_attention: key and value anchors differ in count");
  TORCH_CHECK(hmat.scalar_type() == at::kHalf && hmat.dim() == 2 && hmat.size(0) == D && hmat.size(1) == D,
              "anchor_segment_attention: hmat must be the codec's [D, D] fp16 0/±1 matrix");
  TORCH_CHECK(levels.size() == 4, "anchor_segment_attention: the 2-bit codec has 4 levels, got ", levels.size());
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && (cos.size(1) == D || cos.size(1) == D / 2) &&
                  cos.size(0) >= first_position + n,
              "anchor_segment_attention: the RoPE tables must be fp32 [positions >= ", first_position + n,
              ", D or D / 2]");
  Codec codec;
  codec.D = D;
  codec.rotation = classify(hmat.contiguous(), codec.matrix);
  codec.signs.resize(D);
  widen_row(signs.contiguous().data_ptr<float>(), codec.signs.data(), D);
  codec.factor = float(hfactor);
  codec.factor_signs.resize(D);
  for (int64_t c = 0; c < D; ++c) codec.factor_signs[c] = codec.factor * codec.signs[c];
  for (int i = 0; i < 4; ++i) codec.levels2[i] = float(levels[i]);
  const bool fine = fine_mask_k.numel() > 0;
  if (fine) {
    TORCH_CHECK(fine_levels.scalar_type() == at::kFloat && fine_levels.numel() == 16,
                "anchor_segment_attention: the fine tier needs 16 fp32 levels");
    std::copy(fine_levels.data_ptr<float>(), fine_levels.data_ptr<float>() + 16, codec.levels4);
  }
  Side ks = make_side(index_k, coef_k, H, n, K, "key");
  Side vs = make_side(index_v, coef_v, H, n, K, "value");
  ks.tiers[0] = make_tier(mask_k, prefix_k, res_k, scale_k, 2, H, n, D, "key");
  vs.tiers[0] = make_tier(mask_v, prefix_v, res_v, scale_v, 2, H, n, D, "value");
  if (fine) {
    ks.tiers[1] = make_tier(fine_mask_k, fine_prefix_k, fine_res_k, fine_scale_k, 4, H, n, D, "fine key");
    vs.tiers[1] = make_tier(fine_mask_v, fine_prefix_v, fine_res_v, fine_scale_v, 4, H, n, D, "fine value");
  }
  const int64_t n_blocks = (n + 31) / 32, bps = std::max<int64_t>(1, blocks_per_split);
  const float* qp = q.data_ptr<float>();
  const int64_t W = cos.size(1);
  State out;
  with_dtype(anchor_k, "anchor_segment_attention: anchors", [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    const E* ak = static_cast<const E*>(anchor_k.data_ptr());
    const E* av = static_cast<const E*>(anchor_v.data_ptr());
    out = split_k(H, n_chunks(n_blocks, bps), q.size(1), D, q.options(), [&](int64_t h, int64_t s, RowsState& st) {
      segment_blocks(qp + h * q.size(1) * D, h, s * bps, std::min(n_blocks, (s + 1) * bps), n, K, D, ak, av, ks, vs,
                     codec, cos.data_ptr<float>(), sin.data_ptr<float>(), W, first_position, float(scaling), st);
    });
  });
  return out;
}

}  // namespace kvpack
