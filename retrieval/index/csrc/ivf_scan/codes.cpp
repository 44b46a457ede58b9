// int8 quantization in the index's own arithmetic: the build's residual codes (encode_int8),
// the queries the list scan and the int8 GEMM quantize (quantize_queries), and chosen rows
// decoded back to floats (decode_rows_int8).

#include <ATen/ops/empty.h>

#include "ivf_scan.h"

namespace ivf {

// Queries qf [B, D] to int8 rows q8 (stride `stride`, bytes past D left as they are) with a
// per-query scale qs (absmax / 127, round half to even: the same arithmetic as
// retrieval.index.codes.quantize_int8), and each row's code sum qsum (VNNI's offset correction).
void quantize_queries(const float* qf, int64_t b_count, int64_t d, int8_t* q8, int64_t stride, float* qs,
                      int32_t* qsum) {
  at::parallel_for(0, b_count, std::max<int64_t>(1, 65536 / std::max<int64_t>(d, 1)), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float amax = 0.f;
#ifdef RECSERVE_AVX512_BUILD
      __m512 mx = _mm512_setzero_ps();  // the same maximum: max is exact in any order
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 in = d - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - j)) - 1);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(in, qf + b * d + j)));
      }
      amax = _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__)
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 mx = _mm256_setzero_ps();
      int64_t j0 = 0;
      for (; j0 + 8 <= d; j0 += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(qf + b * d + j0), abs_mask));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      amax = *std::max_element(lanes, lanes + 8);
      for (; j0 < d; ++j0) amax = std::max(amax, std::fabs(qf[b * d + j0]));
#else
      for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(qf[b * d + j]));
#endif
      qs[b] = amax / 127.0f;
      const float safe = qs[b] > 0.f ? qs[b] : 1.f;
      int32_t sum = 0;
      int64_t j = 0;
#ifdef RECSERVE_AVX512_BUILD
      // 16 at a time (a call to nearbyint per element was a large share of a big batch); the same
      // division, round half to even and clamp, so the same bytes
      const __m512 sv = _mm512_set1_ps(safe), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      __m512i acc = _mm512_setzero_si512();
      for (; j < d; j += 16) {
        const __mmask16 in = d - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - j)) - 1);
        __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(in, qf + b * d + j), sv);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i iv = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
        acc = _mm512_add_epi32(acc, iv);
        _mm512_mask_cvtepi32_storeu_epi8(q8 + b * stride + j, in, iv);
      }
      sum = _mm512_reduce_add_epi32(acc);
#elif defined(__AVX2__)  // 8 at a time, the same arithmetic (a scalar nearbyint showed in a batch's profile)
      const __m256 sv = _mm256_set1_ps(safe), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
      __m256i acc = _mm256_setzero_si256();
      for (; j + 8 <= d; j += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(qf + b * d + j), sv);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i iv = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
        acc = _mm256_add_epi32(acc, iv);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q8 + b * stride + j), _mm_packs_epi16(w, w));
      }
      alignas(32) int32_t part[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(part), acc);
      for (int k = 0; k < 8; ++k) sum += part[k];
#endif
      for (; j < d; ++j) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(qf[b * d + j] / safe)));
        q8[b * stride + j] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      qsum[b] = sum;
    }
  });
}

#ifdef RECSERVE_AVX512_BUILD
// s0 += v[0:8]^2, s1 += v[8:16]^2, in double (a norm's sum of squares, 16 lanes of it).
inline void accumulate_squares(__m512 v, __m512d& s0, __m512d& s1) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  s0 = _mm512_fmadd_pd(lo, lo, s0);
  s1 = _mm512_fmadd_pd(hi, hi, s1);
}
#elif defined(__AVX2__)
// s0 += v[0:4]^2, s1 += v[4:8]^2, in double (8 lanes of a norm's sum of squares; a float's square
// is exact in double, so each fused add rounds once, as the scalar sum's add does).
inline void accumulate_squares(__m256 v, __m256d& s0, __m256d& s1) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  s0 = _mm256_fmadd_pd(lo, lo, s0);
  s1 = _mm256_fmadd_pd(hi, hi, s1);
}

