// IVF list scan over quantized residual codes, with the eligibility filter applied inside the scan.
//
// Score of item i (in list l, probed by query b at probe slot p):
//     coarse[b, p] + scale[i] * qscale[b] * <q[b], code[i]>     (codes hold residuals to l's centroid)
// Items that fail the request's filter get no score and never take a top-r slot.
//
// The batch is scanned list-major: (query, list) pairs are grouped by list so that a list's codes
// are read from memory once per batch and reused, from cache, by every query that probes it
// (a query-major scan, as in faiss, reads them once per query). Phase 1 writes every pair's scores
// into a buffer (parallel over lists); phase 2 selects each query's best r from its pairs' scores
// with a bounded min-heap (parallel over queries). Large batches are cut into chunks so that the
// buffer stays bounded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RECSERVE_VNNI 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxBufferFloats = int64_t(1) << 25;  // 128 MiB of pair scores per chunk

using Cand = std::pair<float, int64_t>;  // (score, position in list-sorted order)
struct MinFirst {
  bool operator()(const Cand& a, const Cand& b) const { return a.first > b.first; }
};

// <q, c> for int8 vectors. The VNNI path multiplies unsigned by signed bytes, so the code is flipped
// to offset binary (c + 128, one xor) and the excess 128 * sum(q) is subtracted by the caller.
inline int32_t dot_i8_generic(const int8_t* __restrict q, const int8_t* __restrict c, int64_t d) {
  int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < d; ++j) acc += int32_t(q[j]) * int32_t(c[j]);
  return acc;
}

struct QueryI8 {
  const int8_t* q;
  int32_t qsum;  // sum of q's components, for the offset-binary correction
};

inline int32_t dot_i8(const QueryI8& qq, const int8_t* __restrict c, int64_t d) {
#ifdef RECSERVE_VNNI
  if (d % 64 == 0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i acc = _mm512_setzero_si512();
    for (int64_t j = 0; j < d; j += 64) {
      const __m512i cu = _mm512_xor_si512(_mm512_loadu_si512(c + j), flip);
      acc = _mm512_dpbusd_epi32(acc, cu, _mm512_loadu_si512(qq.q + j));
    }
    return _mm512_reduce_add_epi32(acc) - 128 * qq.qsum;
  }
#endif
  return dot_i8_generic(qq.q, c, d);
}

inline float dot_f8(const float* __restrict q, const uint8_t* __restrict c, const float* lut, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < d; ++j) acc += q[j] * lut[c[j]];
  return acc;
}

// An item passes when every clause holds: clause c holds when (sig & mask_c) != 0, negated if neg_c.
inline bool passes(const int64_t* sig, const int64_t* mask, const bool* neg, int64_t c_count, int64_t w) {
  for (int64_t c = 0; c < c_count; ++c) {
    bool hit = false;
    for (int64_t k = 0; k < w; ++k) hit |= (sig[k] & mask[c * w + k]) != 0;
    if (hit == neg[c]) return false;
  }
  return true;
}

struct Index {
  const float* scales; const int64_t* offsets; int64_t nlist;
  const int64_t* sig; int64_t w;
};
struct Batch {  // one chunk of queries [b0, b1)
  int64_t b0, b1, p;
  const int64_t* probes; const float* coarse;
  const int64_t* fmask; const bool* fneg; int64_t c_count;
};

// Pairs of the chunk grouped by list: pairs_of_list[pair_start[l] .. pair_start[l+1]) = (b, p) flat ids.
// buf_off[(b - b0) * P + p] = where the pair's scores start in the score buffer (-1: no pair).
struct Plan {
  std::vector<int64_t> pair_start, pairs, buf_off;
  std::vector<int64_t> active;  // lists probed by at least one query of the chunk
  int64_t buf_size = 0;
};

