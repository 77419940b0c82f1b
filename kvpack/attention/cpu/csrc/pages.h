// Factorized pages on CPU, shared by the PuzzleKV kernels (puzzle.cpp: fixed ranks; ragged.cpp:
// puzzle_plus's per-(page, head) ranks): one page's factors widened to fp32 (INT4 decoded), and the
// fold of one page into the online-softmax state.
//
// Post-RoPE keys are scored in rank space, (q R_K^T) L_K^T: the page's dense keys never exist.
// Pre-RoPE keys depend on the position inside the page through the rotation, so a page's keys are
// rebuilt, L_K R_K, a tile of tokens at a time in registers, rotated there at their positions
// (rotate_half convention) and dotted with the queries at once: the rebuilt keys never reach memory.
// That rebuild is P r D multiply-adds per page, the page's whole cost when r is near P (puzzle_plus's
// INT4 default spends its budget on ranks of 56-64 of 64), so it is a register-tiled product.
// Values always go through their factors: o += (p L_V) R_V.
#pragma once

#include "common.h"

namespace kvpack {

// One page's factors as fp32, as stored (row-major, at the page's own ranks rk <= RK, rv <= RV):
// lk [P, rk], rk [rk, D], lv [P, rv], rv [rv, D].
//
// Where pre-RoPE keys are rebuilt with bf16 products (Geometry::bf16_products), the key side is held as
// that product's operands: lk16 [P, 2 RP] bf16 rows, rk16 [RP, D, 2] bf16 rank pairs (RP = ceil(rank / 2)).
// INT4 keys are loaded straight into them (load_int4_keys), with R_K's column scales rk_scale [D] kept
// apart; float keys are loaded as fp32 and converted (pre_rope_scores_bf16).
struct Page {
  std::vector<float> lk, rk, lv, rv;
  std::vector<uint16_t> lk16, rk16;
  std::vector<float> rk_scale;
  Page(int64_t P, int64_t RK, int64_t RV, int64_t D) : lk(P * RK), rk(RK * D), lv(P * RV), rv(RV * D) {}
};

// [rows, cols] -> [cols, rows]
inline void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// rows x cols INT4 matrix (packed rows of ceil(cols / 2) bytes, low nibble first) -> fp32 [rows, cols]:
// each code minus 8 times an fp16 scale per column (col_scales, [cols]) or per row (row_scales, [rows]).
// One pass, a vector of codes at a time straight from the packed bytes (Vec::decode looks each code up
// in the 16 values code - 8, exact in fp32), times the scales: one product, as a scalar loop computes it.
// (Widening first and scaling in a second pass was 21% of a perf profile of puzzle_plus's INT4 decode on
// a Zen 1 core.)
inline void widen_int4(const uint8_t* src, const c10::Half* col_scales, const c10::Half* row_scales, int64_t rows,
                       int64_t cols, float* dst, std::vector<float>& scale_buf) {
  static constexpr float kMinus8[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
  constexpr int L = Vec::kLanes;
  const Vec::Table codes = Vec::table(kMinus8, 1.f);
  const int64_t stride = (cols + 1) / 2;
  const float* sc = nullptr;
  if (col_scales) {
    scale_buf.resize(cols);
    widen_row(col_scales, scale_buf.data(), cols);
    sc = scale_buf.data();
  }
  auto code = [](const uint8_t* p, int64_t c) { return kMinus8[stream_code<4>(p, c)]; };
  if (cols % 2 == 0 && cols < 2 * L) {
    // Short rows (a rank of 14 fills less than a vector): the rows are back to back, so their codes are
    // widened in one flat pass, then scaled row by row.
    const int64_t n = rows * cols;
    int64_t c = 0;
    for (; c + L <= n; c += L) Vec::decode<4>(src, c / L, codes).store(dst + c);
    for (; c < n; ++c) dst[c] = code(src, c);
    for (int64_t r = 0; r < rows; ++r) {
      float* out = dst + r * cols;
      if (sc) {
#pragma omp simd
        for (int64_t k = 0; k < cols; ++k) out[k] *= sc[k];
      } else {
        const float a = widen(row_scales[r]);
#pragma omp simd
        for (int64_t k = 0; k < cols; ++k) out[k] *= a;
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * stride;
    float* out = dst + r * cols;
    int64_t c = 0;
    if (sc) {
      for (; c + L <= cols; c += L) (Vec::decode<4>(row, c / L, codes) * Vec::load(sc + c)).store(out + c);
      for (; c < cols; ++c) out[c] = code(row, c) * sc[c];
    } else {
      const float a = widen(row_scales[r]);
      const Vec av = Vec::splat(a);
      for (; c + L <= cols; c += L) (Vec::decode<4>(row, c / L, codes) * av).store(out + c);
      for (; c < cols; ++c) out[c] = code(row, c) * a;
    }
  }
}

// Tokens a rotation-pair tile holds: 2 TT accumulators + 2 R_K vectors + a broadcast fill the registers.
constexpr int kGroupTokens = Vec::kRegisters >= 5 ? (Vec::kRegisters - 3) / 2 : 1;

struct Geometry {
  int64_t M, D, P, RK, RV;
  float scaling;
  bool int4, pre_rope;
  const float* cos;  // [positions, W]
  const float* sin;
  int64_t W;
  bool bf16_products = false;  // pre-RoPE keys rebuilt with bf16 products (resolved by bf16_rebuild)
};

// Per-job buffers of fold_page: qr [M, RK] (queries in rank space), s [M, P] (logits, then
// probabilities), u [M, RV] (probabilities in rank space), keys [P, D] (the generic pre-RoPE path's
// rebuilt keys), lkT [RK, P] (post-RoPE: L_K transposed, so that its inner loop runs over the tokens),
// dots [kGroupTokens, M, kLanes] (pre-RoPE: the rotation-pair tiles' lane-wise dot products).
struct PageScratch {
  std::vector<float> qr, s, u, keys, lkT, dots;
  explicit PageScratch(const Geometry& g)
      : qr(g.M * g.RK), s(g.M * g.P), u(g.M * g.RV), keys(g.pre_rope ? g.P * g.D : 0),
        lkT(g.pre_rope ? 0 : g.RK * g.P), dots(g.pre_rope ? kGroupTokens * g.M * Vec::kLanes : 0) {}
};

// Pre-RoPE keys rebuilt in registers, two tilings written once on Vec and chosen by the register file
// (pre_rope_scores):
// - full-row tiles (32 registers, AVX-512): TT tokens x the key's NV = D / kLanes vectors, NV TT = 16
//   accumulators; per rank NV loads of R_K and TT broadcasts feed NV TT multiply-adds;
// - rotation-pair groups (16 registers, AVX2): TT tokens x one group of kLanes rotation pairs (channels
//   c0 + [0, kLanes) and their partners D / 2 + c0 + [0, kLanes)): 2 TT accumulators, the group's 2 R_K
//   vectors and a broadcast (15 at TT = 6). Per rank 2 TT multiply-adds against 2 loads and TT
//   broadcasts, so the FMA units, not the loads, set the pace (full-row tiles at this register count,
//   4 vectors and 2 tokens, were load-bound at about half the FMA rate on a Zen 1 core). Each group's
//   keys are rotated in registers and their products with the queries added, lane-wise, into dots
//   [TT][M] vectors, summed across lanes once at the end.

// The tile's rebuilt keys acc [TT][NV] (token t at the tables' row t) rotated in registers, then
// s[i * stride + t] = q_i . key_t for the M query rows.
template <int NV, int TT>
inline void rotate_and_score(Vec (&acc)[TT][NV], const float* __restrict q, int64_t M, const float* cos,
                             const float* sin, int64_t W, float* s, int64_t stride) {
  constexpr int L = Vec::kLanes, D = L * NV, HV = NV / 2;
  for (int t = 0; t < TT; ++t) {
    const RopeRow rope(cos + t * W, sin + t * W, D, W);
    for (int v = 0; v < HV; ++v) rotate_pair(acc[t][v], acc[t][v + HV], rope, L * v);
    for (int64_t i = 0; i < M; ++i) {
      const float* qi = q + i * D;
      Vec d = Vec::load(qi) * acc[t][0];
      for (int v = 1; v < NV; ++v) d = fma(Vec::load(qi + L * v), acc[t][v], d);
      s[i * stride + t] = d.reduce_add();
    }
  }
}

// Full-row tile: logits of M query rows against TT consecutive pre-RoPE keys of a page, rebuilt in
// registers: key t = sum_r lk[t, r] R[r] (lk rows of `rank` coefficients, R [rank, kLanes NV]), rotated
// at position pos + t, then s[i * stride + t] = q_i . key_t.
template <int NV, int TT>
inline void rope_scores_tile(const float* __restrict q, int64_t M, const float* __restrict lk, int64_t rank,
                             const float* __restrict R, const float* cos, const float* sin, int64_t W, float* s,
                             int64_t stride) {
  constexpr int L = Vec::kLanes, D = L * NV;
  Vec acc[TT][NV];
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = Vec::zero();
  for (int64_t r = 0; r < rank; ++r) {
    const float* row = R + r * D;
    Vec rv[NV];
    for (int v = 0; v < NV; ++v) rv[v] = Vec::load(row + L * v);
    for (int t = 0; t < TT; ++t) {
      const Vec a = Vec::splat(lk[t * rank + r]);
      for (int v = 0; v < NV; ++v) acc[t][v] = fma(a, rv[v], acc[t][v]);
    }
  }
  rotate_and_score<NV, TT>(acc, q, M, cos, sin, W, s, stride);
}

// The page's P tokens through rope_scores_tile, TT at a time (then one at a time).
template <int NV, int TT>
inline void rope_scores(const float* q, int64_t M, const float* lk, int64_t rank, const float* R, int64_t P,
                        int64_t pos, const Geometry& g, float* s) {
  int64_t p = 0;
  for (; p + TT <= P; p += TT)
    rope_scores_tile<NV, TT>(q, M, lk + p * rank, rank, R, g.cos + (pos + p) * g.W, g.sin + (pos + p) * g.W, g.W,
                             s + p, P);
  for (; p < P; ++p)
    rope_scores_tile<NV, 1>(q, M, lk + p * rank, rank, R, g.cos + (pos + p) * g.W, g.sin + (pos + p) * g.W, g.W,
                            s + p, P);
}

// Rotation-pair groups: the same logits, TT tokens at a time (dots: TT M kLanes floats of scratch).
// Needs D % (2 kLanes) == 0.
template <int TT>
inline void rope_scores_group_tile(const float* __restrict q, int64_t M, int64_t D, const float* __restrict lk,
                                   int64_t rank, const float* __restrict R, const float* cos, const float* sin,
                                   int64_t W, float* s, int64_t stride, float* __restrict dots) {
  constexpr int L = Vec::kLanes;
  const int64_t half = D / 2;
  std::fill(dots, dots + TT * M * L, 0.f);
  for (int64_t c0 = 0; c0 < half; c0 += L) {
    Vec acc[TT][2];
    for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = Vec::zero();
    const float* row = R + c0;
    for (int64_t r = 0; r < rank; ++r, row += D) {
      Vec r0 = Vec::load(row), r1 = Vec::load(row + half);
      r0.pin();  // kept from being folded into (and reloaded by) every multiply-add
      r1.pin();
      for (int t = 0; t < TT; ++t) {
        const Vec a = Vec::splat(lk[t * rank + r]);
        acc[t][0] = fma(a, r0, acc[t][0]);
        acc[t][1] = fma(a, r1, acc[t][1]);
      }
    }
    for (int t = 0; t < TT; ++t) {
      Vec k1r = acc[t][0], k2r = acc[t][1];
      rotate_pair(k1r, k2r, RopeRow(cos + t * W, sin + t * W, D, W), c0);
      for (int64_t i = 0; i < M; ++i) {
        const float* qi = q + i * D + c0;
        float* di = dots + (t * M + i) * L;
        fma(Vec::load(qi + half), k2r, fma(Vec::load(qi), k1r, Vec::load(di))).store(di);
      }
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int64_t i = 0; i < M; ++i) s[i * stride + t] = Vec::load(dots + (t * M + i) * L).reduce_add();
}

inline void rope_scores_grouped(const float* q, int64_t M, const float* lk, int64_t rank, const float* R, int64_t P,
                                int64_t pos, const Geometry& g, float* s, float* dots) {
  int64_t p = 0;
  auto at = [&](int64_t p) { return std::make_pair(g.cos + (pos + p) * g.W, g.sin + (pos + p) * g.W); };
  for (; p + kGroupTokens <= P; p += kGroupTokens) {
    const auto [c, sn] = at(p);
    rope_scores_group_tile<kGroupTokens>(q, M, g.D, lk + p * rank, rank, R, c, sn, g.W, s + p, P, dots);
  }
  for (; p + 2 <= P; p += 2) {
    const auto [c, sn] = at(p);
    rope_scores_group_tile<2>(q, M, g.D, lk + p * rank, rank, R, c, sn, g.W, s + p, P, dots);
  }
  for (; p < P; ++p) {
    const auto [c, sn] = at(p);
    rope_scores_group_tile<1>(q, M, g.D, lk + p * rank, rank, R, c, sn, g.W, s + p, P, dots);
  }
}

#if defined(__AVX512F__)
// ---- The same rebuild with bf16 products (AVX-512 BF16: vdpbf16ps, two ranks per 16-lane instruction) ----
//
// Numerics: the factors are rounded to bf16 (round to nearest even) and their products accumulated in
// fp32, two ranks per step. Factors a store keeps in bf16 round to themselves (every product exact, as the
// fp32 path's); INT4 factors (a code times an fp16 scale) round by at most 2^-9 of each factor entry, far
// below their INT4 step (the tests bound the logits against the fp64 reference). The rest of the page
// (rotation, dot products with the queries, softmax, values) stays fp32.
// Compiled for the AVX512-BF16 target by attribute and entered only where the CPU reports the feature,
// so the avx512 build still runs on AVX-512 CPUs without it.
#define KVPACK_BF16_TARGET __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f,avx2,fma")))

inline bool cpu_has_bf16_products() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// rows x cols fp32 (row-major) -> bf16 rows of cols2 = cols rounded up to even (pad zero), row-major.
KVPACK_BF16_TARGET inline void to_bf16_rows(const float* __restrict src, int64_t rows, int64_t cols,
                                            uint16_t* __restrict dst, int64_t cols2) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = src + r * cols;
    uint16_t* y = dst + r * cols2;
    for (int64_t c = 0; c < cols2; c += 32) {
      const int64_t n = std::min<int64_t>(32, cols - c);  // source floats in this step, 1..32 (c < cols2 <= cols + 1)
      const __mmask16 m0 = n >= 16 ? __mmask16(0xFFFF) : tail_mask(n);
      const __mmask16 m1 = n >= 32 ? __mmask16(0xFFFF) : tail_mask(std::clamp<int64_t>(n - 16, 0, 16));
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, x + c + 16), _mm512_maskz_loadu_ps(m0, x + c));
      const int64_t out = std::min<int64_t>(32, cols2 - c);
      _mm512_mask_storeu_epi16(y + c, out == 32 ? __mmask32(~0u) : __mmask32((1u << out) - 1), b);
    }
  }
}

// R [rank, D] fp32 -> bf16 rank pairs interleaved by channel, [ceil(rank / 2), D, 2] (an odd rank's
// partner row zero): the operand layout of vdpbf16ps, one 32-element load per pair and 16 channels.
KVPACK_BF16_TARGET inline void to_bf16_pairs(const float* __restrict R, int64_t rank, int64_t D,
                                             uint16_t* __restrict dst) {
  // [first row's 16, second row's 16] -> (first c, second c) for c = 0..15
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(order);
  for (int64_t j = 0; 2 * j < rank; ++j) {
    const float* r0 = R + 2 * j * D;
    const bool pair = 2 * j + 1 < rank;
    for (int64_t c = 0; c < D; c += 16) {
      const __m512 a = _mm512_loadu_ps(r0 + c);
      const __m512 b = pair ? _mm512_loadu_ps(r0 + D + c) : _mm512_setzero_ps();
      const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // [a's 16 | b's 16]
      _mm512_storeu_si512(dst + (j * D + c) * 2, _mm512_permutexvar_epi16(idx, packed));
    }
  }
}

// rope_scores_tile with bf16 products: lk [TT, 2 RP] bf16 (row stride 2 RP), R [RP, D, 2] bf16.
template <int NV, int TT>
KVPACK_BF16_TARGET inline void rope_scores_tile_bf16(const float* __restrict q, int64_t M,
                                                     const uint16_t* __restrict lk, int64_t RP,
                                                     const uint16_t* __restrict R, const float* col_scale,
                                                     const float* cos, const float* sin, int64_t W, float* s,
                                                     int64_t stride) {
  constexpr int D = 16 * NV;
  Vec acc[TT][NV];
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = Vec::zero();
  const uint32_t* lk2 = reinterpret_cast<const uint32_t*>(lk);  // a token's rank pair as one 32-bit word
  for (int64_t j = 0; j < RP; ++j) {
    const uint16_t* row = R + j * 2 * D;
    __m512bh rv[NV];
    for (int v = 0; v < NV; ++v) rv[v] = (__m512bh)_mm512_loadu_si512(row + 32 * v);
    for (int t = 0; t < TT; ++t) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(lk2[t * RP + j]));
      for (int v = 0; v < NV; ++v) acc[t][v].v = _mm512_dpbf16_ps(acc[t][v].v, a, rv[v]);
    }
  }
  if (col_scale)  // INT4 keys: R_K's column scales, applied to the rebuilt keys in fp32
    for (int v = 0; v < NV; ++v) {
      const Vec sc = Vec::load(col_scale + 16 * v);
      for (int t = 0; t < TT; ++t) acc[t][v] = acc[t][v] * sc;
    }
  rotate_and_score<NV, TT>(acc, q, M, cos, sin, W, s, stride);
}

