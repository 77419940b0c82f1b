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
// applied as a fast Walsh-Hadamard transform held in registers (fwht_inplace: D / kLanes vectors,
// about D log2(D) / kLanes vector operations); any other 0/+-1 matrix as a D x D product (`combine`: the
// output row held in registers). Profiled at D = 128, the D x D product was 70% of the kernel's time.
//
// Where a key's D / kLanes vectors fill at most half the register file (AVX-512: D = 32 .. 256; AVX2:
// D = 32 and 64) and the rotation is the identity or Sylvester's, each key lives in registers from its
// anchor row to its dot products (block_key_scores_regs); the value residuals of a block are decoded
// into a small buffer and summed per query row with the accumulator in registers (`combine`), as are the
// anchor bins at the end of a split. Profiled at SmolLM2's shape (D = 64, anchor_plus@0.25, 8K tokens)
// before: the row passes through memory between scale, residual, RoPE and dot (store then load, each
// step) and the value axpys were most of the time; 2.06 -> 1.01 ms per layer call (AVX-512); on a Zen 1
// EPYC (AVX2, bench_decode_attention.py --shape smollm2, 8K) 3.85 / 4.75 -> 3.02 / 3.76 ms.
// Written once on Vec (simd.h): its code lookup (Vec::decode) and in-vector Hadamard stages are the
// only ISA-specific pieces.
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
  if ((D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && equals(sylvester)) return Rotation::Sylvester;
  return Rotation::Matrix;
}

// out = H y for the unnormalised Sylvester-Hadamard H of order NCH kLanes, y in NCH vectors (H is
// symmetric: y H = H y): butterflies kLanes or more apart between vectors, then the in-vector ones
// (Vec::hadamard: 1, 2, 4 and 8 apart as a lane permute plus one FMA with a +-1 vector each), about
// D log2(D) / kLanes vector operations. At D = 128 and 256 on AVX2 the 16 / 32 vectors exceed the
// registers and the compiler keeps some on the stack: still far fewer operations than the D x D product.
template <int NCH>
inline void fwht_inplace(Vec* v) {
  for (int span = 1; span < NCH; span *= 2)
    for (int j = 0; j < NCH; ++j)
      if (!(j & span)) {
        const Vec a = v[j], b = v[j + span];
        v[j] = a + b;
        v[j + span] = a - b;
      }
  for (int j = 0; j < NCH; ++j) v[j] = v[j].hadamard();
}

template <int NCH>
inline void fwht_regs(const float* y, float* out) {
  Vec v[NCH];
  for (int j = 0; j < NCH; ++j) v[j] = Vec::load(y + Vec::kLanes * j);
  fwht_inplace<NCH>(v);
  for (int j = 0; j < NCH; ++j) v[j].store(out + Vec::kLanes * j);
}

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
    constexpr int L = Vec::kLanes;
    if (rotation == Rotation::Sylvester) switch (D) {  // fwht_regs' template argument: vectors per row
        case 16: return fwht_regs<16 / L>(y, out);
        case 32: return fwht_regs<32 / L>(y, out);
        case 64: return fwht_regs<64 / L>(y, out);
        case 128: return fwht_regs<128 / L>(y, out);
        case 256: return fwht_regs<256 / L>(y, out);
        default: break;  // classify() admits no other order
      }
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

// y[m] = the residual's codes m kLanes .. (m + 1) kLanes - 1 looked up in `table` (the levels times the
// residual's scale), NCH vectors (D = NCH kLanes, all compile-time): Vec::decode reads each vector's 2 or
// 4 bytes of codes and looks them up with lane permutes, so the codes come out in order, in registers.
template <int BITS, int NCH>
inline void decode_regs(const uint8_t* r, const Vec::Table& table, Vec* y) {
#pragma GCC unroll 16
  for (int m = 0; m < NCH; ++m) y[m] = Vec::decode<BITS>(r, m, table);
}

