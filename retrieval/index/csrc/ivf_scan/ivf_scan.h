// The index's C++ library, one torch extension built from every file of this folder
// (retrieval/index/kernels.py; common/cpp_extension.py hashes them all, this header included):
//
//   scan.cpp      the list-major scan of int8 / fp8 codes with the filter inside it, the int8 dot
//                 kernels and the run-time choice of their instruction set (int8_isa)
//   topk.cpp      the best k of every row (topk_rows)
//   probe.cpp     the lists each query probes (ivf_probe, its int8 table) and q·c of every list
//   bounds.cpp    the bound check's lists: the filtered first round's and the second round's
//   exact.cpp     the rows passing a filter and their exact scores, and the exact search in one call
//   values.cpp    the postings of hashed attributes' values and the buckets a filter reads of them
//   codes.cpp     int8 quantization: the build's codes, the scan's queries, rows decoded to floats
//   ids.cpp       item ids <-> rows, and the plain search keyed by ids in one call
//   merge.cpp     the bound check's merge of a row's two rounds into its top-k
//   ivf_scan.cpp  the Python module: every op's binding
//
// Here: what more than one of them uses. The selection primitives (the bounded heap, the AVX
// selections, TopStream) are defined here, inline: the scan, the top-k and the probe run them per
// candidate, where a call across files would cost as much as the work.
#pragma once

// Tensors and parallel_for only: each file includes the ATen ops it calls (ATen/ATen.h would
// parse the declarations of every op once per file).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RECSERVE_X86 1
#define RECSERVE_TARGET(isa) __attribute__((target(isa)))
#endif
#if defined(__AVX512BW__)  // built with -march=native on an AVX-512 CPU: the heap's 16-wide skip
#define RECSERVE_AVX512_BUILD 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <memory>
#include <limits>
#include <vector>

