// kvpack::pca_quant_attention on CPU: grouped queries over blocks coded in a per-head principal-component
// basis (layouts in kvpack/attention/pca_blocks.py), read where the store keeps them.
//
// Per (KV head, split of blocks), per block of G tokens:
//   keys:   the codes of the head's Ck key components are widened and dequantized into coefficients
//           c [Ck, G] (component-major, as the codes are stored: c = code * scale + zero), the keys rebuilt
//           as mean + cᵀ @ basis (`rebuild_rows`: four keys at a time in registers over the Ck basis rows),
//           rotated by RoPE at their positions where the basis is pre-RoPE, then scored against the M
//           query rows;
//   values: never rebuilt, nor dequantized. sum_t p_t v_t = mean sum_t p_t + sum_j (sum_t p_t c_tj) b_j and
//           sum_t p_t c_tj = scale_j sum_t p_t code_tj + zero_j sum_t p_t, so the split's online-softmax
//           state is kept over the Cv coefficients ([M, Cv]) from the codes, and turned into [M, D] once,
//           when the split ends (Cv basis rows per query row).
// Numerics: fp32 throughout; the fp16 basis, scales and zero points are widened once per split / block.
#include "common.h"

namespace kvpack {

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

inline void widen_codes_any(int w, const uint8_t* src, int64_t n, float* dst) {
  switch (w) {
    case 1: return widen_codes<1>(src, n, dst);
    case 2: return widen_codes<2>(src, n, dst);
    case 3: return widen_codes<3>(src, n, dst);
    case 4: return widen_codes<4>(src, n, dst);
    case 5: return widen_codes<5>(src, n, dst);
    case 6: return widen_codes<6>(src, n, dst);
    case 7: return widen_codes<7>(src, n, dst);
    default: return widen_codes<8>(src, n, dst);
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

// One (side, head)'s place in the layout: its coded components' width runs, first column and first byte.
struct Coded {
  std::vector<std::pair<int, int64_t>> runs;  // (width, components), widest first
  int64_t count = 0, col = 0, byte = 0, bits = 0;  // components, first column of scale/zero/basis, first
                                                   // byte of a block's row, sum of widths
};

// A block's codes of one (side, head) as floats, component-major c [count, G]: each width's stream holds
// its components' codes component-major, so it widens straight into its rows.
inline void block_codes(const Coded& cd, const uint8_t* row, int64_t G, float* c) {
  const uint8_t* src = row + cd.byte;
  for (const auto& [w, n] : cd.runs) {
    widen_codes_any(w, src, G * n, c);
    src += G * n * w / 8;
    c += G * n;
  }
}

State pca_quant_attention(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& scale,
                          const at::Tensor& zero, const at::Tensor& basis, const at::Tensor& mean,
                          const at::Tensor& widths, const at::Tensor& cos, const at::Tensor& sin, int64_t block,
                          bool pre_rope, int64_t first_position, double scaling, int64_t blocks_per_split) {
  check_queries(q);
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), G = block;
  TORCH_CHECK(G > 0 && G % 8 == 0, "pca_quant: block must be a positive multiple of 8, got ", G);
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
  if (pre_rope && NB) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                    (cos.size(1) == D || 2 * cos.size(1) == D) && cos.size(0) >= first_position + NB * G,
                "pca_quant: the rotary table must be contiguous fp32 [>= ", first_position + NB * G, ", ", D,
                " or ", D / 2, "], got ", cos.sizes());
    W = cos.size(1);
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
    const int64_t widest = std::max(ck.count, cv.count);
    std::vector<float> coef(G * widest), keys(G * D), p(M * G);
    RowsState sv(M, cv.count);  // the state over the value coefficients
    const int64_t b0 = s * bps, b1 = std::min(NB, b0 + bps);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* row = cp + b * bytes;
      // Keys: coefficients code * scale + zero, one component's G tokens at a time, then rebuilt.
      block_codes(ck, row, G, coef.data());
      for (int64_t j = 0; j < ck.count; ++j) {
        const float a = widen(sp[b * cols + ck.col + j]), z = widen(zp[b * cols + ck.col + j]);
        float* cj = coef.data() + j * G;
#pragma omp simd
        for (int64_t t = 0; t < G; ++t) cj[t] = cj[t] * a + z;
      }
      rebuild_rows(coef.data(), G, ck.count, bk.data(), D, mk, keys.data());
      if (W)
        for (int64_t t = 0; t < G; ++t) {
          const int64_t pos = first_position + b * G + t;
          rotate_row(keys.data() + t * D, cosp + pos * W, sinp + pos * W, D, W);
        }
      scores_block(qh, keys.data(), M, G, D, float(scaling), p.data(), G);
      sv.absorb(p.data(), G, G);
      // Values in the basis, from the codes: sum_t p_t c_tj = scale_j sum_t p_t code_tj + zero_j sum_t p_t.
      block_codes(cv, row, G, coef.data());
      for (int64_t i = 0; i < M; ++i) {
        const float* pi = p.data() + i * G;
        const float psum = sum(pi, G);
        float* o = sv.o.data() + i * cv.count;
        for (int64_t j = 0; j < cv.count; ++j)
          o[j] += widen(sp[b * cols + cv.col + j]) * dot(pi, coef.data() + j * G, G) +
                  widen(zp[b * cols + cv.col + j]) * psum;
      }
    }
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