Plan plan_chunk(const Index& ix, const Batch& bt) {
  Plan pl;
  const int64_t nb = bt.b1 - bt.b0;
  pl.pair_start.assign(ix.nlist + 1, 0);
  for (int64_t b = bt.b0; b < bt.b1; ++b)
    for (int64_t p = 0; p < bt.p; ++p) {
      const int64_t l = bt.probes[b * bt.p + p];
      if (l >= 0) ++pl.pair_start[l + 1];
    }
  for (int64_t l = 0; l < ix.nlist; ++l) pl.pair_start[l + 1] += pl.pair_start[l];
  pl.pairs.resize(pl.pair_start[ix.nlist]);
  std::vector<int64_t> fill(pl.pair_start.begin(), pl.pair_start.end() - 1);
  for (int64_t b = bt.b0; b < bt.b1; ++b)
    for (int64_t p = 0; p < bt.p; ++p) {
      const int64_t l = bt.probes[b * bt.p + p];
      if (l >= 0) pl.pairs[fill[l]++] = (b - bt.b0) * bt.p + p;
    }
  pl.buf_off.assign(nb * bt.p, -1);
  int64_t off = 0;
  for (int64_t l = 0; l < ix.nlist; ++l) {
    if (pl.pair_start[l + 1] > pl.pair_start[l]) pl.active.push_back(l);
    const int64_t n = ix.offsets[l + 1] - ix.offsets[l];
    for (int64_t k = pl.pair_start[l]; k < pl.pair_start[l + 1]; ++k) {
      pl.buf_off[pl.pairs[k]] = off;
      off += n;
    }
  }
  pl.buf_size = off;
  return pl;
}

// Phase 1: every pair's scores, list by list. A scorer writes `base + scaled dot` for a list's items
// (`prepare` lets it re-lay out the list once for all the queries that probe it); the filter then
// blanks the items a query may not see.
template <typename MakeScorer>
void score_pairs(const Index& ix, const Batch& bt, const Plan& pl, float* buf, MakeScorer make_scorer) {
  // Small batches (a few probed lists) run on the calling thread: a thread team costs more.
  at::parallel_for(0, (int64_t)pl.active.size(), 16, [&](int64_t a0, int64_t a1) {
    auto scorer = make_scorer();
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t l = pl.active[a];
      const int64_t i0 = ix.offsets[l], i1 = ix.offsets[l + 1];
      const int64_t nq = pl.pair_start[l + 1] - pl.pair_start[l];
      if (nq == 0 || i1 == i0) continue;
      scorer.prepare(i0, i1, nq);
      for (int64_t k = pl.pair_start[l]; k < pl.pair_start[l + 1]; ++k) {
        const int64_t bp = pl.pairs[k], b = bt.b0 + bp / bt.p;
        float* out = buf + pl.buf_off[bp];
        scorer.score(b, i0, i1, bt.coarse[b * bt.p + bp % bt.p], out);
        if (bt.c_count == 0) continue;
        const int64_t* fm = bt.fmask + b * bt.c_count * ix.w;
        const bool* fn = bt.fneg + b * bt.c_count;
        for (int64_t i = i0; i < i1; ++i)
          if (!passes(ix.sig + i * ix.w, fm, fn, bt.c_count, ix.w)) out[i - i0] = kNegInf;
      }
    }
  });
}

// Int8 scorer. With VNNI and at least two queries on a list, the list is first transposed into
// blocks of 16 items x 4 bytes (codes flipped to offset binary), so that one dpbusd with a
// broadcast group of 4 query bytes advances 16 items at once and no horizontal sum is needed.
struct Int8Scorer {
  const int8_t* codes; const float* scales; int64_t d;
  const int8_t* q; const float* qscale; const int32_t* qsum;
  std::vector<uint32_t> tbuf;
  bool transposed = false;

