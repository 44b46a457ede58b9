// The exact search's parts: which rows pass a filter (filter_mask; eligible_rows through the
// postings bit_index builds), their scores off the int8 codes (score_rows_int8 for a few
// queries, many_rows_int8 for many), and a selective filter's exact search in one call.

#include <algorithm>

#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include "ivf_scan.h"

namespace ivf {

namespace {

// Float query against int8 codes (the exact plan's scores, no quantized query). The portable loop
// follows the AVX2 path's order exactly (16 lanes of fused multiply-adds, the same pairwise sums,
// the same scalar tail), so the two return the same bits, as the int8 scan's paths do.
inline float dot_f32_i8_portable(const float* __restrict q, const int8_t* __restrict c, int64_t d) {
  float a0[8] = {0.f}, a1[8] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= d; j += 16)
    for (int l = 0; l < 8; ++l) {
      a0[l] = std::fma(q[j + l], float(c[j + l]), a0[l]);
      a1[l] = std::fma(q[j + 8 + l], float(c[j + 8 + l]), a1[l]);
    }
  if (j + 8 <= d) {
    for (int l = 0; l < 8; ++l) a0[l] = std::fma(q[j + l], float(c[j + l]), a0[l]);
    j += 8;
  }
  float a[8], s4[4];
  for (int l = 0; l < 8; ++l) a[l] = a0[l] + a1[l];
  for (int l = 0; l < 4; ++l) s4[l] = a[l] + a[l + 4];
  float sum = (s4[0] + s4[2]) + (s4[1] + s4[3]);
  for (; j < d; ++j) sum = std::fma(q[j], float(c[j]), sum);
  return sum;
}

#ifdef RECSERVE_X86
RECSERVE_TARGET("avx2,fma") inline float dot_f32_i8_avx2(const float* q, const int8_t* c, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), lo, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), hi, a1);
  }
  if (j + 8 <= d) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), a0);
    j += 8;
  }
  const __m256 a = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float sum = _mm_cvtss_f32(s);
  for (; j < d; ++j) sum = std::fma(q[j], float(c[j]), sum);
  return sum;
}
#endif

}  // namespace

// The inverted index over filter bits: sig [N, W] int64 -> counts [W*64] int64 (items setting each
// bit) and postings [nnz] int32 (the items of bit 0, then bit 1, ..., each ascending). Two passes
// over the words: count, then place (a counting sort by bit).
std::tuple<at::Tensor, at::Tensor> bit_index(const at::Tensor& sig) {
  TORCH_CHECK(sig.dim() == 2 && sig.scalar_type() == at::kLong && sig.is_contiguous() && sig.device().is_cpu(),
              "sig must be contiguous CPU int64 [N, W]");
  const int64_t n = sig.size(0), w = sig.size(1), bits = w * 64;
  TORCH_CHECK(n < (int64_t(1) << 31), "postings hold int32 positions: at most 2**31 - 1 items");
  const uint64_t* sp = reinterpret_cast<const uint64_t*>(sig.data_ptr<int64_t>());
  auto counts = at::zeros({bits}, sig.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < n * w; ++i)
    for (uint64_t word = sp[i]; word; word &= word - 1) ++cp[(i % w) * 64 + __builtin_ctzll(word)];
  std::vector<int64_t> next(bits + 1, 0);
  for (int64_t b = 0; b < bits; ++b) next[b + 1] = next[b] + cp[b];
  auto postings = at::empty({next[bits]}, sig.options().dtype(at::kInt));
  int32_t* pp = postings.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < w; ++j)
      for (uint64_t word = sp[i * w + j]; word; word &= word - 1) pp[next[j * 64 + __builtin_ctzll(word)]++] = int32_t(i);
  return {counts, postings};
}

