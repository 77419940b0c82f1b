// kvpack::pca_quant_attention on CPU: grouped queries over blocks coded in a per-head principal-component
// basis (layouts in kvpack/attention/pca_blocks.py), read where the store keeps them.
//
// Per (KV head, split of blocks), per block of G tokens:
//   keys:   the codes of the head's Ck key components are widened and dequantized into coefficients
//           c [Ck, G] (component-major, as the codes are stored: c = code * scale + zero), the keys rebuilt
//           as mean + cᵀ @ basis (`rebuild_rows`: four keys at a time in registers over the Ck basis rows),
//           rotated by RoPE at their positions where the basis is pre-RoPE, then scored against the M
//           query rows (rope = 1: a pre-RoPE basis); otherwise (rope = 0: a post-RoPE basis or no RoPE;
//           rope = 2: keys rotated by their block's first position t0) the keys are scored in the basis,
//           never rebuilt: the M query rows, rotated back by t0 where rope = 2, projected onto the Ck basis
//           rows once per split (0) or per block (2), then s = q' . mean + sum_j (q' . b_j)(scale_j code_tj
//           + zero_j): Ck FMAs a token and query row where a rebuilt key costs Ck D, the codes read
//           straight into registers and multiplied into every row (`ScoreTile`);
//   values: never rebuilt, nor dequantized. sum_t p_t v_t = mean sum_t p_t + sum_j (sum_t p_t c_tj) b_j and
//           sum_t p_t c_tj = scale_j sum_t p_t code_tj + zero_j sum_t p_t, so the split's online-softmax
//           state is kept over the Cv coefficients ([M, Cv]) from the codes (`AccumulateTile`: lane-wise
//           sums, one horizontal sum per row and component when the split ends), and turned into [M, D]
//           once, when the split ends (Cv basis rows per query row).
// Tokens listed in `skip` (per head, counted from the first coded token) get a -inf logit: left out, an exact
// copy attended beside this op stands for each (pca_quant's salient tokens).
// Numerics: fp32 throughout; the fp16 basis, scales and zero points are widened once per split / block.
#include <type_traits>

#include "common.h"

