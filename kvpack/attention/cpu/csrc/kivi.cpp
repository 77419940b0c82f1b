// kvpack::kivi_attention on CPU: grouped queries over KIVI's quantized blocks and its full-precision
// residual, read where the store keeps them: with AVX-512 the codes are decoded into registers; the
// generic path widens one block's codes into a [G, D] float buffer (the codes, not dequantized values).
//
// Keys are quantized per channel over a block of G tokens: k[t, c] = code[t, c] * ks[c] + kz[c], so a
// row's logit is sum_c (q[c] ks[c]) code[t, c] + sum_c q[c] kz[c]: the scaled query q * ks and the
// constant are formed once per block. Values are quantized per token over groups of Gv channels:
// v[t, c] = code[t, c] * vs[t, c / Gv] + vz[t, c / Gv].
#include "common.h"

namespace kvpack {

// Every byte's PER = 8 / BITS codes as floats (first code in the lowest bits): unpacking a row is one
// small copy per byte instead of PER shifts, masks and conversions.
template <int BITS>
struct CodeTable {
  static constexpr int PER = 8 / BITS;
  float v[256][PER];
  CodeTable() {
    for (int b = 0; b < 256; ++b)
      for (int k = 0; k < PER; ++k) v[b][k] = float((b >> (k * BITS)) & ((1 << BITS) - 1));
  }
};

// n codes of BITS bits packed along the row -> floats.
template <int BITS>
inline void unpack_row(const uint8_t* __restrict src, float* __restrict dst, int64_t n) {
  static const CodeTable<BITS> table;
  constexpr int PER = CodeTable<BITS>::PER;
  const int64_t whole = n / PER;
  for (int64_t j = 0; j < whole; ++j) std::memcpy(dst + j * PER, table.v[src[j]], sizeof(float) * PER);
  for (int64_t c = whole * PER; c < n; ++c) dst[c] = table.v[src[c / PER]][c % PER];
}

template <int BITS>
void kivi_blocks(const float* q, int64_t M, int64_t D, const uint8_t* kq, const c10::Half* ks, const c10::Half* kz,
                 const uint8_t* vq, const c10::Half* vs, const c10::Half* vz, int64_t b0, int64_t b1, int64_t G,
                 int64_t Gv, float scaling, RowsState& st) {
  const int64_t k_bytes = (D * BITS + 7) / 8;            // per token
  const int64_t n_vg = D / Gv, vg_bytes = (Gv * BITS + 7) / 8;
  // A block's codes are unpacked into a [G, D] buffer before any of them is read back: reading a row
  // right after its table copies were written stalled on store forwarding (16-byte stores, 64-byte loads).
  std::vector<float> qs(M * D), qc(M), codes(G * D), s(M * G), scale(D), zero(D);
  for (int64_t b = b0; b < b1; ++b) {
    widen_row(ks + b * D, scale.data(), D);
    widen_row(kz + b * D, zero.data(), D);
    for (int64_t i = 0; i < M; ++i) {
      const float* qi = q + i * D;
      float* qsi = qs.data() + i * D;
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) qsi[c] = qi[c] * scale[c];
      qc[i] = dot(qi, zero.data(), D);
    }
    const uint8_t* kb = kq + b * G * k_bytes;
    for (int64_t t = 0; t < G; ++t) unpack_row<BITS>(kb + t * k_bytes, codes.data() + t * D, D);
    for (int64_t t = 0; t < G; ++t)
      for (int64_t i = 0; i < M; ++i)
        s[i * G + t] = (dot(qs.data() + i * D, codes.data() + t * D, D) + qc[i]) * scaling;
    st.absorb(s.data(), G, G);
    // Values: v = code * a + z per (token, channel group); the output takes sum_t p_t v_t.
    const uint8_t* vb = vq + b * G * n_vg * vg_bytes;
    for (int64_t t = 0; t < G; ++t)
      for (int64_t g = 0; g < n_vg; ++g)
        unpack_row<BITS>(vb + (t * n_vg + g) * vg_bytes, codes.data() + t * D + g * Gv, Gv);
    for (int64_t t = 0; t < G; ++t) {
      const int64_t tok = b * G + t;
      float* r = codes.data() + t * D;
      for (int64_t g = 0; g < n_vg; ++g) {
        const float a = widen(vs[tok * n_vg + g]), z = widen(vz[tok * n_vg + g]);
        float* rg = r + g * Gv;
#pragma omp simd
        for (int64_t c = 0; c < Gv; ++c) rg[c] = rg[c] * a + z;
      }
    }
    accumulate_values(s.data(), G, codes.data(), M, G, D, st.o.data());
  }
}