// The checks shared by the calls that read chosen rows of the int8 codes: pos [M] int64 rows in
// range, codes [N, D] int8, scales [N] bf16, offsets [L + 1] int64, all contiguous.
void check_rows_of_codes(const at::Tensor& pos, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes must be contiguous int8 [N, D]");
  TORCH_CHECK(pos.dim() == 1 && pos.scalar_type() == at::kLong && pos.is_contiguous(), "pos must be contiguous int64 [M]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == codes.size(0) && scales.scalar_type() == at::kBFloat16 &&
              scales.is_contiguous(), "scales must be contiguous bfloat16 [N]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) >= 2 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              "offsets must be contiguous int64 [L + 1]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t n = codes.size(0);
  for (int64_t i = 0; i < pos.numel(); ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < n, "pos out of range at ", i);
}

// Exact-plan scores of chosen rows, read off the int8 codes without decoding them: q [B, D] f32,
// pos [M] int64 (list-sorted rows), coarse [B, L] = q·centroids -> [B, M] f32,
//     score[b, m] = (q[b] · code[pos[m]]) * scale[pos[m]] + coarse[b, list of pos[m]]
// (the float query against the codes, as IVFIndex.scores_at's torch ops compute it, with no
// [M, D] float copy of the gathered codes). Parallel over the rows.
at::Tensor score_rows_int8(const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes,
                           const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& coarse) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
  check_rows_of_codes(pos, codes, scales, offsets);
  TORCH_CHECK(codes.size(1) == q.size(1), "codes must have the query's D");
  const int64_t b_count = q.size(0), d = q.size(1), m = pos.numel(), nlist = offsets.size(0) - 1;
  TORCH_CHECK(coarse.dim() == 2 && coarse.size(0) == b_count && coarse.size(1) == nlist &&
              coarse.scalar_type() == at::kFloat && coarse.is_contiguous(), "coarse must be contiguous float32 [B, L]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  auto out = at::empty({b_count, m}, q.options());
  const float* qp = q.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const Scale* sp = scales.data_ptr<Scale>();
  const float* co = coarse.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef RECSERVE_X86
  const bool avx2 = int8_isa() != Isa::kPortable && __builtin_cpu_supports("fma");
#endif
  // a row and query are little work: a thread team (woken, then spinning after) pays off only
  // past a few thousand rows, and past ~2M multiply-adds a thread at narrow dimensions (on a
  // shared machine each wake-up may wait out a time slice: the journal, 2026-12-03)
  const int64_t grain = std::max<int64_t>(4096, (int64_t(1) << 21) / std::max<int64_t>(d, 1));
  at::parallel_for(0, m, std::max<int64_t>(1, grain / std::max<int64_t>(b_count, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = pp[i];
      const int64_t list = std::upper_bound(off, off + nlist + 1, row) - off - 1;
      const int8_t* c = cp + row * d;
      for (int64_t b = 0; b < b_count; ++b) {
        const float* qb = qp + b * d;
#ifdef RECSERVE_X86
        const float acc = avx2 ? dot_f32_i8_avx2(qb, c, d) : dot_f32_i8_portable(qb, c, d);
#else
        const float acc = dot_f32_i8_portable(qb, c, d);
#endif
        op[b * m + i] = acc * float(sp[row]) + co[b * nlist + list];
      }
    }
  });
  return out;
}

// Many queries' scores of chosen rows (the exact plan's, B > a few), a block of queries at a time:
// q [B, D] f32, pos [M] (list-sorted rows), centroids_t [D, L] -> [B, M] f32. From kGemmRows rows
// and kGemmDims dimensions, as the list scan scores them, q·c[list] + scale * qscale[b] * dot, the
// query quantized as the scan quantizes it (quantize_queries), the dots from an int8 GEMM
// (at::_int_mm: faster than the float matmul of decoded rows it replaces, and no [M, D] float
// copy), q·c as the probe computes it (centroid_dots: a row's score does not depend on which rows
// share the call, so a chunked scan's and a whole one's agree); else the rows decoded once and a
// float matmul. many_rows_int8 and the exact search's one call score through it alike, so their
// bits agree, and the one call selects each block's best while its scores are still in cache.

// Below this many rows or dimensions, the int8 GEMM's other costs (the queries quantized, the
// lists' q·c, its epilogue over [B, M]) outweigh its faster dots: decoded rows and a float matmul
// cost less (the break-even, measured for few and many queries, lies below kGemmRows at the wide
// dimensions; at narrow ones the float path stays ahead longer).
constexpr int64_t kGemmRows = 1024, kGemmDims = 128;

namespace {

// Queries a block scores at most: each of a thread's blocks is one single-threaded GEMM (its team
// woken once for the whole call, not once per step: on a shared machine each wake-up may wait out
// a time slice), [32, M] scores stay in L2 for their selection, and 32 rows keep the GEMM near its
// full-matrix speed (fewer rows ran well below it).
constexpr int64_t kBlockQueries = 32;

class RowScores {
 public:
  RowScores(const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes, const at::Tensor& scales,
            const at::Tensor& offsets, const at::Tensor& centroids_t)
      : q_(q), b_count_(q.size(0)), m_(pos.numel()), nlist_(offsets.size(0) - 1) {
    TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, D]");
    check_rows_of_codes(pos, codes, scales, offsets);
    const int64_t d = q.size(1);
    TORCH_CHECK(codes.size(1) == d, "codes must have the query's D");
    TORCH_CHECK(centroids_t.dim() == 2 && centroids_t.size(0) == d && centroids_t.size(1) == nlist_ &&
                centroids_t.scalar_type() == at::kFloat, "centroids_t must be float32 [D, L]");
    gemm_ = m_ >= kGemmRows && d >= kGemmDims;
    // blocks of at most kBlockQueries, as many a thread as its neighbours' (none idles at the end)
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t blocks = threads * ((b_count_ + threads * kBlockQueries - 1) / (threads * kBlockQueries));
    block_ = std::max<int64_t>(1, (b_count_ + blocks - 1) / std::max<int64_t>(blocks, 1));
    if (b_count_ == 0 || m_ == 0) return;
    if (!gemm_) {
      rows_t_ = decode_rows_int8(pos, codes, scales, offsets, centroids_t).t();  // [D, M]
      return;
    }
    const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t* off = offsets.data_ptr<int64_t>();
    const Scale* sp = scales.data_ptr<Scale>();
    // runs of rows in one list (pos ascending: a run per list), and every row's scale as a float
    scale_.resize(m_);
    for (int64_t i = 0, prev = -1; i < m_; ++i) {
      const int64_t l = std::upper_bound(off, off + nlist_ + 1, pp[i]) - off - 1;
      if (l != prev) run_start_.push_back(i), run_list_.push_back(l), prev = l;
      scale_[i] = float(sp[pp[i]]);
    }
    run_start_.push_back(m_);
    coarse_ = centroid_dots(q, centroids_t);  // [B, L]
    q8_ = at::empty({b_count_, d}, codes.options());
    qs_.resize(b_count_);
    std::vector<int32_t> qsum(b_count_);
    quantize_queries(q.data_ptr<float>(), b_count_, d, q8_.data_ptr<int8_t>(), d, qs_.data(), qsum.data());
    rows_t_ = codes.index_select(0, pos).t();  // [D, M] int8
  }

  int64_t queries() const { return b_count_; }
  int64_t rows() const { return m_; }
  int64_t blocks() const { return (b_count_ + block_ - 1) / block_; }
  int64_t block_queries() const { return block_; }

  // Scores of block j's queries ([j * block, ...), at most block_queries()) into out [that many, M]
  // f32, row-major. Called from inside a parallel region: the GEMM runs on the calling thread.
  void score(int64_t j, float* out) const {
    const int64_t b0 = j * block_, nb = std::min(block_, b_count_ - b0);
    if (!gemm_) {
      at::Tensor o = at::from_blob(out, {nb, m_}, q_.options());
      at::mm_out(o, q_.narrow(0, b0, nb), rows_t_);
      return;
    }
    at::Tensor dots = at::from_blob(out, {nb, m_}, q_.options().dtype(at::kInt));
    at::_int_mm_out(dots, q8_.narrow(0, b0, nb), rows_t_);
    const float* cp = coarse_.data_ptr<float>();
    for (int64_t b = 0; b < nb; ++b) {  // the scores over the dots
      float* row = out + b * m_;
      const float* base = cp + (b0 + b) * nlist_;
      const float qscale = qs_[b0 + b];
      for (size_t r = 0; r + 1 < run_start_.size(); ++r) {
        const float c = base[run_list_[r]];
        for (int64_t i = run_start_[r]; i < run_start_[r + 1]; ++i) {
          int32_t dot;
          std::memcpy(&dot, row + i, 4);
          row[i] = c + scale_[i] * qscale * float(dot);
        }
      }
    }
  }

 private:
  const at::Tensor& q_;
  int64_t b_count_, m_, nlist_, block_ = 1;
  bool gemm_ = false;
  at::Tensor rows_t_, coarse_, q8_;  // the rows [D, M] (decoded f32, or the int8 codes)
  std::vector<float> qs_, scale_;
  std::vector<int64_t> run_start_, run_list_;
};

}  // namespace

