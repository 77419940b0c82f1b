// kvpack::chunk_attend on CPU: the end of a decode step in one call — the stored parts' softmax states
// merged (each row's maximum first, then the rescaled normalisers and outputs, as merge_partials), the
// store's dense tail folded in, then the chunk's own keys (causal: row r of a head's group is query
// r mod Q and sees chunk keys j <= r mod Q), normalised. Replaces the PyTorch path's partial state of
// the chunk, its merge and the normalisation (measured at 0.44 ms of a 1.27 ms layer step at 2K).
#include "common.h"

namespace kvpack {

std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_attend(const at::Tensor& m, const at::Tensor& l,
                                                            const at::Tensor& o, const at::Tensor& q,
                                                            const at::Tensor& tail_k, const at::Tensor& tail_v,
                                                            const at::Tensor& k, const at::Tensor& v, double scaling) {
  check_queries(q);
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2);
  TORCH_CHECK(m.dim() == 3 && m.size(0) == H && m.size(2) == M && m.scalar_type() == at::kFloat && m.is_contiguous() &&
                  l.sizes() == m.sizes() && l.scalar_type() == at::kFloat && l.is_contiguous() && o.dim() == 4 &&
                  o.size(1) == m.size(1) && o.size(3) == D && o.scalar_type() == at::kFloat && o.is_contiguous(),
              "chunk_attend: stored states must be contiguous fp32 m, l [H, S, M] and o [H, S, M, D]");
  for (const auto* t : {&tail_k, &tail_v, &k, &v}) check_dense(*t, q, "chunk_attend: keys/values");
  const int64_t S = m.size(1), T = tail_k.size(1), Q = k.size(1);
  TORCH_CHECK(Q >= 1 && M % Q == 0, "chunk_attend: ", M, " query rows are not a multiple of the chunk's ", Q,
              " tokens");
  TORCH_CHECK(tail_k.scalar_type() == tail_v.scalar_type() && k.scalar_type() == v.scalar_type(),
              "chunk_attend: keys and values must share a dtype");
  auto out = at::empty({H, M, D}, q.options());
  auto m_out = at::empty({H, M}, q.options());
  auto l_out = at::empty({H, M}, q.options());
  const float *pm = m.data_ptr<float>(), *pl = l.data_ptr<float>(), *po = o.data_ptr<float>(),
              *qp = q.data_ptr<float>();
  float *out_p = out.data_ptr<float>(), *mo = m_out.data_ptr<float>(), *lo = l_out.data_ptr<float>();
  with_dtype(tail_k, "chunk_attend: tail", [&](auto* tail_tag) {
    using TE = std::remove_pointer_t<decltype(tail_tag)>;
    with_dtype(k, "chunk_attend: chunk", [&](auto* chunk_tag) {
      using CE = std::remove_pointer_t<decltype(chunk_tag)>;
      at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
        std::vector<float> kc(Q * D), vc(Q * D), s(M * Q);
        for (int64_t h = h0; h < h1; ++h) {
          RowsState st(M, D);
          for (int64_t i = 0; i < M; ++i) {  // merge the stored states
            float mx = NEG_INF;
            for (int64_t x = 0; x < S; ++x) mx = std::max(mx, pm[(h * S + x) * M + i]);
            if (mx == NEG_INF) continue;
            float lsum = 0.f;
            for (int64_t x = 0; x < S; ++x) {
              const int64_t r = (h * S + x) * M + i;
              if (pm[r] == NEG_INF) continue;
              const float w = std::exp(pm[r] - mx);
              lsum += pl[r] * w;
              axpy(w, po + r * D, st.o.data() + i * D, D);
            }
            st.m[i] = mx;
            st.l[i] = lsum;
          }
          const float* qh = qp + h * M * D;
          if (T) dense_tokens(qh, static_cast<const TE*>(tail_k.data_ptr()) + h * T * D,
                              static_cast<const TE*>(tail_v.data_ptr()) + h * T * D, 0, T, D, float(scaling), st);
          // The chunk, causal within itself.
          widen_row(static_cast<const CE*>(k.data_ptr()) + h * Q * D, kc.data(), Q * D);
          widen_row(static_cast<const CE*>(v.data_ptr()) + h * Q * D, vc.data(), Q * D);
          scores_block(qh, kc.data(), M, Q, D, float(scaling), s.data(), Q);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = i % Q + 1; j < Q; ++j) s[i * Q + j] = NEG_INF;
          st.absorb(s.data(), Q, Q);
          accumulate_values(s.data(), Q, vc.data(), M, Q, D, st.o.data());
          for (int64_t i = 0; i < M; ++i) {  // rows that saw no key give 0, as finalize does
            const float inv = st.l[i] > 0.f ? 1.f / st.l[i] : 0.f;
            float* dst = out_p + (h * M + i) * D;
            for (int64_t c = 0; c < D; ++c) dst[c] = st.o[i * D + c] * inv;
            mo[h * M + i] = st.m[i];
            lo[h * M + i] = st.l[i];
          }
        }
      });
    });
  });
  return {out, m_out, l_out};
}

}  // namespace kvpack