namespace ivf {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A query's candidates up to this multiple of r are selected (nth_element), more go through the heap.
constexpr int64_t kSelectShare = 16;

using Cand = std::pair<float, int64_t>;  // (score, position in list-sorted order)
struct MinFirst {
  bool operator()(const Cand& a, const Cand& b) const { return a.first > b.first; }
};

// A heap order whose worst, among equal scores, is the higher position: pushed in ascending
// position, the heap then keeps the best r by (score, then lower position) whatever else was
// pushed between, and sort_heap lists them in that order (the probe: see probe_one_int8).
struct BetterFirst {
  bool operator()(const Cand& a, const Cand& b) const {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
};

// Int8 dot products <q, c>. Every path returns the exact integer result of the portable loop.
enum class Isa { kPortable, kAvx2, kVnni };

const char* isa_name(Isa isa);

// The int8 path of this call: $RECSERVE_SCAN_ISA when set (refused if this CPU cannot run it), else
// the best this CPU has. Read per call, so that a test or a benchmark may switch it between calls.
Isa int8_isa();

#ifdef RECSERVE_X86
// The sum of v's 8 int32 lanes.
RECSERVE_TARGET("avx2") inline int32_t sum_lanes_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

// Per-row scales are stored as bfloat16: 2 bytes an item and float32's range. The build rounds
// each scale before it quantizes the row with it, so codes and scale agree exactly and the
// rounding costs no precision (the row's largest value lands within a quarter step of 127).
using Scale = at::BFloat16;

// A clause's "none of these bits" part (none [C, W], FilterBatch.neg_masks; nullptr: no clause
// has one): whether clause c has one and the item holds none of its bits.
inline bool holds_none(const int64_t* sig, const int64_t* none, int64_t c, int64_t w) {
  if (!none) return false;
  bool has = false, held = false;
  for (int64_t k = 0; k < w; ++k) {
    has |= none[c * w + k] != 0;
    held |= (sig[k] & none[c * w + k]) != 0;
  }
  return has && !held;
}

// An item passes when every clause holds: clause c holds when (sig & mask_c) != 0, negated if
// neg_c, or when its "none of these bits" part holds (holds_none).
inline bool passes(const int64_t* sig, const int64_t* mask, const bool* neg, const int64_t* none, int64_t c_count,
                   int64_t w) {
  for (int64_t c = 0; c < c_count; ++c) {
    bool hit = false;
    for (int64_t k = 0; k < w; ++k) hit |= (sig[k] & mask[c * w + k]) != 0;
    if (hit == neg[c] && !holds_none(sig, none, c, w)) return false;
  }
  return true;
}

// fnone as the kernels read it: nullptr when empty (no clause has a "none of" part), else int64
// shaped as fmask.
inline const int64_t* none_ptr(const at::Tensor& fnone, const at::Tensor& fmask) {
  if (!fnone.defined() || fnone.numel() == 0) return nullptr;
  TORCH_CHECK(fnone.sizes() == fmask.sizes() && fnone.scalar_type() == at::kLong && fnone.is_contiguous(),
              "fnone must be contiguous int64 shaped as fmask, or empty");
  return fnone.data_ptr<int64_t>();
}

// Pushes s[0..n) into a bounded min-heap of the best r (positions pos0 + i). Entries not above the
// current worst are skipped 16 at a time on AVX-512 builds, 8 on AVX2 ones; -inf never enters.
template <class Order = MinFirst>
inline void push_one(float v, int64_t pos, int64_t r, std::vector<Cand>& heap, float& worst) {
  if (v <= worst) return;
  if ((int64_t)heap.size() < r) {
    heap.emplace_back(v, pos);
    std::push_heap(heap.begin(), heap.end(), Order());
    if ((int64_t)heap.size() == r) worst = heap.front().first;
  } else {
    std::pop_heap(heap.begin(), heap.end(), Order());
    heap.back() = Cand(v, pos);
    std::push_heap(heap.begin(), heap.end(), Order());
    worst = heap.front().first;
  }
}

template <class Order = MinFirst>
inline void push_scores(const float* s, int64_t n, int64_t pos0, int64_t r, std::vector<Cand>& heap, float& worst) {
  auto push = [&](float v, int64_t i) { push_one<Order>(v, pos0 + i, r, heap, worst); };
  int64_t i = 0;
#ifdef RECSERVE_AVX512_BUILD
  for (; i + 16 <= n; i += 16) {
    __mmask16 gt = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), _mm512_set1_ps(worst), _CMP_GT_OQ);
    while (gt) {
      const int j = __builtin_ctz(gt);
      gt &= gt - 1;
      push(s[i + j], i + j);
    }
  }
#elif defined(__AVX2__)  // a build for AVX2 CPUs: 8 at a time (the probe's top lists of a batch)
  for (; i + 8 <= n; i += 8) {
    unsigned gt = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(worst), _CMP_GT_OQ));
    while (gt) {
      const int j = __builtin_ctz(gt);
      gt &= gt - 1;
      push(s[i + j], i + j);
    }
  }
#endif
  for (; i < n; ++i) push(s[i], i);
}

// Phase 2: each query's best r over its pairs' scores, ordered by BetterFirst (the higher score,
// then the lower position: the order at ties of a selection).

// Selections of up to this many take kth_largest and rank_sort in keep_best (AVX-512 or AVX2).
constexpr int64_t kRankSortMax = 160;

// kth_largest's start: every key lies in [lo, hi], so the k-th shares their common leading bits
// (the bit-by-bit search would set exactly those: a set bit keeps all n keys >= t, a clear one
// none). t = that prefix, top = the highest bit where lo and hi differ; false when lo == hi
// (then t is the answer). The scores of one query share their sign and most exponent bits: a
// quarter or more of the 32 counting passes.
inline bool common_prefix(uint32_t lo, uint32_t hi, uint32_t& t, int& top) {
  if (lo >= hi) {
    t = hi;
    return false;
  }
  top = 31 - __builtin_clz(lo ^ hi);
  t = top == 31 ? 0u : hi & ~((2u << top) - 1);
  return true;
}