// Many queries' scores of chosen rows (IVFIndex.scores_at past a few queries): q [B, D] f32,
// pos [M] -> [B, M] f32, by RowScores, its blocks in one parallel region.
at::Tensor many_rows_int8(const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes,
                          const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& centroids_t) {
  const RowScores scores(q, pos, codes, scales, offsets, centroids_t);
  auto out = at::empty({scores.queries(), scores.rows()}, q.options());
  if (out.numel() == 0) return out;
  float* op = out.data_ptr<float>();
  const int64_t stride = scores.block_queries() * scores.rows();
  at::parallel_for(0, scores.blocks(), 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) scores.score(j, op + j * stride);
  });
  return out;
}

// Which items pass one request's filter: sig [N, W], fmask [C, W], fneg [C], fnone [C, W] (empty:
// no clause has a "none of these bits" part) -> bool [N].
at::Tensor filter_mask(const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone) {
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
  const int64_t* gp = none_ptr(fnone, fmask);
  bool* op = out.data_ptr<bool>();
  at::parallel_for(0, n, 1 << 14, [&](int64_t i0, int64_t i1) {
    if (w == 1 && !gp) {  // one signature word (up to 64 attribute values): branch-free, vectorizes
      for (int64_t i = i0; i < i1; ++i) {
        bool ok = true;
        for (int64_t c = 0; c < c_count; ++c) ok &= ((sp[i] & mp[c]) != 0) != np[c];
        op[i] = ok;
      }
      return;
    }
    for (int64_t i = i0; i < i1; ++i) op[i] = passes(sp + i * w, mp, np, gp, c_count, w);
  });
  return out;
}

