// kvtc's decoding, the memory passes of it in native code.
//
// kvtc_dequantize: one coded group's bit stream (kvpack.ops.bitpack.pack_bitstream: codes of
// `width` bits, little-endian within each byte, token-major) unpacked and dequantized in one pass,
// `code * scale[t] + shift[t]` per token t, written straight into the group's columns of the
// coefficient matrix the inverse PCA multiplies (fp32, or bf16 for a bf16 inverse transform).
//
// The PyTorch path (numpy unpackbits -> one byte per bit -> packbits -> float ops) makes five memory
// passes over eight times the stream; this reads each byte once. Numerics: the product and the sum are
// two fp32 roundings (no FMA contraction: see the pragma below), as `codes.float() * scale + shift` rounds,
// so the fp32 output equals the PyTorch path bit for bit; a bf16 output is that value rounded to
// nearest even, as `.to(torch.bfloat16)` rounds it.
//
// kvtc_quantize: the encoder's twin of kvtc_dequantize — one coded group's columns of the coefficient
// matrix quantized per token (shift = min and scale = (max - shift) / (2^w - 1), both rounded to fp16
// first; code = round-half-even((x - shift) / scale), clamped) and bit-packed, in one pass: the same
// fp32 operations as kvpack.ops.group_quant.quantize_groups + ops.bitpack.pack_bitstream, so the same
// bytes.
//
// kvtc_layer_out: one layer's inverse-PCA output X [T, H*d] (fp32, or bf16 from a bf16 GEMM) plus the
// mean, RoPE re-applied at each token's position (keys), transposed and written in the cache dtype
// into its rows of the layer's [H, tokens, d] cache tensor: one read and one write instead of the
// PyTorch path's widen, add, four products, two sums, cat, permute and cast. Same fp32 products and
// sums in the same order as kvpack.ops.rope.apply_rope (x1 cos - x2 sin | x2 cos + x1 sin), then one
// rounding to the cache dtype: bit for bit the PyTorch path.
//
// kvtc_rope_logits: the scaled logits of a few grouped queries against the keys kvtc_layer_out would write from
// X, without writing them: each token's keys are made in a small buffer (the same products and sums as
// kvtc_layer_out, in fp32) and dotted with every query row (16 partial sums over the head dim, then added in
// order). One read of X per layer instead of a write and a read of fp32 keys.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <tuple>

// No fused multiply-adds in this file: the PyTorch path rounds each product and each sum, and these
// kernels must give its bits (GCC contracts across statements by default even under -std=c++17).
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

namespace kvpack {
namespace {

// fp16 / bf16 -> fp32 is exact: c10's conversions give the same value the PyTorch path widens to.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

inline void put(float* dst, float x) { *dst = x; }
inline void put(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }  // round to nearest even
inline void put(c10::Half* dst, float x) { *dst = c10::Half(x); }          // round to nearest even

// columns: the output column of each of the group's `size` codes (nullptr: 0..size-1).
template <typename Out>
void dequantize_rows(const uint8_t* __restrict stream, int64_t nbytes, int64_t width, const c10::Half* shift,
                     const c10::Half* scale, Out* out, int64_t row_stride, int64_t tokens, int64_t size,
                     const int64_t* columns = nullptr) {
  const uint32_t mask = (1u << width) - 1u;
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float a = widen(scale[t]), b = widen(shift[t]);
      Out* row = out + t * row_stride;
      int64_t bit = t * size * width;
      for (int64_t c = 0; c < size; ++c, bit += width) {
        const int64_t byte = bit >> 3;
        // width + (bit & 7) <= 15: two bytes hold every code; the stream's last byte may have no successor.
        uint32_t word = stream[byte];
        if (byte + 1 < nbytes) word |= uint32_t(stream[byte + 1]) << 8;
        const float code = float((word >> (bit & 7)) & mask);
        float v = code * a;
        v = v + b;
        put(row + (columns != nullptr ? columns[c] : c), v);
      }
    }
  });
}