#ifdef RECSERVE_AVX512_BUILD
// The kept-th largest of asc[0..n) (1 <= kept <= n): the largest t with at least kept values >= t,
// found bit by bit from the top, each bit one branch-free counting pass (nth_element's partitions
// mispredicted about every other element, a large share of a batched scan).
inline uint32_t kth_largest(const uint32_t* asc, int64_t n, int64_t kept) {
  const __mmask16 last = __mmask16((1u << (n % 16)) - 1);
  __m512i lo = _mm512_set1_epi32(-1), hi = _mm512_setzero_si512();
  int64_t i0 = 0;
  for (; i0 + 16 <= n; i0 += 16) {
    const __m512i v = _mm512_loadu_si512(asc + i0);
    lo = _mm512_min_epu32(lo, v), hi = _mm512_max_epu32(hi, v);
  }
  if (i0 < n) {
    lo = _mm512_mask_min_epu32(lo, last, lo, _mm512_maskz_loadu_epi32(last, asc + i0));
    hi = _mm512_mask_max_epu32(hi, last, hi, _mm512_maskz_loadu_epi32(last, asc + i0));
  }
  uint32_t t;
  int top;
  if (!common_prefix(_mm512_reduce_min_epu32(lo), _mm512_reduce_max_epu32(hi), t, top)) return t;
  const __m512i one = _mm512_set1_epi32(1);
  for (int bit = top; bit >= 0; --bit) {
    const uint32_t c = t | (1u << bit);
    const __m512i cv = _mm512_set1_epi32(static_cast<int>(c));
    // counts in lanes (a masked add a compare), summed once: a mask's popcount and a scalar add
    // each compare had made the count's dependency chain the loop's
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      acc = _mm512_mask_add_epi32(acc, _mm512_cmpge_epu32_mask(_mm512_loadu_si512(asc + i), cv), acc, one);
    if (i < n)
      acc = _mm512_mask_add_epi32(acc, _mm512_mask_cmpge_epu32_mask(last, _mm512_maskz_loadu_epi32(last, asc + i), cv), acc, one);
    if (_mm512_reduce_add_epi32(acc) >= kept) t = c;
  }
  return t;
}

// keys[0..n), all distinct, into out in ascending order: each key's rank is the count of smaller
// keys (n^2 / 8 compares, no branch on the data; below kRankSortMax it beats std::sort's mispredicts).
inline void rank_sort_keys(const uint64_t* keys, int64_t n, uint64_t* out) {
  const __mmask8 last = __mmask8((1u << (n % 8)) - 1);
  const __m512i one = _mm512_set1_epi64(1);
  for (int64_t i = 0; i < n; ++i) {
    const __m512i ki = _mm512_set1_epi64(static_cast<long long>(keys[i]));
    __m512i acc = _mm512_setzero_si512();  // counts in lanes, as in kth_largest
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      acc = _mm512_mask_add_epi64(acc, _mm512_cmplt_epu64_mask(_mm512_loadu_si512(keys + j), ki), acc, one);
    if (j < n)
      acc = _mm512_mask_add_epi64(acc, _mm512_mask_cmplt_epu64_mask(last, _mm512_maskz_loadu_epi64(last, keys + j), ki), acc, one);
    out[_mm512_reduce_add_epi64(acc)] = keys[i];
  }
}
#elif defined(__AVX2__)
// kth_largest on a build for AVX2 CPUs: 8 keys a compare, where nth_element (and its sort)
// mispredict as they do on AVX-512 builds.
inline uint32_t kth_largest(const uint32_t* asc, int64_t n, int64_t kept) {
  __m256i lo = _mm256_set1_epi32(-1), hi = _mm256_setzero_si256();
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(asc + i0));
    lo = _mm256_min_epu32(lo, v), hi = _mm256_max_epu32(hi, v);
  }
  alignas(32) uint32_t l8[8], h8[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l8), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(h8), hi);
  uint32_t lo1 = *std::min_element(l8, l8 + 8), hi1 = *std::max_element(h8, h8 + 8);
  for (; i0 < n; ++i0) lo1 = std::min(lo1, asc[i0]), hi1 = std::max(hi1, asc[i0]);
  uint32_t t;
  int top;
  if (!common_prefix(lo1, hi1, t, top)) return t;
  for (int bit = top; bit >= 0; --bit) {
    const uint32_t c = t | (1u << bit);
    const __m256i cv = _mm256_set1_epi32(static_cast<int>(c));
    // a >= c (unsigned) as max(a, c) == a: -1 in a lane, subtracted from counts kept in lanes and
    // summed once (a movemask, popcount and scalar add a compare had been the loop's chain)
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(asc + i));
      acc = _mm256_sub_epi32(acc, _mm256_cmpeq_epi32(_mm256_max_epu32(a, cv), a));
    }
    int64_t count = sum_lanes_epi32(acc);
    for (; i < n; ++i) count += asc[i] >= c;
    if (count >= kept) t = c;
  }
  return t;
}