// The signatures bit-sliced: sig [N, W] int64 -> slices [W * 64, ceil(N / 64)] int64, word j of
// bit b holding bit b of items 64j .. 64j + 63 (item i at bit i % 64). A filter then reads only
// its clauses' bits, 64 items a word, instead of every item's whole signature.
at::Tensor bit_slices(const at::Tensor& sig) {
  TORCH_CHECK(sig.dim() == 2 && sig.scalar_type() == at::kLong && sig.is_contiguous() && sig.device().is_cpu(),
              "sig must be contiguous CPU int64 [N, W]");
  const int64_t n = sig.size(0), w = sig.size(1), words = (n + 63) / 64;
  auto out = at::zeros({w * 64, words}, sig.options());
  const uint64_t* sp = reinterpret_cast<const uint64_t*>(sig.data_ptr<int64_t>());
  uint64_t* op = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  // parallel over blocks of 64 items: each block writes its own word of every slice
  at::parallel_for(0, words, 256, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t i = j * 64; i < std::min(n, j * 64 + 64); ++i)
        for (int64_t k = 0; k < w; ++k)
          for (uint64_t word = sp[i * w + k]; word; word &= word - 1)
            op[(k * 64 + __builtin_ctzll(word)) * words + j] |= uint64_t(1) << (i % 64);
  });
  return out;
}

