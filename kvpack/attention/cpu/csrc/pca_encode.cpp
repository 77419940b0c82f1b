// kvpack::pca_quant_encode on CPU: one (side, KV head)'s coefficients of whole blocks to pca_quant's codes, in one
// pass (layouts in kvpack/attention/pca_encode.py).
//
// Per block of G tokens and component j: the min/max code of quantize_minmax (kvpack/ops/minmax.py) —
// zero = lo rounded down to fp16, scale = (hi - zero) / (2^w - 1) rounded up to fp16, code = round-half-even((c -
// zero) / scale) clamped to [0, 2^w - 1] — then the G codes packed into the component's place in its width's
// bit stream (component-major, little-endian: G codes of w bits are G w / 8 whole bytes, eight codes at a time
// as one 64-bit word whose low w bytes are the stream's, as pack_bitstream_fast packs them). Every step is the
// PyTorch path's fp32 arithmetic in the same order (no -ffast-math), so the codes, scales and zero points are
// the same bits.
#include <cmath>
#include <cstring>

#include "common.h"

namespace kvpack {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "code streams are written as little-endian words");

inline uint16_t half_bits(float x) { return c10::Half(x).x; }
inline float half_value(uint16_t bits) { return float(c10::Half(bits, c10::Half::from_bits())); }

// IEEE nextafter of a finite fp16 toward -inf / +inf (torch.nextafter's result on these bits).
inline uint16_t half_next_down(uint16_t b) {
  if ((b & 0x7fff) == 0) return 0x8001;  // +-0 -> the smallest negative subnormal
  return (b & 0x8000) ? b + 1 : b - 1;
}
inline uint16_t half_next_up(uint16_t b) {
  if ((b & 0x7fff) == 0) return 0x0001;
  return (b & 0x8000) ? b - 1 : b + 1;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> pca_quant_encode(const at::Tensor& coefficients,
                                                                const at::Tensor& widths) {
  TORCH_CHECK(coefficients.dim() == 3 && coefficients.scalar_type() == at::kFloat,
              "pca_quant_encode: coefficients must be [blocks, G, C] fp32, got ", coefficients.sizes(), " ",
              coefficients.scalar_type());
  TORCH_CHECK(widths.dim() == 1 && widths.scalar_type() == at::kInt && widths.size(0) == coefficients.size(2),
              "pca_quant_encode: widths must be [C] int32 for ", coefficients.size(2), " components");
  const at::Tensor c = coefficients.contiguous();
  const at::Tensor w = widths.contiguous();
  const int64_t blocks = c.size(0), G = c.size(1), C = c.size(2);
  TORCH_CHECK(G % 8 == 0, "pca_quant_encode: the block (", G, " tokens) must be a multiple of 8");
  const int32_t* width = w.data_ptr<int32_t>();
  std::vector<int64_t> offset(C + 1, 0);  // byte offset of each component's G codes within a block's run
  for (int64_t j = 0; j < C; ++j) {
    TORCH_CHECK(width[j] >= 1 && width[j] <= 8, "pca_quant_encode: widths must be 1..8, got ", width[j]);
    TORCH_CHECK(j == 0 || width[j] <= width[j - 1], "pca_quant_encode: widths must be non-increasing");
    offset[j + 1] = offset[j] + G * width[j] / 8;
  }
  const int64_t R = offset[C];
  at::Tensor codes = at::empty({blocks, R}, c.options().dtype(at::kByte));
  at::Tensor scale = at::empty({blocks, C}, c.options().dtype(at::kHalf));
  at::Tensor zero = at::empty({blocks, C}, c.options().dtype(at::kHalf));
  const float* src = c.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  uint16_t* scale_out = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  uint16_t* zero_out = reinterpret_cast<uint16_t*>(zero.data_ptr<at::Half>());

  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> lo(C), hi(C), zf(C), safe(C), top(C);
    std::vector<uint8_t> q(C * G);  // [C, G]: a component's codes together, as they are packed
    for (int64_t b = b0; b < b1; ++b) {
      const float* x = src + b * G * C;
      for (int64_t j = 0; j < C; ++j) lo[j] = hi[j] = x[j];
      for (int64_t t = 1; t < G; ++t)
        for (int64_t j = 0; j < C; ++j) {
          lo[j] = std::min(lo[j], x[t * C + j]);
          hi[j] = std::max(hi[j], x[t * C + j]);
        }
      for (int64_t j = 0; j < C; ++j) {
        uint16_t z = half_bits(lo[j]);
        if (half_value(z) > lo[j]) z = half_next_down(z);
        const float levels = float((1 << width[j]) - 1);
        const float step = (hi[j] - half_value(z)) / levels;
        uint16_t s = half_bits(step);
        if (half_value(s) < step) s = half_next_up(s);
        zero_out[b * C + j] = z;
        scale_out[b * C + j] = s;
        zf[j] = half_value(z);
        safe[j] = half_value(s) > 0.0f ? half_value(s) : 1.0f;
        top[j] = levels;
      }
      for (int64_t t = 0; t < G; ++t)
        for (int64_t j = 0; j < C; ++j) {
          const float code = std::nearbyint((x[t * C + j] - zf[j]) / safe[j]);  // half to even
          q[j * G + t] = uint8_t(std::min(std::max(code, 0.0f), top[j]));
        }
      uint8_t* dst = out + b * R;
      for (int64_t j = 0; j < C; ++j) {
        const int64_t bits = width[j];
        const uint8_t* qj = q.data() + j * G;
        uint8_t* run = dst + offset[j];
        for (int64_t k = 0; k < G; k += 8) {
          uint64_t word = 0;
          for (int i = 0; i < 8; ++i) word |= uint64_t(qj[k + i]) << (i * bits);
          std::memcpy(run + k / 8 * bits, &word, bits);
        }
      }
    }
  });
  return {codes, scale, zero};
}

}  // namespace kvpack
