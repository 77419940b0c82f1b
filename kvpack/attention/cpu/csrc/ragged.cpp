// kvpack::puzzle_ragged_attention on CPU: grouped queries over one puzzle_plus layer — dense sink,
// pages whose ranks differ per (KV head, page, side), dense tail — split-K over pages and tokens.
//
// Page n of head h is entry e = n H + h: its rank r and rank offset o come from the side's tables
// (rank [N, H] int16, offset [N, H] int32); L [P, r] starts at element o P of the flat left buffer,
// R [r, D] at element o D of the right one (INT4: bytes o P / 2 and o D / 2, codes two per byte along
// a row, L's column scales at o, R's at e D). Each page is widened into fp32 buffers sized for the
// largest rank and folded (pages.h) at its own ranks, so the work follows each page's rank.
#include "pages.h"

namespace kvpack {
namespace {

struct RaggedSide {
  const void* left;
  const void* right;
  const c10::Half* left_scale;   // INT4: [sum r]
  const c10::Half* right_scale;  // INT4: [N, H, D]
  const int16_t* rank;           // [N, H]
  const int32_t* offset;         // [N, H]
};

// One side's factors of entry e (rank r, offset o) as fp32: L into [P, r], R into [r, D].
template <typename E>
void load_side(const RaggedSide& side, bool int4, int64_t e, int64_t r, int64_t o, int64_t P, int64_t D, float* L,
               float* R, std::vector<float>& scale_buf) {
  if (int4) {
    widen_int4(static_cast<const uint8_t*>(side.left) + o * P / 2, side.left_scale + o, nullptr, P, r, L,
               scale_buf);
    widen_int4(static_cast<const uint8_t*>(side.right) + o * D / 2, side.right_scale + e * D, nullptr, r, D, R,
               scale_buf);
  } else {
    widen_row(static_cast<const E*>(side.left) + o * P, L, P * r);
    widen_row(static_cast<const E*>(side.right) + o * D, R, r * D);
  }
}

RaggedSide ragged_side(const at::Tensor& left, const at::Tensor& right, const at::Tensor& left_scale,
                       const at::Tensor& right_scale, const at::Tensor& rank, const at::Tensor& offset, bool int4,
                       int64_t N, int64_t H, int64_t P, int64_t D, const char* which) {
  TORCH_CHECK(rank.scalar_type() == at::kShort && offset.scalar_type() == at::kInt && rank.is_contiguous() &&
                  offset.is_contiguous() && rank.numel() == N * H && offset.numel() == N * H,
              "puzzle_ragged_attention: ", which, " rank / offset must be contiguous int16 / int32 [N, H]");
  TORCH_CHECK(left.is_contiguous() && right.is_contiguous(), "puzzle_ragged_attention: ", which,
              " factors must be contiguous");
  RaggedSide s{left.data_ptr(), right.data_ptr(), nullptr, nullptr, rank.data_ptr<int16_t>(),
               offset.data_ptr<int32_t>()};
  if (int4) {
    TORCH_CHECK(left.scalar_type() == at::kByte && right.scalar_type() == at::kByte &&
                    left_scale.scalar_type() == at::kHalf && right_scale.scalar_type() == at::kHalf &&
                    right_scale.numel() == N * H * D && left_scale.is_contiguous() && right_scale.is_contiguous(),
                "puzzle_ragged_attention: ", which, " INT4 factors must be uint8 with fp16 scales ([sum r], [N, H, D])");
    s.left_scale = left_scale.data_ptr<c10::Half>();
    s.right_scale = right_scale.data_ptr<c10::Half>();
  }
  // Every entry must lie inside the buffers (a corrupted table must not read other memory).
  int64_t max_end = 0;
  for (int64_t e = 0; e < N * H; ++e) {
    TORCH_CHECK(s.rank[e] >= 1 && s.offset[e] >= 0, "puzzle_ragged_attention: ", which, " entry ", e,
                " has rank ", s.rank[e], " and offset ", s.offset[e]);
    max_end = std::max<int64_t>(max_end, int64_t(s.offset[e]) + s.rank[e]);
  }
  const int64_t per_element = int4 ? 2 : 1;  // codes per stored element
  TORCH_CHECK(left.numel() * per_element >= max_end * P && right.numel() * per_element >= max_end * D &&
                  (!int4 || left_scale.numel() >= max_end),
              "puzzle_ragged_attention: ", which, " rank offsets reach rank ", max_end,
              " beyond the factor buffers");
  return s;
}

}  // namespace

// The `pages` operand's tensors, in the order RAGGED_OPERANDS (kvpack/attention/ragged_pages.py) lists them.
struct RaggedOperands {
  const at::Tensor &lk, &rk, &lv, &rv, &lks, &rks, &lvs, &rvs;
  const at::Tensor &k_rank, &k_offset, &v_rank, &v_offset;
  const at::Tensor &cos, &sin, &sink_k, &sink_v, &tail_k, &tail_v;