namespace kvpack {

// The op's `rope` (kvpack/attention/pca_blocks.py): keys stored as RoPE left them, rotated at their own
// positions, or rotated by their block's first position.
constexpr int64_t kRopeNone = 0, kRopeToken = 1, kRopeBlock = 2;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the code streams are read as little-endian words");

// n codes of W bits from a little-endian stream (code i at bits [i W, (i + 1) W)) -> floats, n a multiple
// of 8: a vector of codes at a time (Vec::unpack: the codes' bytes widened to lanes, shifted and masked),
// the last partial vector one code at a time; nothing past the n codes' bytes is read. (A scalar loop over
// 8-code words was a fifth of the kernel's time at SmolLM2's shape.)
template <int W>
inline void widen_codes(const uint8_t* __restrict src, int64_t n, float* __restrict dst) {
  constexpr int L = Vec::kLanes;
  int64_t i = 0;
  for (; i + L <= n; i += L) Vec::unpack<W>(src, i / L).store(dst + i);
  for (; i < n; ++i) dst[i] = float(stream_code<W>(src, i));
}

// f(std::integral_constant<int, W>{}) for a code width w of 1..8 (8 for anything wider: the layout checks
// widths <= 8): the one place a runtime width picks a kernel's compile-time width.
template <typename F>
inline void with_width(int w, F&& f) {
  switch (w) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// out [4, D] = base [D] + coefᵀ @ rows [C, D] for D-columns [0, NCH L) of four tokens, the coefficients
// given component-major (token r's coefficient j at coef[j ld + r]; out's row stride D). 4 x NCH
// accumulators stay in registers over the C basis rows, so the FMAs of four tokens interleave instead of
// each token's chain of C dependent FMAs waiting on the FMA latency.
template <int NCH, bool TAIL>
inline void rebuild4(const float* __restrict coef, int64_t ld, int64_t C, const float* __restrict rows, int64_t D,
                     const float* __restrict base, Vec::Mask last, float* __restrict out) {
  constexpr int L = Vec::kLanes;
  auto load = [&](const float* p, int k) {
    return TAIL && k + 1 == NCH ? Vec::load(p + L * k, last) : Vec::load(p + L * k);
  };
  Vec acc[4][NCH];
  for (int k = 0; k < NCH; ++k) acc[0][k] = acc[1][k] = acc[2][k] = acc[3][k] = load(base, k);
  for (int64_t j = 0; j < C; ++j) {
    Vec b[NCH];
    for (int k = 0; k < NCH; ++k) b[k] = load(rows + j * D, k);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const Vec a = Vec::splat(coef[j * ld + r]);
      for (int k = 0; k < NCH; ++k) acc[r][k] = fma(a, b[k], acc[r][k]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < NCH; ++k) {
      if (TAIL && k + 1 == NCH) acc[r][k].store(out + r * D + L * k, last);
      else acc[r][k].store(out + r * D + L * k);
    }
}

template <int NCH>
inline void rebuild4_any(bool tail, const float* coef, int64_t ld, int64_t C, const float* rows, int64_t D,
                         const float* base, Vec::Mask last, float* out) {
  if (tail) rebuild4<NCH, true>(coef, ld, C, rows, D, base, last, out);
  else rebuild4<NCH, false>(coef, ld, C, rows, D, base, last, out);
}

// keys [n, D] = base [D] + coefᵀ @ rows [C, D] for coefficients coef [C, n] (component-major), n a
// multiple of 4 (a block: G % 8 == 0).
inline void rebuild_rows(const float* coef, int64_t n, int64_t C, const float* rows, int64_t D, const float* base,
                         float* keys) {
  constexpr int L = Vec::kLanes;
  constexpr int64_t kMax = L == 16 ? 4 : 2;  // vectors per row chunk: 4 x kMax accumulators + kMax + 1 registers
  const int64_t nv = (D + L - 1) / L;
  const Vec::Mask last = Vec::first(D % L ? D % L : L);
  for (int64_t t = 0; t < n; t += 4)
    for (int64_t v0 = 0; v0 < nv; v0 += kMax) {
      const int64_t nch = std::min(kMax, nv - v0);
      const bool tail = v0 + nch == nv && D % L;
      const float* r = rows + v0 * L;
      const float* b = base + v0 * L;
      float* o = keys + t * D + v0 * L;
      const float* c = coef + t;
      switch (nch) {
        case 4: rebuild4_any<4>(tail, c, n, C, r, D, b, last, o); break;
        case 3: rebuild4_any<3>(tail, c, n, C, r, D, b, last, o); break;
        case 2: rebuild4_any<2>(tail, c, n, C, r, D, b, last, o); break;
        default: rebuild4_any<1>(tail, c, n, C, r, D, b, last, o);
      }
    }
}

// The query rows q [M, D] projected into a head's key basis: qb [M, C] = q @ rows_t (rows_t [D, C]: the basis
// rows transposed, so each row's projection is D vector FMAs over the C columns, no horizontal sums),
// qm [M] = q . mean.
inline void project_queries(const float* q, int64_t M, int64_t D, const float* rows_t, int64_t C, const float* mean,
                            float* qb, float* qm) {
  for (int64_t i = 0; i < M; ++i) {
    qm[i] = dot(q + i * D, mean, D);
    std::fill(qb + i * C, qb + (i + 1) * C, 0.f);
    combine(q + i * D, rows_t, D, C, qb + i * C);
  }
}

// One (side, head)'s place in the layout: its coded components' width runs, first column and first byte.
struct Coded {
  std::vector<std::pair<int, int64_t>> runs;  // (width, components), widest first
  int64_t count = 0, col = 0, byte = 0, bits = 0;  // components, first column of scale/zero/basis, first
                                                   // byte of a block's row, sum of widths
};

// f(std::integral_constant<int, W>{}, src, n, j0) for each width-W run of one (side, head)'s codes in a block's
// row, widest first: its n components from column j0, their stream from src (G codes a component).
template <typename F>
inline void for_each_run(const Coded& cd, const uint8_t* row, int64_t G, F&& f) {
  const uint8_t* src = row + cd.byte;
  int64_t j0 = 0;
  for (const auto& [w, n] : cd.runs) {
    with_width(w, [&](auto W) { f(W, src, n, j0); });
    src += G * n * w / 8;
    j0 += n;
  }
}

// A block's codes of one (side, head) as floats, component-major c [count, G]: each width's stream holds
// its components' codes component-major, so it widens straight into its rows.
inline void block_codes(const Coded& cd, const uint8_t* row, int64_t G, float* c) {
  for_each_run(cd, row, G, [&](auto W, const uint8_t* src, int64_t n, int64_t j0) {
    widen_codes<decltype(W)::value>(src, G * n, c + j0 * G);
  });
}

// Halves -> floats, a vector at a time (the fp16 scales and zero points of a block's components).
inline void widen_halves(const c10::Half* __restrict src, float* __restrict dst, int64_t n) {
  constexpr int L = Vec::kLanes;
  int64_t i = 0;
  for (; i + L <= n; i += L) Vec::load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = widen(src[i]);
}

// Codes k L .. k L + L - 1 of a W-bit stream as floats; FULL: all L belong to the component, else only
// `valid` of them (a block of G % L == 8 tokens' last vector): those read one at a time, the rest 0 (nothing
// past them is read).
template <int W, bool FULL>
inline Vec code_vector(const uint8_t* __restrict src, int64_t k, int64_t valid) {
  constexpr int L = Vec::kLanes;
  if (FULL || valid >= L) return Vec::unpack<W>(src, k);
  alignas(64) float tmp[L] = {};
  for (int64_t i = 0; i < valid; ++i) tmp[i] = float(stream_code<W>(src, k * L + i));
  return Vec::load(tmp);
}

// Register tiles of the fused readers below: R <= kTileRows query rows x NC vectors of tokens, both compile
// time, so the accumulators stay in registers (AVX-512: up to 4 x 4 of 16 lanes, a block of 64 tokens in one
// pass; AVX2: 2 x 4 of 8 lanes). NC is 4 (whole groups of four vectors) or 1 (the rest, the last one maybe
// partial).
constexpr int kTileRows = Vec::kLanes == 16 ? 4 : 2;

// Keys scored from their codes, never widened into memory: s [R, G] (row stride G) += a [R, C] (row stride lda)
// @ codes [C, G], for the n components of one width-W run (streams component-major, a component's G codes
// together) and the token vectors [k0, k0 + NC). A code vector is read once and multiplied into every row.
template <int W, int R, int NC>
inline void score_run(const uint8_t* src, int64_t n, int64_t G, const float* a, int64_t lda, int64_t k0,
                      Vec (&acc)[R][NC]) {
  constexpr int L = Vec::kLanes;
  for (int64_t j = 0; j < n; ++j, src += G * W / 8) {
    Vec c[NC];
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k) c[k] = code_vector<W, NC == 4>(src, k0 + k, G - (k0 + k) * L);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Vec ar = Vec::splat(a[r * lda + j]);
#pragma GCC unroll 4
      for (int k = 0; k < NC; ++k) acc[r][k] = fma(ar, c[k], acc[r][k]);
    }
  }
}

template <int R, int NC>
inline void score_tile(const Coded& cd, const uint8_t* row, int64_t G, const float* a, int64_t k0, float* s) {
  constexpr int L = Vec::kLanes;
  Vec acc[R][NC];
  const int64_t left = G - k0 * L;  // tokens from the tile's first vector on (NC == 1: maybe fewer than L)
  const Vec::Mask m = Vec::first(std::min<int64_t>(left, L));
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NC; ++k)
      acc[r][k] = NC == 4 ? Vec::load(s + r * G + (k0 + k) * L) : Vec::load(s + r * G + k0 * L, m);
  for_each_run(cd, row, G, [&](auto W, const uint8_t* src, int64_t n, int64_t j0) {
    score_run<decltype(W)::value, R, NC>(src, n, G, a + j0, cd.count, k0, acc);
  });
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NC; ++k) {
      if (NC == 4) acc[r][k].store(s + r * G + (k0 + k) * L);
      else acc[r][k].store(s + r * G + k0 * L, m);
    }
}

