// The CPU kernels of kvpack's decode-attention ops (and pca_quant's block coding) registered as the ops' CPU implementations.
#include <torch/library.h>
#include <torch/extension.h>

#include "common.h"

namespace kvpack {
State dense_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                      int64_t tokens_per_split);
State kivi_attention(const at::Tensor& q, const at::Tensor& kq, const at::Tensor& ks, const at::Tensor& kz,
                     const at::Tensor& vq, const at::Tensor& vs, const at::Tensor& vz, const at::Tensor& tail_k,
                     const at::Tensor& tail_v, int64_t bits, int64_t group, int64_t value_group, double scaling,
                     int64_t blocks_per_split, int64_t tokens_per_split);
State puzzle_attention(const at::Tensor& q, at::TensorList pages, int64_t page_size, int64_t rank_k, int64_t rank_v,
                       double scaling, bool int4, bool pre_rope, int64_t first_position, int64_t pages_per_split,
                       int64_t tokens_per_split, bool bf16_products);
State puzzle_ragged_attention(const at::Tensor& q, at::TensorList pages, int64_t page_size, int64_t max_rank,
                              double scaling, bool int4, bool pre_rope, int64_t first_position, int64_t pages_per_split,
                              int64_t tokens_per_split, bool bf16_products);
State anchor_segment_attention(const at::Tensor& q, at::TensorList segment, c10::ArrayRef<double> levels,
                               double hfactor, double scaling, int64_t first_position, int64_t blocks_per_split);
State pca_quant_attention(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& scale,
                          const at::Tensor& zero, const at::Tensor& basis, const at::Tensor& mean,
                          const at::Tensor& widths, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& skip, int64_t block, int64_t rope, int64_t first_position, double scaling,
                          int64_t blocks_per_split);
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_attend(const at::Tensor& m, const at::Tensor& l,
                                                            const at::Tensor& o, const at::Tensor& q,
                                                            const at::Tensor& tail_k, const at::Tensor& tail_v,
                                                            const at::Tensor& k, const at::Tensor& v, double scaling);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pca_quant_encode(const at::Tensor& coefficients,
                                                                const at::Tensor& widths);
bool bf16_products_available();

// dense_attention and kivi_attention read their tensors in place; the stores' own tensors already are
// contiguous, a view of a growing buffer may not be (contiguous() returns the tensor itself when it is).
State dense_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                          int64_t tokens_per_split) {
  return dense_attention(q, k.contiguous(), v.contiguous(), scaling, tokens_per_split);
}
State kivi_attention_cpu(const at::Tensor& q, const at::Tensor& kq, const at::Tensor& ks, const at::Tensor& kz,
                         const at::Tensor& vq, const at::Tensor& vs, const at::Tensor& vz, const at::Tensor& tail_k,
                         const at::Tensor& tail_v, int64_t bits, int64_t group, int64_t value_group, double scaling,
                         int64_t blocks_per_split, int64_t tokens_per_split) {
  return kivi_attention(q, kq.contiguous(), ks.contiguous(), kz.contiguous(), vq.contiguous(), vs.contiguous(),
                        vz.contiguous(), tail_k.contiguous(), tail_v.contiguous(), bits, group, value_group, scaling,
                        blocks_per_split, tokens_per_split);
}
}  // namespace kvpack

// The CPU kernels of the kvpack:: ops, bound to the schemas the ops declare (kvpack/attention/*.py and
// kvpack/attention/triton/*_op.py, with torch.library): the dispatcher calls them for CPU tensors
// directly, no Python in between. Loading this library (kvpack.attention.cpu.native) registers them.
TORCH_LIBRARY_IMPL(kvpack, CPU, m) {
  m.impl("dense_attention", &kvpack::dense_attention_cpu);
  m.impl("kivi_attention", &kvpack::kivi_attention_cpu);
  m.impl("puzzle_attention", &kvpack::puzzle_attention);
  m.impl("puzzle_ragged_attention", &kvpack::puzzle_ragged_attention);
  m.impl("anchor_segment_attention", &kvpack::anchor_segment_attention);
  m.impl("pca_quant_attention", &kvpack::pca_quant_attention);
  m.impl("chunk_attend", &kvpack::chunk_attend);
  m.impl("pca_quant_encode", &kvpack::pca_quant_encode);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_products_available", &kvpack::bf16_products_available,
        "whether this CPU and build run the pre-RoPE page rebuild with bf16 products (AVX-512 BF16)");
}