template <int NV, int TT>
KVPACK_BF16_TARGET inline void rope_scores_bf16(const float* q, int64_t M, const uint16_t* lk, int64_t RP,
                                                const uint16_t* R, const float* col_scale, int64_t P, int64_t pos,
                                                const Geometry& g, float* s) {
  int64_t p = 0;
  for (; p + TT <= P; p += TT)
    rope_scores_tile_bf16<NV, TT>(q, M, lk + p * 2 * RP, RP, R, col_scale, g.cos + (pos + p) * g.W,
                                  g.sin + (pos + p) * g.W, g.W, s + p, P);
  for (; p < P; ++p)
    rope_scores_tile_bf16<NV, 1>(q, M, lk + p * 2 * RP, RP, R, col_scale, g.cos + (pos + p) * g.W,
                                 g.sin + (pos + p) * g.W, g.W, s + p, P);
}

// INT4 key factors straight into the bf16 operands (no fp32 copy): L_K's codes minus 8 times its column
// scales (fp16, [rank]), rounded to bf16 rows [P, 2 RP]; R_K's codes minus 8, exact in bf16, as rank pairs
// [RP, D, 2]; R_K's column scales (fp16, [D]) widened into pg.rk_scale. Packed rows of ceil(cols / 2)
// bytes, low nibble first, as widen_int4 reads them.
KVPACK_BF16_TARGET inline void load_int4_keys_bf16(const uint8_t* L, const c10::Half* l_scale, const uint8_t* R,
                                                   const c10::Half* r_scale, int64_t P, int64_t rank, int64_t D,
                                                   Page& pg, std::vector<float>& scale_buf) {
  const int64_t RP = (rank + 1) / 2, lstride = RP, rstride = (D + 1) / 2;  // packed row bytes of L, R
  pg.lk16.resize(P * 2 * RP);
  pg.rk16.resize(RP * 2 * D);
  pg.rk_scale.resize(D);
  widen_row(r_scale, pg.rk_scale.data(), D);
  scale_buf.assign(2 * RP + 32, 0.f);  // L's scales, zero past the rank (padding lanes)
  widen_row(l_scale, scale_buf.data(), rank);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  for (int64_t p = 0; p < P; ++p) {  // 32 codes of a row a step: 16 bytes -> 32 fp32 -> 32 bf16
    const uint8_t* row = L + p * lstride;
    uint16_t* out = pg.lk16.data() + p * 2 * RP;
    for (int64_t c = 0; c < 2 * RP; c += 32) {
      const int64_t nbytes = std::min<int64_t>(16, lstride - c / 2);
      const __m128i b = _mm_maskz_loadu_epi8(__mmask16((1u << nbytes) - 1), row + c / 2);
      const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      const __m512 x0 = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))),
                                                    eight), _mm512_loadu_ps(scale_buf.data() + c));
      const __m512 x1 = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))),
                                                    eight), _mm512_loadu_ps(scale_buf.data() + c + 16));
      const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
      const int64_t n = std::min<int64_t>(32, 2 * RP - c);
      _mm512_mask_storeu_epi16(out + c, n == 32 ? __mmask32(~0u) : __mmask32((1u << n) - 1), v);
    }
  }
  // bf16 of k - 8 for the codes k = 0..15 (the upper 16 entries unused), made once
  struct Levels {
    alignas(64) uint16_t v[32] = {};
    Levels() {
      for (int k = 0; k < 16; ++k) {
        const float f = float(k - 8);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        v[k] = uint16_t(bits >> 16);  // exact: small integers have no bits below bf16's
      }
    }
  };
  static const Levels levels;
  const __m512i table = _mm512_load_si512(levels.v);
  for (int64_t j = 0; j < RP; ++j) {
    const uint8_t* r0 = R + 2 * j * rstride;
    const bool pair = 2 * j + 1 < rank;
    for (int64_t c = 0; c < D; c += 16) {  // 16 channels of both rows: 8 bytes each
      auto codes16 = [&](const uint8_t* row) {  // the 16 codes of channels c.. as bytes, in order
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
        return _mm_unpacklo_epi8(_mm_and_si128(b, low4), _mm_and_si128(_mm_srli_epi16(b, 4), low4));
      };
      const __m128i a = codes16(r0);
      const __m128i b = pair ? codes16(r0 + rstride) : _mm_set1_epi8(8);  // an odd rank's partner: code 8 = 0
      const __m256i inter = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
      const __m512i words = _mm512_cvtepu8_epi16(inter);
      _mm512_storeu_si512(pg.rk16.data() + (j * D + c) * 2, _mm512_permutexvar_epi16(words, table));
    }
  }
}

