// The bound check's lists (retrieval/index/bound.py, search.py's BoundCheck): a filtered first
// round's lists with every list's bound (list_bounds), then the lists a second round must scan
// (second_round_lists).

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include "ivf_scan.h"

namespace ivf {

// Whether rows a and b of masks [B, C, W] / negate [B, C] / none [B, C, W] (nullptr: none) hold
// the same filter.
inline bool same_filter(const int64_t* masks, const bool* negate, const int64_t* none, int64_t c_count, int64_t w,
                        int64_t a, int64_t b) {
  return std::equal(masks + a * c_count * w, masks + (a + 1) * c_count * w, masks + b * c_count * w) &&
         std::equal(negate + a * c_count, negate + (a + 1) * c_count, negate + b * c_count) &&
         (!none || std::equal(none + a * c_count * w, none + (a + 1) * c_count * w, none + b * c_count * w));
}

// out[l] = whether list l may hold an item the filter (mask [C, W], neg [C], none [C, W]) admits:
// every non-negated clause shares a bit with list_bits[l] (a negated clause, or one with a "none
// of these bits" part, rules no list out: list_bits say which bits some item holds, not which all).
inline void lists_admitting(const int64_t* list_bits, int64_t nlist, int64_t w, const int64_t* mask, const bool* neg,
                            const int64_t* none, int64_t c_count, uint8_t* out) {
  for (int64_t l = 0; l < nlist; ++l) {
    const int64_t* bits = list_bits + l * w;
    bool ok = true;
    for (int64_t c = 0; c < c_count; ++c) {
      if (neg[c] || (none && std::any_of(none + c * w, none + (c + 1) * w, [](int64_t x) { return x != 0; })))
        continue;
      int64_t hit = 0;
      for (int64_t k = 0; k < w; ++k) hit |= bits[k] & mask[c * w + k];
      ok &= hit != 0;
    }
    out[l] = ok;
  }
}

// The filtered first round's lists and the bound check's bounds (retrieval/index/bound.py,
// with_bounds), one pass per row of ip [B, L] = q·c: key = ip - half (the L2 probe; half empty:
// ip) over the lists that may hold an item the row admits (not empty: sizes [L]; and for a row with
// check[b], every non-negated clause of masks [B, C, W] / negate [B, C] shares a bit with the list's
// list_bits [L, W]: bound.py's _may_hold, reused while consecutive rows share a filter);
// the best nprobe[b] of them, as topk_rows picks them -> first [B, P] (-1 padded); bounds [B, L] =
// ip + factor[b] * radius[l] (the product rounded, then the sum, as torch computes it) where
// check[b], -inf for the lists probed first, out of reach, or of a row without a check.
__attribute__((optimize("fp-contract=off")))
std::tuple<at::Tensor, at::Tensor> list_bounds(const at::Tensor& ip, const at::Tensor& half, const at::Tensor& list_bits,
                                               const at::Tensor& masks, const at::Tensor& negate,
                                               const at::Tensor& none, const at::Tensor& sizes, const at::Tensor& nprobe,
                                               const at::Tensor& factor, const at::Tensor& radius,
                                               const at::Tensor& check, int64_t p) {
  TORCH_CHECK(ip.dim() == 2 && ip.scalar_type() == at::kFloat && ip.is_contiguous() && ip.device().is_cpu(),
              "ip must be a contiguous CPU float32 [B, L]");
  const int64_t b_count = ip.size(0), nlist = ip.size(1);
  TORCH_CHECK(p >= 1 && p <= nlist, "p must be in [1, L]");
  TORCH_CHECK(half.numel() == 0 || (half.numel() == nlist && half.scalar_type() == at::kFloat && half.is_contiguous()),
              "half must be float32 [L] or empty");
  TORCH_CHECK(masks.dim() == 3 && masks.size(0) == b_count && masks.scalar_type() == at::kLong && masks.is_contiguous(),
              "masks: int64 [B, C, W]");
  TORCH_CHECK(negate.dim() == 2 && negate.size(0) == b_count && negate.size(1) == masks.size(1) &&
              negate.scalar_type() == at::kBool && negate.is_contiguous(), "negate: bool [B, C]");
  const int64_t c_count = masks.size(1), w = masks.size(2);
  const bool has_bits = list_bits.numel() > 0 && c_count > 0 && w > 0;
  TORCH_CHECK(!has_bits || (list_bits.dim() == 2 && list_bits.size(0) == nlist && list_bits.size(1) == w &&
                            list_bits.scalar_type() == at::kLong && list_bits.is_contiguous()),
              "list_bits: int64 [L, W] with the masks' W");
  TORCH_CHECK(sizes.numel() == nlist && sizes.scalar_type() == at::kLong && sizes.is_contiguous(), "sizes: int64 [L]");
  TORCH_CHECK(radius.numel() == nlist && radius.scalar_type() == at::kFloat && radius.is_contiguous(), "radius: float32 [L]");
  TORCH_CHECK(nprobe.numel() == b_count && nprobe.scalar_type() == at::kLong && nprobe.is_contiguous(), "nprobe: int64 [B]");
  TORCH_CHECK(factor.numel() == b_count && factor.scalar_type() == at::kFloat && factor.is_contiguous(), "factor: float32 [B]");
  TORCH_CHECK(check.numel() == b_count && check.scalar_type() == at::kBool && check.is_contiguous(), "check: bool [B]");
  auto first = at::empty({b_count, p}, ip.options().dtype(at::kLong));
  auto bounds = at::empty({b_count, nlist}, ip.options());
  const float* ipp = ip.data_ptr<float>();
  const float* hp = half.numel() ? half.data_ptr<float>() : nullptr;
  const int64_t* lbp = has_bits ? list_bits.data_ptr<int64_t>() : nullptr;
  const int64_t* mp = masks.data_ptr<int64_t>();
  const bool* ngp = negate.data_ptr<bool>();
  const int64_t* nop = none_ptr(none, masks);
  const int64_t* sp = sizes.data_ptr<int64_t>();
  const int64_t* np_ = nprobe.data_ptr<int64_t>();
  const float* fp = factor.data_ptr<float>();
  const float* radp = radius.data_ptr<float>();
  const bool* cp = check.data_ptr<bool>();
  int64_t* firstp = first.data_ptr<int64_t>();
  float* bp = bounds.data_ptr<float>();
  at::parallel_for(0, b_count, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> key(nlist);
    std::vector<uint8_t> reach(nlist, 1);
    int64_t reach_of = -1;  // the row whose filter `reach` was computed for
    std::vector<Cand> heap;
    SelectScratch scratch;
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = ipp + b * nlist;
      const bool filtered = has_bits && cp[b];
      if (filtered && !(reach_of >= 0 && same_filter(mp, ngp, nop, c_count, w, reach_of, b))) {
        lists_admitting(lbp, nlist, w, mp + b * c_count * w, ngp + b * c_count,
                        nop ? nop + b * c_count * w : nullptr, c_count, reach.data());
        reach_of = b;
      }
      for (int64_t l = 0; l < nlist; ++l)
        key[l] = (!filtered || reach[l]) && sp[l] > 0 ? (hp ? row[l] - hp[l] : row[l]) : kNegInf;
      row_topk(key.data(), nlist, p, heap, scratch);
      float* out = bp + b * nlist;
      if (cp[b]) {
        const float f = fp[b];
        for (int64_t l = 0; l < nlist; ++l) {
          const float reach_ = radp[l] * f;  // factor * radius, rounded, then added (no FMA)
          out[l] = key[l] > kNegInf ? row[l] + reach_ : kNegInf;
        }
      } else {
        std::fill(out, out + nlist, kNegInf);
      }
      for (int64_t j = 0; j < p; ++j) {
        const bool have = j < (int64_t)heap.size() && j < np_[b];
        firstp[b * p + j] = have ? heap[j].second : -1;
        if (have) out[heap[j].second] = kNegInf;  // probed in the first round
      }
    }
  });
  return {first, bounds};
}