namespace {

// The words of items passing one filter, from the bit slices: clause c is the OR of its bits'
// slices (complemented when negated; ORed with the complement of its "none of" bits' OR where it
// has them), the filter the AND of its clauses, 64 items a word.
std::vector<uint64_t> sliced_words(const at::Tensor& slices, const at::Tensor& fmask, const at::Tensor& fneg,
                                   const at::Tensor& fnone, int64_t n) {
  TORCH_CHECK(slices.dim() == 2 && slices.scalar_type() == at::kLong && slices.is_contiguous() &&
              slices.size(0) % 64 == 0 && slices.size(1) == (n + 63) / 64,
              "slices must be contiguous int64 [W * 64, ceil(n / 64)]");
  const int64_t w = slices.size(0) / 64, words = slices.size(1), c_count = fmask.size(0);
  TORCH_CHECK(fmask.dim() == 2 && fmask.size(1) == w && fmask.scalar_type() == at::kLong && fmask.is_contiguous(),
              "fmask must be contiguous int64 [C, W]");
  TORCH_CHECK(fneg.dim() == 1 && fneg.size(0) == c_count && fneg.scalar_type() == at::kBool && fneg.is_contiguous(),
              "fneg must be bool [C]");
  const uint64_t* sl = reinterpret_cast<const uint64_t*>(slices.data_ptr<int64_t>());
  const uint64_t* mp = reinterpret_cast<const uint64_t*>(fmask.data_ptr<int64_t>());
  const bool* np = fneg.data_ptr<bool>();
  const uint64_t* gp = reinterpret_cast<const uint64_t*>(none_ptr(fnone, fmask));
  std::vector<std::vector<int64_t>> bits(c_count), nones(c_count);  // each clause's set bits, read once
  for (int64_t c = 0; c < c_count; ++c)
    for (int64_t k = 0; k < w; ++k) {
      for (uint64_t m = mp[c * w + k]; m; m &= m - 1) bits[c].push_back(k * 64 + __builtin_ctzll(m));
      for (uint64_t m = gp ? gp[c * w + k] : 0; m; m &= m - 1) nones[c].push_back(k * 64 + __builtin_ctzll(m));
    }
  std::vector<uint64_t> acc(words);
  at::parallel_for(0, words, 1 << 10, [&](int64_t j0, int64_t j1) {
    constexpr int64_t kBlock = 256;  // words kept in L1 while every clause is applied to them
    uint64_t any[kBlock], held[kBlock];
    for (int64_t b0 = j0; b0 < j1; b0 += kBlock) {
      const int64_t len = std::min(kBlock, j1 - b0);
      uint64_t* a = acc.data() + b0;
      for (int64_t j = 0; j < len; ++j) a[j] = ~uint64_t(0);
      for (int64_t c = 0; c < c_count; ++c) {
        for (int64_t j = 0; j < len; ++j) any[j] = 0;
        for (int64_t bit : bits[c]) {
          const uint64_t* s = sl + bit * words + b0;
          for (int64_t j = 0; j < len; ++j) any[j] |= s[j];
        }
        const uint64_t flip = np[c] ? ~uint64_t(0) : 0;
        for (int64_t j = 0; j < len; ++j) any[j] ^= flip;
        if (!nones[c].empty()) {  // "or none of these bits"
          for (int64_t j = 0; j < len; ++j) held[j] = 0;
          for (int64_t bit : nones[c]) {
            const uint64_t* s = sl + bit * words + b0;
            for (int64_t j = 0; j < len; ++j) held[j] |= s[j];
          }
          for (int64_t j = 0; j < len; ++j) any[j] |= ~held[j];
        }
        for (int64_t j = 0; j < len; ++j) a[j] &= any[j];
      }
    }
  });
  if (n % 64) acc.back() &= (uint64_t(1) << (n % 64)) - 1;  // past the last item: nothing
  return acc;
}

}  // namespace

