// The probe: which lists each query scans (ivf_probe), through the float centroids or, for a few
// queries, their int8 table (probe_table) with an exact check that keeps the float probe's
// answer; and q·c of every list (centroid_dots) in the probe's arithmetic.

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include "ivf_scan.h"

namespace ivf {

// q · every centroid: acc[l] = sum over j of q[j] * ct[j, l], j ascending (one fused multiply-add
// per term), so every path gives the same bits. Blocks of lists keep their sums in registers
// across the D terms; one pass of the whole acc row per term was bound by its stores.
constexpr int64_t kProbeBlock = 32;
inline void probe_dots_portable(const float* __restrict q, const float* __restrict ct, int64_t d, int64_t nlist,
                                float* __restrict acc) {
  int64_t l0 = 0;
  for (; l0 + kProbeBlock <= nlist; l0 += kProbeBlock) {
    float sum[kProbeBlock] = {};
    for (int64_t j = 0; j < d; ++j) {
      const float qj = q[j];
      const float* row = ct + j * nlist + l0;
#pragma omp simd
      for (int64_t l = 0; l < kProbeBlock; ++l) sum[l] = std::fma(qj, row[l], sum[l]);
    }
    std::copy(sum, sum + kProbeBlock, acc + l0);
  }
  for (int64_t l = l0; l < nlist; ++l) {
    float sum = 0.f;
    for (int64_t j = 0; j < d; ++j) sum = std::fma(q[j], ct[j * nlist + l], sum);
    acc[l] = sum;
  }
}

#ifdef RECSERVE_X86
// AVX-512: 128 lists at a time in eight 16-lane sums, enough independent FMAs to hide their
// latency. The portable loop's compiled form kept its sums on the stack (GCC's 256-bit default):
// a store-forward per term, which dominated a one-query probe.
RECSERVE_TARGET("avx512f")
void probe_dots_avx512(const float* __restrict q, const float* __restrict ct, int64_t d, int64_t nlist,
                       float* __restrict acc) {
  int64_t l0 = 0;
  for (; l0 + 128 <= nlist; l0 += 128) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t j = 0; j < d; ++j) {
      const __m512 qj = _mm512_set1_ps(q[j]);
      const float* row = ct + j * nlist + l0;
      s0 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row), s0);
      s1 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 16), s1);
      s2 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 32), s2);
      s3 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 48), s3);
      s4 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 64), s4);
      s5 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 80), s5);
      s6 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 96), s6);
      s7 = _mm512_fmadd_ps(qj, _mm512_loadu_ps(row + 112), s7);
    }
    float* out = acc + l0;
    _mm512_storeu_ps(out, s0), _mm512_storeu_ps(out + 16, s1), _mm512_storeu_ps(out + 32, s2);
    _mm512_storeu_ps(out + 48, s3), _mm512_storeu_ps(out + 64, s4), _mm512_storeu_ps(out + 80, s5);
    _mm512_storeu_ps(out + 96, s6), _mm512_storeu_ps(out + 112, s7);
  }
  for (; l0 < nlist; l0 += 16) {
    const __mmask16 m = nlist - l0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nlist - l0)) - 1);
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; ++j)
      s = _mm512_fmadd_ps(_mm512_set1_ps(q[j]), _mm512_maskz_loadu_ps(m, ct + j * nlist + l0), s);
    _mm512_mask_storeu_ps(acc + l0, m, s);
  }
}
#endif

inline void probe_dots(const float* __restrict q, const float* __restrict ct, int64_t d, int64_t nlist,
                       float* __restrict acc) {
#ifdef RECSERVE_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) return probe_dots_avx512(q, ct, d, nlist, acc);
#endif
  probe_dots_portable(q, ct, d, nlist, acc);
}

// The probe's int8 table: the centroids quantized once per index (IVFIndex._refresh), for the
// probe of a few queries. One query's probe read the whole float table (L x D floats: much of
// the query's time goes to that read); the table is a quarter of it. centroids_t [D, L] ->
// words int32 [ceil(L/16) * G * 16] (G = ceil(D/4): blocks of 16 lists x 4 bytes in offset binary,
// block_dots_vnni's layout), per f32 [4, ceil(L/16) * 16] = each list's (scale: symmetric absmax /
// 127, |c - ĉ|, |ĉ|, |c|; pads 0), the norms summed in double, inflated by kSquareSlack and rounded
// up, so they stay upper bounds, and finite bool [1]: false when a centroid is not (then the
// table is never used).
constexpr double kSquareSlack = 1.001;

