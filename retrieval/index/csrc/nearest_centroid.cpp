// The nearest centroid of every row (k-means' assignment step, and the build's assignment of the
// whole catalog), by int8 dot products on AVX-512 VNNI, checked exactly.
//
// A row x is assigned to argmax_j  x·c_j + bias_j   (bias = -|c_j|^2 / 2 for L2, 0 for inner product).
// Rows and centroids are quantized to int8 with a scale per row; the approximate score a_j of every
// centroid comes from vpdpbusd (64 multiply-adds per instruction, 4x a float FMA's). Every centroid
// whose a_j lies within the error bound of the best a_j is then scored exactly, in double, and the
// best exact score wins (ties: the smaller index). The bound:
//     |x·c - x̂·ĉ| <= |x| |c - ĉ| + |x - x̂| |ĉ|  <=  |x| max_j|c_j - ĉ_j| + |x - x̂| max_j|ĉ_j|  = E
// so the true best is never more than 2E below the best approximate score, plus the float rounding
// of a_j (bounded by 1e-6 of the scores' magnitude, ~17 ulps). The answer is the exact argmax: the
// int8 pass only decides which few centroids get an exact score.
//
// Register tile: 8 rows x 32 centroids (16 accumulators). Centroids sit as blocks of 16 centroids x
// 4 bytes in offset binary (c + 128, the unsigned operand of vpdpbusd); a row's 4 bytes are
// broadcast. The excess 128 * sum(row) is subtracted once per row. Python calls this only when the
// CPU has AVX-512 VNNI (retrieval/index/kmeans.py); others take faiss's float search.
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

Centroids quantize_centroids(const float* c, int64_t k, int64_t d, bool l2) {
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
    const Quant qc = quantize_row(cj, d, q.data());
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

// The exact best of one row among the centroids whose approximate score is within its bound of
// the best: returns (label, candidates scored); label -1 when none is (a non-finite row).
__attribute__((target("avx512f")))
std::pair<int64_t, int64_t> exact_best(const Centroids& c, const float* x, const Quant& row,
                                       const float* scores, float best) {
  const double e = row.norm * c.max_err + row.err * c.max_norm;
  const double magnitude = (row.norm + row.err) * c.max_norm + c.max_abs_bias;
  const float floor_ = std::nextafter(static_cast<float>(double(best) - 2 * e - kRoundingShare * magnitude),
                                      -std::numeric_limits<float>::infinity());
  const __m512 thr = _mm512_set1_ps(floor_);
  int64_t label = -1, scored = 0;
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t j0 = 0; j0 < c.kpad; j0 += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + j0), thr, _CMP_GE_OQ);
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

}  // namespace

// Rows quantized once for every assignment against them (k-means assigns the same sample each
// iteration): q [N, groups * 4] int8 (bytes past d zero) and meta [N, 4] float64 = (scale, sum of
// the bytes, |x - x̂|, |x|), as quantize_row gives them, in parallel.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"), "quantize_rows needs AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [N, D]");
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(0), d = xc.size(1), stride = (d + 3) / 4 * 4;
  at::Tensor q = at::zeros({n, stride}, at::kChar), meta = at::empty({n, 4}, at::kDouble);
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  double* mp = meta.data_ptr<double>();
  at::parallel_for(0, n, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Quant v = quantize_row(xp + r * d, d, qp + r * stride);
      mp[4 * r] = v.scale, mp[4 * r + 1] = v.sum, mp[4 * r + 2] = v.err, mp[4 * r + 3] = v.norm;
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
    const c10::optional<std::tuple<at::Tensor, at::Tensor>>& rows_q, int64_t sum_parts) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"),
              "nearest_centroids needs AVX-512 VNNI (callers check int8_isa() first)");
  TORCH_CHECK(x.dim() == 2 && centroids.dim() == 2 && x.size(1) == centroids.size(1),
              "x [N, D] and centroids [K, D] must share D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && centroids.scalar_type() == at::kFloat, "float32 inputs");
  TORCH_CHECK(centroids.size(0) >= 1, "at least one centroid");
  const at::Tensor xc = x.contiguous(), cc = centroids.contiguous();
  const int64_t n = xc.size(0), d = xc.size(1);
  const Centroids c = quantize_centroids(cc.data_ptr<float>(), cc.size(0), d, l2);
  const int64_t stride = c.groups * 4;
  const int8_t* pre = nullptr;
  const double* meta = nullptr;
  if (rows_q.has_value()) {
    const auto& [q, m] = *rows_q;
    TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 2 && q.size(0) == n &&
                    q.size(1) == stride && m.scalar_type() == at::kDouble && m.is_contiguous() &&
                    m.dim() == 2 && m.size(0) == n && m.size(1) == 4,
                "rows: not quantize_rows(x) of this x");
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
          rows[i] = quantize_row(xp + (r0 + i) * d, d, q.data() + i * stride);
          continue;
        }
        const double* mr = meta + 4 * (r0 + i);
        rows[i].scale = static_cast<float>(mr[0]), rows[i].sum = static_cast<int32_t>(mr[1]);
        rows[i].err = mr[2], rows[i].norm = mr[3];
        if (tile == q.data()) std::memcpy(q.data() + i * stride, pre + (r0 + i) * stride, stride);
      }
      tile_scores(c, tile, rows, scores.data(), best);
      for (int i = 0; i < count; ++i) {
        const auto [label, taken] = exact_best(c, xp + (r0 + i) * d, rows[i], scores.data() + i * c.kpad, best[i]);
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
        "Nearest centroid of every row: int8 VNNI scores, candidates within the bound scored exactly",
        pybind11::arg("x"), pybind11::arg("centroids"), pybind11::arg("l2"), pybind11::arg("rows") = pybind11::none(),
        pybind11::arg("sum_parts") = 0,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quantize_rows", &quantize_rows, "Rows quantized once for nearest_centroids (k-means' sample)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