// Values in the basis from their codes: acc [R, C] vectors (one of L lanes per row and component) += p [R, G]
// times scale_j codes_j, lane-wise over the token vectors [k0, k0 + NC); the lanes are summed once, when the
// split ends (no horizontal sum per block). The NC vectors of each of the R rows of p stay in registers.
template <int W, int R, int NC>
inline void accumulate_run(const uint8_t* src, int64_t n, int64_t G, const float* scale, const Vec (&p)[R][NC],
                           int64_t C, int64_t k0, float* acc) {
  constexpr int L = Vec::kLanes;
  for (int64_t j = 0; j < n; ++j, src += G * W / 8) {
    const Vec sj = Vec::splat(scale[j]);
    Vec c[NC];
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k) c[k] = code_vector<W, NC == 4>(src, k0 + k, G - (k0 + k) * L) * sj;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float* out = acc + (r * C + j) * L;
      Vec v = Vec::load(out);
#pragma GCC unroll 4
      for (int k = 0; k < NC; ++k) v = fma(p[r][k], c[k], v);
      v.store(out);
    }
  }
}

template <int R, int NC>
inline void accumulate_tile(const Coded& cd, const uint8_t* row, int64_t G, const float* scale, const float* p,
                            int64_t k0, float* acc) {
  constexpr int L = Vec::kLanes;
  const Vec::Mask m = Vec::first(std::min<int64_t>(G - k0 * L, L));
  Vec pr[R][NC];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NC; ++k)
      pr[r][k] = NC == 4 ? Vec::load(p + r * G + (k0 + k) * L) : Vec::load(p + r * G + k0 * L, m);
  for_each_run(cd, row, G, [&](auto W, const uint8_t* src, int64_t n, int64_t j0) {
    accumulate_run<decltype(W)::value, R, NC>(src, n, G, scale + j0, pr, cd.count, k0, acc + j0 * L);
  });
}