#if defined(__AVX512F__)
// The AVX-512 path: 16 bytes of a row are widened to 16 int32 lanes and each of the byte's PER codes
// taken out by a shift and a mask, so vector k holds the codes of channels (16 ch + lane) PER + k. The
// dot product does not care about the order: the scaled query is laid out the same way once per block
// ([M][chunks][PER][16]), and the values' weighted sum is accumulated in that order and put back in
// channel order once per block. Needs rows of a multiple of 16 bytes and at most 16 value groups.
template <int BITS>
void kivi_blocks_avx512(const float* q, int64_t M, int64_t D, const uint8_t* kq, const c10::Half* ks,
                        const c10::Half* kz, const uint8_t* vq, const c10::Half* vs, const c10::Half* vz, int64_t b0,
                        int64_t b1, int64_t G, int64_t Gv, float scaling, RowsState& st) {
  constexpr int PER = 8 / BITS;
  const int64_t row_bytes = D * BITS / 8, n_ch = row_bytes / 16, n_vg = D / Gv;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  std::vector<float> qp(M * D), qc(M), s(M * G), scale(D), zero(D), op(M * D), zacc(M * 16);
  // lane -> value group of its byte, per chunk
  std::vector<__m512i> group_of(n_ch);
  for (int64_t ch = 0; ch < n_ch; ++ch) {
    alignas(64) int32_t idx[16];
    for (int l = 0; l < 16; ++l) idx[l] = int32_t((ch * 16 + l) * PER / Gv);
    group_of[ch] = _mm512_load_si512(idx);
  }
  // channel of each permuted slot, and its value group (computed once: no divisions in the loops)
  std::vector<int32_t> channel(D), group(D);
  for (int64_t ch = 0; ch < n_ch; ++ch)
    for (int k = 0; k < PER; ++k)
      for (int l = 0; l < 16; ++l) {
        const int64_t slot = (ch * PER + k) * 16 + l;
        channel[slot] = int32_t((ch * 16 + l) * PER + k);
        group[slot] = int32_t(channel[slot] / Gv);
      }
  const __mmask16 group_mask = __mmask16((1u << n_vg) - 1);
  auto codes = [&](const uint8_t* row, int64_t ch, int k) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + ch * 16)));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, k * BITS), mask));
  };
  for (int64_t b = b0; b < b1; ++b) {
    widen_row(ks + b * D, scale.data(), D);
    widen_row(kz + b * D, zero.data(), D);
    for (int64_t i = 0; i < M; ++i) {
      const float* qi = q + i * D;
      qc[i] = dot(qi, zero.data(), D);
      for (int64_t slot = 0; slot < D; ++slot) qp[i * D + slot] = qi[channel[slot]] * scale[channel[slot]];
    }
    const uint8_t* kb = kq + b * G * row_bytes;
    for (int64_t t = 0; t < G; ++t) {
      const uint8_t* row = kb + t * row_bytes;
      for (int64_t i = 0; i < M; ++i) {
        __m512 acc = _mm512_setzero_ps();
        const float* qi = qp.data() + i * D;
        for (int64_t ch = 0; ch < n_ch; ++ch)
          for (int k = 0; k < PER; ++k)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + (ch * PER + k) * 16), codes(row, ch, k), acc);
        s[i * G + t] = (_mm512_reduce_add_ps(acc) + qc[i]) * scaling;
      }
    }
    st.absorb(s.data(), G, G);
    std::fill(op.begin(), op.end(), 0.f);
    std::fill(zacc.begin(), zacc.end(), 0.f);
    const uint8_t* vb = vq + b * G * row_bytes;
    for (int64_t t = 0; t < G; ++t) {
      const int64_t tok = b * G + t;
      const uint8_t* row = vb + t * row_bytes;
      const __m512 a = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(group_mask, vs + tok * n_vg));
      const __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(group_mask, vz + tok * n_vg));
      for (int64_t ch = 0; ch < n_ch; ++ch) {
        const __m512 a_lane = _mm512_permutexvar_ps(group_of[ch], a);
        for (int k = 0; k < PER; ++k) {
          const __m512 v = _mm512_mul_ps(codes(row, ch, k), a_lane);
          for (int64_t i = 0; i < M; ++i) {
            float* o = op.data() + i * D + (ch * PER + k) * 16;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(s[i * G + t]), v, _mm512_loadu_ps(o)));
          }
        }
      }
      for (int64_t i = 0; i < M; ++i) {
        float* zi = zacc.data() + i * 16;
        _mm512_storeu_ps(zi, _mm512_fmadd_ps(_mm512_set1_ps(s[i * G + t]), z, _mm512_loadu_ps(zi)));
      }
    }
    for (int64_t i = 0; i < M; ++i) {  // back to channel order, plus each group's sum_t p_t z_t
      float* o = st.o.data() + i * D;
      for (int64_t slot = 0; slot < D; ++slot) o[channel[slot]] += op[i * D + slot] + zacc[i * 16 + group[slot]];
    }
  }
}
#endif