// rank_sort_keys on a build for AVX2 CPUs: 4 keys a compare (signed, on keys with the sign bit
// flipped). A std::sort of the kept keys in its place mispredicts on most compares.
// The keys are flipped once into a copy padded to 4 with the largest key (never below another),
// and counts stay in lanes, summed once a key (see kth_largest). n <= kRankSortMax.
inline void rank_sort_keys(const uint64_t* keys, int64_t n, uint64_t* out) {
  alignas(32) int64_t flipped[kRankSortMax + 3];
  const int64_t n4 = (n + 3) & ~int64_t(3);
  for (int64_t j = 0; j < n; ++j) flipped[j] = static_cast<int64_t>(keys[j] ^ 0x8000000000000000ull);
  for (int64_t j = n; j < n4; ++j) flipped[j] = INT64_MAX;
  for (int64_t i = 0; i < n; ++i) {
    const __m256i ki = _mm256_set1_epi64x(flipped[i]);
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = 0; j < n4; j += 4)
      acc = _mm256_sub_epi64(acc, _mm256_cmpgt_epi64(ki, _mm256_load_si256(reinterpret_cast<const __m256i*>(flipped + j))));
    const __m128i two = _mm_add_epi64(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    out[_mm_cvtsi128_si64(two) + _mm_extract_epi64(two, 1)] = keys[i];
  }
}
#endif

#if defined(RECSERVE_AVX512_BUILD) || defined(__AVX2__)
// How many of hi[0..n8) are below v (n8 a multiple of the vector width; signed).
inline int64_t count_below(const int32_t* hi, int64_t n8, int32_t v) {
#ifdef RECSERVE_AVX512_BUILD
  const __m512i vv = _mm512_set1_epi32(v), one = _mm512_set1_epi32(1);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t j = 0; j < n8; j += 16)
    acc = _mm512_mask_add_epi32(acc, _mm512_cmplt_epi32_mask(_mm512_load_si512(hi + j), vv), acc, one);
  return _mm512_reduce_add_epi32(acc);
#else
  const __m256i vv = _mm256_set1_epi32(v);
  __m256i acc = _mm256_setzero_si256();
  for (int64_t j = 0; j < n8; j += 8)
    acc = _mm256_sub_epi32(acc, _mm256_cmpgt_epi32(vv, _mm256_load_si256(reinterpret_cast<const __m256i*>(hi + j))));
  return sum_lanes_epi32(acc);
#endif
}