// Calls tile<R, NC>(i0, k0) over rows [0, M) and the block's token vectors: rows kTileRows at a time (the last
// group R = the rest), vectors four at a time while four remain, then one at a time.
template <template <int, int> class Tile, typename... Args>
inline void over_tiles(int64_t M, int64_t G, Args&&... args) {
  constexpr int L = Vec::kLanes;
  const int64_t nv = (G + L - 1) / L, whole = G / L / 4 * 4;
  for (int64_t i0 = 0; i0 < M; i0 += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, M - i0);
    for (int64_t k0 = 0; k0 < nv;) {
      const bool four = k0 + 4 <= whole;
      switch (rows * 2 + four) {
#define KVPACK_TILE(R)                                                    \
  case 2 * R: Tile<R, 1>::run(i0, k0, args...); break;                    \
  case 2 * R + 1: Tile<R, 4>::run(i0, k0, args...); break;
        KVPACK_TILE(1)
        KVPACK_TILE(2)
#if defined(__AVX512F__)
        KVPACK_TILE(3)
        KVPACK_TILE(4)
#endif
#undef KVPACK_TILE
      }
      k0 += four ? 4 : 1;
    }
  }
}

// s [M, G] += a [M, Ck] @ codes [Ck, G] over one (side, head)'s coded key components.
template <int R, int NC>
struct ScoreTile {
  static void run(int64_t i0, int64_t k0, const Coded& cd, const uint8_t* row, int64_t G, const float* a, float* s) {
    score_tile<R, NC>(cd, row, G, a + i0 * cd.count, k0, s + i0 * G);
  }
};

// acc [M, Cv, L] += p [M, G] (scale_j codes_j) over one (side, head)'s coded value components.
template <int R, int NC>
struct AccumulateTile {
  static void run(int64_t i0, int64_t k0, const Coded& cd, const uint8_t* row, int64_t G, const float* scale,
                  const float* p, float* acc) {
    accumulate_tile<R, NC>(cd, row, G, scale, p + i0 * G, k0, acc + i0 * cd.count * Vec::kLanes);
  }
};

