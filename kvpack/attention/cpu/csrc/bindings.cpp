// The CPU kernels of kvpack's decode-attention custom ops, exposed to Python; kvpack/attention/cpu
// registers each as the "cpu" kernel of its kvpack:: op (one schema, a Triton and a CPU backend).
#include "common.h"

namespace kvpack {
State dense_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                      int64_t tokens_per_split);
State kivi_attention(const at::Tensor& q, const at::Tensor& kq, const at::Tensor& ks, const at::Tensor& kz,
                     const at::Tensor& vq, const at::Tensor& vs, const at::Tensor& vz, const at::Tensor& tail_k,
                     const at::Tensor& tail_v, int64_t bits, int64_t group, int64_t value_group, double scaling,
                     int64_t blocks_per_split, int64_t tokens_per_split);
}  // namespace kvpack

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dense_attention", &kvpack::dense_attention, "softmax state of grouped queries over dense K/V");
  m.def("kivi_attention", &kvpack::kivi_attention, "softmax state over KIVI's quantized blocks and residual");
}