inline double sum_lanes_pd(__m256d a, __m256d b) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a, b));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}
#endif

// The build's codes in one pass, with no float copy of the catalog: row i of the index is item
// order[i] of x [N, D] f32, in list lists[i] (list-sorted); its residual to centroids[lists[i]] is
// quantized as codes.quantize_int8 does (absmax / 127, round half to even, clamp), bit for bit
// -> codes [N, D] int8, scales [N] bf16 (rounded first: the codes use the stored scale),
// and norms [N] f32 = max(|r|, |decoded r|) summed in double
// and rounded up to a float (list_radius is a bound: no rounding may shrink it).
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_int8(const at::Tensor& x, const at::Tensor& order,
                                                           const at::Tensor& lists, const at::Tensor& centroids) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [N, D]");
  TORCH_CHECK(centroids.dim() == 2 && centroids.size(1) == x.size(1) && centroids.scalar_type() == at::kFloat &&
              centroids.is_contiguous(), "centroids must be contiguous float32 [L, D] with x's D");
  TORCH_CHECK(order.dim() == 1 && lists.sizes() == order.sizes() && order.scalar_type() == at::kLong &&
              lists.scalar_type() == at::kLong && order.is_contiguous() && lists.is_contiguous(),
              "order and lists must be contiguous int64 [N]");
  const int64_t n = order.numel(), d = x.size(1), nx = x.size(0), nlist = centroids.size(0);
  const int64_t* op = order.data_ptr<int64_t>();
  const int64_t* lp = lists.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(op[i] >= 0 && op[i] < nx && lp[i] >= 0 && lp[i] < nlist, "order or lists out of range at ", i);
  auto codes = at::empty({n, d}, x.options().dtype(at::kChar));
  auto scales = at::empty({n}, x.options().dtype(at::kBFloat16));
  auto norms = at::empty({n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = centroids.data_ptr<float>();
  int8_t* out = codes.data_ptr<int8_t>();
  Scale* sp = scales.data_ptr<Scale>();
  float* np_ = norms.data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t i0, int64_t i1) {
    std::vector<float> r(d);
    for (int64_t i = i0; i < i1; ++i) {
      const float* xi = xp + op[i] * d;
      const float* c = cp + lp[i] * d;
      float amax = 0.f;
      double exact = 0.0;
      int64_t j = 0;
#ifdef RECSERVE_AVX512_BUILD
      // 16 at a time (one serial double sum per element had been most of the build's encode):
      // the same differences and maximum; the double sums in 8-lane partial sums
      {
        __m512 mx = _mm512_setzero_ps();
        __m512d s0 = _mm512_setzero_pd(), s1 = s0;
        for (; j < d; j += 16) {
          const __mmask16 in = d - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - j)) - 1);
          const __m512 rv = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, xi + j), _mm512_maskz_loadu_ps(in, c + j));
          _mm512_mask_storeu_ps(r.data() + j, in, rv);
          mx = _mm512_max_ps(mx, _mm512_abs_ps(rv));
          accumulate_squares(rv, s0, s1);
        }
        amax = _mm512_reduce_max_ps(mx);
        exact = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
      }