inline float round_up(double v) {
  const float f = static_cast<float>(v);
  return double(f) < v ? std::nextafter(f, std::numeric_limits<float>::infinity()) : f;
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> probe_table(const at::Tensor& centroids_t) {
  TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.scalar_type() == at::kFloat && centroids_t.is_contiguous() &&
              centroids_t.device().is_cpu(), "centroids_t must be contiguous CPU float32 [D, L]");
  const int64_t d = centroids_t.size(0), nlist = centroids_t.size(1), groups = (d + 3) / 4;
  const int64_t blocks = (nlist + 15) / 16;
  auto words = at::full({blocks * groups * 16}, static_cast<int32_t>(0x80808080u), centroids_t.options().dtype(at::kInt));
  auto per = at::zeros({4, blocks * 16}, centroids_t.options());
  auto finite_t = at::empty({1}, centroids_t.options().dtype(at::kBool));
  const float* ct = centroids_t.data_ptr<float>();
  uint32_t* wp = reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>());
  float* sp = per.data_ptr<float>();
  const int64_t stride = blocks * 16;
  std::vector<int8_t> code(groups * 4);
  bool finite = true;
  for (int64_t l = 0; l < nlist; ++l) {
    float amax = 0.f;
    for (int64_t j = 0; j < d; ++j) {
      const float v = ct[j * nlist + l];
      finite &= std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
    }
    const float sc = amax > 0.f ? amax / 127.f : 1.f;
    double err = 0, qn = 0, nn = 0;
    std::fill(code.begin(), code.end(), 0);
    for (int64_t j = 0; j < d; ++j) {
      const float v = ct[j * nlist + l];
      const float c = std::min(127.f, std::max(-127.f, std::nearbyint(v / sc)));
      code[j] = static_cast<int8_t>(c);
      const double back = double(c) * sc;
      err += (v - back) * (v - back), qn += back * back, nn += double(v) * v;
    }
    sp[l] = sc;
    sp[stride + l] = round_up(std::sqrt(kSquareSlack * err));
    sp[2 * stride + l] = round_up(std::sqrt(kSquareSlack * qn));
    sp[3 * stride + l] = round_up(std::sqrt(kSquareSlack * nn));
    uint32_t* dst = wp + (l / 16) * groups * 16 + l % 16;
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t w;
      std::memcpy(&w, code.data() + 4 * g, 4);
      dst[g * 16] = w ^ 0x80808080u;
    }
  }
  finite_t.fill_(finite);
  return {words, per, finite_t};
}

#ifdef RECSERVE_X86
// AVX2 dots of one query against blocks of 16 lists (probe_table's words: block_dots_vnni's layout)
// for a CPU without VNNI. vpmaddubsw multiplies the unsigned word bytes (c + 128 <= 255) by the
// query's signed bytes into saturating s16 pair sums, so the query is quantized to |q| <= 63: a pair
// sums to at most 2 * 255 * 63 = 32130 < 2^15 and nothing saturates; vpmaddwd widens each pair
// to s32, and the excess 128 * sum(q) is subtracted. dots must hold n rounded up to 16.
RECSERVE_TARGET("avx2")
void block_dots_avx2(const uint32_t* t, int64_t n, int64_t groups, const int8_t* q, int32_t qsum, int32_t* dots) {
  const __m256i corr = _mm256_set1_epi32(128 * qsum), ones = _mm256_set1_epi16(1);
  const int64_t blocks = (n + 15) / 16, stride = groups * 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i* blk = reinterpret_cast<const __m256i*>(t + b * stride);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t qw;
      std::memcpy(&qw, q + 4 * g, 4);
      const __m256i qv = _mm256_set1_epi32(qw);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256(blk + 2 * g), qv), ones));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256(blk + 2 * g + 1), qv), ones));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + b * 16), _mm256_sub_epi32(a0, corr));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + b * 16 + 8), _mm256_sub_epi32(a1, corr));
  }
}