// keys[0..n), all distinct, into out in ascending order (n <= kRankSortMax). Ranked first by
// their upper halves (a candidate's score): twice the keys a compare of rank_sort_keys. Equal
// halves (equal scores) rank alike, so a rank taken twice sends the whole sort to rank_sort_keys.
inline void rank_sort(const uint64_t* keys, int64_t n, uint64_t* out) {
  constexpr int64_t kWidth = 16;  // the padding: a multiple of either build's lane count
  alignas(64) int32_t hi[kRankSortMax + kWidth];
  const int64_t n8 = (n + kWidth - 1) / kWidth * kWidth;
  for (int64_t j = 0; j < n; ++j) hi[j] = static_cast<int32_t>(uint32_t(keys[j] >> 32) ^ 0x80000000u);
  for (int64_t j = n; j < n8; ++j) hi[j] = INT32_MAX;  // never below another
  bool taken[kRankSortMax] = {};
  bool again = false;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t rank = count_below(hi, n8, hi[i]);
    again |= taken[rank];
    taken[rank] = true;
    out[rank] = keys[i];
  }
  if (again) rank_sort_keys(keys, n, out);
}
#endif

// The score's bits, order-preserving as an unsigned integer (higher score, higher key); -0 as +0.
inline uint32_t ascending_bits(float score) {
  uint32_t bits;
  const float s = score + 0.0f;
  std::memcpy(&bits, &s, 4);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// A candidate as one integer that sorts in BetterFirst's order: the score's ascending bits flipped
// (higher first) above the position (lower first). Integer compares have no branch on ties
// (the pair compare's branches dominated a one-query selection). Positions must be below 2^32.
inline uint64_t best_first_key(float score, int64_t pos) {
  return (uint64_t(~ascending_bits(score)) << 32) | uint64_t(pos);
}

// The candidate a best_first_key stands for, its score bit for bit (a -0 reads as +0: the same value).
inline Cand from_key(uint64_t key) {
  const uint32_t ascending = ~uint32_t(key >> 32);
  const uint32_t bits = ascending & 0x80000000u ? ascending & 0x7FFFFFFFu : ~ascending;
  float score;
  std::memcpy(&score, &bits, 4);
  return Cand(score, int64_t(key & 0xFFFFFFFFu));
}

// Scratch of keep_best, owned by the caller's thread (a thread_local in this library is looked up
// again through __tls_get_addr inside every loop that calls out, a cost a one-query select feels).
struct SelectScratch {
  std::vector<uint64_t> keys, sorted;
  std::vector<uint32_t> asc, pos;
  std::vector<int64_t> ties;
};

// The best r of cands, best first. Cheaper than the bounded heap where most candidates would enter
// it (r a large share of them). With AVX-512 or AVX2: the r-th best score by kth_largest, the
// candidates above it and the lowest positions at it (the ties a selection keeps), then rank_sort
// of those kept. Elsewhere: nth_element, then a sort. Both give the same candidates in the same
// order.
inline void keep_best(std::vector<Cand>& cands, int64_t r, SelectScratch& scratch) {
  const int64_t n = (int64_t)cands.size(), kept = std::min<int64_t>(r, n);
  if (std::any_of(cands.begin(), cands.end(), [](const Cand& c) { return uint64_t(c.second) >> 32; })) {
    if (kept < n) std::nth_element(cands.begin(), cands.begin() + kept, cands.end(), BetterFirst());
    cands.resize(kept);
    std::sort(cands.begin(), cands.end(), BetterFirst());
    return;
  }
  std::vector<uint64_t>&keys = scratch.keys, &sorted = scratch.sorted;
  keys.resize(n);
#if defined(RECSERVE_AVX512_BUILD) || defined(__AVX2__)
  if (kept >= 1 && kept <= kRankSortMax) {
    std::vector<uint32_t>& asc = scratch.asc;
    std::vector<int64_t>& ties = scratch.ties;
    asc.resize(n);
    for (int64_t i = 0; i < n; ++i) asc[i] = ascending_bits(cands[i].first);
    const uint32_t t = kth_largest(asc.data(), n, kept);
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {  // those above t, without a branch on each
      keys[m] = (uint64_t(~asc[i]) << 32) | uint64_t(cands[i].second);
      m += asc[i] > t;
    }
    ties.clear();
    for (int64_t i = 0; i < n; ++i)
      if (asc[i] == t) ties.push_back(cands[i].second);
    std::sort(ties.begin(), ties.end());  // at the cut, the lower positions
    for (int64_t i = 0; m < kept; ++i) keys[m++] = (uint64_t(~t) << 32) | uint64_t(ties[i]);
    sorted.resize(kept);
    rank_sort(keys.data(), kept, sorted.data());
    cands.resize(kept);
    for (int64_t i = 0; i < kept; ++i) cands[i] = from_key(sorted[i]);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) keys[i] = best_first_key(cands[i].first, cands[i].second);
  if (kept < n) std::nth_element(keys.begin(), keys.begin() + kept, keys.end());
  std::sort(keys.begin(), keys.begin() + kept);
  cands.resize(kept);
  for (int64_t i = 0; i < kept; ++i) cands[i] = from_key(keys[i]);
}

#ifdef RECSERVE_AVX512_BUILD
// The best k (1 <= k <= kRankSortMax) of scores pushed a run at a time, in one pass: each run's
// keys (ascending_bits, 16 at a time) at or above a threshold are compress-stored with their
// positions; when the buffer fills, it is cut to its best k (kth_largest, the lowest positions
// among ties at the cut) and the threshold rises to the k-th key. The bounded heap this replaces
// mispredicted on most of its inserts, which made it most of an exact search of many queries.
// Same answer as keep_best over every score pushed: the best k,
// the lower position first among equal scores; -inf and scores below `floor` never count.
// Positions must be below 2^32.
class TopStream {
 public:
  TopStream(int64_t k, float floor, SelectScratch& s)
      : k_(k), cap_(std::max<int64_t>(8 * k, 64)), asc_(s.asc), pos_(s.pos), s_(s) {
    asc_.resize(cap_ + 16);
    pos_.resize(cap_ + 16);
    // admit keys >= t_: above -inf's key, and at or above the floor's
    t_ = std::max(ascending_bits(kNegInf) + 1, floor > kNegInf ? ascending_bits(floor) : 0u);
  }

  // Scores s[0..n) at positions pos0 + i.
  void push(const float* s, int64_t n, int64_t pos0) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i tv = _mm512_set1_epi32(static_cast<int>(t_));
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 in = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      const __m512i asc = ascending(_mm512_maskz_loadu_ps(in, s + i));
      const __mmask16 keep = _mm512_mask_cmpge_epu32_mask(in, asc, tv);
      if (!keep) continue;
      _mm512_mask_compressstoreu_epi32(asc_.data() + n_, keep, asc);
      const __m512i at = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(pos0 + i)));
      _mm512_mask_compressstoreu_epi32(pos_.data() + n_, keep, at);
      n_ += __builtin_popcount(keep);
      if (n_ >= cap_) {
        cut(k_);
        tv = _mm512_set1_epi32(static_cast<int>(t_));
      }
    }
  }

  // The best k pushed, best first, into out.
  void finish(std::vector<Cand>& out) {
    out.clear();
    if (n_ == 0) return;
    cut(std::min(k_, n_));
    std::vector<uint64_t>&keys = s_.keys, &sorted = s_.sorted;
    keys.resize(n_);
    sorted.resize(n_);
    for (int64_t i = 0; i < n_; ++i) keys[i] = (uint64_t(~asc_[i]) << 32) | uint64_t(pos_[i]);
    rank_sort(keys.data(), n_, sorted.data());
    for (int64_t i = 0; i < n_; ++i) out.push_back(from_key(sorted[i]));
  }

 private:
  // Order-preserving keys of 16 scores (ascending_bits: -0 as +0).
  static __m512i ascending(__m512 v) {
    const __m512i bits = _mm512_castps_si512(_mm512_add_ps(v, _mm512_setzero_ps()));
    const __m512i flip = _mm512_or_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(INT32_MIN));
    return _mm512_xor_si512(bits, flip);
  }

  // The buffer cut to its best `kept` (<= n_): those above the kept-th key, then the lowest
  // positions at it; later keys must reach it. Order in the buffer is not kept.
  void cut(int64_t kept) {
    if (kept == n_) return;  // all of them (finish with fewer than k)
    const uint32_t t = kth_largest(asc_.data(), n_, kept);
    std::vector<int64_t>& ties = s_.ties;
    ties.clear();
    for (int64_t i = 0; i < n_; ++i)
      if (asc_[i] == t) ties.push_back(pos_[i]);
    int64_t m = 0;
    for (int64_t i = 0; i < n_; ++i) {  // those above t, without a branch on each
      asc_[m] = asc_[i];
      pos_[m] = pos_[i];
      m += asc_[i] > t;
    }
    if (m + (int64_t)ties.size() > kept) std::sort(ties.begin(), ties.end());
    for (int64_t i = 0; m < kept; ++i, ++m) asc_[m] = t, pos_[m] = uint32_t(ties[i]);
    n_ = kept;
    t_ = t;
  }

  const int64_t k_, cap_;
  std::vector<uint32_t>&asc_, &pos_;
  SelectScratch& s_;
  int64_t n_ = 0;
  uint32_t t_;
};
#endif