#elif defined(__AVX2__)
      {  // 8 at a time, the same (scalar encode loops showed in an AVX2 build's profile)
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 mx = _mm256_setzero_ps();
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        for (; j + 8 <= d; j += 8) {
          const __m256 rv = _mm256_sub_ps(_mm256_loadu_ps(xi + j), _mm256_loadu_ps(c + j));
          _mm256_storeu_ps(r.data() + j, rv);
          mx = _mm256_max_ps(mx, _mm256_and_ps(rv, abs_mask));
          accumulate_squares(rv, s0, s1);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        amax = *std::max_element(lanes, lanes + 8);
        exact = sum_lanes_pd(s0, s1);
      }
#endif
      for (; j < d; ++j) {
        r[j] = xi[j] - c[j];
        amax = std::max(amax, std::fabs(r[j]));
        exact += double(r[j]) * r[j];
      }
      const Scale stored(amax / 127.0f);  // round to nearest even, as torch's .bfloat16()
      const float scale = float(stored);
      const float safe = scale > 0.f ? scale : 1.f;
      double decoded = 0.0;
      int8_t* code = out + i * d;
      j = 0;
#ifdef RECSERVE_AVX512_BUILD
      {  // the same division, round half to even and clamp as below, so the same bytes
        const __m512 sv = _mm512_set1_ps(safe), back = _mm512_set1_ps(scale);
        const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
        __m512d s0 = _mm512_setzero_pd(), s1 = s0;
        for (; j < d; j += 16) {
          const __mmask16 in = d - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - j)) - 1);
          __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(in, r.data() + j), sv);
          v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
          _mm512_mask_cvtepi32_storeu_epi8(code + j, in, _mm512_cvtps_epi32(v));
          accumulate_squares(_mm512_mul_ps(v, back), s0, s1);
        }
        decoded = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
      }
#elif defined(__AVX2__)
      {  // the same division, round half to even and clamp as below, so the same bytes
        const __m256 sv = _mm256_set1_ps(safe), back = _mm256_set1_ps(scale);
        const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        for (; j + 8 <= d; j += 8) {
          __m256 v = _mm256_div_ps(_mm256_loadu_ps(r.data() + j), sv);
          v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
          const __m256i iv = _mm256_cvtps_epi32(v);
          const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(code + j), _mm_packs_epi16(c16, c16));
          accumulate_squares(_mm256_mul_ps(v, back), s0, s1);
        }
        decoded = sum_lanes_pd(s0, s1);
      }
#endif
      for (; j < d; ++j) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(r[j] / safe)));
        code[j] = static_cast<int8_t>(v);
        const float back = v * scale;
        decoded += double(back) * back;
      }
      const double norm = std::sqrt(std::max(exact, decoded));
      float up = static_cast<float>(norm);
      if (double(up) < norm) up = std::nextafter(up, std::numeric_limits<float>::infinity());
      sp[i] = stored;
      np_[i] = up;
    }
  });
  return {codes, scales, norms};
}

// Float vectors of chosen rows, decoded in one pass: pos [M] int64, codes [N, D] int8, scales [N],
// offsets [L + 1], centroids_t [D, L] f32 (the index keeps its centroids in the probe's layout
// only) -> [M, D] f32, row m = centroid[list] + scale * code. A list's centroid is gathered once
// per run of its rows (pos ascending: once per list a thread meets).
at::Tensor decode_rows_int8(const at::Tensor& pos, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& offsets, const at::Tensor& centroids_t) {
  check_rows_of_codes(pos, codes, scales, offsets);
  const int64_t d = codes.size(1), m = pos.numel(), nlist = offsets.size(0) - 1;
  TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.size(1) == nlist && centroids_t.size(0) == d &&
              centroids_t.scalar_type() == at::kFloat && centroids_t.is_contiguous(),
              "centroids_t must be contiguous float32 [D, L]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  auto out = at::empty({m, d}, centroids_t.options());
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const Scale* sp = scales.data_ptr<Scale>();
  const float* ct = centroids_t.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> cen(d);
    int64_t have = -1;  // the list whose centroid cen holds
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = pp[i];
      const int64_t list = std::upper_bound(off, off + nlist + 1, row) - off - 1;
      if (list != have) {
        for (int64_t j = 0; j < d; ++j) cen[j] = ct[j * nlist + list];
        have = list;
      }
      const int8_t* c = cp + row * d;
      const float s = float(sp[row]);
      float* o = op + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] = cen[j] + s * float(c[j]);
    }
  });
  return out;
}

}  // namespace ivf