// Pre-RoPE logits through the bf16 tiles (g.bf16_products: a tiled head size). INT4 keys arrive as the
// operands (load_int4_keys); float keys as fp32, converted here.
KVPACK_BF16_TARGET inline void pre_rope_scores_bf16(const float* q, Page& pg, int64_t rank, int64_t pos,
                                                    const Geometry& g, PageScratch& w) {
  const int64_t M = g.M, D = g.D, P = g.P, RP = (rank + 1) / 2;
  if (!g.int4) {
    pg.lk16.resize(P * 2 * RP);
    pg.rk16.resize(RP * 2 * D);
    to_bf16_rows(pg.lk.data(), P, rank, pg.lk16.data(), 2 * RP);
    to_bf16_pairs(pg.rk.data(), rank, D, pg.rk16.data());
  }
  const uint16_t *L = pg.lk16.data(), *R = pg.rk16.data();
  const float* sc = g.int4 ? pg.rk_scale.data() : nullptr;
  switch (D) {
    case 32: rope_scores_bf16<2, 8>(q, M, L, RP, R, sc, P, pos, g, w.s.data()); break;
    case 64: rope_scores_bf16<4, 4>(q, M, L, RP, R, sc, P, pos, g, w.s.data()); break;
    case 128: rope_scores_bf16<8, 2>(q, M, L, RP, R, sc, P, pos, g, w.s.data()); break;
    default: rope_scores_bf16<16, 1>(q, M, L, RP, R, sc, P, pos, g, w.s.data()); break;
  }
}
#endif

