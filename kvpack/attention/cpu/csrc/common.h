// Pieces every kvpack CPU decode kernel shares: element loads, a vectorisable exp, the online-softmax
// state of a block of query rows, and the split-K driver over (KV head x split) on torch's own pool.
//
// Layout conventions (as the Triton kernels): grouped queries q [H, M, D] fp32 contiguous (M = GQA
// group x queries); every kernel returns the merged softmax state m, l [H, M], o [H, M, D] fp32 over
// what it read (m = -inf, l = 0, o = 0 for rows that saw no key).
//
// Numerics: fp32 accumulation; inputs fp32 / bf16 / fp16 are widened on load. exp is a degree-6
// polynomial on 2^frac (relative error < 3e-7 on [-87, 0], the range the online softmax feeds it;
// 0 below -87), written as a plain loop so the compiler vectorises it (no -ffast-math: the -inf
// of rows that saw no key must stay -inf).
#pragma once

// ATen alone (not torch/extension.h, which brings pybind11 and the autograd headers): each kernel
// translation unit compiles in a fraction of the time; bindings.cpp includes the extension header.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace kvpack {

using State = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {  // bf16 is the top half of an fp32
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float widen(c10::Half x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.x);
#else
  return static_cast<float>(x);
#endif
}

template <typename T>
inline void widen_row(const T* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

// Dot product, sum and y += a x, written once against Vec (simd.h). The last partial vector is a masked
// load, so a short row (a rank of 12, a page of 32 tokens) costs one or two vector operations and no
// scalar epilogue: the compiler's own `omp simd` reduction ended in a serial chain of scalar adds, and
// its loops' scalar prologues and epilogues cost more than the work at these lengths (both measured as
// hot spots).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  Vec acc = Vec::zero();
  int64_t i = 0;
  for (; i + Vec::kLanes <= n; i += Vec::kLanes) acc = fma(Vec::load(a + i), Vec::load(b + i), acc);
  if (i < n) {
    const Vec::Mask m = Vec::first(n - i);
    acc = fma(Vec::load(a + i, m), Vec::load(b + i, m), acc);
  }
  return acc.reduce_add();
}

inline float sum(const float* __restrict a, int64_t n) {
  Vec acc = Vec::zero();
  int64_t i = 0;
  for (; i + Vec::kLanes <= n; i += Vec::kLanes) acc = Vec::load(a + i) + acc;
  if (i < n) acc = Vec::load(a + i, Vec::first(n - i)) + acc;
  return acc.reduce_add();
}

inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  const Vec av = Vec::splat(a);
  int64_t i = 0;
  for (; i + Vec::kLanes <= n; i += Vec::kLanes) fma(av, Vec::load(x + i), Vec::load(y + i)).store(y + i);
  if (i < n) {
    const Vec::Mask m = Vec::first(n - i);
    fma(av, Vec::load(x + i, m), Vec::load(y + i, m)).store(y + i, m);
  }
}

inline float exp_approx(float x) {
  // e^x = 2^i * 2^f with i = round(x log2 e), f in [-1/2, 1/2]; 2^f = e^(f ln 2) by its Taylor series to
  // degree 6 (truncation error (ln 2 / 2)^7 / 7! < 1.3e-7 relative).
  const float t = std::max(x, -87.f) * 1.4426950408889634f;
  const float fi = std::floor(t + 0.5f);
  const float g = (t - fi) * 0.6931471805599453f;
  float p = 1.f / 720.f;
  p = p * g + 1.f / 120.f;
  p = p * g + 1.f / 24.f;
  p = p * g + 1.f / 6.f;
  p = p * g + 0.5f;
  p = p * g + 1.f;
  p = p * g + 1.f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.f ? 0.f : p * scale;
}

