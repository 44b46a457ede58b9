// The nearest centroid of every row (k-means' assignment step, and the build's assignment of the
// whole catalog), by int8 dot products on AVX-512 VNNI, checked exactly.
//
// A row x is assigned to argmax_j  x·c_j + bias_j   (bias = -|c_j|^2 / 2 for L2, 0 for inner product).
// Rows and centroids are quantized to int8 with a scale per row; the approximate score a_j of every
// centroid comes from vpdpbusd (64 multiply-adds per instruction, a float FMA's 16). Every centroid
// whose a_j lies within the error bound of the best a_j is then scored exactly, in double, and the
// best exact score wins (ties: the smaller index). The bound:
//     |x·c - x̂·ĉ| <= |x| |c - ĉ| + |x - x̂| |ĉ|  <=  |x| max_j|c_j - ĉ_j| + |x - x̂| max_j|ĉ_j|  = E
// so the true best is never more than 2E below the best approximate score, plus the float rounding
// of a_j (bounded by 1e-6 of the scores' magnitude, ~17 ulps). The answer is the exact argmax: the
// int8 pass only decides which few centroids get an exact score.
//
// Register tile: 8 rows x 32 centroids (16 accumulators). Centroids sit as blocks of 16 centroids x
// 4 bytes in offset binary (c + 128, the unsigned operand of vpdpbusd); a row's 4 bytes are
// broadcast. The excess 128 * sum(row) is subtracted once per row.
//
// Without VNNI, AVX2 (avx2 = true): vpmaddubsw multiplies the centroid's offset-binary bytes
// (<= 255) by the row's signed bytes into saturating s16 pair sums, so rows are quantized to
// |x| <= 31 there: two steps' pair sums add in s16 (2 * 2 * 255 * 31 = 31620 < 2^15: nothing
// saturates or wraps) before one vpmaddwd widens them to s32, 3 multiply uops per 64
// multiply-adds where a pair sum widened each step (63 levels) took 4; tiles of
// 8 rows x 8 centroids. The coarser row widens the bound (a few more exact scores); the same
// exact answer. Python picks the path by the int8 scan's (retrieval/index/kmeans.py); a CPU with
// neither takes faiss's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kRows = 8;     // rows per register tile
constexpr int kCents = 32;   // centroids per register tile: two words of 16 lanes
constexpr uint32_t kFlip = 0x80808080u;
constexpr double kRoundingShare = 1e-6;  // float rounding of an approximate score, of its magnitude
constexpr float kLevels = 127.f;      // |byte| of a quantized centroid, and of a row on VNNI
constexpr float kRowLevelsAvx2 = 31.f;  // |byte| of a row on AVX2: two steps' pair sums fit s16

// Centroids quantized for the tile: kpad = k rounded up to kCents; pads score -inf.
struct Centroids {
  int64_t k = 0, kpad = 0, d = 0, groups = 0;
  std::vector<uint32_t> words;     // (kpad / 16) blocks x groups x 16 lanes, offset binary
  std::vector<float> scale, bias;  // [kpad]; pads: scale 0, bias -inf
  std::vector<double> exact_bias;  // [k]
  const float* exact = nullptr;    // [k, d] the float centroids, for exact scores
  double max_err = 0, max_norm = 0, max_abs_bias = 0;
};

// Symmetric int8 of one row (scale = max|v| / 127, 1 for a zero row; bytes past d untouched), and
// the norms the bound needs. Float sums of squares are inflated by kSumSlack, so err, qnorm and
// norm stay upper bounds (their relative rounding is under d * 2^-24 < 1e-3 for d < 16k).
struct Quant {
  float scale = 1.f;
  int32_t sum = 0;  // sum of the bytes
  double err = 0, qnorm = 0, norm = 0;  // |v - scale * q|, |scale * q|, |v|
};
constexpr double kSumSlack = 1.001;