  static RaggedOperands from(at::TensorList t) {
    TORCH_CHECK(t.size() == 18, "puzzle_ragged_attention: expected the 18 tensors of RAGGED_OPERANDS "
                "(kvpack/attention/ragged_pages.py), got ", t.size());
    return {t[0], t[1],  t[2],  t[3],  t[4],  t[5],  t[6],  t[7],  t[8],
            t[9], t[10], t[11], t[12], t[13], t[14], t[15], t[16], t[17]};
  }
};

State puzzle_ragged_attention(const at::Tensor& q, at::TensorList pages, int64_t page_size, int64_t max_rank,
                              double scaling, bool int4, bool pre_rope, int64_t first_position, int64_t pages_per_split,
                              int64_t tokens_per_split, bool bf16_products) {
  const RaggedOperands o = RaggedOperands::from(pages);
  check_queries(q);
  for (const auto* t : {&o.sink_k, &o.sink_v, &o.tail_k, &o.tail_v})
    check_dense(*t, q, "puzzle_ragged_attention: dense tokens");
  TORCH_CHECK(o.sink_k.scalar_type() == o.tail_k.scalar_type() && o.sink_v.scalar_type() == o.tail_v.scalar_type() &&
                  o.sink_k.scalar_type() == o.sink_v.scalar_type(),
              "puzzle_ragged_attention: sink and tail must share a dtype");
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), P = page_size;
  const int64_t N = o.k_rank.dim() == 2 ? o.k_rank.size(0) : 0;
  TORCH_CHECK(P >= 1 && max_rank >= 1, "puzzle_ragged_attention: page size and max rank must be >= 1");
  RaggedSide ks{}, vs{};
  if (N) {
    ks = ragged_side(o.lk, o.rk, o.lks, o.rks, o.k_rank, o.k_offset, int4, N, H, P, D, "key");
    vs = ragged_side(o.lv, o.rv, o.lvs, o.rvs, o.v_rank, o.v_offset, int4, N, H, P, D, "value");
    for (int64_t e = 0; e < N * H; ++e)
      TORCH_CHECK(ks.rank[e] <= max_rank && vs.rank[e] <= max_rank, "puzzle_ragged_attention: a rank exceeds ",
                  max_rank);
  }
  Geometry g{M, D, P, max_rank, max_rank, float(scaling), int4, pre_rope, nullptr, nullptr, D};
  if (pre_rope && N) {
    TORCH_CHECK(D % 2 == 0, "puzzle_ragged_attention: pre-RoPE keys need an even head_dim, got ", D);
    TORCH_CHECK(o.cos.scalar_type() == at::kFloat && o.sin.scalar_type() == at::kFloat && o.cos.is_contiguous() &&
                    o.sin.is_contiguous() && o.cos.dim() == 2 && o.cos.sizes() == o.sin.sizes() &&
                    (o.cos.size(1) == D || o.cos.size(1) == D / 2) && o.cos.size(0) >= first_position + N * P,
                "puzzle_ragged_attention: the RoPE tables must be fp32 [positions >= ", first_position + N * P,
                ", D or D / 2], got ", o.cos.sizes());
    g.cos = o.cos.data_ptr<float>();
    g.sin = o.sin.data_ptr<float>();
    g.W = o.cos.size(1);
    g.bf16_products = bf16_rebuild(bf16_products, D);
  }
  const int64_t TS = o.sink_k.size(1), TT = o.tail_k.size(1), T = TS + TT;
  const int64_t pps = std::max<int64_t>(1, pages_per_split), tps = std::max<int64_t>(1, tokens_per_split);
  const int64_t np = n_chunks(N, pps), n_splits = np + n_chunks(T, tps);
  const float* qp = q.data_ptr<float>();
  State out;
  with_dtype(o.sink_k, "puzzle_ragged_attention: dense tokens", [&](auto* dense_tag) {
    using DE = std::remove_pointer_t<decltype(dense_tag)>;
    auto run = [&](auto* factor_tag) {
      using FE = std::remove_pointer_t<decltype(factor_tag)>;
      out = split_k(H, n_splits, M, D, q.options(), [&](int64_t h, int64_t s, RowsState& st) {
        const float* qh = qp + h * M * D;
        if (s < np) {
          Page pg(P, max_rank, max_rank, D);
          PageScratch w(g);
          std::vector<float> scale_buf;
          for (int64_t n = s * pps; n < std::min(N, (s + 1) * pps); ++n) {
            const int64_t e = n * H + h;
            const int64_t rk_e = ks.rank[e], rv_e = vs.rank[e];
            if (int4) {  // INT4 keys: the bf16 rebuild's operands where g.bf16_products, else fp32
              load_int4_keys(static_cast<const uint8_t*>(ks.left) + ks.offset[e] * P / 2, ks.left_scale + ks.offset[e],
                             static_cast<const uint8_t*>(ks.right) + ks.offset[e] * D / 2, ks.right_scale + e * D, P,
                             rk_e, D, g, pg, scale_buf);
            } else {
              load_side<FE>(ks, int4, e, rk_e, ks.offset[e], P, D, pg.lk.data(), pg.rk.data(), scale_buf);
            }
            load_side<FE>(vs, int4, e, rv_e, vs.offset[e], P, D, pg.lv.data(), pg.rv.data(), scale_buf);
            fold_page(qh, pg, rk_e, rv_e, first_position + n * P, g, w, st);
          }
        } else {
          const int64_t t0 = (s - np) * tps, t1 = std::min(T, t0 + tps);
          const DE* sk = static_cast<const DE*>(o.sink_k.data_ptr()) + h * TS * D;
          const DE* sv = static_cast<const DE*>(o.sink_v.data_ptr()) + h * TS * D;
          const DE* tk = static_cast<const DE*>(o.tail_k.data_ptr()) + h * TT * D;
          const DE* tv = static_cast<const DE*>(o.tail_v.data_ptr()) + h * TT * D;
          if (t0 < TS) dense_tokens(qh, sk, sv, t0, std::min(t1, TS), D, float(scaling), st);
          if (t1 > TS) dense_tokens(qh, tk, tv, std::max(t0, TS) - TS, t1 - TS, D, float(scaling), st);
        }
      });
    };
    if (int4 || !N) {
      run(static_cast<float*>(nullptr));  // the element type is unused for INT4 factors (or no pages)
    } else {
      with_dtype(o.lk, "puzzle_ragged_attention: factors", run);
    }
  });
  return out;
}

}  // namespace kvpack
