// Item ids and index rows: positions to ids (ids_of_positions), ids to rows through the index's
// id order (id_rows), and the plain search keyed by ids in one call (ivf_search_ids_int8).

#include <ATen/ops/empty_like.h>

#include "ivf_scan.h"

namespace ivf {

// Positions pos [B, k] int64 (-1 pads) -> item ids [B, k] (-1 pads) through item_ids [N] int64, in one
// parallel pass (NumPy's gather and where, two passes and a temporary, showed in a search's profile).
at::Tensor ids_of_positions(const at::Tensor& pos, const at::Tensor& item_ids) {
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.device().is_cpu(),
              "pos must be contiguous CPU int64");
  TORCH_CHECK(item_ids.dim() == 1 && item_ids.scalar_type() == at::kLong && item_ids.is_contiguous(),
              "item_ids must be contiguous int64 [N]");
  auto out = at::empty_like(pos);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* ip = item_ids.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = item_ids.numel();
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, pos.numel(), 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = pp[i];
      if (p >= n) bad.store(i, std::memory_order_relaxed);
      op[i] = p < 0 ? p : ip[p < n ? p : 0];
    }
  });
  TORCH_CHECK(bad.load() < 0, "position out of range at flat index ", bad.load(), " (", n, " items)");
  return out;
}

// The rows of item ids through an index's id order: item_ids [N] int64 (row -> id) and perm [N]
// int32 (rows in ascending id order: 4 bytes an item); a binary search per id. ids [B, S] int64
// -> rows [B, S] int64, `missing` where the index holds no such id (a -1 pad included), each
// row sorted when `ascending` (the scan's exclusions: missing = INT64_MAX sorts last).
void check_id_order(const at::Tensor& item_ids, const at::Tensor& perm) {
  TORCH_CHECK(item_ids.dim() == 1 && perm.sizes() == item_ids.sizes() && item_ids.scalar_type() == at::kLong &&
              perm.scalar_type() == at::kInt && item_ids.is_contiguous() && perm.is_contiguous() &&
              item_ids.device().is_cpu() && perm.device().is_cpu(),
              "item_ids (int64) and perm (int32) must be contiguous CPU [N]");
}

// The first place in id order whose id is >= w, searched from a guess: the place w would take if the
// ids were spread evenly between the smallest and the largest (exact for a contiguous range of ids,
// the common catalog; near for ids spread evenly, a document shard's). From the guess the search
// gallops to bracket w, then bisects the bracket. A plain bisection over the whole order takes
// log2(N) dependent loads from ids and order, most of them cache misses from a cold cache; a good
// guess takes two.
inline int64_t first_at_least(const int64_t* ids, const int32_t* order, int64_t n, int64_t lo_id, double slope,
                              int64_t w) {
  const auto at = [&](int64_t j) { return ids[order[j]]; };
  const int64_t g = std::min<int64_t>(n - 1, std::max<int64_t>(0, int64_t(double(w - lo_id) * slope)));
  int64_t lo, hi;  // the answer lies in [lo, hi]: at(lo - 1) < w (or lo == 0), at(hi) >= w (or hi == n)
  if (at(g) < w) {
    int64_t below = g, step = 1;
    hi = g + 1;
    while (hi < n && at(hi) < w) {
      below = hi;
      step <<= 1;
      hi = std::min(n, below + step);
    }
    lo = below + 1;
  } else {
    int64_t below = g - 1, step = 1;
    hi = g;
    while (below >= 0 && at(below) >= w) {
      hi = below;
      step <<= 1;
      below = std::max<int64_t>(-1, hi - step);
    }
    lo = below + 1;
  }
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (at(mid) < w) lo = mid + 1; else hi = mid;
  }
  return lo;
}

void rows_of_ids(const int64_t* ids, const int32_t* order, int64_t n, const int64_t* want, int64_t count,
                 int64_t missing, int64_t* rows) {
  if (n == 0) {
    std::fill(rows, rows + count, missing);
    return;
  }
  const int64_t lo_id = ids[order[0]], hi_id = ids[order[n - 1]];
  const double slope = hi_id > lo_id ? double(n - 1) / (double(hi_id) - double(lo_id)) : 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t w = want[i];
    if (w < lo_id || w > hi_id) {  // a -1 pad, or an id outside the index's range
      rows[i] = missing;
      continue;
    }
    const int64_t j = first_at_least(ids, order, n, lo_id, slope, w);
    rows[i] = j < n && ids[order[j]] == w ? order[j] : missing;
  }
}