__attribute__((target("avx512f,avx512bw")))
Quant quantize_row(const float* v, int64_t d, int8_t* q) {
  const auto tail = [d](int64_t t) { return d - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - t)) - 1); };
  __m512 mx = _mm512_setzero_ps();
  for (int64_t t = 0; t < d; t += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail(t), v + t)));
  const float m = _mm512_reduce_max_ps(mx);
  Quant out;
  out.scale = m > 0.f ? m / 127.f : 1.f;
  const __m512 s = _mm512_set1_ps(out.scale), inv = _mm512_set1_ps(1.f / out.scale);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512 err = _mm512_setzero_ps(), qn = _mm512_setzero_ps(), nn = _mm512_setzero_ps();
  __m512i sum = _mm512_setzero_si512();
  for (int64_t t = 0; t < d; t += 16) {
    const __mmask16 k = tail(t);
    const __m512 x = _mm512_maskz_loadu_ps(k, v + t);
    const __m512i c = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x, inv)), lo), hi);
    _mm512_mask_cvtsepi32_storeu_epi8(q + t, k, c);
    const __m512 deq = _mm512_mul_ps(_mm512_cvtepi32_ps(c), s), diff = _mm512_sub_ps(x, deq);
    err = _mm512_fmadd_ps(diff, diff, err);
    qn = _mm512_fmadd_ps(deq, deq, qn);
    nn = _mm512_fmadd_ps(x, x, nn);
    sum = _mm512_add_epi32(sum, c);
  }
  out.sum = _mm512_reduce_add_epi32(sum);
  out.err = std::sqrt(kSumSlack * _mm512_reduce_add_ps(err));
  out.qnorm = std::sqrt(kSumSlack * _mm512_reduce_add_ps(qn));
  out.norm = std::sqrt(kSumSlack * _mm512_reduce_add_ps(nn));
  return out;
}

// quantize_row on AVX2, to |q| <= levels (the AVX2 path's rows: kRowLevelsAvx2), with the same
// rounding (nearest even of v times the scale's reciprocal); 8 lanes, the last d % 8 one by one.
__attribute__((target("avx2,fma")))
Quant quantize_row_avx2(const float* v, int64_t d, int8_t* q, float levels) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const int64_t full = d / 8 * 8;
  __m256 mx = _mm256_setzero_ps();
  for (int64_t t = 0; t < full; t += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(v + t), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = *std::max_element(lanes, lanes + 8);
  for (int64_t t = full; t < d; ++t) m = std::max(m, std::fabs(v[t]));
  Quant out;
  out.scale = m > 0.f ? m / levels : 1.f;
  const float inv1 = 1.f / out.scale;
  const __m256 s = _mm256_set1_ps(out.scale), inv = _mm256_set1_ps(inv1);
  const __m256i lo = _mm256_set1_epi32(-int32_t(levels)), hi = _mm256_set1_epi32(int32_t(levels));
  __m256 err = _mm256_setzero_ps(), qn = err, nn = err;
  __m256i sum = _mm256_setzero_si256();
  for (int64_t t = 0; t < full; t += 8) {
    const __m256 x = _mm256_loadu_ps(v + t);
    const __m256i c = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x, inv)), lo), hi);
    const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + t), _mm_packs_epi16(c16, c16));
    const __m256 deq = _mm256_mul_ps(_mm256_cvtepi32_ps(c), s), diff = _mm256_sub_ps(x, deq);
    err = _mm256_fmadd_ps(diff, diff, err);
    qn = _mm256_fmadd_ps(deq, deq, qn);
    nn = _mm256_fmadd_ps(x, x, nn);
    sum = _mm256_add_epi32(sum, c);
  }
  alignas(32) float e8[8], q8[8], n8[8];
  alignas(32) int32_t s8[8];
  _mm256_store_ps(e8, err), _mm256_store_ps(q8, qn), _mm256_store_ps(n8, nn);
  _mm256_store_si256(reinterpret_cast<__m256i*>(s8), sum);
  double e = 0, qs = 0, ns = 0;
  for (int i = 0; i < 8; ++i) e += e8[i], qs += q8[i], ns += n8[i], out.sum += s8[i];
  for (int64_t t = full; t < d; ++t) {
    const float c = std::min(levels, std::max(-levels, std::nearbyint(v[t] * inv1)));
    q[t] = static_cast<int8_t>(c);
    out.sum += static_cast<int32_t>(c);
    const double deq = double(c * out.scale), diff = double(v[t]) - deq;
    e += diff * diff, qs += deq * deq, ns += double(v[t]) * v[t];
  }
  out.err = std::sqrt(kSumSlack * e);
  out.qnorm = std::sqrt(kSumSlack * qs);
  out.norm = std::sqrt(kSumSlack * ns);
  return out;
}

// A row (avx2: the AVX2 path's coarser row) or a centroid (row = false: always kLevels).
Quant quantize(const float* v, int64_t d, int8_t* q, bool avx2, bool row) {
  if (!avx2) return quantize_row(v, d, q);
  return quantize_row_avx2(v, d, q, row ? kRowLevelsAvx2 : kLevels);
}