// The exact q·c of lists idx[0..n) in probe_dots' own arithmetic (per list, fmaf over j from 0 in
// order: the same bits whatever the vector width), 8 lists per AVX2 gather (16 with AVX-512).
RECSERVE_TARGET("avx2,fma")
void probe_dots_of_avx2(const float* q, const float* ct, int64_t d, int64_t nlist, const int32_t* idx, int64_t n,
                        float* out) {
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    alignas(32) int32_t at[8] = {};  // past n: list 0, gathered and dropped
    alignas(32) float s8[8];
    std::copy(idx + i, idx + i + m, at);
    const __m256i av = _mm256_load_si256(reinterpret_cast<const __m256i*>(at));
    __m256 s = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; ++j)
      s = _mm256_fmadd_ps(_mm256_set1_ps(q[j]), _mm256_i32gather_ps(ct + j * nlist, av, 4), s);
    _mm256_store_ps(s8, s);
    std::copy(s8, s8 + m, out + i);
  }
}

RECSERVE_TARGET("avx512f")
void probe_dots_of_avx512(const float* q, const float* ct, int64_t d, int64_t nlist, const int32_t* idx, int64_t n,
                          float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512i at = _mm512_maskz_loadu_epi32(m, idx + i);
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; ++j)
      s = _mm512_fmadd_ps(_mm512_set1_ps(q[j]), _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, at, ct + j * nlist, 4), s);
    _mm512_mask_storeu_ps(out + i, m, s);
  }
}

// Each list's approximate key ± T_l (see probe_one_int8) as lo, hi [L] in float (one vector
// loop): key = dots * qs * scale (- half), T_l = a |c - ĉ| + b |ĉ| + c |c| + e |half|, widened by
// m = (|key| + T_l) 2^-21, which exceeds the rounding of the three float steps after key's (each
// at most 2^-24 of (|key| + T_l + m)).
template <bool kL2>
void key_bounds(const int32_t* dots, float qs, const float* per, int64_t stride, const float* hp, int64_t nlist,
                float a, float b, float c, float e, float* lo, float* hi) {
  const float *cscale = per, *cerr = per + stride, *chat = per + 2 * stride, *cnorm = per + 3 * stride;
  constexpr float kOut = 1.f / (1 << 21), kTiny = 1e-30f;
  for (int64_t l = 0; l < nlist; ++l) {
    const float ip = float(dots[l]) * qs * cscale[l];
    const float key = kL2 ? ip - hp[l] : ip;
    const float t = a * cerr[l] + b * chat[l] + c * cnorm[l] + (kL2 ? e * std::fabs(hp[l]) : 0.f);
    const float m = (std::fabs(key) + t) * kOut + kTiny;
    lo[l] = (key - t) - m;
    hi[l] = (key + t) + m;
  }
}