// ---- shared by more than one file (defined where named)

#ifdef RECSERVE_X86
// scan.cpp: VNNI dots of one query against 16-item blocks (the scan's transposed lists, the
// probe's table).
RECSERVE_TARGET("avx512f,avx512bw,avx512vnni")
void block_dots_vnni(const uint32_t* t, int64_t n, int64_t groups, const int8_t* q, int32_t qsum, int32_t* dots);
#endif

// codes.cpp: the scan's query quantization, also the int8 GEMM's.
void quantize_queries(const float* qf, int64_t b_count, int64_t d, int8_t* q8, int64_t stride, float* qs,
                      int32_t* qsum);

// exact.cpp: the checks of the calls that read chosen rows of the int8 codes.
void check_rows_of_codes(const at::Tensor& pos, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets);

// topk.cpp: the best k of one row, best first (topk_rows' rule, also list_bounds').
void row_topk(const float* row, int64_t m, int64_t k, std::vector<Cand>& heap, SelectScratch& scratch);

// ---- the ops (bound in ivf_scan.cpp; each documented where defined)

// scan.cpp
std::tuple<at::Tensor, at::Tensor> ivf_scan_int8(
    const at::Tensor& q, const at::Tensor& probes, const at::Tensor& coarse, const at::Tensor& codes,
    const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig, const at::Tensor& fmask,
    const at::Tensor& fneg, const at::Tensor& fnone, const at::Tensor& excl, int64_t r, const at::Tensor& floor);
