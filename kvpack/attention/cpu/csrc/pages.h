// Factorized pages on CPU, shared by the PuzzleKV kernels (puzzle.cpp: fixed ranks; ragged.cpp:
// puzzle_plus's per-(page, head) ranks): one page's factors widened to fp32 (INT4 decoded), and the
// fold of one page into the online-softmax state, scores in rank space.
//
// A page's logits are (q R_K^T) L_K^T and its output (p L_V) R_V: the query meets the factors in rank
// space and a page's dense K/V never exist. Pre-RoPE keys are rebuilt for one page at a time in a
// [P, D] buffer (L_K R_K), rotated at their positions (rotate_half convention) and dotted with the
// queries; values still go through their factors.
#pragma once

#include "common.h"

namespace kvpack {

// One page's factors as fp32, the left factors transposed so that every inner loop runs over the
// page's P tokens or the D channels (ranks are small: 12-16 at the defaults, too short to vectorise):
// lkT [RK, P], rk [RK, D], lvT [RV, P], rv [RV, D]; `scratch` holds a left factor before its transpose.
struct Page {
  std::vector<float> lkT, rk, lvT, rv, scratch;
  Page(int64_t P, int64_t RK, int64_t RV, int64_t D)
      : lkT(RK * P), rk(RK * D), lvT(RV * P), rv(RV * D), scratch(P * std::max(RK, RV)) {}
};

// [rows, cols] -> [cols, rows]
inline void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// Every byte's two nibbles minus 8, as floats.
struct NibbleTable {
  float v[256][2];
  NibbleTable() {
    for (int b = 0; b < 256; ++b) {
      v[b][0] = float((b & 0xF) - 8);
      v[b][1] = float((b >> 4) - 8);
    }
  }
};

// n codes (two per byte, low nibble first) minus 8 as floats, n even.
inline void widen_nibbles(const uint8_t* __restrict src, int64_t n, float* __restrict dst) {
  static const NibbleTable table;
  int64_t c = 0;
#if defined(__AVX512F__)
  // 16 bytes -> 32 codes: low and high nibbles interleaved at byte level, widened 16 at a time.
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  for (; c + 32 <= n; c += 32) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c / 2));
    const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
    _mm512_storeu_ps(dst + c, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)), eight));
    _mm512_storeu_ps(dst + c + 16, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)), eight));
  }
#endif
  for (; c < n; c += 2) std::memcpy(dst + c, table.v[src[c / 2]], 8);
}

// rows x cols INT4 matrix (packed rows of ceil(cols / 2) bytes) -> fp32 [rows, cols], times an fp16
// scale per column (col_scales, [cols]) or per row (row_scales, [rows]).
inline void widen_int4(const uint8_t* src, const c10::Half* col_scales, const c10::Half* row_scales, int64_t rows,
                int64_t cols, float* dst, std::vector<float>& scale_buf) {
  static const NibbleTable table;
  const int64_t stride = (cols + 1) / 2;
  if (cols % 2 == 0) {
    widen_nibbles(src, rows * cols, dst);  // even rows are back to back: one flat pass
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = src + r * stride;
      float* out = dst + r * cols;
      widen_nibbles(row, cols - 1, out);
      out[cols - 1] = table.v[row[cols / 2]][0];
    }
  }
  // Scales in a second pass (after the copies above have left the store buffer).
  if (col_scales) {
    scale_buf.resize(cols);
    widen_row(col_scales, scale_buf.data(), cols);
    const float* sc = scale_buf.data();
    for (int64_t r = 0; r < rows; ++r) {
      float* out = dst + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) out[c] *= sc[c];
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const float a = widen(row_scales[r]);
      float* out = dst + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) out[c] *= a;
    }
  }
}

struct Geometry {
  int64_t M, D, P, RK, RV;
  float scaling;
  bool int4, pre_rope;
  const float* cos;  // [positions, W]
  const float* sin;
  int64_t W;
};

// Per-job buffers of fold_page.
struct PageScratch {
  std::vector<float> qr, s, u, keys, coeffs;
  explicit PageScratch(const Geometry& g)
      : qr(g.M * g.RK), s(g.M * g.P), u(g.M * g.RV), keys(g.pre_rope ? g.P * g.D : 0), coeffs(g.RK) {}
};

// Fold one loaded page (ranks rk <= g.RK, rv <= g.RV; its first token at position `pos`) into the state.
inline void fold_page(const float* q, const Page& pg, int64_t rk, int64_t rv, int64_t pos, const Geometry& g,
                      PageScratch& w, RowsState& st) {
  const int64_t M = g.M, D = g.D, P = g.P, half = D / 2;
  std::fill(w.s.begin(), w.s.end(), 0.f);
  if (g.pre_rope) {
    // K = L_K R_K, one row per token: row p = sum_r lkT[r, p] R_K[r]; then rotated at its position.
    std::fill(w.keys.begin(), w.keys.end(), 0.f);
    for (int64_t p = 0; p < P; ++p) {
      float* k = w.keys.data() + p * D;
      for (int64_t r = 0; r < rk; ++r) w.coeffs[r] = pg.lkT[r * P + p];
      combine(w.coeffs.data(), pg.rk.data(), rk, D, k);
      const float* c = g.cos + (pos + p) * g.W;
      const float* sn = g.sin + (pos + p) * g.W;
      const float* c2 = g.W == D ? c + half : c;  // equal halves: the table keeps one
      const float* s2 = g.W == D ? sn + half : sn;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float k1 = k[j], k2 = k[j + half];
        k[j] = k1 * c[j] - k2 * sn[j];
        k[j + half] = k2 * c2[j] + k1 * s2[j];
      }
    }
    scores_block(q, w.keys.data(), M, P, D, 1.f, w.s.data(), P);
  } else {
    // (q R_K^T) L_K^T: the query in rank space, then s[i, :] = sum_r qr[i, r] lkT[r, :].
    for (int64_t i = 0; i < M; ++i)
      for (int64_t r = 0; r < rk; ++r) w.qr[i * g.RK + r] = dot(q + i * D, pg.rk.data() + r * D, D);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t r = 0; r < rk; ++r) axpy(w.qr[i * g.RK + r], pg.lkT.data() + r * P, w.s.data() + i * P, P);
  }
  for (int64_t x = 0; x < M * P; ++x) w.s[x] *= g.scaling;
  st.absorb(w.s.data(), P, P);
  // (p L_V) R_V: u[i, r] = p[i, :] . lvT[r, :], then o[i] += sum_r u[i, r] R_V[r].
  for (int64_t i = 0; i < M; ++i)
    for (int64_t r = 0; r < rv; ++r) w.u[i * g.RV + r] = dot(w.s.data() + i * P, pg.lvT.data() + r * P, P);
  for (int64_t i = 0; i < M; ++i) combine(w.u.data() + i * g.RV, pg.rv.data(), rv, D, st.o.data() + i * D);
}

}  // namespace kvpack