Centroids quantize_centroids(const float* c, int64_t k, int64_t d, bool l2, bool avx2) {
  Centroids out;
  out.k = k, out.d = d, out.groups = (d + 3) / 4, out.kpad = (k + kCents - 1) / kCents * kCents;
  out.words.assign(out.kpad / 16 * out.groups * 16, kFlip);
  out.scale.assign(out.kpad, 0.f);
  out.bias.assign(out.kpad, -std::numeric_limits<float>::infinity());
  out.exact_bias.resize(k);
  out.exact = c;
  std::vector<int8_t> q(out.groups * 4, 0);
  for (int64_t j = 0; j < k; ++j) {
    const float* cj = c + j * d;
    const Quant qc = quantize(cj, d, q.data(), avx2, false);
    double sq = 0;
    for (int64_t t = 0; t < d; ++t) sq += double(cj[t]) * cj[t];
    out.scale[j] = qc.scale;
    out.exact_bias[j] = l2 ? -0.5 * sq : 0.0;
    out.bias[j] = static_cast<float>(out.exact_bias[j]);
    out.max_err = std::max(out.max_err, qc.err);
    out.max_norm = std::max(out.max_norm, qc.qnorm);
    out.max_abs_bias = std::max(out.max_abs_bias, std::fabs(out.exact_bias[j]));
    uint32_t* dst = out.words.data() + (j / 16) * out.groups * 16 + j % 16;
    for (int64_t g = 0; g < out.groups; ++g) {
      uint32_t w;
      std::memcpy(&w, q.data() + 4 * g, 4);
      dst[g * 16] = w ^ kFlip;
    }
  }
  return out;
}

// Approximate scores of kRows rows (q: kRows x groups * 4 bytes) against every centroid:
// out [kRows, kpad], best [kRows] the largest of each row.
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void tile_scores(const Centroids& c, const int8_t* q, const Quant* rows, float* out, float* best) {
  const int64_t g_count = c.groups, stride = g_count * 4;
  __m512 top[kRows];
  for (int i = 0; i < kRows; ++i) top[i] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t cb = 0; cb < c.kpad; cb += kCents) {
    const uint32_t* b0 = c.words.data() + (cb / 16) * g_count * 16;
    const uint32_t* b1 = b0 + g_count * 16;
    __m512i acc[kRows][2];
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (int64_t g = 0; g < g_count; ++g) {
      const __m512i c0 = _mm512_loadu_si512(b0 + g * 16), c1 = _mm512_loadu_si512(b1 + g * 16);
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        int32_t w;
        std::memcpy(&w, q + i * stride + 4 * g, 4);
        const __m512i x = _mm512_set1_epi32(w);
        acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], c0, x);
        acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], c1, x);
      }
    }
#pragma GCC unroll 2  // constant indices keep acc in registers
    for (int h = 0; h < 2; ++h) {
      const __m512 sc = _mm512_loadu_ps(c.scale.data() + cb + 16 * h);
      const __m512 bi = _mm512_loadu_ps(c.bias.data() + cb + 16 * h);
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][h], _mm512_set1_epi32(128 * rows[i].sum)));
        const __m512 s = _mm512_fmadd_ps(dot, _mm512_mul_ps(sc, _mm512_set1_ps(rows[i].scale)), bi);
        _mm512_storeu_ps(out + i * c.kpad + cb + 16 * h, s);
        top[i] = _mm512_max_ps(top[i], s);
      }
    }
  }
  for (int i = 0; i < kRows; ++i) best[i] = _mm512_reduce_max_ps(top[i]);
}