std::tuple<at::Tensor, at::Tensor> ivf_scan_fp8(
    const at::Tensor& q, const at::Tensor& codes_u8, const at::Tensor& lut, const at::Tensor& probes,
    const at::Tensor& coarse, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
    const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone, const at::Tensor& excl, int64_t r);

// topk.cpp
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k);

// probe.cpp
using ProbeTable = c10::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>>;
std::tuple<at::Tensor, at::Tensor> ivf_probe(const at::Tensor& q, const at::Tensor& centroids_t,
                                             const at::Tensor& half, int64_t p, const ProbeTable& table);
std::tuple<at::Tensor, at::Tensor, at::Tensor> probe_table(const at::Tensor& centroids_t);
at::Tensor centroid_dots(const at::Tensor& q, const at::Tensor& centroids_t);

// bounds.cpp
std::tuple<at::Tensor, at::Tensor> list_bounds(const at::Tensor& ip, const at::Tensor& half, const at::Tensor& list_bits,
                                               const at::Tensor& masks, const at::Tensor& negate,
                                               const at::Tensor& none, const at::Tensor& sizes, const at::Tensor& nprobe,
                                               const at::Tensor& factor, const at::Tensor& radius,
                                               const at::Tensor& check, int64_t p);
std::tuple<at::Tensor, at::Tensor, at::Tensor> second_round_lists(const at::Tensor& bounds, const at::Tensor& kth,
                                                                  const at::Tensor& sizes, const at::Tensor& budget);