// The bound check's second round (retrieval/index/search.py, BoundCheck.second_round): per row of
// bounds [B, L], the lists that could still beat kth [B] (bounds > kth) -> todo [B] (some list
// could), exact [B] (todo and their codes, sum of sizes [L], above budget [B]: the exact scan costs
// less) and lists [B, P]: the first P needed lists by index, -1 padded, P = the most a row that
// probes them needs (1 when none does).
std::tuple<at::Tensor, at::Tensor, at::Tensor> second_round_lists(const at::Tensor& bounds, const at::Tensor& kth,
                                                                  const at::Tensor& sizes, const at::Tensor& budget) {
  TORCH_CHECK(bounds.dim() == 2 && bounds.scalar_type() == at::kFloat && bounds.is_contiguous() &&
              bounds.device().is_cpu(), "bounds must be a contiguous CPU float32 [B, L]");
  const int64_t b_count = bounds.size(0), nlist = bounds.size(1);
  TORCH_CHECK(kth.numel() == b_count && kth.scalar_type() == at::kFloat && kth.is_contiguous(), "kth: float32 [B]");
  TORCH_CHECK(budget.numel() == b_count && budget.scalar_type() == at::kFloat && budget.is_contiguous(), "budget: float32 [B]");
  TORCH_CHECK(sizes.numel() == nlist && sizes.scalar_type() == at::kLong && sizes.is_contiguous(), "sizes: int64 [L]");
  auto todo = at::empty({b_count}, bounds.options().dtype(at::kBool));
  auto exact = at::empty({b_count}, bounds.options().dtype(at::kBool));
  std::vector<int64_t> count(b_count);
  const float* bp = bounds.data_ptr<float>();
  const float* kp = kth.data_ptr<float>();
  const float* gp = budget.data_ptr<float>();
  const int64_t* sp = sizes.data_ptr<int64_t>();
  bool* tp = todo.data_ptr<bool>();
  bool* ep = exact.data_ptr<bool>();
  at::parallel_for(0, b_count, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = bp + b * nlist;
      int64_t n = 0, codes = 0;
      for (int64_t l = 0; l < nlist; ++l) {
        const bool need = row[l] > kp[b];
        n += need;
        codes += need ? sp[l] : 0;
      }
      count[b] = n;
      tp[b] = n > 0;
      ep[b] = n > 0 && float(codes) > gp[b];
    }
  });
  int64_t p = 0;
  for (int64_t b = 0; b < b_count; ++b)
    if (tp[b] && !ep[b]) p = std::max(p, count[b]);
  p = std::max<int64_t>(p, 1);
  auto lists = at::full({b_count, p}, -1, bounds.options().dtype(at::kLong));
  int64_t* lp = lists.data_ptr<int64_t>();
  at::parallel_for(0, b_count, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = bp + b * nlist;
      for (int64_t l = 0, j = 0; l < nlist && j < p; ++l)
        if (row[l] > kp[b]) lp[b * p + j++] = l;
    }
  });
  return {todo, exact, lists};
}

}  // namespace ivf