// One head's row of X plus the mean, RoPE'd with the token's ct, st [d] (nullptr: values, no RoPE), in fp32:
// k [d] (y [d] is scratch). The products and sums of kvpack.ops.rope.apply_rope (x1 cos - x2 sin | x2 cos + x1 sin).
template <typename In>
inline void head_row(const In* __restrict src, const float* __restrict mu, const float* ct, const float* st,
                     float* __restrict y, float* __restrict k, int64_t d) {
  const int64_t half = d / 2;
  if (ct == nullptr) {
    for (int64_t c = 0; c < d; ++c) k[c] = widen(src[c]) + mu[c];
    return;
  }
  for (int64_t c = 0; c < d; ++c) y[c] = widen(src[c]) + mu[c];
  for (int64_t c = 0; c < half; ++c) {
    float a = y[c] * ct[c], b = y[c + half] * st[c];
    k[c] = a - b;
    float e = y[c + half] * ct[c + half], f = y[c] * st[c + half];
    k[c + half] = e + f;
  }
}

// Every (token, head) row of X [tokens, heads*d] plus the mean, RoPE'd (head_row), handed to visit(t, h, k) as
// fp32 k [d]; tokens split over the threads.
template <typename In, typename Visit>
void each_head_row(const In* __restrict x, const float* __restrict mean, const float* cos, const float* sin,
                   int64_t tokens, int64_t heads, int64_t d, const Visit& visit) {
  const int64_t width = heads * d;
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> y(d), k(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cos != nullptr ? cos + t * d : nullptr;
      const float* st = sin != nullptr ? sin + t * d : nullptr;
      for (int64_t h = 0; h < heads; ++h) {
        head_row(x + t * width + h * d, mean + h * d, ct, st, y.data(), k.data(), d);
        visit(t, h, k.data());
      }
    }
  });
}

template <typename In, typename Out>
void layer_rows(const In* __restrict x, const float* __restrict mean, const float* cos, const float* sin,
                Out* out, int64_t tokens, int64_t heads, int64_t d, int64_t head_stride, int64_t token_stride) {
  each_head_row(x, mean, cos, sin, tokens, heads, d, [&](int64_t t, int64_t h, const float* k) {
    Out* dst = out + h * head_stride + t * token_stride;
    for (int64_t c = 0; c < d; ++c) put(dst + c, k[c]);
  });
}

template <typename In>
void layer_out_typed(const at::Tensor& x, const float* mean, const float* cos, const float* sin, at::Tensor& out) {
  const int64_t heads = out.size(0), tokens = out.size(1), d = out.size(2);
  const In* src = x.data_ptr<In>();
  switch (out.scalar_type()) {
    case at::kFloat:
      layer_rows(src, mean, cos, sin, out.data_ptr<float>(), tokens, heads, d, out.stride(0), out.stride(1));
      break;
    case at::kBFloat16:
      layer_rows(src, mean, cos, sin, out.data_ptr<c10::BFloat16>(), tokens, heads, d, out.stride(0), out.stride(1));
      break;
    case at::kHalf:
      layer_rows(src, mean, cos, sin, out.data_ptr<c10::Half>(), tokens, heads, d, out.stride(0), out.stride(1));
      break;
    default:
      TORCH_CHECK(false, "kvtc_layer_out: the cache is fp32, bf16 or fp16, got ", out.scalar_type());
  }
}

