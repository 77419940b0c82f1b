// kvpack::dense_attention on CPU: grouped queries over dense keys/values [H, T, D] (FullKV's store,
// the eviction stores' kept tokens, any store's dense sink and tail), split-K over the tokens.
#include "common.h"

namespace kvpack {

State dense_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                      int64_t tokens_per_split) {
  check_queries(q);
  check_dense(k, q, "keys");
  check_dense(v, q, "values");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "keys ", k.sizes(), " ",
              k.scalar_type(), " and values ", v.sizes(), " ", v.scalar_type(), " must match");
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), T = k.size(1);
  const int64_t per = std::max<int64_t>(1, tokens_per_split);
  const float* qp = q.data_ptr<float>();
  State out;
  with_dtype(k, "keys", [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    const E* kp = static_cast<const E*>(k.data_ptr());
    const E* vp = static_cast<const E*>(v.data_ptr());
    out = split_k(H, n_chunks(T, per), M, D, q.options(), [&](int64_t h, int64_t s, RowsState& st) {
      const int64_t t0 = s * per, t1 = std::min(T, t0 + per);
      dense_tokens(qp + h * M * D, kp + h * T * D, vp + h * T * D, t0, t1, D, float(scaling), st);
    });
  });
  return out;
}

}  // namespace kvpack