// exact.cpp
std::tuple<at::Tensor, at::Tensor> bit_index(const at::Tensor& sig);
at::Tensor filter_mask(const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone);
at::Tensor bit_slices(const at::Tensor& sig);
at::Tensor sliced_mask(const at::Tensor& slices, const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone,
                       int64_t n);
at::Tensor sliced_rows(const at::Tensor& slices, const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone,
                       int64_t n);
at::Tensor eligible_rows(const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone,
                         const at::Tensor& bit_counts, const at::Tensor& postings, const at::Tensor& value_layout,
                         const at::Tensor& value_offsets, const at::Tensor& value_postings);
at::Tensor score_rows_int8(const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes,
                           const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& coarse);
at::Tensor many_rows_int8(const at::Tensor& q, const at::Tensor& pos, const at::Tensor& codes,
                          const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& centroids_t);
std::tuple<at::Tensor, at::Tensor> exact_search_ids_int8(
    const at::Tensor& q, const at::Tensor& centroids_t, const at::Tensor& codes, const at::Tensor& scales,
    const at::Tensor& offsets, const at::Tensor& sig, const at::Tensor& fmask, const at::Tensor& fneg,
    const at::Tensor& fnone, const at::Tensor& bit_counts, const at::Tensor& postings, const at::Tensor& value_layout,
    const at::Tensor& value_offsets, const at::Tensor& value_postings, const at::Tensor& item_ids, int64_t k, int64_t few,
    int64_t max_scores);

// values.cpp
int64_t value_slot_count(const at::Tensor& layout);
void check_value_postings(const at::Tensor& layout, const at::Tensor& offsets, const at::Tensor& postings, int64_t w);
std::tuple<at::Tensor, at::Tensor> value_index(const at::Tensor& sig, const at::Tensor& layout);
bool value_slots(const int64_t* layout, int64_t a, const int64_t* mp, const bool* np, const int64_t* gp,
                 int64_t c_count, int64_t w, std::vector<int64_t>& out);
int64_t best_value_slots(const at::Tensor& layout, const at::Tensor& offsets, const int64_t* mp, const bool* np,
                         const int64_t* gp, int64_t c_count, int64_t w, std::vector<int64_t>& slots);
std::tuple<int64_t, at::Tensor> value_drive(const at::Tensor& layout, const at::Tensor& offsets, const at::Tensor& fmask,
                                            const at::Tensor& fneg, const at::Tensor& fnone);

// codes.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_int8(const at::Tensor& x, const at::Tensor& order,
                                                           const at::Tensor& lists, const at::Tensor& centroids);
at::Tensor decode_rows_int8(const at::Tensor& pos, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& offsets, const at::Tensor& centroids_t);

// ids.cpp
at::Tensor ids_of_positions(const at::Tensor& pos, const at::Tensor& item_ids);
at::Tensor id_rows(const at::Tensor& item_ids, const at::Tensor& perm, const at::Tensor& ids, int64_t missing,
                   bool ascending);
std::tuple<at::Tensor, at::Tensor, bool> ivf_search_ids_int8(
    const at::Tensor& q, const at::Tensor& centroids_t, const at::Tensor& half, int64_t p,
    const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
    const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone, const at::Tensor& excl_ids,
    const at::Tensor& item_ids, const at::Tensor& perm, int64_t r, const at::Tensor& sizes, int64_t least,
    const at::Tensor& hold, const ProbeTable& table);

// merge.cpp
void merge_rounds(at::Tensor& top_keys, at::Tensor& top_approx, at::Tensor& top_scores, const at::Tensor& first_keys,
                  const at::Tensor& first_approx, const at::Tensor& first_scores, const at::Tensor& rows,
                  const at::Tensor& drop, const at::Tensor& more_keys, const at::Tensor& more_approx,
                  const at::Tensor& more_scores, int64_t r);

}  // namespace ivf