// x[i] = exp(x[i] - shift): exp_approx's polynomial, a vector at a time.
inline void exp_shifted(float* __restrict x, float shift, int64_t n) {
  const Vec sh = Vec::splat(shift), lo = Vec::splat(-87.f), log2e = Vec::splat(1.4426950408889634f),
            ln2 = Vec::splat(0.6931471805599453f);
  int64_t i = 0;
  for (; i + Vec::kLanes <= n; i += Vec::kLanes) {
    const Vec v = Vec::load(x + i) - sh;
    const Vec t = max(v, lo) * log2e;
    const Vec fi = t.round();
    const Vec g = (t - fi) * ln2;
    Vec p = Vec::splat(1.f / 720.f);
    p = fma(p, g, Vec::splat(1.f / 120.f));
    p = fma(p, g, Vec::splat(1.f / 24.f));
    p = fma(p, g, Vec::splat(1.f / 6.f));
    p = fma(p, g, Vec::splat(0.5f));
    p = fma(p, g, Vec::splat(1.f));
    p = fma(p, g, Vec::splat(1.f));
    keep_ge(scale_pow2(p, fi), v, lo).store(x + i);  // 0 below -87
  }
  for (; i < n; ++i) x[i] = exp_approx(x[i] - shift);
}

inline float max_of(const float* __restrict x, int64_t n) {
  Vec best = Vec::splat(NEG_INF);
  int64_t i = 0;
  for (; i + Vec::kLanes <= n; i += Vec::kLanes) best = max(best, Vec::load(x + i));
  float out = best.reduce_max();
  for (; i < n; ++i) out = std::max(out, x[i]);
  return out;
}

// The online-softmax state of M query rows (head_dim D) over the keys folded in so far.
struct RowsState {
  int64_t M, D;
  std::vector<float> m, l, o;  // [M], [M], [M, D]
  RowsState(int64_t M_, int64_t D_) : M(M_), D(D_), m(M_, NEG_INF), l(M_, 0.f), o(M_ * D_, 0.f) {}

  // Fold a block of scaled logits s [M, B] (row stride `stride`) in: on return s holds the
  // unnormalised probabilities exp(s - m_new) and the outputs are rescaled to the new maxima; the
  // caller then adds p @ values into o.
  void absorb(float* s, int64_t B, int64_t stride) {
    for (int64_t i = 0; i < M; ++i) {
      float* row = s + i * stride;
      const float m_new = std::max(m[i], max_of(row, B));
      if (m_new == NEG_INF) {  // nothing seen yet (cannot happen for finite logits)
        std::fill(row, row + B, 0.f);
        continue;
      }
      const float alpha = m[i] == NEG_INF ? 0.f : exp_approx(m[i] - m_new);
      exp_shifted(row, m_new, B);
      l[i] = l[i] * alpha + sum(row, B);
      if (alpha != 1.f) {
        float* oi = o.data() + i * D;
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) oi[c] *= alpha;
      }
      m[i] = m_new;
    }
  }
};

// Runs body(h, s, state) for every (KV head h, split s) on torch's intra-op pool and merges the splits'
// states by log-sum-exp into m, l [H, M], o [H, M, D].
//
// Jobs are handed out one at a time from a shared counter (each of the pool's threads takes the next
// job when it finishes one) rather than in the pool's static contiguous ranges: a split's cost follows
// what it holds (puzzle_plus's per-page ranks, AnchorKV's residual counts), and with static ranges one
// thread idled while the other finished the costly half. Each job writes its own state slot and the
// merge below runs in job order, so the result does not depend on which thread ran what.
template <typename Body>
State split_k(int64_t H, int64_t n_splits, int64_t M, int64_t D, const at::TensorOptions& opts, Body&& body) {
  auto m = at::full({H, M}, NEG_INF, opts);
  auto l = at::zeros({H, M}, opts);
  auto o = at::zeros({H, M, D}, opts);
  if (n_splits == 0 || H == 0 || M == 0) return {m, l, o};
  std::vector<float> sm(H * n_splits * M), sl(H * n_splits * M), so(H * n_splits * M * D);
  const int64_t jobs = H * n_splits;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(jobs, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t job; (job = next.fetch_add(1, std::memory_order_relaxed)) < jobs;) {
      const int64_t h = job / n_splits, s = job % n_splits;
      RowsState st(M, D);
      body(h, s, st);
      std::copy(st.m.begin(), st.m.end(), sm.begin() + job * M);
      std::copy(st.l.begin(), st.l.end(), sl.begin() + job * M);
      std::copy(st.o.begin(), st.o.end(), so.begin() + job * M * D);
    }
  });
  float* pm = m.data_ptr<float>();
  float* pl = l.data_ptr<float>();
  float* po = o.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < M; ++i) {
      float mx = NEG_INF;
      for (int64_t s = 0; s < n_splits; ++s) mx = std::max(mx, sm[(h * n_splits + s) * M + i]);
      if (mx == NEG_INF) continue;
      float lsum = 0.f;
      float* out = po + (h * M + i) * D;
      for (int64_t s = 0; s < n_splits; ++s) {
        const int64_t r = (h * n_splits + s) * M + i;
        if (sm[r] == NEG_INF) continue;
        const float w = std::exp(sm[r] - mx);
        lsum += sl[r] * w;
        axpy(w, so.data() + r * D, out, D);
      }
      pm[h * M + i] = mx;
      pl[h * M + i] = lsum;
    }
  }
  return {m, l, o};
}

