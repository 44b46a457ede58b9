// The postings of a hashed attribute's values (retrieval/filters.py: a value's position stored as
// D hexadecimal key digits, each one-hot in 16 bits): value_index lists each item under its
// value's bucket, the top b key digits (the position's lowest b digits: position mod 16^b), and
// value_runs finds the buckets a filter's clauses on those digits leave, so that `creator = k`
// reads the items of k's bucket, not of one digit (a 16th of the catalog).
//
// layout [A, 4] int64, one row an attribute: (first bit, digits D, bucket digits b, first slot);
// the attribute's slots are its 16^b buckets, then one of items whose bucket digits are neither
// all empty nor each one-hot (a signature written by hand: listed so that no answer misses them).
// An item with every bucket digit empty (no value) is listed nowhere: a clause reading only
// those digits has positive bits there, none of which it sets, so it passes no such clause.

#include <algorithm>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "ivf_scan.h"

namespace ivf {

namespace {

constexpr int64_t kMaxBuckets = 1 << 14;
// Buckets one filter may enumerate: past this many (a `!=` on the leading digit, say) its
// candidates are most of the attribute's items, and the enumeration would cost more than it saves.

// The 16 bits from bit `bit` of a row of words (a digit's one-hot field; it may straddle two words).
inline uint32_t field16(const uint64_t* row, int64_t bit) {
  const int64_t word = bit / 64, off = bit % 64;
  uint64_t v = row[word] >> off;
  if (off > 48) v |= row[word + 1] << (64 - off);
  return uint32_t(v & 0xFFFF);
}

struct Layout {
  int64_t base, digits, bucket_digits, first;
  int64_t bit_of_level(int64_t j) const { return base + (digits - 1 - j) * 16; }  // key digit D-1-j
  int64_t buckets() const { return int64_t(1) << (4 * bucket_digits); }
};

Layout layout_row(const int64_t* lp, int64_t a) { return {lp[a * 4], lp[a * 4 + 1], lp[a * 4 + 2], lp[a * 4 + 3]}; }

// The slot of a row's value: its bucket, the overflow slot, or -1 (no value).
int64_t slot_of(const uint64_t* row, const Layout& l) {
  int64_t bucket = 0, empty = 0;
  bool one_hot = true;
  for (int64_t j = 0; j < l.bucket_digits; ++j) {
    const uint32_t f = field16(row, l.bit_of_level(j));
    if (f == 0) ++empty;
    if (__builtin_popcount(f) != 1) one_hot = false;
    else bucket |= int64_t(__builtin_ctz(f)) << (4 * j);
  }
  if (one_hot) return l.first + bucket;
  return empty == l.bucket_digits ? -1 : l.first + l.buckets();
}

}  // namespace

int64_t value_slot_count(const at::Tensor& layout) {
  const int64_t* lp = layout.data_ptr<int64_t>();
  int64_t slots = 0;
  for (int64_t a = 0; a < layout.size(0); ++a) slots += layout_row(lp, a).buckets() + 1;
  return slots;
}

void check_value_postings(const at::Tensor& layout, const at::Tensor& offsets, const at::Tensor& postings, int64_t w) {
  TORCH_CHECK(layout.dim() == 2 && layout.size(1) == 4 && layout.scalar_type() == at::kLong && layout.is_contiguous() &&
                  layout.device().is_cpu(),
              "value layout must be contiguous CPU int64 [A, 4]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              "value offsets must be contiguous int64 [S + 1]");
  TORCH_CHECK(postings.dim() == 1 && postings.scalar_type() == at::kInt && postings.is_contiguous(),
              "value postings must be contiguous int32 [M]");
  const int64_t* lp = layout.data_ptr<int64_t>();
  for (int64_t a = 0; a < layout.size(0); ++a) {
    const Layout l = layout_row(lp, a);
    TORCH_CHECK(l.bucket_digits >= 1 && l.bucket_digits <= l.digits && l.base >= 0 && l.base + l.digits * 16 <= w * 64,
                "value layout row ", a, " does not fit the signatures");
  }
}

// Each item of sig [N, W] under its value's slot of every hashed attribute of layout [A, 4]
// -> (offsets [S + 1] int64, postings [M] int32): slot s holds postings[offsets[s] : offsets[s + 1]],
// ascending. Two passes (count, place): a counting sort by slot.
std::tuple<at::Tensor, at::Tensor> value_index(const at::Tensor& sig, const at::Tensor& layout) {
  TORCH_CHECK(sig.dim() == 2 && sig.scalar_type() == at::kLong && sig.is_contiguous() && sig.device().is_cpu(),
              "sig must be contiguous CPU int64 [N, W]");
  const int64_t n = sig.size(0), w = sig.size(1), attrs = layout.size(0);
  TORCH_CHECK(n < (int64_t(1) << 31), "postings hold int32 positions: at most 2**31 - 1 items");
  auto offsets = at::zeros({1}, sig.options());
  check_value_postings(layout, offsets, at::empty({0}, sig.options().dtype(at::kInt)), w);
  const int64_t* lp = layout.data_ptr<int64_t>();
  for (int64_t a = 0, first = 0; a < attrs; first += layout_row(lp, a).buckets() + 1, ++a)
    TORCH_CHECK(layout_row(lp, a).first == first, "value layout row ", a, ": its first slot must follow the last attribute's");
  const int64_t slots = value_slot_count(layout);
  offsets = at::zeros({slots + 1}, sig.options());
  int64_t* op = offsets.data_ptr<int64_t>();
  const uint64_t* sp = reinterpret_cast<const uint64_t*>(sig.data_ptr<int64_t>());
  std::vector<int64_t> slot(n * attrs);
  at::parallel_for(0, n, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t a = 0; a < attrs; ++a) slot[i * attrs + a] = slot_of(sp + i * w, layout_row(lp, a));
  });
  for (int64_t s : slot)
    if (s >= 0) ++op[s + 1];
  for (int64_t s = 0; s < slots; ++s) op[s + 1] += op[s];
  auto postings = at::empty({op[slots]}, sig.options().dtype(at::kInt));
  int32_t* pp = postings.data_ptr<int32_t>();
  std::vector<int64_t> next(op, op + slots);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t a = 0; a < attrs; ++a)
      if (const int64_t s = slot[i * attrs + a]; s >= 0) pp[next[s]++] = int32_t(i);
  return {offsets, postings};
}