// tile_scores on AVX2: 8 rows x 8 centroids (half a block of words) a step, 8 accumulators.
__attribute__((target("avx2,fma")))
void tile_scores_avx2(const Centroids& c, const int8_t* q, const Quant* rows, float* out, float* best) {
  const int64_t g_count = c.groups, stride = g_count * 4;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t cb = 0; cb < c.kpad; cb += 8) {
    const uint32_t* w = c.words.data() + (cb / 16) * g_count * 16 + cb % 16;
    __m256i acc[kRows];
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) acc[i] = _mm256_setzero_si256();
    int64_t g = 0;
    for (; g + 1 < g_count; g += 2) {  // two steps a widening (rows <= 31: see the top)
      const __m256i cw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 16));
      const __m256i cw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g + 1) * 16));
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        int32_t x0, x1;
        std::memcpy(&x0, q + i * stride + 4 * g, 4);
        std::memcpy(&x1, q + i * stride + 4 * g + 4, 4);
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(cw0, _mm256_set1_epi32(x0)),
                                               _mm256_maddubs_epi16(cw1, _mm256_set1_epi32(x1)));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs, ones));
      }
    }
    if (g < g_count) {
      const __m256i cw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 16));
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        int32_t x;
        std::memcpy(&x, q + i * stride + 4 * g, 4);
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(cw, _mm256_set1_epi32(x)), ones));
      }
    }
    const __m256 sc = _mm256_loadu_ps(c.scale.data() + cb), bi = _mm256_loadu_ps(c.bias.data() + cb);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i], _mm256_set1_epi32(128 * rows[i].sum)));
      _mm256_storeu_ps(out + i * c.kpad + cb, _mm256_fmadd_ps(dot, _mm256_mul_ps(sc, _mm256_set1_ps(rows[i].scale)), bi));
    }
  }
  for (int i = 0; i < kRows; ++i) {  // 8 lanes of maxima (a scalar chain waited on vmaxss)
    const float* row = out + i * c.kpad;
    __m256 top = _mm256_loadu_ps(row);
    for (int64_t j = 8; j < c.kpad; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    best[i] = *std::max_element(lanes, lanes + 8);
  }
}

// x·c in double on AVX2: four chains of 4-lane fused multiply-adds.
__attribute__((target("avx2,fma")))
inline __m256d fma4(const float* x, const float* c, int64_t t, __m256d acc) {
  return _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + t)), _mm256_cvtps_pd(_mm_loadu_ps(c + t)), acc);
}

__attribute__((target("avx2,fma")))
double dot_double_avx2(const float* x, const float* c, int64_t d) {
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  int64_t t = 0;
  for (; t + 16 <= d; t += 16) {
    a0 = fma4(x, c, t, a0), a1 = fma4(x, c, t + 4, a1);
    a2 = fma4(x, c, t + 8, a2), a3 = fma4(x, c, t + 12, a3);
  }
  for (; t + 4 <= d; t += 4) a0 = fma4(x, c, t, a0);
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
  double s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; t < d; ++t) s += double(x[t]) * c[t];
  return s;
}

// acc + x[t:t+8]·c[t:t+8] in double, lane by lane. (A function, not a lambda: a lambda does not
// inherit its caller's target attribute, so builds for CPUs without AVX-512 would fail.)
__attribute__((target("avx512f")))
inline __m512d fma8(const float* x, const float* c, int64_t t, __m512d acc) {
  return _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + t)), _mm512_cvtps_pd(_mm256_loadu_ps(c + t)), acc);
}

// x·c in double, 8 lanes of fused multiply-adds (the candidates' exact scores). Four
// accumulators: one chain of dependent FMAs waited on their latency (a third of an assignment).
__attribute__((target("avx512f")))
double dot_double(const float* x, const float* c, int64_t d) {
  __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  int64_t t = 0;
  for (; t + 32 <= d; t += 32) {
    a0 = fma8(x, c, t, a0), a1 = fma8(x, c, t + 8, a1);
    a2 = fma8(x, c, t + 16, a2), a3 = fma8(x, c, t + 24, a3);
  }
  for (; t + 8 <= d; t += 8) a0 = fma8(x, c, t, a0);
  double s = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
  for (; t < d; ++t) s += double(x[t]) * c[t];
  return s;
}

// The scores a row's exact best can hide below: best approximate score - 2E - rounding (NaN for a
// NaN row: no score passes it).
float exact_floor(const Centroids& c, const Quant& row, float best) {
  const double e = row.norm * c.max_err + row.err * c.max_norm;
  const double magnitude = (row.norm + row.err) * c.max_norm + c.max_abs_bias;
  return std::nextafter(static_cast<float>(double(best) - 2 * e - kRoundingShare * magnitude),
                        -std::numeric_limits<float>::infinity());
}

// The exact best of one row among the centroids whose approximate score is within its bound of
// the best: returns (label, candidates scored); label -1 when none is (a non-finite row).
__attribute__((target("avx512f")))
std::pair<int64_t, int64_t> exact_best(const Centroids& c, const float* x, const Quant& row,
                                       const float* scores, float best) {
  const __m512 thr = _mm512_set1_ps(exact_floor(c, row, best));
  int64_t label = -1, scored = 0;
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t j0 = 0; j0 < c.k; j0 += 16) {  // not the pads: a -inf floor (overflow) passes them
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + j0), thr, _CMP_GE_OQ);
    if (c.k - j0 < 16) m &= __mmask16((1u << (c.k - j0)) - 1);
    while (m) {
      const int64_t j = j0 + __builtin_ctz(m);
      m &= m - 1;
      const double s = dot_double(x, c.exact + j * c.d, c.d) + c.exact_bias[j];
      ++scored;
      if (s > top) top = s, label = j;
    }
  }
  return {label, scored};
}