// Scores of M rows q [M, D] against `n` keys given as fp32 rows k [n, D]: s[i * stride + t].
inline void scores_block(const float* q, const float* k, int64_t M, int64_t n, int64_t D, float scaling, float* s,
                         int64_t stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < M; ++i) s[i * stride + t] = dot(q + i * D, k + t * D, D) * scaling;
}

// out [D] += sum_t c[t] rows[t] for n rows [n, D] (any D; rows back to back). A block of the output
// row stays in registers across the n updates: a row buffer updated in memory made each axpy wait on
// the previous one's store (measured as the hot spot of the first kernels). Blocks hold at most half the
// ISA's vector registers (AVX-512: 16 of 32, AVX2: 8 of 16); TAIL: the block's last vector is the row's
// partial one (masked), when D is not a multiple of the lanes (a rank of 36, a head of 80).
template <int NCH, bool TAIL>
inline void combine_block(const float* __restrict c, const float* __restrict rows, int64_t n, int64_t D,
                          Vec::Mask last, float* __restrict out) {
  constexpr int L = Vec::kLanes;
  Vec acc[NCH];
  for (int j = 0; j < NCH; ++j) acc[j] = TAIL && j + 1 == NCH ? Vec::load(out + L * j, last) : Vec::load(out + L * j);
  for (int64_t t = 0; t < n; ++t) {
    const Vec a = Vec::splat(c[t]);
    const float* row = rows + t * D;
#pragma GCC unroll 16
    for (int j = 0; j < NCH; ++j)
      acc[j] = fma(a, TAIL && j + 1 == NCH ? Vec::load(row + L * j, last) : Vec::load(row + L * j), acc[j]);
  }
  for (int j = 0; j < NCH; ++j) {
    if (TAIL && j + 1 == NCH) acc[j].store(out + L * j, last);
    else acc[j].store(out + L * j);
  }
}

template <bool TAIL>
inline void combine_block_any(int nch, const float* c, const float* rows, int64_t n, int64_t D, Vec::Mask last,
                              float* out) {
  switch (nch) {
    case 1: return combine_block<1, TAIL>(c, rows, n, D, last, out);
    case 2: return combine_block<2, TAIL>(c, rows, n, D, last, out);
    case 3: return combine_block<3, TAIL>(c, rows, n, D, last, out);
    case 4: return combine_block<4, TAIL>(c, rows, n, D, last, out);
    case 5: return combine_block<5, TAIL>(c, rows, n, D, last, out);
    case 6: return combine_block<6, TAIL>(c, rows, n, D, last, out);
    case 7: return combine_block<7, TAIL>(c, rows, n, D, last, out);
    case 8: return combine_block<8, TAIL>(c, rows, n, D, last, out);
    default: return combine_block<16, TAIL>(c, rows, n, D, last, out);  // AVX-512 only: blocks of 9-15 are split
  }
}

inline void combine(const float* __restrict c, const float* __restrict rows, int64_t n, int64_t D,
                    float* __restrict out) {
  constexpr int L = Vec::kLanes;
  constexpr int64_t kBlock = L == 16 ? 16 : 8;  // vectors per block: half the ISA's registers
  const int64_t nv = (D + L - 1) / L;
  const Vec::Mask last = Vec::first(D % L ? D % L : L);
  for (int64_t b = 0; b < nv;) {
    int64_t nch = std::min<int64_t>(kBlock, nv - b);
    if (nch > 8 && nch < 16) nch = 8;  // instantiated block sizes: 1-8 and 16
    const bool tail = b + nch == nv && D % L;
    if (tail) combine_block_any<true>(int(nch), c, rows + L * b, n, D, last, out + L * b);
    else combine_block_any<false>(int(nch), c, rows + L * b, n, D, last, out + L * b);
    b += nch;
  }
}

