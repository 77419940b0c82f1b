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

#include <immintrin.h>

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

// Dot product, sum and y += a x. With AVX-512 the last partial vector is a masked load, so a short
// row (a rank of 12, a page of 32 tokens) costs one or two vector operations and no scalar epilogue;
// the compiler's own `omp simd` reduction ended in a serial chain of scalar adds, and its loops' scalar
// prologues and epilogues cost more than the work at these lengths (both measured as hot spots).
// AVX2 (8 lanes) does the same with vmaskmovps, whose masked-off lanes are never read (no fault past
// the end of a buffer).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define KVPACK_AVX2 1
// Lanes [0, n) set, n in [0, 8].
inline __m256i tail_mask8(int64_t n) {
  static const int32_t bits[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 8 - n));
}

inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t n) { return __mmask16((1u << n) - 1); }

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m512 v = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v);
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), v);
  }
  return _mm512_reduce_add_ps(v);
}

inline float sum(const float* __restrict a, int64_t n) {
  __m512 v = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) v = _mm512_add_ps(_mm512_loadu_ps(a + i), v);
  if (i < n) v = _mm512_add_ps(_mm512_maskz_loadu_ps(tail_mask(n - i), a + i), v);
  return _mm512_reduce_add_ps(v);
}

inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, m,
                          _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}
#elif defined(KVPACK_AVX2)
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m256 v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v);
  if (i < n) {
    const __m256i m = tail_mask8(n - i);
    v = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), v);
  }
  return hsum8(v);
}

inline float sum(const float* __restrict a, int64_t n) {
  __m256 v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) v = _mm256_add_ps(_mm256_loadu_ps(a + i), v);
  if (i < n) v = _mm256_add_ps(_mm256_maskload_ps(a + i, tail_mask8(n - i)), v);
  return hsum8(v);
}

inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  if (i < n) {
    const __m256i m = tail_mask8(n - i);
    _mm256_maskstore_ps(y + i, m, _mm256_fmadd_ps(av, _mm256_maskload_ps(x + i, m), _mm256_maskload_ps(y + i, m)));
  }
}
#else
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline float sum(const float* __restrict a, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i];
  return acc;
}

inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
#endif

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

// x[i] = exp(x[i] - shift)
inline void exp_shifted(float* __restrict x, float shift, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 sh = _mm512_set1_ps(shift), lo = _mm512_set1_ps(-87.f), log2e = _mm512_set1_ps(1.4426950408889634f),
               ln2 = _mm512_set1_ps(0.6931471805599453f);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_sub_ps(_mm512_loadu_ps(x + i), sh);
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(v, lo), log2e);
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 g = _mm512_mul_ps(_mm512_sub_ps(t, fi), ln2);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f));
    const __m512 r = _mm512_scalef_ps(p, fi);  // p * 2^fi
    _mm512_storeu_ps(x + i, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ), r));
  }
#elif defined(KVPACK_AVX2)
  // 2^fi built in the exponent field: fi >= -126 (inputs clamped at -87), so the biased exponent is >= 1.
  const __m256 sh = _mm256_set1_ps(shift), lo = _mm256_set1_ps(-87.f), log2e = _mm256_set1_ps(1.4426950408889634f),
               ln2 = _mm256_set1_ps(0.6931471805599453f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + i), sh);
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(v, lo), log2e);
    const __m256 fi = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 g = _mm256_mul_ps(_mm256_sub_ps(t, fi), ln2);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.f));
    const __m256 two_fi = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23));
    const __m256 r = _mm256_mul_ps(p, two_fi);
    _mm256_storeu_ps(x + i, _mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ), r));
  }
#endif
  for (; i < n; ++i) x[i] = exp_approx(x[i] - shift);
}