// Items passing one filter from the bit slices (slices [W * 64, ceil(N / 64)], fmask [C, W], fneg
// [C], fnone [C, W] or empty) -> bool [n]. The same rule as filter_mask, reading only the filter's bits.
at::Tensor sliced_mask(const at::Tensor& slices, const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone,
                       int64_t n) {
  const std::vector<uint64_t> acc = sliced_words(slices, fmask, fneg, fnone, n);
  auto out = at::empty({n}, slices.options().dtype(at::kBool));
  bool* op = out.data_ptr<bool>();
  at::parallel_for(0, (int64_t)acc.size(), 1 << 12, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t i = 0, m = std::min<int64_t>(64, n - j * 64); i < m; ++i) op[j * 64 + i] = (acc[j] >> i) & 1;
  });
  return out;
}

// The same items as positions: int64 [M] ascending (no [n] mask in between).
at::Tensor sliced_rows(const at::Tensor& slices, const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone,
                       int64_t n) {
  const std::vector<uint64_t> acc = sliced_words(slices, fmask, fneg, fnone, n);
  int64_t m = 0;
  for (uint64_t a : acc) m += __builtin_popcountll(a);
  auto out = at::empty({m}, slices.options());
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t j = 0; j < (int64_t)acc.size(); ++j)
    for (uint64_t a = acc[j]; a; a &= a - 1) *op++ = j * 64 + __builtin_ctzll(a);
  return out;
}