// exact_best on AVX2: 8 scores a compare.
__attribute__((target("avx2,fma")))
std::pair<int64_t, int64_t> exact_best_avx2(const Centroids& c, const float* x, const Quant& row,
                                            const float* scores, float best) {
  const __m256 thr = _mm256_set1_ps(exact_floor(c, row, best));
  int64_t label = -1, scored = 0;
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t j0 = 0; j0 < c.k; j0 += 8) {  // not the pads (as exact_best)
    unsigned m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(scores + j0), thr, _CMP_GE_OQ));
    if (c.k - j0 < 8) m &= (1u << (c.k - j0)) - 1;
    while (m) {
      const int64_t j = j0 + __builtin_ctz(m);
      m &= m - 1;
      const double s = dot_double_avx2(x, c.exact + j * c.d, c.d) + c.exact_bias[j];
      ++scored;
      if (s > top) top = s, label = j;
    }
  }
  return {label, scored};
}

}  // namespace

// Rows quantized once for every assignment against them (k-means assigns the same sample each
// iteration): q [N, groups * 4] int8 (bytes past d zero) and meta [N, kMeta] float64 = (scale, sum
// of the bytes, |x - x̂|, |x|, the byte range: 127 or, for the AVX2 path, 31), as quantize gives
// them, in parallel.
constexpr int64_t kMeta = 5;

void check_path(bool avx2) {
  if (avx2) {
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "the AVX2 path needs AVX2 and FMA");
  } else {
    TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"),
                "the VNNI path needs AVX-512 VNNI (callers check int8_isa() first)");
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, bool avx2) {
  check_path(avx2);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [N, D]");
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(0), d = xc.size(1), stride = (d + 3) / 4 * 4;
  at::Tensor q = at::zeros({n, stride}, at::kChar), meta = at::empty({n, kMeta}, at::kDouble);
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  double* mp = meta.data_ptr<double>();
  at::parallel_for(0, n, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Quant v = quantize(xp + r * d, d, qp + r * stride, avx2, true);
      double* m = mp + kMeta * r;
      m[0] = v.scale, m[1] = v.sum, m[2] = v.err, m[3] = v.norm, m[4] = avx2 ? kRowLevelsAvx2 : kLevels;
    }
  });
  return {q, meta};
}

