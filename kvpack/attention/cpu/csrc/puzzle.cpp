// kvpack::puzzle_attention on CPU: grouped queries over one PuzzleKV layer — dense sink, factorized
// pages of the main and the recent set (read in place), dense tail — split-K over pages and tokens.
//
// A page is folded by pages.h (logits in rank space for post-RoPE keys, pre-RoPE keys rebuilt a tile
// at a time in registers; values through their factors). INT4 factors (nibble - 8 times an fp16 scale:
// per column for L_K, R_K, R_V, per row for L_V; low nibble = even element) are widened one page at a
// time. Layouts as puzzle_decode.puzzle_split_kernel's docstring.
#include "pages.h"

namespace kvpack {
namespace {

struct FactorSet {
  const void *lk, *rk, *lv, *rv;              // float form: E*, INT4 form: uint8_t*
  const c10::Half *lks, *rks, *lvs, *rvs;     // INT4 scales (null in float form)
  int64_t n;                                  // pages per head
};

// One page's factors into `out` as fp32 (INT4 keys: as the bf16 rebuild's operands where g.bf16_products).
template <typename E>
void load_page(const FactorSet& f, const Geometry& g, int64_t page, Page& out, std::vector<float>& scale_buf) {
  const int64_t P = g.P, RK = g.RK, RV = g.RV, D = g.D;
  if (g.int4) {
    const int64_t rkc = (RK + 1) / 2, rvc = (RV + 1) / 2, dc = (D + 1) / 2;
    load_int4_keys(static_cast<const uint8_t*>(f.lk) + page * P * rkc, f.lks + page * RK,
                   static_cast<const uint8_t*>(f.rk) + page * RK * dc, f.rks + page * D, P, RK, D, g, out, scale_buf);
    widen_int4(static_cast<const uint8_t*>(f.lv) + page * P * rvc, nullptr, f.lvs + page * P, P, RV, out.lv.data(),
               scale_buf);
    widen_int4(static_cast<const uint8_t*>(f.rv) + page * RV * dc, f.rvs + page * D, nullptr, RV, D, out.rv.data(),
               scale_buf);
    return;
  }
  widen_row(static_cast<const E*>(f.lk) + page * P * RK, out.lk.data(), P * RK);
  widen_row(static_cast<const E*>(f.rk) + page * RK * D, out.rk.data(), RK * D);
  widen_row(static_cast<const E*>(f.lv) + page * P * RV, out.lv.data(), P * RV);
  widen_row(static_cast<const E*>(f.rv) + page * RV * D, out.rv.data(), RV * D);
}

// Fold pages [n0, n1) of one set (its page n at position pos0 + n P) of head h into the state.
template <typename E>
void factor_pages(const float* q, const FactorSet& f, int64_t h, int64_t n0, int64_t n1, int64_t pos0,
                  const Geometry& g, RowsState& st) {
  Page pg(g.P, g.RK, g.RV, g.D);
  PageScratch w(g);
  std::vector<float> scale_buf;
  for (int64_t n = n0; n < n1; ++n) {
    load_page<E>(f, g, h * f.n + n, pg, scale_buf);
    fold_page(q, pg, g.RK, g.RV, pos0 + n * g.P, g, w, st);
  }
}

FactorSet factor_set(const at::Tensor& lk, const at::Tensor& rk, const at::Tensor& lv, const at::Tensor& rv,
                     const at::Tensor& lks, const at::Tensor& rks, const at::Tensor& lvs, const at::Tensor& rvs,
                     bool int4, int64_t H, int64_t P, int64_t RK, int64_t RV, int64_t D, const char* which) {
  FactorSet f{};
  f.n = lk.numel() ? lk.size(1) : 0;
  if (!f.n) return f;
  const int64_t rkc = int4 ? (RK + 1) / 2 : RK, rvc = int4 ? (RV + 1) / 2 : RV, dc = int4 ? (D + 1) / 2 : D;
  const int64_t N = f.n;
  auto expect = [&](const at::Tensor& t, int64_t numel, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == numel, "puzzle_attention: ", which, " ",
                name, " must be contiguous with ", numel, " elements, got ", t.sizes());
  };
  expect(lk, H * N * P * rkc, "lk");
  expect(rk, H * N * RK * dc, "rk");
  expect(lv, H * N * P * rvc, "lv");
  expect(rv, H * N * RV * dc, "rv");
  f.lk = lk.data_ptr();
  f.rk = rk.data_ptr();
  f.lv = lv.data_ptr();
  f.rv = rv.data_ptr();
  if (int4) {
    for (const auto* t : {&lk, &rk, &lv, &rv})
      TORCH_CHECK(t->scalar_type() == at::kByte, "puzzle_attention: INT4 factors must be uint8, got ",
                  t->scalar_type());
    expect(lks, H * N * RK, "lk scales");
    expect(rks, H * N * D, "rk scales");
    expect(lvs, H * N * P, "lv scales");
    expect(rvs, H * N * D, "rv scales");
    for (const auto* t : {&lks, &rks, &lvs, &rvs})
      TORCH_CHECK(t->scalar_type() == at::kHalf, "puzzle_attention: INT4 scales must be fp16");
    f.lks = lks.data_ptr<c10::Half>();
    f.rks = rks.data_ptr<c10::Half>();
    f.lvs = lvs.data_ptr<c10::Half>();
    f.rvs = rvs.data_ptr<c10::Half>();
  } else {
    for (const auto* t : {&rk, &lv, &rv})
      TORCH_CHECK(t->scalar_type() == lk.scalar_type(), "puzzle_attention: factors of one set must share a dtype");
  }
  return f;
}

}  // namespace