// Whether pre-RoPE pages of head size D are rebuilt with bf16 products when `requested`: the AVX-512
// build's tiled head sizes, on a CPU with AVX-512 BF16. The ops resolve it once into Geometry::bf16_products.
inline bool bf16_rebuild(bool requested, int64_t D) {
#if defined(__AVX512F__)
  return requested && (D == 32 || D == 64 || D == 128 || D == 256) && cpu_has_bf16_products();
#else
  (void)requested, (void)D;
  return false;
#endif
}

// One page's INT4 key factors (L [P, rank] with fp16 column scales [rank], R [rank, D] with fp16 column
// scales [D]; packed rows of ceil(cols / 2) bytes): straight into the bf16 rebuild's operands where
// g.bf16_products, else widened to fp32 pg.lk, pg.rk.
inline void load_int4_keys(const uint8_t* L, const c10::Half* l_scale, const uint8_t* R, const c10::Half* r_scale,
                           int64_t P, int64_t rank, int64_t D, const Geometry& g, Page& pg,
                           std::vector<float>& scale_buf) {
#if defined(__AVX512F__)
  if (g.bf16_products) return load_int4_keys_bf16(L, l_scale, R, r_scale, P, rank, D, pg, scale_buf);
#endif
  (void)g;
  widen_int4(L, l_scale, nullptr, P, rank, pg.lk.data(), scale_buf);
  widen_int4(R, r_scale, nullptr, rank, D, pg.rk.data(), scale_buf);
}