// Rows passing one filter (sig [N, W], fmask [C, W], fneg [C], fnone [C, W] or empty) -> int64 [M]
// ascending. The most selective non-negated clause without a "none of" part drives: the postings of
// its bits (bit_counts [W * 64], postings: each bit's rows, bit after bit, ascending) are the only
// candidates, and only they are checked against every clause. A bit counted -1 has no postings (a
// hashed attribute's digit): a clause with one never drives. A hashed attribute's clauses on its
// bucket digits drive together instead, through its values' postings (value_layout [A, 4],
// value_offsets [S + 1], value_postings: values.cpp), when their buckets hold fewer items. With no
// driver under a quarter of the catalog (or no postings), every row is checked.
at::Tensor eligible_rows(const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone,
                         const at::Tensor& bit_counts, const at::Tensor& postings, const at::Tensor& value_layout,
                         const at::Tensor& value_offsets, const at::Tensor& value_postings) {
  TORCH_CHECK(sig.dim() == 2 && sig.scalar_type() == at::kLong && sig.is_contiguous(), "sig must be contiguous int64 [N, W]");
  TORCH_CHECK(fmask.dim() == 2 && fmask.size(1) == sig.size(1) && fmask.scalar_type() == at::kLong && fmask.is_contiguous(),
              "fmask must be contiguous int64 [C, W]");
  TORCH_CHECK(fneg.dim() == 1 && fneg.size(0) == fmask.size(0) && fneg.scalar_type() == at::kBool && fneg.is_contiguous(),
              "fneg must be bool [C]");
  const int64_t n = sig.size(0), w = sig.size(1), c_count = fmask.size(0), bits = w * 64;
  TORCH_CHECK(bit_counts.dim() == 1 && bit_counts.size(0) == bits && bit_counts.scalar_type() == at::kLong &&
              bit_counts.is_contiguous(), "bit_counts must be contiguous int64 [W * 64]");
  TORCH_CHECK(postings.dim() == 1 && postings.scalar_type() == at::kInt && postings.is_contiguous(),
              "postings must be contiguous int32 [nnz]");
  check_value_postings(value_layout, value_offsets, value_postings, w);
  const int64_t* counts = bit_counts.data_ptr<int64_t>();
  const int64_t* mp = fmask.data_ptr<int64_t>();
  const bool* np = fneg.data_ptr<bool>();
  const int64_t* gp = none_ptr(fnone, fmask);
  auto set = [&](int64_t c, int64_t bit) { return (mp[c * w + bit / 64] >> (bit % 64)) & 1; };
  int64_t best = -1, best_count = n / 4 + 1;
  int64_t nnz = 0;
  for (int64_t bit = 0; bit < bits; ++bit) nnz += std::max<int64_t>(counts[bit], 0);
  if (postings.numel() == nnz)
    for (int64_t c = 0; c < c_count; ++c) {
      // an item holding none of a clause's "none of" bits passes it whatever its postings say
      if (np[c] || (gp && std::any_of(gp + c * w, gp + (c + 1) * w, [](int64_t x) { return x != 0; }))) continue;
      int64_t count = 0;
      for (int64_t bit = 0; bit < bits && count < best_count; ++bit)
        if (set(c, bit)) count += counts[bit] < 0 ? best_count : counts[bit];
      if (count < best_count) best = c, best_count = count;
    }
  // the candidates: runs of postings, each ascending
  std::vector<std::pair<const int32_t*, const int32_t*>> runs;
  std::vector<int64_t> best_slots;
  const bool values_listed = value_offsets.numel() && value_offsets.data_ptr<int64_t>()[value_offsets.numel() - 1] ==
                                                          value_postings.numel();
  const int64_t by_value =
      values_listed ? best_value_slots(value_layout, value_offsets, mp, np, gp, c_count, w, best_slots) : -1;
  if (by_value >= 0 && by_value < best_count) best = c_count, best_count = by_value;
  if (best < 0) return filter_mask(sig, fmask, fneg, fnone).nonzero().flatten();
  if (best == c_count) {  // a hashed attribute's buckets
    const int64_t* vo = value_offsets.data_ptr<int64_t>();
    const int32_t* vp = value_postings.data_ptr<int32_t>();
    for (int64_t s : best_slots)
      if (vo[s + 1] > vo[s]) runs.emplace_back(vp + vo[s], vp + vo[s + 1]);
  } else {
    const int32_t* post = postings.data_ptr<int32_t>();
    int64_t start = 0;
    for (int64_t bit = 0; bit < bits; ++bit) {
      if (set(best, bit) && counts[bit] > 0) runs.emplace_back(post + start, post + start + counts[bit]);
      start += std::max<int64_t>(counts[bit], 0);
    }
  }
  const int64_t* sp = sig.data_ptr<int64_t>();
  // Several runs are merged through a bitmap of the catalog (an item of a multi-valued attribute
  // may sit under more than one bit), read back in order.
  std::vector<int64_t> rows;
  rows.reserve(best_count);
  if (runs.size() == 1) {
    rows.assign(runs[0].first, runs[0].second);
  } else if (runs.size() > 1) {
    std::vector<uint64_t> seen((n + 63) / 64, 0);
    for (const auto& [i0, i1] : runs)
      for (const int32_t* i = i0; i < i1; ++i) seen[*i / 64] |= uint64_t(1) << (*i % 64);
    for (int64_t word = 0; word < (int64_t)seen.size(); ++word)
      for (uint64_t m = seen[word]; m; m &= m - 1) rows.push_back(word * 64 + __builtin_ctzll(m));
  }
  // each candidate's signature checked (a row is a cache miss: the next ones are fetched meanwhile)
  const int64_t m = rows.size();
  int64_t kept = 0;
  for (int64_t i = 0; i < m; ++i) {
    if (i + 8 < m) __builtin_prefetch(sp + rows[i + 8] * w);
    if (passes(sp + rows[i] * w, mp, np, gp, c_count, w)) rows[kept++] = rows[i];
  }
  auto out = at::empty({kept}, sig.options());
  std::copy(rows.begin(), rows.begin() + kept, out.data_ptr<int64_t>());
  return out;
}