  void prepare(int64_t i0, int64_t i1, int64_t nq) {
    transposed = false;
#ifdef RECSERVE_VNNI
    if (nq < 2 || d % 4 != 0) return;
    transposed = true;
    const int64_t n = i1 - i0, groups = d / 4;
    tbuf.assign(((n + 15) / 16) * groups * 16, 0x80808080u);  // padding items decode to 0
    for (int64_t i = 0; i < n; ++i) {
      uint32_t* dst = tbuf.data() + (i / 16) * groups * 16 + (i % 16);
      const int8_t* src = codes + (i0 + i) * d;
      for (int64_t g = 0; g < groups; ++g) {
        uint32_t word;
        std::memcpy(&word, src + 4 * g, 4);
        dst[g * 16] = word ^ 0x80808080u;
      }
    }
#else
    (void)i0; (void)i1; (void)nq;
#endif
  }

  void score(int64_t b, int64_t i0, int64_t i1, float base, float* out) const {
    const int64_t n = i1 - i0;
    const int8_t* qb = q + b * d;
#ifdef RECSERVE_VNNI
    if (transposed) {
      const int64_t groups = d / 4;
      const __m512i corr = _mm512_set1_epi32(128 * qsum[b]);
      const __m512 vbase = _mm512_set1_ps(base), vqs = _mm512_set1_ps(qscale[b]);
      for (int64_t start = 0; start < n; start += 16) {
        const uint32_t* blk = tbuf.data() + (start / 16) * groups * 16;
        __m512i acc = _mm512_setzero_si512();
        for (int64_t g = 0; g < groups; ++g) {
          int32_t qw;
          std::memcpy(&qw, qb + 4 * g, 4);
          acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(blk + g * 16), _mm512_set1_epi32(qw));
        }
        const int64_t cnt = std::min<int64_t>(16, n - start);
        const __mmask16 m = static_cast<__mmask16>((1u << cnt) - 1u);
        const __m512 sc = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scales + i0 + start), vqs);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, corr));
        _mm512_mask_storeu_ps(out + start, m, _mm512_fmadd_ps(dot, sc, vbase));
      }
      return;
    }
#endif
    const QueryI8 qq{qb, qsum[b]};
    for (int64_t i = i0; i < i1; ++i) out[i - i0] = base + scales[i] * qscale[b] * float(dot_i8(qq, codes + i * d, d));
  }
};

struct Fp8Scorer {
  const uint8_t* codes; const float* scales; int64_t d;
  const float* q; const float* lut;
  void prepare(int64_t, int64_t, int64_t) {}
  void score(int64_t b, int64_t i0, int64_t i1, float base, float* out) const {
    for (int64_t i = i0; i < i1; ++i) out[i - i0] = base + scales[i] * dot_f8(q + b * d, codes + i * d, lut, d);
  }
};

// Pushes s[0..n) into a bounded min-heap of the best r (positions pos0 + i). Entries not above the
// current worst are skipped 16 at a time where AVX-512 is available; -inf never enters.
inline void push_scores(const float* s, int64_t n, int64_t pos0, int64_t r, std::vector<Cand>& heap, float& worst) {
  auto push = [&](float v, int64_t i) {
    if (v <= worst) return;
    if ((int64_t)heap.size() < r) {
      heap.emplace_back(v, pos0 + i);
      std::push_heap(heap.begin(), heap.end(), MinFirst());
      if ((int64_t)heap.size() == r) worst = heap.front().first;
    } else {
      std::pop_heap(heap.begin(), heap.end(), MinFirst());
      heap.back() = Cand(v, pos0 + i);
      std::push_heap(heap.begin(), heap.end(), MinFirst());
      worst = heap.front().first;
    }
  };
  int64_t i = 0;
#ifdef RECSERVE_VNNI
  for (; i + 16 <= n; i += 16) {
    __mmask16 gt = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), _mm512_set1_ps(worst), _CMP_GT_OQ);
    while (gt) {
      const int j = __builtin_ctz(gt);
      gt &= gt - 1;
      push(s[i + j], i + j);
    }
  }
#endif
  for (; i < n; ++i) push(s[i], i);
}

