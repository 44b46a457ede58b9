// The best k of every row of a score matrix (topk_rows), as the scan's selection picks them.

#include <ATen/ops/empty.h>

#include "ivf_scan.h"

namespace ivf {

#ifdef __AVX2__
// Candidates of row_topk_few at most: past this the bound let too much through.
constexpr size_t kFewCandidates = 64;

// The best 2 <= k <= 8 of a row of m >= 64 (a probe's top lists of all centroid scores), by a bound:
// the 8 lanes' maxima are 8 distinct elements, so the k-th largest of them is at most the row's
// k-th largest, and only elements at or above it can be in the answer (ties at the cut too). Those
// few are sorted by BetterFirst: less work than the bounded heap (mispredicting on its pushes) on
// an AVX2 build or TopStream on an AVX-512 one, for long rows and a small k.
// (k = 1 keeps those: the heap's filter is an argmax.) False (the caller selects)
// when more than kFewCandidates pass, or the bound is -inf.
inline bool row_topk_few(const float* row, int64_t m, int64_t k, std::vector<Cand>& heap) {
  __m256 mx = _mm256_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  std::sort(lanes, lanes + 8, std::greater<float>());
  const float bound = lanes[k - 1];
  if (!(bound > kNegInf)) return false;
  heap.clear();
  const __m256 bv = _mm256_set1_ps(bound);
  for (i = 0; i + 8 <= m; i += 8) {
    for (unsigned ge = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), bv, _CMP_GE_OQ)); ge; ge &= ge - 1) {
      const int64_t j = i + __builtin_ctz(ge);
      heap.emplace_back(row[j], j);
    }
    if (heap.size() > kFewCandidates) return false;
  }
  for (; i < m; ++i)
    if (row[i] >= bound) heap.emplace_back(row[i], i);
  if (heap.size() > kFewCandidates) return false;
  std::sort(heap.begin(), heap.end(), BetterFirst());
  heap.resize(std::min<size_t>(size_t(k), heap.size()));
  return true;
}
#endif

// The best k of row[0..m) into heap, best first (the lower index first among equal scores at the
// cut; -inf never counts): row_topk_few for 2 <= k <= 8 of a long row (AVX2 or AVX-512 builds);
// TopStream where k <= kRankSortMax on an AVX-512 build; else a selection where k is a large share
// of the row (m <= 16 k), where most items would pass through the heap, else the bounded heap.
void row_topk(const float* row, int64_t m, int64_t k, std::vector<Cand>& heap, SelectScratch& scratch) {
#ifdef __AVX2__
  if (k >= 2 && k <= 8 && m >= 64 && row_topk_few(row, m, k, heap)) return;
#endif
  heap.clear();
#ifdef RECSERVE_AVX512_BUILD
  if (k <= kRankSortMax && m <= (int64_t(1) << 32)) {
    TopStream top(k, kNegInf, scratch);
    top.push(row, m, 0);
    top.finish(heap);
    return;
  }
#endif
  if (m <= kSelectShare * k) {
    for (int64_t i = 0; i < m; ++i)
      if (row[i] > kNegInf) heap.emplace_back(row[i], i);
    keep_best(heap, k, scratch);
  } else {
    float worst = kNegInf;
    push_scores(row, m, 0, k, heap, worst);
    std::sort_heap(heap.begin(), heap.end(), MinFirst());
  }
}

// Best k of every row of x [B, M] (float32) -> values [B, k] best first, indices [B, k] (-1 pads).
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
    SelectScratch scratch;
    for (int64_t b = b0; b < b1; ++b) {
      row_topk(xp + b * m, m, k, heap, scratch);
      for (int64_t j = 0; j < k; ++j) {
        const bool have = j < (int64_t)heap.size();
        vp[b * k + j] = have ? heap[j].first : kNegInf;
        ip[b * k + j] = have ? heap[j].second : -1;
      }
    }
  });
  return {values, indices};
}

}  // namespace ivf