// A selective filter's exact search in one call: the rows passing one filter (eligible_rows),
// their scores off the codes as IVFIndex.scores_at computes them (up to `few` queries against the
// float queries, score_rows_int8; more, RowScores as many_rows_int8), the best k (row_topk, as
// exact.exact_topk picks them) and the rows' item ids ->
// (ids [B, k], scores [B, k]), -1 / -inf padded. The same answer as the planned path's exact scan.
// Undefined tensors where B x M would pass max_scores (the caller then scans in chunks). Many
// queries are scored, selected and mapped to ids a block at a time in one parallel region.

std::tuple<at::Tensor, at::Tensor> exact_search_ids_int8(
    const at::Tensor& q, const at::Tensor& centroids_t, const at::Tensor& codes, const at::Tensor& scales,
    const at::Tensor& offsets, const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg,
    const at::Tensor& fnone, const at::Tensor& bit_counts, const at::Tensor& postings, const at::Tensor& value_layout,
    const at::Tensor& value_offsets, const at::Tensor& value_postings, const at::Tensor& item_ids, int64_t k, int64_t few,
    int64_t max_scores) {
  TORCH_CHECK(k >= 1, "k must be >= 1");
  TORCH_CHECK(item_ids.dim() == 1 && item_ids.size(0) == codes.size(0) && item_ids.scalar_type() == at::kLong,
              "item_ids must be int64 [N]");
  const at::Tensor rows =
      eligible_rows(sig, fmask, fneg, fnone, bit_counts, postings, value_layout, value_offsets, value_postings);
  const int64_t b_count = q.size(0), m = rows.numel();
  if (b_count * m > max_scores) return {at::Tensor(), at::Tensor()};  // the caller scans in chunks
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* item = item_ids.data_ptr<int64_t>();
  if (b_count <= few || m == 0) {  // IVFIndex.scores_at's way for a few queries, so its bits
    const at::Tensor scores = score_rows_int8(q, rows, codes, scales, offsets, centroid_dots(q, centroids_t));
    auto [best, idx] = topk_rows(scores, k);  // pads -1 / -inf where fewer than k rows pass
    // the positions' item ids in place (six [B, k] tensor ops in its place cost more than the loop)
    int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < b_count * k; ++i) ip[i] = ip[i] >= 0 ? item[rp[ip[i]]] : -1;
    return {idx, best};
  }
  const RowScores scores(q, rows, codes, scales, offsets, centroids_t);
  auto best = at::empty({b_count, k}, q.options());
  auto ids = at::empty({b_count, k}, item_ids.options());
  float* vp = best.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t block = scores.block_queries();
  at::parallel_for(0, scores.blocks(), 1, [&](int64_t j0, int64_t j1) {
    static thread_local std::vector<float> buffer;  // a block's scores, kept for the next call
    if ((int64_t)buffer.size() < block * m) buffer.resize(block * m);
    std::vector<Cand> heap;
    SelectScratch scratch;
    for (int64_t j = j0; j < j1; ++j) {
      scores.score(j, buffer.data());
      for (int64_t b = j * block; b < std::min(b_count, (j + 1) * block); ++b) {
        row_topk(buffer.data() + (b - j * block) * m, m, k, heap, scratch);
        for (int64_t i = 0; i < k; ++i) {
          const bool have = i < (int64_t)heap.size();
          vp[b * k + i] = have ? heap[i].first : kNegInf;
          ip[b * k + i] = have ? item[rp[heap[i].second]] : -1;
        }
      }
    }
  });
  return {ids, best};
}

}  // namespace ivf