template <typename In>
void rope_logits_rows(const In* __restrict x, const float* __restrict mean, const float* cos, const float* sin,
                      const float* __restrict q, float* __restrict logits, int64_t tokens, int64_t heads,
                      int64_t rows, int64_t d, float scaling) {
  constexpr int64_t LANES = 16;  // the dot product's partial sums: lane j sums the dims c = j (mod 16)
  each_head_row(x, mean, cos, sin, tokens, heads, d, [&](int64_t t, int64_t h, const float* k) {
    for (int64_t m = 0; m < rows; ++m) {
      const float* qm = q + (h * rows + m) * d;
      float part[LANES] = {0.0f};
      int64_t c = 0;
      for (; c + LANES <= d; c += LANES) {
        for (int64_t j = 0; j < LANES; ++j) part[j] += qm[c + j] * k[c + j];
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < LANES; ++j) sum += part[j];
      for (; c < d; ++c) sum += qm[c] * k[c];
      logits[(h * rows + m) * tokens + t] = sum * scaling;
    }
  });
}

// The checks of the passes that add a layer's mean and re-apply RoPE to X [tokens, heads*d]; true where cos
// and sin are given (keys).
bool check_mean_and_rope(const char* op, const at::Tensor& mean, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t heads, int64_t d, int64_t tokens) {
  TORCH_CHECK(mean.scalar_type() == at::kFloat && mean.is_contiguous() && mean.numel() == heads * d, op,
              ": mean is fp32 [heads*d]");
  const bool rope = cos.numel() > 0;
  if (rope) {
    TORCH_CHECK(d % 2 == 0, op, ": RoPE needs an even head dim, got ", d);
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == d &&
                    sin.sizes() == cos.sizes(),
                op, ": cos and sin are contiguous fp32 [tokens, d]");
  }
  return rope;
}

// One coded group's stream, shift and scale checked and dequantized into out's rows: code c of each token to
// column columns[c] (nullptr: column c).
void dequantize_group(const char* op, const at::Tensor& stream, int64_t width, const at::Tensor& shift,
                      const at::Tensor& scale, at::Tensor& out, int64_t size, const int64_t* columns) {
  TORCH_CHECK(width >= 1 && width <= 8, op, ": width must be in 1..8, got ", width);
  TORCH_CHECK(stream.scalar_type() == at::kByte && stream.dim() == 1 && stream.is_contiguous(), op,
              ": the stream is a contiguous uint8 vector");
  const int64_t tokens = out.size(0);
  TORCH_CHECK(shift.scalar_type() == at::kHalf && scale.scalar_type() == at::kHalf && shift.is_contiguous() &&
                  scale.is_contiguous() && shift.numel() == tokens && scale.numel() == tokens,
              op, ": shift and scale are contiguous fp16 [tokens]");
  const int64_t need = (tokens * size * width + 7) / 8;
  TORCH_CHECK(stream.numel() >= need, op, ": a stream of ", stream.numel(), " bytes is shorter than the ", need,
              " its codes need");
  if (tokens == 0 || size == 0) return;
  const auto* s = stream.data_ptr<uint8_t>();
  const auto* sh = shift.data_ptr<c10::Half>();
  const auto* sc = scale.data_ptr<c10::Half>();
  if (out.scalar_type() == at::kFloat) {
    dequantize_rows(s, need, width, sh, sc, out.data_ptr<float>(), out.stride(0), tokens, size, columns);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, op, ": out is fp32 or bf16, got ", out.scalar_type());
    dequantize_rows(s, need, width, sh, sc, out.data_ptr<c10::BFloat16>(), out.stride(0), tokens, size, columns);
  }
}

}  // namespace

