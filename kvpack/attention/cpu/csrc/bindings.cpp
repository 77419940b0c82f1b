// The CPU kernels of kvpack's decode-attention custom ops, exposed to Python; kvpack/attention/cpu
// registers each as the "cpu" kernel of its kvpack:: op (one schema, a Triton and a CPU backend).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "common.h"

namespace kvpack {
State dense_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                      int64_t tokens_per_split);
State kivi_attention(const at::Tensor& q, const at::Tensor& kq, const at::Tensor& ks, const at::Tensor& kz,
                     const at::Tensor& vq, const at::Tensor& vs, const at::Tensor& vz, const at::Tensor& tail_k,
                     const at::Tensor& tail_v, int64_t bits, int64_t group, int64_t value_group, double scaling,
                     int64_t blocks_per_split, int64_t tokens_per_split);
State puzzle_attention(const at::Tensor& q, const at::Tensor& lk, const at::Tensor& rk, const at::Tensor& lv,
                       const at::Tensor& rv, const at::Tensor& lks, const at::Tensor& rks, const at::Tensor& lvs,
                       const at::Tensor& rvs, const at::Tensor& lk2, const at::Tensor& rk2, const at::Tensor& lv2,
                       const at::Tensor& rv2, const at::Tensor& lks2, const at::Tensor& rks2, const at::Tensor& lvs2,
                       const at::Tensor& rvs2, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& sink_k,
                       const at::Tensor& sink_v, const at::Tensor& tail_k, const at::Tensor& tail_v, int64_t page_size,
                       int64_t rank_k, int64_t rank_v, double scaling, bool int4, bool pre_rope, int64_t first_position,
                       int64_t pages_per_split, int64_t tokens_per_split, bool bf16_products);
State puzzle_ragged_attention(const at::Tensor& q, const at::Tensor& lk, const at::Tensor& rk, const at::Tensor& lv,
                              const at::Tensor& rv, const at::Tensor& lks, const at::Tensor& rks,
                              const at::Tensor& lvs, const at::Tensor& rvs, const at::Tensor& k_rank,
                              const at::Tensor& k_offset, const at::Tensor& v_rank, const at::Tensor& v_offset,
                              const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& sink_k,
                              const at::Tensor& sink_v, const at::Tensor& tail_k, const at::Tensor& tail_v,
                              int64_t page_size, int64_t max_rank, double scaling, bool int4, bool pre_rope,
                              int64_t first_position, int64_t pages_per_split, int64_t tokens_per_split, bool bf16_products);
State anchor_segment_attention(
    const at::Tensor& q, const at::Tensor& anchor_k, const at::Tensor& anchor_v, const at::Tensor& hmat,
    const at::Tensor& signs, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& index_k,
    const at::Tensor& coef_k, const at::Tensor& mask_k, const at::Tensor& prefix_k, const at::Tensor& res_k,
    const at::Tensor& scale_k, const at::Tensor& index_v, const at::Tensor& coef_v, const at::Tensor& mask_v,
    const at::Tensor& prefix_v, const at::Tensor& res_v, const at::Tensor& scale_v, const at::Tensor& fine_mask_k,
    const at::Tensor& fine_prefix_k, const at::Tensor& fine_res_k, const at::Tensor& fine_scale_k,
    const at::Tensor& fine_mask_v, const at::Tensor& fine_prefix_v, const at::Tensor& fine_res_v,
    const at::Tensor& fine_scale_v, const at::Tensor& fine_levels, const std::vector<double>& levels, double hfactor,
    double scaling, int64_t first_position, int64_t blocks_per_split);
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_attend(const at::Tensor& m, const at::Tensor& l,
                                                            const at::Tensor& o, const at::Tensor& q,
                                                            const at::Tensor& tail_k, const at::Tensor& tail_v,
                                                            const at::Tensor& k, const at::Tensor& v, double scaling);
bool bf16_products_available();
}  // namespace kvpack

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dense_attention", &kvpack::dense_attention, "softmax state of grouped queries over dense K/V");
  m.def("puzzle_attention", &kvpack::puzzle_attention, "softmax state over a PuzzleKV layer's pages, sink, tail");
  m.def("puzzle_ragged_attention", &kvpack::puzzle_ragged_attention,
        "softmax state over a puzzle_plus layer's per-page-rank pages, sink, tail");
  m.def("anchor_segment_attention", &kvpack::anchor_segment_attention,
        "softmax state over one AnchorKV segment (anchors, coefficients, residual tiers)");
  m.def("chunk_attend", &kvpack::chunk_attend, "stored states merged with the tail and the chunk, normalised");
  m.def("kivi_attention", &kvpack::kivi_attention, "softmax state over KIVI's quantized blocks and residual");
  m.def("bf16_products_available", &kvpack::bf16_products_available,
        "whether this CPU and build run the pre-RoPE page rebuild with bf16 products (AVX-512 BF16)");
}