// One query's probe through the table: approximate q·c of every list (block_dots_vnni, or
// block_dots_avx2 with a 7-bit query), then every list whose approximate key + its error bound T_l
// reaches the p-th best of (approximate key - T_m) over all lists is scored exactly
// (probe_dots_of_*) and ranked by the same heap as the float probe, lists in ascending order. T_l
// bounds |exact float key - approximate key| of list l:
//   |q·c - q̂·ĉ| <= |q| |c - ĉ| + |q - q̂| |ĉ|           (quantization)
//   + 4u |q̂| |ĉ|                                          (the approximation's float rounding)
//   + γ_D |q| |c|                                          (the exact sum's own rounding)
//   + 2u (|q| |c| + |half|)                                (the key's subtraction, both sides)
// The p lists of the best lower bounds all reach the p-th of them, so every list of the float
// probe's best p (ties included) is scored, and the answer is the float probe's. False when the
// query is not finite (the caller takes the float probe).
bool probe_one_int8(Isa isa, const float* qb, int64_t d, const float* ct, int64_t nlist, const float* hp,
                    const uint32_t* words, const float* per, int64_t p, std::vector<Cand>& heap,
                    std::vector<int8_t>& q8, std::vector<int32_t>& dots, std::vector<float>& lo,
                    std::vector<float>& hi, std::vector<int32_t>& cand, std::vector<float>& exact) {
  const int64_t groups = (d + 3) / 4, stride = (nlist + 15) / 16 * 16;
  const float levels = isa == Isa::kVnni ? 127.f : 63.f;  // vpdpbusd's s32 sums; vpmaddubsw's s16 pairs
  double qn = 0;
  float amax = 0.f;
  for (int64_t j = 0; j < d; ++j) qn += double(qb[j]) * qb[j], amax = std::max(amax, std::fabs(qb[j]));
  if (!std::isfinite(qn)) return false;
  const float qs = amax > 0.f ? amax / levels : 1.f;
  q8.assign(groups * 4, 0);
  int32_t qsum = 0;
  double err = 0, qhat = 0;
  for (int64_t j = 0; j < d; ++j) {
    const float c = std::min(levels, std::max(-levels, std::nearbyint(qb[j] / qs)));
    q8[j] = static_cast<int8_t>(c);
    qsum += static_cast<int32_t>(c);
    const double back = double(c) * qs;
    err += (qb[j] - back) * (qb[j] - back), qhat += back * back;
  }
  const double u = std::ldexp(1.0, -24), du = double(d) * u, inflate = 1 + 1e-5;
  const double qnorm = std::sqrt(kSquareSlack * qn), qerr = std::sqrt(kSquareSlack * err);
  const double qhn = std::sqrt(kSquareSlack * qhat);
  // T_l = a |c_l - ĉ_l| + b |ĉ_l| + c |c_l| + e |half_l|, in float: inflated past its own rounding
  const float a = float(qnorm * inflate), b = float((qerr + 4 * u * qhn) * inflate);
  const float c = float((du / (1 - du) + 2 * u) * qnorm * inflate), e = float(2 * u * inflate);
  dots.resize(stride);
  lo.resize(nlist), hi.resize(nlist);
  if (isa == Isa::kVnni)  // any x86 build: the VNNI functions carry their own target
    block_dots_vnni(words, nlist, groups, q8.data(), qsum, dots.data());
  else
    block_dots_avx2(words, nlist, groups, q8.data(), qsum, dots.data());
  if (hp)
    key_bounds<true>(dots.data(), qs, per, stride, hp, nlist, a, b, c, e, lo.data(), hi.data());
  else
    key_bounds<false>(dots.data(), qs, per, stride, hp, nlist, a, b, c, e, lo.data(), hi.data());
  heap.clear();
  float floor_ = kNegInf;
  push_scores(lo.data(), nlist, 0, p, heap, floor_);  // the p-th best lower bound
  cand.clear();
  for (int64_t l = 0; l < nlist; ++l)
    if (hi[l] >= floor_) cand.push_back(static_cast<int32_t>(l));
  exact.resize(cand.size());
  // The AVX2 path gathers 8 lists even where AVX-512 exists, so forcing it tests what an AVX2 CPU runs
  if (isa == Isa::kVnni)
    probe_dots_of_avx512(qb, ct, d, nlist, cand.data(), (int64_t)cand.size(), exact.data());
  else
    probe_dots_of_avx2(qb, ct, d, nlist, cand.data(), (int64_t)cand.size(), exact.data());
  heap.clear();
  float worst = kNegInf;
  for (size_t i = 0; i < cand.size(); ++i)
    push_one<BetterFirst>(hp ? exact[i] - hp[cand[i]] : exact[i], cand[i], p, heap, worst);
  return true;  // exact[i]: the exact q·c of list cand[i] (ascending)
}
#endif

// The probe's inputs: queries ``q [B, D]`` and transposed centroids ``centroids_t [D, L]``.
static void check_query_and_centroids(const at::Tensor& q, const at::Tensor& centroids_t) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
              "q must be a contiguous CPU float32 [B, D]");
  TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.size(0) == q.size(1) &&
              centroids_t.scalar_type() == at::kFloat && centroids_t.is_contiguous(),
              "centroids_t must be contiguous float32 [D, L] with the query's D");
}

// The lists each query probes: q [B, D], centroids_t [D, L] (the centroids transposed, float32) ->
// coarse [B, P] = q·c of each probed list and probes [B, P], best first by q·c, or by q·c - half[l]
// (half = ||c||^2 / 2: the nearest centroids by L2) when half is not empty; P <= L. The dots run
// over centroids_t [D, L] in blocks of lists (vector-wide, no horizontal sums: probe_dots),
// and the same heap as topk_rows picks and orders the lists: one call instead of a matmul and a
// top-k (for one query, each op's dispatch costs more than its work).