// x: [T, H*d] fp32 or bf16 contiguous; mean: fp32 [H*d]; cos, sin: fp32 [T, d] contiguous, or empty (no RoPE);
// q: fp32 [H, M, d] contiguous. Returns fp32 [H, M, T]: scaling * q . key, key = RoPE(x + mean) per head.
at::Tensor kvtc_rope_logits(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& q, double scaling) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "kvtc_rope_logits: q is a contiguous fp32 [heads, rows, d] tensor");
  const int64_t heads = q.size(0), rows = q.size(1), d = q.size(2);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == heads * d,
              "kvtc_rope_logits: x is a contiguous [tokens, heads*d] matrix matching q");
  const int64_t tokens = x.size(0);
  const bool rope = check_mean_and_rope("kvtc_rope_logits", mean, cos, sin, heads, d, tokens);
  auto logits = at::empty({heads, rows, tokens}, q.options());
  if (tokens == 0 || rows == 0) return logits;
  const float* c = rope ? cos.data_ptr<float>() : nullptr;
  const float* s = rope ? sin.data_ptr<float>() : nullptr;
  const float scale = static_cast<float>(scaling);
  if (x.scalar_type() == at::kFloat) {
    rope_logits_rows(x.data_ptr<float>(), mean.data_ptr<float>(), c, s, q.data_ptr<float>(),
                     logits.data_ptr<float>(), tokens, heads, rows, d, scale);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "kvtc_rope_logits: x is fp32 or bf16, got ", x.scalar_type());
    rope_logits_rows(x.data_ptr<c10::BFloat16>(), mean.data_ptr<float>(), c, s, q.data_ptr<float>(),
                     logits.data_ptr<float>(), tokens, heads, rows, d, scale);
  }
  return logits;
}

// x: [T, H*d] fp32 or bf16 contiguous; mean: fp32 [H*d]; cos, sin: fp32 [T, d] contiguous, or empty
// (values: no RoPE); out: [H, T, d] with unit last stride (the coded rows of a layer's cache tensor).
void kvtc_layer_out(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor out) {
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "kvtc_layer_out: out is [heads, tokens, d], unit last stride");
  const int64_t heads = out.size(0), tokens = out.size(1), d = out.size(2);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == tokens && x.size(1) == heads * d,
              "kvtc_layer_out: x is a contiguous [tokens, heads*d] matrix matching out");
  const bool rope = check_mean_and_rope("kvtc_layer_out", mean, cos, sin, heads, d, tokens);
  if (tokens == 0) return;
  const float* c = rope ? cos.data_ptr<float>() : nullptr;
  const float* s = rope ? sin.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    layer_out_typed<float>(x, mean.data_ptr<float>(), c, s, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "kvtc_layer_out: x is fp32 or bf16, got ", x.scalar_type());
    layer_out_typed<c10::BFloat16>(x, mean.data_ptr<float>(), c, s, out);
  }
}

// x: fp32 [tokens, >= start + size] with unit column stride. Returns (stream uint8 [ceil(tokens*size*width/8)],
// shift fp16 [tokens], scale fp16 [tokens]). Finite inputs within the fp16 range are the caller's to check.
std::tuple<at::Tensor, at::Tensor, at::Tensor> kvtc_quantize(const at::Tensor& x, int64_t start, int64_t size,
                                                             int64_t width) {
  TORCH_CHECK(width >= 1 && width <= 8, "kvtc_quantize: width must be in 1..8, got ", width);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "kvtc_quantize: x is fp32 [tokens, columns] with unit column stride");
  TORCH_CHECK(start >= 0 && size >= 1 && start + size <= x.size(1), "kvtc_quantize: columns ", start, "..",
              start + size, " outside x's ", x.size(1));
  const int64_t tokens = x.size(0), stride = x.stride(0);
  const int64_t nbytes = (tokens * size * width + 7) / 8;
  auto stream = at::zeros({nbytes}, x.options().dtype(at::kByte));
  auto shift = at::empty({tokens}, x.options().dtype(at::kHalf));
  auto scale = at::empty({tokens}, x.options().dtype(at::kHalf));
  const float* src = x.data_ptr<float>() + start;
  uint8_t* out = stream.data_ptr<uint8_t>();
  c10::Half* sh = shift.data_ptr<c10::Half>();
  c10::Half* sc = scale.data_ptr<c10::Half>();
  const float levels = float((1 << width) - 1);
  const int64_t blocks = (tokens + 7) / 8;  // 8 tokens' codes end on a byte boundary: threads own whole bytes
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin * 8; t < std::min(tokens, end * 8); ++t) {
      const float* row = src + t * stride;
      float lo = row[0], hi = row[0];
      for (int64_t c = 1; c < size; ++c) {
        lo = std::min(lo, row[c]);
        hi = std::max(hi, row[c]);
      }
      const c10::Half shift_h(lo);  // rounded to nearest even, as .to(torch.float16)
      const float shift_f = widen(shift_h);
      const c10::Half scale_h((hi - shift_f) / levels);
      const float scale_f = widen(scale_h);
      sh[t] = shift_h;
      sc[t] = scale_h;
      int64_t bit = t * size * width;
      for (int64_t c = 0; c < size; ++c, bit += width) {
        float q = scale_f > 0 ? std::nearbyint((row[c] - shift_f) / scale_f) : 0.0f;  // half to even
        q = std::min(std::max(q, 0.0f), levels);
        const uint32_t code = uint32_t(q);
        const int64_t byte = bit >> 3;
        const int off = int(bit & 7);
        out[byte] |= uint8_t(code << off);
        if (off + width > 8) out[byte + 1] |= uint8_t(code >> (8 - off));
      }
    }
  });
  return {stream, shift, scale};
}