// The slots whose items may pass every clause of one filter (fmask [C, W] words, fneg [C], fnone
// [C, W] or null) that reads only the top bucket digits of hashed attribute `a` of layout
// (non-negated, no "none of" part: such a clause holds on an item iff it holds on its bucket's
// digits). Enumerated digit by digit, from the top: a bucket prefix is extended by the digits every
// clause ending at that digit allows (any, for one a higher digit already satisfies). Appends the
// slots (the overflow one too) to `out` and returns true; false when no clause reads only those
// digits, or past kMaxBuckets (the attribute cannot drive the filter).
bool value_slots(const int64_t* layout, int64_t a, const int64_t* mp, const bool* np, const int64_t* gp,
                 int64_t c_count, int64_t w, std::vector<int64_t>& out) {
  const Layout l = layout_row(layout, a);
  const int64_t lo = l.bit_of_level(l.bucket_digits - 1), hi = l.base + l.digits * 16;
  struct Group { uint32_t field[16]; int64_t last; };  // its digits' bits, level by level; its deepest level
  std::vector<Group> group;
  for (int64_t c = 0; c < c_count; ++c) {
    if (np[c] || (gp && std::any_of(gp + c * w, gp + (c + 1) * w, [](int64_t x) { return x != 0; }))) continue;
    const uint64_t* row = reinterpret_cast<const uint64_t*>(mp + c * w);
    bool inside = true;
    for (int64_t k = 0; k < w && inside; ++k)
      for (uint64_t m = row[k]; m && inside; m &= m - 1) {
        const int64_t bit = k * 64 + __builtin_ctzll(m);
        inside = bit >= lo && bit < hi;
      }
    if (!inside) continue;
    Group g{{0}, -1};
    for (int64_t j = 0; j < l.bucket_digits; ++j)
      if ((g.field[j] = field16(row, l.bit_of_level(j))) != 0) g.last = j;
    group.push_back(g);
  }
  if (group.empty()) return false;
  for (const Group& g : group)
    if (g.last < 0) return true;  // a clause with no bits: nothing passes
  std::vector<int64_t> live{0}, next;
  for (int64_t j = 0; j < l.bucket_digits; ++j) {
    next.clear();
    for (int64_t p : live) {
      uint32_t allowed = 0xFFFF;
      for (const Group& g : group) {
        if (g.last != j) continue;
        bool held = false;  // a higher digit of the prefix already satisfies the clause
        for (int64_t i = 0; i < j && !held; ++i) held = (g.field[i] >> ((p >> (4 * i)) & 15)) & 1;
        if (!held) allowed &= g.field[j];
      }
      for (uint32_t m = allowed; m; m &= m - 1) next.push_back(p | int64_t(__builtin_ctz(m)) << (4 * j));
    }
    if ((int64_t)next.size() > kMaxBuckets) return false;
    std::swap(live, next);
  }
  for (int64_t p : live) out.push_back(l.first + p);
  out.push_back(l.first + l.buckets());
  return true;
}