// Phase 2: each query's best r over its pairs' scores.
void select_top(const Index& ix, const Batch& bt, const Plan& pl, const float* buf, int64_t r,
                int64_t* out_pos, float* out_score) {
  at::parallel_for(bt.b0, bt.b1, 1, [&](int64_t q0, int64_t q1) {
    std::vector<Cand> heap;
    heap.reserve(std::min<int64_t>(r, 1 << 16));
    for (int64_t b = q0; b < q1; ++b) {
      heap.clear();
      float worst = kNegInf;
      for (int64_t p = 0; p < bt.p; ++p) {
        const int64_t off = pl.buf_off[(b - bt.b0) * bt.p + p];
        if (off < 0) continue;
        const int64_t l = bt.probes[b * bt.p + p], i0 = ix.offsets[l];
        push_scores(buf + off, ix.offsets[l + 1] - i0, i0, r, heap, worst);
      }
      std::sort_heap(heap.begin(), heap.end(), MinFirst());  // best first
      for (int64_t k = 0; k < r; ++k) {
        const bool have = k < (int64_t)heap.size();
        out_pos[b * r + k] = have ? heap[k].second : -1;
        out_score[b * r + k] = have ? heap[k].first : kNegInf;
      }
    }
  });
}

// Score buffer reused across calls (uninitialized: every slot read is written first).
float* scratch(int64_t floats) {
  static thread_local std::unique_ptr<float[]> buf;
  static thread_local int64_t cap = 0;
  if (floats > cap) {
    cap = std::max<int64_t>(floats, cap * 2);
    buf.reset(new float[cap]);
  }
  return buf.get();
}

// Cuts the batch into chunks whose score buffer stays bounded, then plans, scores and selects.
template <typename MakeScorer>
void scan(const Index& ix, Batch bt_all, int64_t r, int64_t* out_pos, float* out_score, MakeScorer make_scorer) {
  int64_t max_list = 1;
  for (int64_t l = 0; l < ix.nlist; ++l) max_list = std::max(max_list, ix.offsets[l + 1] - ix.offsets[l]);
  const int64_t per_query = std::max<int64_t>(1, bt_all.p * max_list);
  const int64_t chunk = std::max<int64_t>(1, kMaxBufferFloats / per_query);
  for (int64_t b0 = bt_all.b0; b0 < bt_all.b1; b0 += chunk) {
    Batch bt = bt_all;
    bt.b0 = b0;
    bt.b1 = std::min(bt_all.b1, b0 + chunk);
    const Plan pl = plan_chunk(ix, bt);
    float* buf = scratch(pl.buf_size);
    score_pairs(ix, bt, pl, buf, make_scorer);
    select_top(ix, bt, pl, buf, r, out_pos, out_score);
  }
}

struct Checked {
  Index ix;
  Batch bt;
  at::Tensor out_pos, out_score;
};

Checked check(int64_t b_count, int64_t n, const at::Tensor& probes, const at::Tensor& coarse,
              const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
              const at::Tensor& fmask, const at::Tensor& fneg, int64_t r) {
  TORCH_CHECK(r >= 1, "r must be >= 1");
  TORCH_CHECK(probes.dim() == 2 && probes.size(0) == b_count && probes.scalar_type() == at::kLong, "probes must be int64 [B, P]");
  TORCH_CHECK(coarse.sizes() == probes.sizes() && coarse.scalar_type() == at::kFloat, "coarse must be float32 [B, P]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.scalar_type() == at::kFloat, "scales must be float32 [N]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) >= 2 && offsets.scalar_type() == at::kLong, "offsets must be int64 [nlist + 1]");
  TORCH_CHECK(sig.dim() == 2 && sig.size(0) == n && sig.scalar_type() == at::kLong, "sig must be int64 [N, W]");
  TORCH_CHECK(fmask.dim() == 3 && fmask.size(0) == b_count && fmask.size(2) == sig.size(1) && fmask.scalar_type() == at::kLong,
              "filter masks must be int64 [B, C, W]");
  TORCH_CHECK(fneg.dim() == 2 && fneg.size(0) == b_count && fneg.size(1) == fmask.size(1) && fneg.scalar_type() == at::kBool,
              "filter negations must be bool [B, C]");
  for (const at::Tensor* t : {&probes, &coarse, &scales, &offsets, &sig, &fmask, &fneg})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "ivf_scan inputs must be contiguous CPU tensors");
  const int64_t nlist = offsets.size(0) - 1;
  TORCH_CHECK(offsets[nlist].item<int64_t>() == n, "offsets[-1] must equal N");
  TORCH_CHECK(probes.numel() == 0 || probes.max().item<int64_t>() < nlist, "probe ids must be < nlist");
  Checked c{Index{scales.data_ptr<float>(), offsets.data_ptr<int64_t>(), nlist, sig.data_ptr<int64_t>(), sig.size(1)},
            Batch{0, b_count, probes.size(1), probes.data_ptr<int64_t>(), coarse.data_ptr<float>(),
                  fmask.data_ptr<int64_t>(), fneg.data_ptr<bool>(), fmask.size(1)},
            at::empty({b_count, r}, probes.options()), at::empty({b_count, r}, coarse.options())};
  return c;
}

}  // namespace