// o [M, D] += p [M, n] (row stride `stride`) @ v [n, D] (fp32 rows).
inline void accumulate_values(const float* p, int64_t stride, const float* v, int64_t M, int64_t n, int64_t D,
                              float* o) {
  for (int64_t i = 0; i < M; ++i) combine(p + i * stride, v, n, D, o + i * D);
}

// Fold dense tokens [t0, t1) of k, v [T, D] (one head, element type T_) into the state, BT at a time.
template <typename E>
void dense_tokens(const float* q, const E* k, const E* v, int64_t t0, int64_t t1, int64_t D, float scaling,
                  RowsState& st) {
  constexpr int64_t BT = 32;
  std::vector<float> kb(BT * D), vb(BT * D), s(st.M * BT);
  for (int64_t a = t0; a < t1; a += BT) {
    const int64_t n = std::min(BT, t1 - a);
    widen_row(k + a * D, kb.data(), n * D);
    scores_block(q, kb.data(), st.M, n, D, scaling, s.data(), BT);
    st.absorb(s.data(), n, BT);
    widen_row(v + a * D, vb.data(), n * D);
    accumulate_values(s.data(), BT, vb.data(), st.M, n, D, st.o.data());
  }
}

inline void check_queries(const at::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "kvpack CPU kernels take grouped queries [H, M, D] as contiguous fp32 CPU tensors, got ",
              q.scalar_type(), " ", q.sizes());
}

inline void check_dense(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 3 && t.size(0) == q.size(0) &&
                  t.size(2) == q.size(2),
              name, " must be a contiguous CPU tensor [H=", q.size(0), ", T, D=", q.size(2), "], got ", t.sizes());
}

// Calls f with a typed null pointer of t's element type (fp32 / bf16 / fp16).
template <typename F>
void with_dtype(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, name, ": expected float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// RoPE at one position, rotate_half convention: for the halves k1, k2 of a row, k1' = k1 c - k2 s and
// k2' = k2 c2 + k1 s2, with c2 / s2 the table's second halves (its first ones where the table keeps one
// half, W = D / 2). Written once: rotate_row for a row in memory, rotate_pair for one vector of each half
// held in registers (the AnchorKV, page and PCA kernels' register paths).
struct RopeRow {
  const float *c, *s, *c2, *s2;
  RopeRow(const float* cos_row, const float* sin_row, int64_t D, int64_t W)
      : c(cos_row), s(sin_row), c2(W == D ? cos_row + D / 2 : cos_row), s2(W == D ? sin_row + D / 2 : sin_row) {}
};

// k1, k2: channels [j, j + kLanes) of each half.
inline void rotate_pair(Vec& k1, Vec& k2, const RopeRow& r, int64_t j) {
  const Vec a = k1, b = k2;
  k1 = fms(a, Vec::load(r.c + j), b * Vec::load(r.s + j));
  k2 = fma(b, Vec::load(r.c2 + j), a * Vec::load(r.s2 + j));
}

// Rotates row k [D] in place (cos_row / sin_row: the table's row, W = D or D / 2 wide); INVERSE: by the transpose
// (k1' = k1 c + k2 s, k2' = k2 c2 - k1 s2), which undoes it.
template <bool INVERSE = false>
inline void rotate_row(float* k, const float* cos_row, const float* sin_row, int64_t D, int64_t W) {
  const RopeRow r(cos_row, sin_row, D, W);
  const int64_t half = D / 2;
  constexpr float sign = INVERSE ? -1.f : 1.f;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float k1 = k[j], k2 = k[j + half];
    k[j] = k1 * r.c[j] - sign * k2 * r.s[j];
    k[j + half] = k2 * r.c2[j] + sign * k1 * r.s2[j];
  }
}

inline void unrotate_row(float* k, const float* cos_row, const float* sin_row, int64_t D, int64_t W) {
  rotate_row<true>(k, cos_row, sin_row, D, W);
}

// Splits of `n` items, `per` at a time.
inline int64_t n_chunks(int64_t n, int64_t per) { return per > 0 ? (n + per - 1) / per : 0; }

}  // namespace kvpack