template <int BITS>
void kivi_blocks_any(const float* q, int64_t M, int64_t D, const uint8_t* kq, const c10::Half* ks, const c10::Half* kz,
                     const uint8_t* vq, const c10::Half* vs, const c10::Half* vz, int64_t b0, int64_t b1, int64_t G,
                     int64_t Gv, float scaling, RowsState& st) {
#if defined(__AVX512F__)
  if ((D * BITS) % 128 == 0 && D / Gv <= 16 && Gv % (8 / BITS) == 0) {
    kivi_blocks_avx512<BITS>(q, M, D, kq, ks, kz, vq, vs, vz, b0, b1, G, Gv, scaling, st);
    return;
  }
#endif
  kivi_blocks<BITS>(q, M, D, kq, ks, kz, vq, vs, vz, b0, b1, G, Gv, scaling, st);
}

State kivi_attention(const at::Tensor& q, const at::Tensor& kq, const at::Tensor& ks, const at::Tensor& kz,
                     const at::Tensor& vq, const at::Tensor& vs, const at::Tensor& vz, const at::Tensor& tail_k,
                     const at::Tensor& tail_v, int64_t bits, int64_t group, int64_t value_group, double scaling,
                     int64_t blocks_per_split, int64_t tokens_per_split) {
  check_queries(q);
  check_dense(tail_k, q, "tail keys");
  check_dense(tail_v, q, "tail values");
  TORCH_CHECK(bits == 2 || bits == 4, "kivi: bits must be 2 or 4, got ", bits);
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2);
  TORCH_CHECK(value_group >= 1 && D % value_group == 0, "kivi: head_dim ", D, " is not a multiple of the value group ",
              value_group);
  const int64_t B = kq.numel() ? kq.size(1) : 0;
  if (B) {
    TORCH_CHECK(kq.dim() == 4 && kq.size(0) == H && kq.size(2) == group && kq.size(3) == (D * bits + 7) / 8 &&
                    kq.scalar_type() == at::kByte && kq.is_contiguous(),
                "kivi: key codes must be contiguous uint8 [H, blocks, group, packed D], got ", kq.sizes());
    TORCH_CHECK(vq.numel() == H * B * group * (D / value_group) * ((value_group * bits + 7) / 8) &&
                    vq.scalar_type() == at::kByte && vq.is_contiguous(),
                "kivi: value codes of shape ", vq.sizes(), " do not match ", B, " blocks");
    for (const auto* t : {&ks, &kz})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == H * B * D,
                  "kivi: key scales and zeros must be contiguous fp16 [H, blocks, 1, D], got ", t->sizes());
    for (const auto* t : {&vs, &vz})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == H * B * group * (D / value_group),
                  "kivi: value scales and zeros must be contiguous fp16 [H, blocks, group, D / Gv, 1], got ",
                  t->sizes());
  }
  const int64_t T = tail_k.size(1);
  const int64_t bps = std::max<int64_t>(1, blocks_per_split), tps = std::max<int64_t>(1, tokens_per_split);
  const int64_t n_block_splits = n_chunks(B, bps), n_splits = n_block_splits + n_chunks(T, tps);
  const float* qp = q.data_ptr<float>();
  State out;
  with_dtype(tail_k, "tail keys", [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    const E* tk = static_cast<const E*>(tail_k.data_ptr());
    const E* tv = static_cast<const E*>(tail_v.data_ptr());
    out = split_k(H, n_splits, M, D, q.options(), [&](int64_t h, int64_t s, RowsState& st) {
      const float* qh = qp + h * M * D;
      if (s < n_block_splits) {
        const int64_t b0 = s * bps, b1 = std::min(B, b0 + bps);
        const auto* kqh = kq.data_ptr<uint8_t>() + h * B * group * ((D * bits + 7) / 8);
        const auto* vqh = vq.data_ptr<uint8_t>() + h * B * group * (D / value_group) * ((value_group * bits + 7) / 8);
        const auto* ksh = ks.data_ptr<c10::Half>() + h * B * D;
        const auto* kzh = kz.data_ptr<c10::Half>() + h * B * D;
        const auto* vsh = vs.data_ptr<c10::Half>() + h * B * group * (D / value_group);
        const auto* vzh = vz.data_ptr<c10::Half>() + h * B * group * (D / value_group);
        if (bits == 2)
          kivi_blocks_any<2>(qh, M, D, kqh, ksh, kzh, vqh, vsh, vzh, b0, b1, group, value_group, float(scaling), st);
        else
          kivi_blocks_any<4>(qh, M, D, kqh, ksh, kzh, vqh, vsh, vzh, b0, b1, group, value_group, float(scaling), st);
      } else {
        const int64_t t0 = (s - n_block_splits) * tps, t1 = std::min(T, t0 + tps);
        dense_tokens(qh, tk + h * T * D, tv + h * T * D, t0, t1, D, float(scaling), st);
      }
    });
  });
  return out;
}

}  // namespace kvpack