// stream: uint8 [>= ceil(tokens*size*width/8)]; shift, scale: fp16 [tokens]; out: fp32 or bf16 [tokens, size]
// with unit column stride (a column slice of the coefficient matrix).
void kvtc_dequantize(const at::Tensor& stream, int64_t width, const at::Tensor& shift, const at::Tensor& scale,
                     at::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1, "kvtc_dequantize: out is [tokens, size] with unit column stride");
  dequantize_group("kvtc_dequantize", stream, width, shift, scale, out, out.size(1), nullptr);
}

// kvtc_dequantize with the group's codes scattered to the columns `columns` (int64 [size], each within out's
// [tokens, columns] row, unit column stride): the coefficient matrix written in another component order (a
// layer-block calibration's, so that each block's components are adjacent) with no gather pass after it.
void kvtc_dequantize_columns(const at::Tensor& stream, int64_t width, const at::Tensor& shift,
                             const at::Tensor& scale, at::Tensor out, const at::Tensor& columns) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1,
              "kvtc_dequantize_columns: out is [tokens, columns] with unit column stride");
  TORCH_CHECK(columns.scalar_type() == at::kLong && columns.dim() == 1 && columns.is_contiguous(),
              "kvtc_dequantize_columns: columns is a contiguous int64 vector");
  if (columns.numel() > 0) {
    const auto range = at::aminmax(columns);
    TORCH_CHECK(std::get<0>(range).item<int64_t>() >= 0 && std::get<1>(range).item<int64_t>() < out.size(1),
                "kvtc_dequantize_columns: a column is outside out's ", out.size(1));
  }
  dequantize_group("kvtc_dequantize_columns", stream, width, shift, scale, out, columns.numel(),
                   columns.data_ptr<int64_t>());
}

}  // namespace kvpack

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kvtc_dequantize", &kvpack::kvtc_dequantize,
        "kvtc: one coded group's bit stream unpacked and dequantized into its coefficient columns");
  m.def("kvtc_dequantize_columns", &kvpack::kvtc_dequantize_columns,
        "kvtc: one coded group's bit stream unpacked and dequantized into the given coefficient columns");
  m.def("kvtc_rope_logits", &kvpack::kvtc_rope_logits,
        "kvtc: scaled logits of grouped queries against a layer's keys rebuilt from X (+ mean, RoPE), not written");
  m.def("kvtc_quantize", &kvpack::kvtc_quantize,
        "kvtc: one coded group's coefficient columns quantized per token and bit-packed (stream, shift, scale)");
  m.def("kvtc_layer_out", &kvpack::kvtc_layer_out,
        "kvtc: a layer's inverse-PCA output + mean, RoPE'd, transposed, in the cache dtype, into its cache rows");
}