// q: float32 [B, D], quantized here to int8 with a per-query scale (absmax / 127, round half to
// even: the same arithmetic as retrieval.index.codes.quantize_int8); codes: int8 [N, D], list-sorted.
std::tuple<at::Tensor, at::Tensor> ivf_scan_int8(
    const at::Tensor& q, const at::Tensor& probes, const at::Tensor& coarse, const at::Tensor& codes,
    const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig, const at::Tensor& fmask,
    const at::Tensor& fneg, int64_t r) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) == q.size(1) && codes.is_contiguous(),
              "codes must be contiguous int8 [N, D] with the query's D");
  const int64_t b_count = q.size(0), d = q.size(1);
  auto c = check(b_count, codes.size(0), probes, coarse, scales, offsets, sig, fmask, fneg, r);
  std::vector<int8_t> q8(b_count * d);
  std::vector<float> qs(b_count);
  std::vector<int32_t> qsum(b_count, 0);
  const float* qf = q.data_ptr<float>();
  for (int64_t b = 0; b < b_count; ++b) {
    float amax = 0.f;
    for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(qf[b * d + j]));
    qs[b] = amax / 127.0f;
    const float safe = qs[b] > 0.f ? qs[b] : 1.f;
    for (int64_t j = 0; j < d; ++j) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(qf[b * d + j] / safe)));
      q8[b * d + j] = static_cast<int8_t>(v);
      qsum[b] += static_cast<int32_t>(v);
    }
  }
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sc = c.ix.scales;
  scan(c.ix, c.bt, r, c.out_pos.data_ptr<int64_t>(), c.out_score.data_ptr<float>(),
       [&] { return Int8Scorer{cp, sc, d, q8.data(), qs.data(), qsum.data(), {}, false}; });
  return {c.out_pos, c.out_score};
}

// Which items pass one request's filter: sig [N, W], fmask [C, W], fneg [C] -> bool [N].
at::Tensor filter_mask(const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg) {
  TORCH_CHECK(sig.dim() == 2 && sig.scalar_type() == at::kLong && sig.is_contiguous(), "sig must be contiguous int64 [N, W]");
  TORCH_CHECK(fmask.dim() == 2 && fmask.size(1) == sig.size(1) && fmask.scalar_type() == at::kLong && fmask.is_contiguous(),
              "fmask must be contiguous int64 [C, W]");
  TORCH_CHECK(fneg.dim() == 1 && fneg.size(0) == fmask.size(0) && fneg.scalar_type() == at::kBool && fneg.is_contiguous(),
              "fneg must be bool [C]");
  const int64_t n = sig.size(0), w = sig.size(1), c_count = fmask.size(0);
  auto out = at::empty({n}, sig.options().dtype(at::kBool));
  const int64_t* sp = sig.data_ptr<int64_t>();
  const int64_t* mp = fmask.data_ptr<int64_t>();
  const bool* np = fneg.data_ptr<bool>();
  bool* op = out.data_ptr<bool>();
  at::parallel_for(0, n, 1 << 14, [&](int64_t i0, int64_t i1) {
    if (w == 1) {  // one signature word (up to 64 attribute values): branch-free, vectorizes
      for (int64_t i = i0; i < i1; ++i) {
        bool ok = true;
        for (int64_t c = 0; c < c_count; ++c) ok &= ((sp[i] & mp[c]) != 0) != np[c];
        op[i] = ok;
      }
      return;
    }
    for (int64_t i = i0; i < i1; ++i) op[i] = passes(sp + i * w, mp, np, c_count, w);
  });
  return out;
}