inline float max_of(const float* __restrict x, int64_t n) {
  int64_t i = 0;
  float best = NEG_INF;
#if defined(__AVX512F__)
  __m512 v = _mm512_set1_ps(NEG_INF);
  for (; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
  best = _mm512_reduce_max_ps(v);
#elif defined(KVPACK_AVX2)
  __m256 v = _mm256_set1_ps(NEG_INF);
  for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
  best = hmax8(v);
#endif
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
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

// out [D] += sum_t c[t] rows[t] for n rows [n, D] (any D; rows back to back). The output row stays in
// registers across the n updates: a row buffer updated in memory made each axpy wait on the previous
// one's store (measured as the hot spot of the first kernels). The last vector is masked when D is not
// a multiple of 16 (a rank of 36, a head of 80).
#if defined(__AVX512F__)
template <int NCH>
inline void combine_regs(const float* __restrict c, const float* __restrict rows, int64_t n, int64_t D,
                         float* __restrict out) {
  const __mmask16 last = D % 16 ? tail_mask(D % 16) : __mmask16(0xFFFF);
  __m512 acc[NCH];
  for (int j = 0; j < NCH; ++j) acc[j] = _mm512_maskz_loadu_ps(j + 1 < NCH ? __mmask16(0xFFFF) : last, out + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 a = _mm512_set1_ps(c[t]);
    const float* row = rows + t * D;
#pragma GCC unroll 16
    for (int j = 0; j < NCH; ++j)
      acc[j] = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(j + 1 < NCH ? __mmask16(0xFFFF) : last, row + 16 * j), acc[j]);
  }
  for (int j = 0; j < NCH; ++j) _mm512_mask_storeu_ps(out + 16 * j, j + 1 < NCH ? __mmask16(0xFFFF) : last, acc[j]);
}
#elif defined(KVPACK_AVX2)
// AVX2 has 16 vector registers: the row is done in blocks of at most 8 vectors (64 floats) held in
// registers across the n updates; TAIL: the block's last vector is the row's partial one (masked).
template <int NCH, bool TAIL>
inline void combine_block8(const float* __restrict c, const float* __restrict rows, int64_t n, int64_t D,
                           __m256i last, float* __restrict out) {
  __m256 acc[NCH];
  for (int j = 0; j < NCH; ++j)
    acc[j] = TAIL && j + 1 == NCH ? _mm256_maskload_ps(out + 8 * j, last) : _mm256_loadu_ps(out + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 a = _mm256_set1_ps(c[t]);
    const float* row = rows + t * D;
#pragma GCC unroll 8
    for (int j = 0; j < NCH; ++j)
      acc[j] = _mm256_fmadd_ps(
          a, TAIL && j + 1 == NCH ? _mm256_maskload_ps(row + 8 * j, last) : _mm256_loadu_ps(row + 8 * j), acc[j]);
  }
  for (int j = 0; j < NCH; ++j) {
    if (TAIL && j + 1 == NCH) _mm256_maskstore_ps(out + 8 * j, last, acc[j]);
    else _mm256_storeu_ps(out + 8 * j, acc[j]);
  }
}

template <bool TAIL>
inline void combine_block8_any(int nch, const float* c, const float* rows, int64_t n, int64_t D, __m256i last,
                               float* out) {
  switch (nch) {
    case 1: return combine_block8<1, TAIL>(c, rows, n, D, last, out);
    case 2: return combine_block8<2, TAIL>(c, rows, n, D, last, out);
    case 3: return combine_block8<3, TAIL>(c, rows, n, D, last, out);
    case 4: return combine_block8<4, TAIL>(c, rows, n, D, last, out);
    case 5: return combine_block8<5, TAIL>(c, rows, n, D, last, out);
    case 6: return combine_block8<6, TAIL>(c, rows, n, D, last, out);
    case 7: return combine_block8<7, TAIL>(c, rows, n, D, last, out);
    default: return combine_block8<8, TAIL>(c, rows, n, D, last, out);
  }
}
#endif

inline void combine(const float* __restrict c, const float* __restrict rows, int64_t n, int64_t D,
                    float* __restrict out) {
#if defined(KVPACK_AVX2)
  const int64_t nv = (D + 7) / 8;
  const __m256i last = tail_mask8(D % 8 ? D % 8 : 8);
  for (int64_t b = 0; b < nv; b += 8) {
    const int nch = int(std::min<int64_t>(8, nv - b));
    if (b + nch == nv && D % 8) combine_block8_any<true>(nch, c, rows + 8 * b, n, D, last, out + 8 * b);
    else combine_block8_any<false>(nch, c, rows + 8 * b, n, D, last, out + 8 * b);
  }
#else
#if defined(__AVX512F__)
  switch ((D + 15) / 16) {
    case 1: return combine_regs<1>(c, rows, n, D, out);
    case 2: return combine_regs<2>(c, rows, n, D, out);
    case 3: return combine_regs<3>(c, rows, n, D, out);
    case 4: return combine_regs<4>(c, rows, n, D, out);
    case 5: return combine_regs<5>(c, rows, n, D, out);
    case 6: return combine_regs<6>(c, rows, n, D, out);
    case 7: return combine_regs<7>(c, rows, n, D, out);
    case 8: return combine_regs<8>(c, rows, n, D, out);
    case 16: return combine_regs<16>(c, rows, n, D, out);
    default: break;
  }
#endif
  for (int64_t t = 0; t < n; ++t) axpy(c[t], rows + t * D, out, D);
#endif
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

// Rotates row k [D] at one position (rotate_half convention): k1' = k1 c - k2 s, k2' = k2 c2 + k1 s2 for
// the halves k1, k2; c2 / s2 are the table's second halves (its first ones where the table keeps one).
inline void rotate_row(float* k, const float* c, const float* sn, int64_t D, int64_t W) {
  const int64_t half = D / 2;
  const float* c2 = W == D ? c + half : c;
  const float* s2 = W == D ? sn + half : sn;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float k1 = k[j], k2 = k[j + half];
    k[j] = k1 * c[j] - k2 * sn[j];
    k[j + half] = k2 * c2[j] + k1 * s2[j];
  }
}

// Splits of `n` items, `per` at a time.
inline int64_t n_chunks(int64_t n, int64_t per) { return per > 0 ? (n + per - 1) / per : 0; }

}  // namespace kvpack