std::tuple<at::Tensor, at::Tensor> ivf_probe(const at::Tensor& q, const at::Tensor& centroids_t,
                                             const at::Tensor& half, int64_t p, const ProbeTable& table) {
  check_query_and_centroids(q, centroids_t);
  const int64_t b_count = q.size(0), d = q.size(1), nlist = centroids_t.size(1);
  TORCH_CHECK(p >= 1 && p <= nlist, "nprobe must be in [1, nlist]");
  const bool by_l2 = half.numel() > 0;
  TORCH_CHECK(!by_l2 || (half.dim() == 1 && half.size(0) == nlist && half.scalar_type() == at::kFloat &&
                         half.is_contiguous()), "half norms must be float32 [L] (or empty)");
  auto coarse = at::empty({b_count, p}, q.options());
  auto probes = at::empty({b_count, p}, q.options().dtype(at::kLong));
  const float* qp = q.data_ptr<float>();
  const float* ct = centroids_t.data_ptr<float>();
  const float* hp = by_l2 ? half.data_ptr<float>() : nullptr;
  float* op = coarse.data_ptr<float>();
  int64_t* pp = probes.data_ptr<int64_t>();
  // The int8 table (probe_table of these centroids) on a CPU with AVX2 or VNNI: the same lists and bits
  const uint32_t* words = nullptr;
  const float* per = nullptr;
  const Isa isa = table.has_value() ? int8_isa() : Isa::kPortable;
#ifdef RECSERVE_X86
  if (isa != Isa::kPortable) {
    const auto& [w, pl, ok] = *table;
    const int64_t blocks = (nlist + 15) / 16, groups = (d + 3) / 4;
    TORCH_CHECK(w.scalar_type() == at::kInt && w.is_contiguous() && w.numel() == blocks * groups * 16 &&
                    pl.scalar_type() == at::kFloat && pl.is_contiguous() && pl.numel() == 4 * blocks * 16 &&
                    ok.scalar_type() == at::kBool && ok.numel() == 1,
                "table: not probe_table(centroids_t) of these centroids");
    if (ok.data_ptr<bool>()[0]) {
      words = reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
      per = pl.data_ptr<float>();
    }
  }
#endif
  at::parallel_for(0, b_count, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> ip(words ? 0 : nlist), key(by_l2 ? nlist : 0), hi, exact;
    std::vector<Cand> heap;
    std::vector<int8_t> q8;
    std::vector<int32_t> dots, cand;
    heap.reserve(p);
    for (int64_t b = b0; b < b1; ++b) {
      const float* qb = qp + b * d;
#ifdef RECSERVE_X86
      if (words && probe_one_int8(isa, qb, d, ct, nlist, hp, words, per, p, heap, q8, dots, key, hi, cand, exact)) {
        std::sort_heap(heap.begin(), heap.end(), BetterFirst());
        for (int64_t j = 0; j < p; ++j) {
          const bool have = j < (int64_t)heap.size();
          const int64_t l = have ? heap[j].second : -1;
          pp[b * p + j] = l;
          op[b * p + j] = have ? exact[std::lower_bound(cand.begin(), cand.end(), int32_t(l)) - cand.begin()] : kNegInf;
        }
        continue;
      }
#endif
      ip.resize(nlist);
      probe_dots(qb, ct, d, nlist, ip.data());
      if (by_l2)
        for (int64_t l = 0; l < nlist; ++l) key[l] = ip[l] - hp[l];
      heap.clear();
      float worst = kNegInf;
      push_scores<BetterFirst>(by_l2 ? key.data() : ip.data(), nlist, 0, p, heap, worst);
      std::sort_heap(heap.begin(), heap.end(), BetterFirst());  // equal keys: the lower list first
      for (int64_t j = 0; j < p; ++j) {
        const bool have = j < (int64_t)heap.size();  // fewer only for -inf or NaN keys
        pp[b * p + j] = have ? heap[j].second : -1;
        op[b * p + j] = have ? ip[heap[j].second] : kNegInf;
      }
    }
  });
  return {coarse, probes};
}

// q [B, D] · every centroid -> [B, L] f32, by probe_dots over centroids_t [D, L] (what ivf_probe
// ranks lists by: the same bits). A few queries run on the calling thread: a matmul of one query
// against the centroids woke a second thread, which then spun through the rest of the search.
at::Tensor centroid_dots(const at::Tensor& q, const at::Tensor& centroids_t) {
  check_query_and_centroids(q, centroids_t);
  const int64_t b_count = q.size(0), d = q.size(1), nlist = centroids_t.size(1);
  auto out = at::empty({b_count, nlist}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* ct = centroids_t.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b_count, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) probe_dots(qp + b * d, ct, d, nlist, op + b * nlist);
  });
  return out;
}

}  // namespace ivf