// The hashed attribute of layout whose buckets hold the fewest items that may pass one filter
// (value_slots), value_offsets [S + 1] giving each slot's items -> their count, and its slots in
// `slots`; -1 when no attribute's clauses narrow it (or the offsets list none: an index that did
// not make them).
int64_t best_value_slots(const at::Tensor& layout, const at::Tensor& offsets, const int64_t* mp, const bool* np,
                         const int64_t* gp, int64_t c_count, int64_t w, std::vector<int64_t>& slots) {
  const int64_t* vo = offsets.data_ptr<int64_t>();
  if (offsets.numel() != value_slot_count(layout) + 1) return -1;
  int64_t best = -1;
  std::vector<int64_t> mine;
  for (int64_t a = 0; a < layout.size(0); ++a) {
    mine.clear();
    if (!value_slots(layout.data_ptr<int64_t>(), a, mp, np, gp, c_count, w, mine)) continue;
    int64_t count = 0;
    for (int64_t s : mine) count += vo[s + 1] - vo[s];
    if (best < 0 || count < best) best = count, slots.swap(mine);
  }
  return best;
}

// best_value_slots for one filter (fmask [C, W], fneg [C], fnone [C, W] or empty) as tensors ->
// (items, slots [k] int64): what eligible_rows drives from, for the torch path and the planner.
std::tuple<int64_t, at::Tensor> value_drive(const at::Tensor& layout, const at::Tensor& offsets, const at::Tensor& fmask,
                                            const at::Tensor& fneg, const at::Tensor& fnone) {
  TORCH_CHECK(fmask.dim() == 2 && fmask.scalar_type() == at::kLong && fmask.is_contiguous() && fmask.device().is_cpu(),
              "fmask must be contiguous CPU int64 [C, W]");
  TORCH_CHECK(fneg.dim() == 1 && fneg.size(0) == fmask.size(0) && fneg.scalar_type() == at::kBool && fneg.is_contiguous(),
              "fneg must be bool [C]");
  TORCH_CHECK(offsets.device().is_cpu(), "value offsets must be on the CPU");
  check_value_postings(layout, offsets, at::empty({0}, offsets.options().dtype(at::kInt)), fmask.size(1));
  std::vector<int64_t> slots;
  const int64_t count = best_value_slots(layout, offsets, fmask.data_ptr<int64_t>(), fneg.data_ptr<bool>(),
                                         none_ptr(fnone, fmask), fmask.size(0), fmask.size(1), slots);
  auto out = at::empty({(int64_t)slots.size()}, offsets.options());
  std::copy(slots.begin(), slots.end(), out.data_ptr<int64_t>());
  return {count, out};
}

}  // namespace ivf