bool bf16_products_available() {
#if defined(__AVX512F__)
  return cpu_has_bf16_products();
#else
  return false;
#endif
}

// The `pages` operand's tensors, in the order PAGES_OPERANDS (kvpack/attention/pages.py) lists them.
struct PagesOperands {
  const at::Tensor &lk, &rk, &lv, &rv, &lks, &rks, &lvs, &rvs;          // the main set
  const at::Tensor &lk2, &rk2, &lv2, &rv2, &lks2, &rks2, &lvs2, &rvs2;  // the recent set
  const at::Tensor &cos, &sin, &sink_k, &sink_v, &tail_k, &tail_v;

  static PagesOperands from(at::TensorList t) {
    TORCH_CHECK(t.size() == 22, "puzzle_attention: expected the 22 tensors of PAGES_OPERANDS "
                "(kvpack/attention/pages.py), got ", t.size());
    return {t[0],  t[1],  t[2],  t[3],  t[4],  t[5],  t[6],  t[7],  t[8],  t[9],  t[10],
            t[11], t[12], t[13], t[14], t[15], t[16], t[17], t[18], t[19], t[20], t[21]};
  }
};

State puzzle_attention(const at::Tensor& q, at::TensorList pages, int64_t page_size, int64_t rank_k, int64_t rank_v,
                       double scaling, bool int4, bool pre_rope, int64_t first_position, int64_t pages_per_split,
                       int64_t tokens_per_split, bool bf16_products) {
  const PagesOperands o = PagesOperands::from(pages);
  check_queries(q);
  for (const auto* t : {&o.sink_k, &o.sink_v, &o.tail_k, &o.tail_v})
    check_dense(*t, q, "puzzle_attention: dense tokens");
  TORCH_CHECK(o.sink_k.scalar_type() == o.tail_k.scalar_type() && o.sink_v.scalar_type() == o.tail_v.scalar_type() &&
                  o.sink_k.scalar_type() == o.sink_v.scalar_type(),
              "puzzle_attention: sink and tail must share a dtype");
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), P = page_size;
  TORCH_CHECK(P >= 1 && rank_k >= 1 && rank_v >= 1, "puzzle_attention: page size and ranks must be >= 1");
  const FactorSet a =
      factor_set(o.lk, o.rk, o.lv, o.rv, o.lks, o.rks, o.lvs, o.rvs, int4, H, P, rank_k, rank_v, D, "main set");
  const FactorSet b = factor_set(o.lk2, o.rk2, o.lv2, o.rv2, o.lks2, o.rks2, o.lvs2, o.rvs2, int4, H, P, rank_k,
                                 rank_v, D, "recent set");
  Geometry g{M, D, P, rank_k, rank_v, float(scaling), int4, pre_rope, nullptr, nullptr, D};
  if (pre_rope && (a.n || b.n)) {
    TORCH_CHECK(D % 2 == 0, "puzzle_attention: pre-RoPE keys need an even head_dim, got ", D);
    TORCH_CHECK(o.cos.scalar_type() == at::kFloat && o.sin.scalar_type() == at::kFloat && o.cos.is_contiguous() &&
                    o.sin.is_contiguous() && o.cos.dim() == 2 && o.cos.sizes() == o.sin.sizes() &&
                    (o.cos.size(1) == D || o.cos.size(1) == D / 2) &&
                    o.cos.size(0) >= first_position + (a.n + b.n) * P,
                "puzzle_attention: the RoPE tables must be fp32 [positions >= ", first_position + (a.n + b.n) * P,
                ", D or D / 2], got ", o.cos.sizes());
    g.cos = o.cos.data_ptr<float>();
    g.sin = o.sin.data_ptr<float>();
    g.W = o.cos.size(1);
    g.bf16_products = bf16_rebuild(bf16_products, D);
  }
  const int64_t TS = o.sink_k.size(1), TT = o.tail_k.size(1), T = TS + TT;
  const int64_t pps = std::max<int64_t>(1, pages_per_split), tps = std::max<int64_t>(1, tokens_per_split);
  const int64_t na = n_chunks(a.n, pps), nb = n_chunks(b.n, pps), n_splits = na + nb + n_chunks(T, tps);
  const float* qp = q.data_ptr<float>();
  const at::Tensor& factor_dtype = a.n ? o.lk : (b.n ? o.lk2 : o.sink_k);
  State out;
  with_dtype(o.sink_k, "puzzle_attention: dense tokens", [&](auto* dense_tag) {
    using DE = std::remove_pointer_t<decltype(dense_tag)>;
    auto run = [&](auto* factor_tag) {
      using FE = std::remove_pointer_t<decltype(factor_tag)>;
      out = split_k(H, n_splits, M, D, q.options(), [&](int64_t h, int64_t s, RowsState& st) {
        const float* qh = qp + h * M * D;
        if (s < na) {
          factor_pages<FE>(qh, a, h, s * pps, std::min(a.n, (s + 1) * pps), first_position, g, st);
        } else if (s < na + nb) {
          const int64_t n0 = (s - na) * pps;
          factor_pages<FE>(qh, b, h, n0, std::min(b.n, n0 + pps), first_position + a.n * P, g, st);
        } else {  // dense tokens: the sink's, then the tail's, each read where it lives
          const int64_t t0 = (s - na - nb) * tps, t1 = std::min(T, t0 + tps);
          const DE* sk = static_cast<const DE*>(o.sink_k.data_ptr()) + h * TS * D;
          const DE* sv = static_cast<const DE*>(o.sink_v.data_ptr()) + h * TS * D;
          const DE* tk = static_cast<const DE*>(o.tail_k.data_ptr()) + h * TT * D;
          const DE* tv = static_cast<const DE*>(o.tail_v.data_ptr()) + h * TT * D;
          if (t0 < TS) dense_tokens(qh, sk, sv, t0, std::min(t1, TS), D, float(scaling), st);
          if (t1 > TS) dense_tokens(qh, tk, tv, std::max(t0, TS) - TS, t1 - TS, D, float(scaling), st);
        }
      });
    };
    if (int4) {
      run(static_cast<float*>(nullptr));  // the element type is unused for INT4 factors
    } else {
      with_dtype(factor_dtype, "puzzle_attention: factors", run);
    }
  });
  return out;
}

}  // namespace kvpack