at::Tensor id_rows(const at::Tensor& item_ids, const at::Tensor& perm, const at::Tensor& ids, int64_t missing,
                   bool ascending) {
  check_id_order(item_ids, perm);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.device().is_cpu(),
              "ids must be contiguous CPU int64");
  auto rows = at::empty_like(ids);
  int64_t* out = rows.data_ptr<int64_t>();
  rows_of_ids(item_ids.data_ptr<int64_t>(), perm.data_ptr<int32_t>(), item_ids.numel(), ids.data_ptr<int64_t>(),
              ids.numel(), missing, out);
  const int64_t s = ids.dim() ? ids.size(-1) : 1;
  if (ascending && s > 1)
    for (int64_t i = 0; i < ids.numel(); i += s) std::sort(out + i, out + i + s);
  return rows;
}

// Each row's probed lists (probes [B, P], best first, -1 skips) cut to its best ones until they hold
// hold[b] items (hold [B] int64) by sizes [L] (the lists as built), at least `least`: the slots
// past that -1, in place. probe.lists_holding's rule, for the one-call search.
void hold_lists(at::Tensor& probes, const at::Tensor& sizes, int64_t least, const at::Tensor& hold) {
  TORCH_CHECK(sizes.dim() == 1 && sizes.scalar_type() == at::kLong && sizes.is_contiguous(),
              "sizes must be contiguous int64 [L]");
  TORCH_CHECK(hold.dim() == 1 && hold.size(0) == probes.size(0) && hold.scalar_type() == at::kLong &&
              hold.is_contiguous(), "hold must be contiguous int64 [B]");
  const int64_t b_count = probes.size(0), p = probes.size(1), nlist = sizes.size(0);
  int64_t* pp = probes.data_ptr<int64_t>();
  const int64_t* sp = sizes.data_ptr<int64_t>();
  const int64_t* hp = hold.data_ptr<int64_t>();
  for (int64_t b = 0; b < b_count; ++b) {
    int64_t held = 0;
    for (int64_t j = 0; j < p; ++j) {
      int64_t& l = pp[b * p + j];
      if (j >= least && held >= hp[b]) l = -1;
      else if (l >= 0 && l < nlist) held += sp[l];
    }
  }
}

// A plain search keyed by item id, in one call (what a document shard answers most): the item ids
// each query excludes (excl_ids [B, S], -1 pads) -> their rows through the index's id order (a
// binary search over item_ids in perm order; ascending per query, absent ids and pads last as
// INT64_MAX), then ivf_probe (cut by hold_lists where sizes is not empty) and ivf_scan_int8, then
// the rows found -> item ids (-1 pads stay), and whether any row found fewer than r (undefined
// tensors where a kernel is forced).
// The same steps as a dozen tensor ops around the two kernels, which cost a one-query search
// more than the kernels do.
std::tuple<at::Tensor, at::Tensor, bool> ivf_search_ids_int8(
    const at::Tensor& q, const at::Tensor& centroids_t, const at::Tensor& half, int64_t p,
    const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& sig,
    const at::Tensor& fmask, const at::Tensor& fneg, const at::Tensor& fnone, const at::Tensor& excl_ids,
    const at::Tensor& item_ids, const at::Tensor& perm, int64_t r, const at::Tensor& sizes, int64_t least,
    const at::Tensor& hold, const ProbeTable& table) {
  // A kernel forced by $RECSERVE_SCAN_KERNEL (retrieval.index.scan.KERNEL_ENV: set, and not
  // "auto"): not this call's to answer, undefined tensors back (the caller takes the step-by-step
  // path through the forced kernel). Read here: a getenv costs less than os.environ's lookup.
  if (const char* forced = std::getenv("RECSERVE_SCAN_KERNEL"); forced && std::strcmp(forced, "auto") != 0)
    return {at::Tensor(), at::Tensor(), false};
  TORCH_CHECK(excl_ids.dim() == 2 && excl_ids.size(0) == q.size(0) && excl_ids.scalar_type() == at::kLong &&
              excl_ids.is_contiguous(), "excluded ids must be contiguous int64 [B, S]");
  TORCH_CHECK(item_ids.numel() == codes.size(0), "item_ids must be [N] with the codes' N");
  const at::Tensor excl = id_rows(item_ids, perm, excl_ids, std::numeric_limits<int64_t>::max(), true);
  const int64_t* ids = item_ids.data_ptr<int64_t>();
  auto probed = ivf_probe(q, centroids_t, half, p, table);
  if (sizes.numel() && least < p) hold_lists(std::get<1>(probed), sizes, least, hold);
  auto found = ivf_scan_int8(q, std::get<1>(probed), std::get<0>(probed), codes, scales, offsets, sig,
                             fmask, fneg, fnone, excl, r, at::Tensor());
  at::Tensor pos = std::get<0>(found);
  int64_t* pp = pos.data_ptr<int64_t>();
  bool short_row = false;  // a row that found fewer than r: its caller widens it
  for (int64_t i = 0; i < pos.numel(); ++i) {
    if (pp[i] >= 0) pp[i] = ids[pp[i]];
    else short_row = true;
  }
  return {pos, std::get<1>(found), short_row};
}

}  // namespace ivf