// Pre-RoPE logits s [M, P] of one page (keys L_K R_K at ranks `rank`, first token at `pos`), unscaled.
inline void pre_rope_scores(const float* q, Page& pg, int64_t rank, int64_t pos, const Geometry& g,
                            PageScratch& w) {
  const int64_t M = g.M, D = g.D, P = g.P;
#if defined(__AVX512F__)
  if (g.bf16_products) return pre_rope_scores_bf16(q, pg, rank, pos, g, w);
#endif
  constexpr int L = Vec::kLanes;
  if (Vec::kRegisters >= 32 && D % (2 * L) == 0) {  // full-row tiles, 16 accumulators
    switch (D / L) {
      case 2: return rope_scores<2, 8>(q, M, pg.lk.data(), rank, pg.rk.data(), P, pos, g, w.s.data());
      case 4: return rope_scores<4, 4>(q, M, pg.lk.data(), rank, pg.rk.data(), P, pos, g, w.s.data());
      case 8: return rope_scores<8, 2>(q, M, pg.lk.data(), rank, pg.rk.data(), P, pos, g, w.s.data());
      case 16: return rope_scores<16, 1>(q, M, pg.lk.data(), rank, pg.rk.data(), P, pos, g, w.s.data());
      default: break;
    }
  }
  if (Vec::kRegisters > 0 && Vec::kRegisters < 32 && D % (2 * L) == 0)
    return rope_scores_grouped(q, M, pg.lk.data(), rank, pg.rk.data(), P, pos, g, w.s.data(), w.dots.data());
  // Any other D: each key row rebuilt in a buffer (combine), rotated, then dotted with the queries.
  std::fill(w.keys.begin(), w.keys.end(), 0.f);
  for (int64_t p = 0; p < P; ++p) {
    float* k = w.keys.data() + p * D;
    combine(pg.lk.data() + p * rank, pg.rk.data(), rank, D, k);
    rotate_row(k, g.cos + (pos + p) * g.W, g.sin + (pos + p) * g.W, D, g.W);
  }
  scores_block(q, w.keys.data(), M, P, D, 1.f, w.s.data(), P);
}