State pca_quant_attention(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& scale,
                          const at::Tensor& zero, const at::Tensor& basis, const at::Tensor& mean,
                          const at::Tensor& widths, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& skip, int64_t block, int64_t rope, int64_t first_position, double scaling,
                          int64_t blocks_per_split) {
  check_queries(q);
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), G = block;
  TORCH_CHECK(G > 0 && G % 8 == 0, "pca_quant: block must be a positive multiple of 8, got ", G);
  TORCH_CHECK(rope >= kRopeNone && rope <= kRopeBlock, "pca_quant: rope must be 0 (none), 1 (per token) or 2 (per block), got ",
              rope);
  TORCH_CHECK(mean.scalar_type() == at::kFloat && mean.is_contiguous() && mean.dim() == 3 && mean.size(0) == 2 &&
                  mean.size(1) == H && mean.size(2) == D,
              "pca_quant: mean must be contiguous fp32 [2, ", H, ", ", D, "], got ", mean.sizes());
  TORCH_CHECK(widths.scalar_type() == at::kByte && widths.is_contiguous() && widths.sizes() == mean.sizes(),
              "pca_quant: widths must be contiguous uint8 [2, ", H, ", ", D, "], got ", widths.sizes());
  // The layout, from the widths: per (side, head) its width runs, columns and bytes.
  std::vector<Coded> layout(2 * H);
  int64_t cols = 0, bytes = 0;
  const uint8_t* wp = widths.data_ptr<uint8_t>();
  for (int64_t i = 0; i < 2 * H; ++i) {
    Coded& cd = layout[i];
    cd.col = cols;
    cd.byte = bytes;
    for (int64_t j = 0; j < D; ++j) {
      const int w = wp[i * D + j];
      TORCH_CHECK(w <= 8, "pca_quant: a component width of ", w, " bits (at most 8)");
      TORCH_CHECK(j == 0 || w <= wp[i * D + j - 1], "pca_quant: component widths must be non-increasing");
      if (w == 0) continue;  // (every later width is 0 too: checked above)
      if (cd.runs.empty() || cd.runs.back().first != w) cd.runs.emplace_back(w, 0);
      ++cd.runs.back().second;
      ++cd.count;
      cd.bits += w;
    }
    cols += cd.count;
    bytes += G * cd.bits / 8;
  }
  const int64_t NB = codes.numel() ? codes.size(0) : 0;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(1) == bytes,
              "pca_quant: codes must be contiguous uint8 [blocks, ", bytes, "] for these widths, got ", codes.sizes());
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == NB &&
                    t->size(1) == cols,
                "pca_quant: scales and zero points must be contiguous fp16 [", NB, ", ", cols, "], got ", t->sizes());
  TORCH_CHECK(basis.scalar_type() == at::kHalf && basis.is_contiguous() && basis.dim() == 2 && basis.size(0) == cols &&
                  basis.size(1) == D,
              "pca_quant: basis must be contiguous fp16 [", cols, ", ", D, "], got ", basis.sizes());
  int64_t W = 0;
  if (rope != kRopeNone && NB) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                    (cos.size(1) == D || 2 * cos.size(1) == D) && cos.size(0) >= first_position + NB * G,
                "pca_quant: the rotary table must be contiguous fp32 [>= ", first_position + NB * G, ", ", D,
                " or ", D / 2, "], got ", cos.sizes());
    W = cos.size(1);
  }
  // Tokens left out: per head an ascending run of token indices counted from the first coded token.
  const int64_t n_skip = skip.numel() ? skip.size(1) : 0;
  if (n_skip)
    TORCH_CHECK(skip.scalar_type() == at::kInt && skip.is_contiguous() && skip.dim() == 2 && skip.size(0) == H,
                "pca_quant: skip must be contiguous int32 [", H, ", n], got ", skip.sizes());
  const int32_t* kp = n_skip ? skip.data_ptr<int32_t>() : nullptr;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n_skip; ++i) {
      const int32_t t = kp[h * n_skip + i];
      TORCH_CHECK(t >= 0 && t < NB * G && (i == 0 || t > kp[h * n_skip + i - 1]),
                  "pca_quant: skip must hold ascending token indices in [0, ", NB * G, ") per head");
    }
  const int64_t bps = std::max<int64_t>(1, blocks_per_split);
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const c10::Half* sp = scale.data_ptr<c10::Half>();
  const c10::Half* zp = zero.data_ptr<c10::Half>();
  const c10::Half* bp = basis.data_ptr<c10::Half>();
  const float* mp = mean.data_ptr<float>();
  const float* cosp = W ? cos.data_ptr<float>() : nullptr;
  const float* sinp = W ? sin.data_ptr<float>() : nullptr;
  return split_k(H, n_chunks(NB, bps), M, D, q.options(), [&](int64_t h, int64_t s, RowsState& st) {
    const Coded& ck = layout[h];
    const Coded& cv = layout[H + h];
    const float* qh = qp + h * M * D;
    const float* mk = mp + h * D;
    const float* mv = mp + (H + h) * D;
    std::vector<float> bk(ck.count * D), bv(cv.count * D);  // the head's basis rows, fp32
    widen_row(bp + ck.col * D, bk.data(), ck.count * D);
    widen_row(bp + cv.col * D, bv.data(), cv.count * D);
    const bool rebuild = rope == kRopeToken;
    std::vector<float> coef(rebuild ? G * ck.count : 0), keys(rebuild ? G * D : 0), p(M * G);
    // Otherwise keys are scored in the basis: q . k_t = q' . mean + sum_j (q' . b_j) c_tj with q' the query
    // rotated back by the block's rotation (none: q' = q), projected once per split (kRopeNone) or per block
    // (kRopeBlock) into qb [M, Ck], qm [M]; a block then costs Ck FMAs a token and query row where a rebuilt
    // key costs Ck D, and no key is ever rebuilt.
    std::vector<float> qb(rebuild ? 0 : M * ck.count), qm(rebuild ? 0 : M), a(rebuild ? 0 : M * ck.count);
    std::vector<float> qrot(rope == kRopeBlock ? M * D : 0);
    std::vector<float> bkt(rebuild ? 0 : D * ck.count);  // the key basis transposed, [D, Ck]
    for (int64_t j = 0; j < (rebuild ? 0 : ck.count); ++j)
      for (int64_t c = 0; c < D; ++c) bkt[c * ck.count + j] = bk[j * D + c];
    if (rope == kRopeNone) project_queries(qh, M, D, bkt.data(), ck.count, mk, qb.data(), qm.data());
    std::vector<float> ks(ck.count), kz(ck.count), vs(cv.count), vz(cv.count);  // a block's scales, zero points
    // Values: the split's softmax state with o [M, Cv] holding the zero points' share (zero_j sum_t p_t), and
    // vacc [M, Cv, L] the codes' share lane-wise (scale_j sum_t p_t code_tj, summed over the lanes at the end);
    // both rescaled together as the running maxima move.
    RowsState sv(M, cv.count);
    std::vector<float> vacc(M * cv.count * Vec::kLanes, 0.f), m_before(M);
    const int64_t b0 = s * bps, b1 = std::min(NB, b0 + bps);
    // this head's tokens left out, from the split's first token on (ascending: a cursor walks them)
    const int32_t* skip_at = kp ? std::lower_bound(kp + h * n_skip, kp + (h + 1) * n_skip, int32_t(b0 * G)) : nullptr;
    const int32_t* skip_end = kp ? kp + (h + 1) * n_skip : nullptr;
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* row = cp + b * bytes;
      widen_halves(sp + b * cols + ck.col, ks.data(), ck.count);
      widen_halves(zp + b * cols + ck.col, kz.data(), ck.count);
      if (rebuild) {
        // Keys: coefficients code * scale + zero, one component's G tokens at a time, rebuilt, rotated.
        block_codes(ck, row, G, coef.data());
        for (int64_t j = 0; j < ck.count; ++j) {
          const float sc = ks[j], z = kz[j];
          float* cj = coef.data() + j * G;
#pragma omp simd
          for (int64_t t = 0; t < G; ++t) cj[t] = cj[t] * sc + z;
        }
        rebuild_rows(coef.data(), G, ck.count, bk.data(), D, mk, keys.data());
        for (int64_t t = 0; t < G; ++t) {
          const int64_t pos = first_position + b * G + t;
          rotate_row(keys.data() + t * D, cosp + pos * W, sinp + pos * W, D, W);
        }
        scores_block(qh, keys.data(), M, G, D, float(scaling), p.data(), G);
      } else {
        if (rope == kRopeBlock) {  // k_t = R(t0) u_t, so q . k_t = (R(t0)^T q) . u_t: the rows rotated back once
          const int64_t t0 = first_position + b * G;
          std::copy(qh, qh + M * D, qrot.begin());
          for (int64_t i = 0; i < M; ++i) unrotate_row(qrot.data() + i * D, cosp + t0 * W, sinp + t0 * W, D, W);
          project_queries(qrot.data(), M, D, bkt.data(), ck.count, mk, qb.data(), qm.data());
        }
        // From the raw codes: s_it = scaling (qm_i + sum_j qb_ij zero_j) + sum_j (scaling qb_ij scale_j) code_tj.
        for (int64_t i = 0; i < M; ++i) {
          const float* qbi = qb.data() + i * ck.count;
          float* ai = a.data() + i * ck.count;
          float c0 = qm[i];
          for (int64_t j = 0; j < ck.count; ++j) {
            c0 += qbi[j] * kz[j];
            ai[j] = qbi[j] * ks[j] * float(scaling);
          }
          std::fill(p.data() + i * G, p.data() + (i + 1) * G, c0 * float(scaling));
        }
        over_tiles<ScoreTile>(M, G, ck, row, G, a.data(), p.data());
      }
      for (; skip_at != skip_end && *skip_at < (b + 1) * G; ++skip_at) {  // left out: an exact copy stands for it
        for (int64_t i = 0; i < M; ++i) p[i * G + (*skip_at - b * G)] = NEG_INF;
      }
      std::copy(sv.m.begin(), sv.m.end(), m_before.begin());
      sv.absorb(p.data(), G, G);  // p: exp(s - m); o rescaled
      for (int64_t i = 0; i < M; ++i) {  // the lane sums rescaled exactly as absorb rescaled o
        const float alpha = m_before[i] == NEG_INF ? 0.f : exp_approx(m_before[i] - sv.m[i]);
        if (alpha == 1.f) continue;
        float* acc = vacc.data() + i * cv.count * Vec::kLanes;
        for (int64_t j = 0; j < cv.count; ++j)
          (Vec::load(acc + j * Vec::kLanes) * Vec::splat(alpha)).store(acc + j * Vec::kLanes);
      }
      // Values in the basis, from the codes: sum_t p_t c_tj = scale_j sum_t p_t code_tj + zero_j sum_t p_t.
      widen_halves(sp + b * cols + cv.col, vs.data(), cv.count);
      widen_halves(zp + b * cols + cv.col, vz.data(), cv.count);
      over_tiles<AccumulateTile>(M, G, cv, row, G, vs.data(), p.data(), vacc.data());
      for (int64_t i = 0; i < M; ++i) {
        const float psum = sum(p.data() + i * G, G);
        float* o = sv.o.data() + i * cv.count;
        for (int64_t j = 0; j < cv.count; ++j) o[j] += vz[j] * psum;
      }
    }
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < cv.count; ++j)
        sv.o[i * cv.count + j] += Vec::load(vacc.data() + (i * cv.count + j) * Vec::kLanes).reduce_add();
    // Back from coefficients to values: o_i = l_i mean + sum_j o_ij b_j.
    for (int64_t i = 0; i < M; ++i) {
      st.m[i] = sv.m[i];
      st.l[i] = sv.l[i];
      float* o = st.o.data() + i * D;
      for (int64_t c = 0; c < D; ++c) o[c] = sv.l[i] * mv[c];
      combine(sv.o.data() + i * cv.count, bv.data(), cv.count, D, o);
    }
  });
}

}  // namespace kvpack