// y = scale * levels[codes] of residual `slot` of a tier.
inline void residual_codes(const Tier& t, const Codec& c, int64_t slot, float* y) {
  TORCH_CHECK(slot >= 0 && slot < t.slots, "anchor_segment_attention: residual slot ", slot, " outside [0, ",
              t.slots, "): corrupted mask or prefix");
  const float s = t.scale[slot];
  const int64_t D = c.D;
  constexpr int L = Vec::kLanes;
  const uint8_t* r = t.res + slot * (D * t.bits / 8);
  if (D % L == 0) {
    const Vec::Table table = Vec::table(t.bits == 2 ? c.levels2 : c.levels4, s);
    if (t.bits == 2)
      for (int64_t m = 0; m < D / L; ++m) Vec::decode<2>(r, m, table).store(y + m * L);
    else
      for (int64_t m = 0; m < D / L; ++m) Vec::decode<4>(r, m, table).store(y + m * L);
    return;
  }
  if (t.bits == 2)  // D not a multiple of the lanes: one code at a time
    for (int64_t j = 0; j < D; ++j) y[j] = s * c.levels2[stream_code<2>(r, j)];
  else
    for (int64_t j = 0; j < D; ++j) y[j] = s * c.levels4[stream_code<4>(r, j)];
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

// The same with each key held in NCH vectors (D = NCH kLanes, NCH even: RoPE's halves are whole vectors)
// from its anchor row to its dot products: its residual decoded into them, Hadamard-transformed (or not:
// the identity), times the factor signs plus the scaled anchor row (both loaded from L1, so the key's NCH
// vectors are the only ones held across the steps: D = 32 and 64 stay in AVX2's 16 registers), rotated,
// dotted with the query rows, never stored. The buffered version spent most of its time on the
// store-then-load between those steps (perf: the scale, RoPE and dot loops, each a pass over the row in
// memory).
template <int NCH, typename E>
void block_key_scores_regs(const float* q, int64_t M, int64_t h, int64_t n, int64_t K, const E* anchor_k,
                           const Side& ks, const BlockSlots& slots, const Codec& codec, const float* cos,
                           const float* sin, int64_t W, int64_t first_position, float scaling, int64_t t0, int64_t t1,
                           float* s) {
  static_assert(NCH % 2 == 0, "RoPE's halves must be whole vectors");
  constexpr int L = Vec::kLanes;
  constexpr int64_t D = L * NCH;
  constexpr int HALF = NCH / 2;
  const float* fs = codec.factor_signs.data();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t e = h * n + t;
    const E* a = anchor_k + (h * K + ks.anchor_of(e)) * D;
    const Vec g = Vec::splat(widen(ks.coef[e]));
    Vec x[NCH];
    if (slots.tier[t - t0] >= 0) {
      const Tier& tier = ks.tiers[slots.tier[t - t0]];
      const int64_t slot = slots.slot[t - t0];
      TORCH_CHECK(slot >= 0 && slot < tier.slots, "anchor_segment_attention: residual slot ", slot, " outside [0, ",
                  tier.slots, "): corrupted mask or prefix");
      const float scale = tier.scale[slot];
      if (tier.bits == 2) decode_regs<2, NCH>(tier.res + slot * (D / 4), Vec::table(codec.levels2, scale), x);
      else decode_regs<4, NCH>(tier.res + slot * (D / 2), Vec::table(codec.levels4, scale), x);
      if (codec.rotation == Rotation::Sylvester) fwht_inplace<NCH>(x);
      for (int j = 0; j < NCH; ++j) x[j] = fma(Vec::load(fs + L * j), x[j], g * Vec::load(a + L * j));
    } else {
      for (int j = 0; j < NCH; ++j) x[j] = g * Vec::load(a + L * j);
    }
    const RopeRow rope(cos + (first_position + t) * W, sin + (first_position + t) * W, D, W);
    for (int j = 0; j < HALF; ++j) rotate_pair(x[j], x[j + HALF], rope, L * j);
    for (int64_t i = 0; i < M; ++i) {
      const float* qi = q + i * D;
      Vec acc = Vec::load(qi) * x[0];
      for (int j = 1; j < NCH; ++j) acc = fma(Vec::load(qi + L * j), x[j], acc);
      s[i * 32 + (t - t0)] = acc.reduce_add() * scaling;
    }
  }
}

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
    // Keys in registers where a key's vectors fill at most half the register file (AVX-512: D <= 256;
    // AVX2: D <= 64; the scalar build: never).
    constexpr int L = Vec::kLanes;
    if (codec.rotation != Rotation::Matrix && D % L == 0 && D / L <= Vec::kRegisters / 2) switch (D / L) {
        case 2: return block_key_scores_regs<2>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W, first_position,
                                                scaling, t0, t1, s.data());
        case 4: return block_key_scores_regs<4>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W, first_position,
                                                scaling, t0, t1, s.data());
        case 8: return block_key_scores_regs<8>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W, first_position,
                                                scaling, t0, t1, s.data());
        case 16: return block_key_scores_regs<16>(q, M, h, n, K, anchor_k, ks, slots, codec, cos, sin, W,
                                                  first_position, scaling, t0, t1, s.data());
        default: break;
      }
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

// The `segment` operand's tensors, in the order SEGMENT_OPERANDS (kvpack/attention/anchor.py) lists them.
struct AnchorOperands {
  const at::Tensor &anchor_k, &anchor_v, &hmat, &signs, &cos, &sin;
  const at::Tensor &index_k, &coef_k, &mask_k, &prefix_k, &res_k, &scale_k;
  const at::Tensor &index_v, &coef_v, &mask_v, &prefix_v, &res_v, &scale_v;
  const at::Tensor &fine_mask_k, &fine_prefix_k, &fine_res_k, &fine_scale_k;
  const at::Tensor &fine_mask_v, &fine_prefix_v, &fine_res_v, &fine_scale_v, &fine_levels;

  static AnchorOperands from(at::TensorList t) {
    TORCH_CHECK(t.size() == 27, "anchor_segment_attention: expected the 27 tensors of SEGMENT_OPERANDS "
                "(kvpack/attention/anchor.py), got ", t.size());
    return {t[0],  t[1],  t[2],  t[3],  t[4],  t[5],  t[6],  t[7],  t[8],  t[9],  t[10], t[11], t[12], t[13],
            t[14], t[15], t[16], t[17], t[18], t[19], t[20], t[21], t[22], t[23], t[24], t[25], t[26]};
  }
};