// q: float32 [B, D]; codes: float8_e4m3fn [N, D] passed as its uint8 bytes, decoded by lut [256].
std::tuple<at::Tensor, at::Tensor> ivf_scan_fp8(
    const at::Tensor& q, const at::Tensor& codes_u8, const at::Tensor& lut, const at::Tensor& probes,
    const at::Tensor& coarse, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
    const at::Tensor& fmask, const at::Tensor& fneg, int64_t r) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  TORCH_CHECK(codes_u8.dim() == 2 && codes_u8.scalar_type() == at::kByte && codes_u8.size(1) == q.size(1) && codes_u8.is_contiguous(),
              "codes must be contiguous uint8 [N, D] (fp8 bytes) with the query's D");
  TORCH_CHECK(lut.numel() == 256 && lut.scalar_type() == at::kFloat && lut.is_contiguous(), "lut must be float32 [256]");
  const int64_t b_count = q.size(0), d = q.size(1);
  auto c = check(b_count, codes_u8.size(0), probes, coarse, scales, offsets, sig, fmask, fneg, r);
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = codes_u8.data_ptr<uint8_t>();
  const float* lp = lut.data_ptr<float>();
  const float* sc = c.ix.scales;
  scan(c.ix, c.bt, r, c.out_pos.data_ptr<int64_t>(), c.out_score.data_ptr<float>(),
       [&] { return Fp8Scorer{cp, sc, d, qp, lp}; });
  return {c.out_pos, c.out_score};
}

// Best k of every row of x [B, M] (float32) -> values [B, k] best first, indices [B, k] (-1 pads).
// The same bounded heap as the scan: far cheaper than a full sort when k << M.
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous CPU float32 [B, M]");
  TORCH_CHECK(k >= 1, "k must be >= 1");
  const int64_t b_count = x.size(0), m = x.size(1);
  auto values = at::empty({b_count, k}, x.options());
  auto indices = at::empty({b_count, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, b_count, 16, [&](int64_t b0, int64_t b1) {
    std::vector<Cand> heap;
    heap.reserve(std::min(k, m));
    for (int64_t b = b0; b < b1; ++b) {
      heap.clear();
      float worst = kNegInf;
      push_scores(xp + b * m, m, 0, k, heap, worst);
      std::sort_heap(heap.begin(), heap.end(), MinFirst());
      for (int64_t j = 0; j < k; ++j) {
        const bool have = j < (int64_t)heap.size();
        vp[b * k + j] = have ? heap[j].first : kNegInf;
        ip[b * k + j] = have ? heap[j].second : -1;
      }
    }
  });
  return {values, indices};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch only tensors: other Python threads (a server's gRPC threads) run meanwhile.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("topk_rows", &topk_rows, "Best k per row with a bounded heap", nogil);
  m.def("filter_mask", &filter_mask, "Items passing one filter", nogil);
  m.def("ivf_scan_int8", &ivf_scan_int8, "List-major IVF scan over int8 residual codes with in-scan filter", nogil);
  m.def("ivf_scan_fp8", &ivf_scan_fp8, "List-major IVF scan over fp8 e4m3 residual codes with in-scan filter", nogil);
}