// labels [N] int64 of x [N, D] float32 against centroids [K, D] float32 (l2: nearest; else largest
// inner product), the number of exact scores taken (>= N; the bound's looseness), and with
// sum_parts > 0 the sums [K, D] float32 of the rows by label (k-means' update; undefined
// otherwise). rows: x as quantize_rows gave it (undefined: quantized here, tile by tile).
// The sums are taken while the exact check has each row in cache (a second pass over x had been
// a fifth of an iteration): the rows split into sum_parts fixed parts, each summed in row order
// into its own buffer, the parts then added in order, so no thread count changes a bit.
std::tuple<at::Tensor, int64_t, at::Tensor> nearest_centroids(
    const at::Tensor& x, const at::Tensor& centroids, bool l2,
    const c10::optional<std::tuple<at::Tensor, at::Tensor>>& rows_q, int64_t sum_parts, bool avx2) {
  check_path(avx2);
  TORCH_CHECK(x.dim() == 2 && centroids.dim() == 2 && x.size(1) == centroids.size(1),
              "x [N, D] and centroids [K, D] must share D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && centroids.scalar_type() == at::kFloat, "float32 inputs");
  TORCH_CHECK(centroids.size(0) >= 1, "at least one centroid");
  const at::Tensor xc = x.contiguous(), cc = centroids.contiguous();
  const int64_t n = xc.size(0), d = xc.size(1);
  const Centroids c = quantize_centroids(cc.data_ptr<float>(), cc.size(0), d, l2, avx2);
  const int64_t stride = c.groups * 4;
  const int8_t* pre = nullptr;
  const double* meta = nullptr;
  if (rows_q.has_value()) {
    const auto& [q, m] = *rows_q;
    TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 2 && q.size(0) == n &&
                    q.size(1) == stride && m.scalar_type() == at::kDouble && m.is_contiguous() &&
                    m.dim() == 2 && m.size(0) == n && m.size(1) == kMeta &&
                    (n == 0 || m.data_ptr<double>()[4] == (avx2 ? kRowLevelsAvx2 : kLevels)),
                "rows: not quantize_rows(x) of this x on this path");
    pre = q.data_ptr<int8_t>(), meta = m.data_ptr<double>();
  }
  at::Tensor labels = at::empty({n}, at::kLong);
  const float* xp = xc.data_ptr<float>();
  int64_t* lp = labels.data_ptr<int64_t>();
  const int64_t tiles = (n + kRows - 1) / kRows, k = c.k;
  TORCH_CHECK(sum_parts >= 0, "sum_parts must be >= 0");
  const int64_t parts = sum_parts > 0 ? std::max<int64_t>(1, std::min(sum_parts, tiles)) : tiles;
  std::vector<float> part_sums(sum_parts > 0 ? parts * k * d : 0, 0.f);
  std::atomic<int64_t> scored{0}, bad{-1};
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<int8_t> q(kRows * stride);
    std::vector<float> scores(kRows * c.kpad);
    Quant rows[kRows];
    float best[kRows];
    int64_t local = 0;
    for (int64_t t = p0 * tiles / parts, p = p0; t < p1 * tiles / parts; ++t) {
      while (t >= (p + 1) * tiles / parts) ++p;  // the part tile t is in
      float* acc = sum_parts > 0 ? part_sums.data() + p * k * d : nullptr;
      const int64_t r0 = t * kRows, count = std::min<int64_t>(kRows, n - r0);
      const int8_t* tile = q.data();
      if (pre != nullptr && count == kRows) {
        tile = pre + r0 * stride;  // kRows consecutive rows of stride bytes: the tile's layout
      } else {
        std::fill(q.begin(), q.end(), 0);
      }
      for (int i = 0; i < kRows; ++i) {
        rows[i] = Quant();
        if (i >= count) continue;  // a zero row: its scores are computed and ignored
        if (pre == nullptr) {
          rows[i] = quantize(xp + (r0 + i) * d, d, q.data() + i * stride, avx2, true);
          continue;
        }
        const double* mr = meta + kMeta * (r0 + i);
        rows[i].scale = static_cast<float>(mr[0]), rows[i].sum = static_cast<int32_t>(mr[1]);
        rows[i].err = mr[2], rows[i].norm = mr[3];
        if (tile == q.data()) std::memcpy(q.data() + i * stride, pre + (r0 + i) * stride, stride);
      }
      if (avx2) {
        tile_scores_avx2(c, tile, rows, scores.data(), best);
      } else {
        tile_scores(c, tile, rows, scores.data(), best);
      }
      for (int i = 0; i < count; ++i) {
        const float* xr = xp + (r0 + i) * d;
        const float* sr = scores.data() + i * c.kpad;
        const auto [label, taken] = avx2 ? exact_best_avx2(c, xr, rows[i], sr, best[i])
                                         : exact_best(c, xr, rows[i], sr, best[i]);
        lp[r0 + i] = label;
        local += taken;
        if (label < 0) {
          bad.store(r0 + i);
        } else if (acc != nullptr) {
          float* to = acc + label * d;
          const float* row = xp + (r0 + i) * d;
          for (int64_t j = 0; j < d; ++j) to[j] += row[j];
        }
      }
    }
    scored += local;
  });
  TORCH_CHECK(bad.load() < 0, "row ", bad.load(), " of x has a non-finite value: no nearest centroid");
  at::Tensor sums;
  if (sum_parts > 0) {
    sums = at::zeros({k, d}, at::kFloat);
    float* out = sums.data_ptr<float>();
    for (int64_t p = 0; p < parts; ++p) {
      const float* from = part_sums.data() + p * k * d;
      for (int64_t j = 0; j < k * d; ++j) out[j] += from[j];
    }
  }
  return {labels, scored.load(), sums};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nearest_centroids", &nearest_centroids,
        "Nearest centroid of every row: int8 scores (VNNI, or AVX2 with avx2), candidates within the bound "
        "scored exactly",
        pybind11::arg("x"), pybind11::arg("centroids"), pybind11::arg("l2"), pybind11::arg("rows") = pybind11::none(),
        pybind11::arg("sum_parts") = 0, pybind11::arg("avx2") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quantize_rows", &quantize_rows, "Rows quantized once for nearest_centroids (k-means' sample)",
        pybind11::arg("x"), pybind11::arg("avx2") = false, pybind11::call_guard<pybind11::gil_scoped_release>());
}