State anchor_segment_attention(const at::Tensor& q, at::TensorList segment, c10::ArrayRef<double> levels,
                               double hfactor, double scaling, int64_t first_position, int64_t blocks_per_split) {
  const AnchorOperands o = AnchorOperands::from(segment);
  check_queries(q);
  const int64_t H = q.size(0), D = q.size(2), n = o.index_k.dim() == 2 ? o.index_k.size(1) : 0;
  TORCH_CHECK(D % 4 == 0, "anchor_segment_attention: head_dim must be a multiple of 4, got ", D);
  for (const auto* a : {&o.anchor_k, &o.anchor_v})
    TORCH_CHECK(a->dim() == 3 && a->size(0) == H && a->size(2) == D && a->is_contiguous() &&
                    a->scalar_type() == o.anchor_k.scalar_type(),
                "anchor_segment_attention: anchors must be contiguous [H, k, D] of one dtype, got ", a->sizes());
  const int64_t K = o.anchor_k.size(1);
  TORCH_CHECK(o.anchor_v.size(1) == K, "anchor_segment_attention: key and value anchors differ in count");
  TORCH_CHECK(o.hmat.scalar_type() == at::kHalf && o.hmat.dim() == 2 && o.hmat.size(0) == D && o.hmat.size(1) == D,
              "anchor_segment_attention: hmat must be the codec's [D, D] fp16 0/±1 matrix");
  TORCH_CHECK(levels.size() == 4, "anchor_segment_attention: the 2-bit codec has 4 levels, got ", levels.size());
  TORCH_CHECK(o.cos.scalar_type() == at::kFloat && o.cos.is_contiguous() && o.sin.is_contiguous() && o.cos.dim() == 2 &&
                  o.cos.sizes() == o.sin.sizes() && (o.cos.size(1) == D || o.cos.size(1) == D / 2) &&
                  o.cos.size(0) >= first_position + n,
              "anchor_segment_attention: the RoPE tables must be fp32 [positions >= ", first_position + n,
              ", D or D / 2]");
  Codec codec;
  codec.D = D;
  codec.rotation = classify(o.hmat.contiguous(), codec.matrix);
  codec.signs.resize(D);
  widen_row(o.signs.contiguous().data_ptr<float>(), codec.signs.data(), D);
  codec.factor = float(hfactor);
  codec.factor_signs.resize(D);
  for (int64_t c = 0; c < D; ++c) codec.factor_signs[c] = codec.factor * codec.signs[c];
  for (int i = 0; i < 4; ++i) codec.levels2[i] = float(levels[i]);
  const bool fine = o.fine_mask_k.numel() > 0;
  if (fine) {
    TORCH_CHECK(o.fine_levels.scalar_type() == at::kFloat && o.fine_levels.numel() == 16,
                "anchor_segment_attention: the fine tier needs 16 fp32 levels");
    std::copy(o.fine_levels.data_ptr<float>(), o.fine_levels.data_ptr<float>() + 16, codec.levels4);
  }
  Side ks = make_side(o.index_k, o.coef_k, H, n, K, "key");
  Side vs = make_side(o.index_v, o.coef_v, H, n, K, "value");
  ks.tiers[0] = make_tier(o.mask_k, o.prefix_k, o.res_k, o.scale_k, 2, H, n, D, "key");
  vs.tiers[0] = make_tier(o.mask_v, o.prefix_v, o.res_v, o.scale_v, 2, H, n, D, "value");
  if (fine) {
    ks.tiers[1] = make_tier(o.fine_mask_k, o.fine_prefix_k, o.fine_res_k, o.fine_scale_k, 4, H, n, D, "fine key");
    vs.tiers[1] = make_tier(o.fine_mask_v, o.fine_prefix_v, o.fine_res_v, o.fine_scale_v, 4, H, n, D, "fine value");
  }
  const int64_t n_blocks = (n + 31) / 32, bps = std::max<int64_t>(1, blocks_per_split);
  const float* qp = q.data_ptr<float>();
  const int64_t W = o.cos.size(1);
  State out;
  with_dtype(o.anchor_k, "anchor_segment_attention: anchors", [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    const E* ak = static_cast<const E*>(o.anchor_k.data_ptr());
    const E* av = static_cast<const E*>(o.anchor_v.data_ptr());
    out = split_k(H, n_chunks(n_blocks, bps), q.size(1), D, q.options(), [&](int64_t h, int64_t s, RowsState& st) {
      segment_blocks(qp + h * q.size(1) * D, h, s * bps, std::min(n_blocks, (s + 1) * bps), n, K, D, ak, av, ks, vs,
                     codec, o.cos.data_ptr<float>(), o.sin.data_ptr<float>(), W, first_position, float(scaling), st);
    });
  });
  return out;
}

}  // namespace kvpack