// Fold one loaded page (ranks rk <= g.RK, rv <= g.RV; its first token at position `pos`) into the state.
inline void fold_page(const float* q, Page& pg, int64_t rk, int64_t rv, int64_t pos, const Geometry& g,
                      PageScratch& w, RowsState& st) {
  const int64_t M = g.M, D = g.D, P = g.P;
  if (g.pre_rope) {
    pre_rope_scores(q, pg, rk, pos, g, w);
  } else {
    // (q R_K^T) L_K^T: the query in rank space, then s[i, :] = sum_r qr[i, r] lkT[r, :].
    transpose(pg.lk.data(), P, rk, w.lkT.data());
    std::fill(w.s.begin(), w.s.end(), 0.f);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t r = 0; r < rk; ++r) w.qr[i * g.RK + r] = dot(q + i * D, pg.rk.data() + r * D, D);
    for (int64_t i = 0; i < M; ++i) combine(w.qr.data() + i * g.RK, w.lkT.data(), rk, P, w.s.data() + i * P);
  }
  for (int64_t x = 0; x < M * P; ++x) w.s[x] *= g.scaling;
  st.absorb(w.s.data(), P, P);
  // (p L_V) R_V: u[i] = sum_p p[i, p] L_V[p] (rows of rv), then o[i] += sum_r u[i, r] R_V[r].
  std::fill(w.u.begin(), w.u.end(), 0.f);
  for (int64_t i = 0; i < M; ++i) combine(w.s.data() + i * P, pg.lv.data(), P, rv, w.u.data() + i * g.RV);
  for (int64_t i = 0; i < M; ++i) combine(w.u.data() + i * g.RV, pg.rv.data(), rv, D, st.o.data() + i * D);
}

}  // namespace kvpack
