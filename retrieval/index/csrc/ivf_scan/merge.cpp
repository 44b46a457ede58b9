// The bound check's merge of two rounds (search._second_round on the CPU): per row, the first
// round's candidates beside the second round's, each key once, the best r by approximate score,
// then the best k by final score, written into the top. One parallel region over blocks of rows:
// the torch ops it replaces (gather, cat, sort, scatter, masked_fill, topk, index_put) each woke
// the thread team, which on a loaded 2-core machine cost more than their work.

#include "ivf_scan.h"

namespace ivf {

namespace {

// One candidate of a row: its scores, its key, and its column in the two rounds side by side
// (first round's columns, then the second's), the order at equal scores.
struct Entry {
  float approx, score;
  int64_t key, col;
};

// The higher `by` first, then the lower column (a selection's order at ties).
template <float Entry::*by>
struct Before {
  bool operator()(const Entry& a, const Entry& b) const {
    return a.*by > b.*by || (a.*by == b.*by && a.col < b.col);
  }
};

// The best n of `e` by score, in that order (a selection, then a sort of the n).
void keep_best_scores(std::vector<Entry>& e, size_t n) {
  if (n < e.size()) {
    std::nth_element(e.begin(), e.begin() + n, e.end(), Before<&Entry::score>());
    e.resize(n);
  }
  std::sort(e.begin(), e.end(), Before<&Entry::score>());
}

// Keys met in a row, open addressing (key + 1 in a slot, 0 free): a row's repeats in one pass.
class SeenKeys {
 public:
  void reset(size_t n) {
    size_t want = 16;
    while (want < 2 * n) want *= 2;
    slots_.assign(want, 0);
  }
  // False when key was met before (key >= 0).
  bool insert(int64_t key) {
    const size_t mask = slots_.size() - 1;
    for (size_t h = (uint64_t(key) * 0x9E3779B97F4A7C15ull) >> 40 & mask;; h = (h + 1) & mask) {
      if (slots_[h] == key + 1) return false;
      if (slots_[h] == 0) return slots_[h] = key + 1, true;
    }
  }

 private:
  std::vector<int64_t> slots_;
};

void check_round(const at::Tensor& keys, const at::Tensor& approx, const at::Tensor& scores, int64_t rows,
                 const char* what) {
  TORCH_CHECK(keys.dim() == 2 && keys.size(0) == rows && keys.scalar_type() == at::kLong && keys.is_contiguous() &&
                  keys.device().is_cpu(), what, " keys must be contiguous CPU int64 [rows, W]");
  for (const at::Tensor* t : {&approx, &scores})
    TORCH_CHECK(t->sizes() == keys.sizes() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->device().is_cpu(), what, " scores must be contiguous CPU float32 like its keys");
}

}  // namespace

// Rows `rows [b]` of the top (keys [B, k] int64, approx / scores [B, k] float32, written in place)
// <- the best k by score of the best r by approx of: the first round's row (first_* [B, W1]; none
// where `drop [b]` bool: an exact row keeps its scan alone) beside the second round's (more_*
// [b, W2]), a key met again emptied (the first met kept; -1 never counts). Pads: -1 / -inf, and
// -1 wherever the score is -inf (what search.select_top writes). The top may be the first round
// itself: each row is read whole before it is written.
void merge_rounds(at::Tensor& top_keys, at::Tensor& top_approx, at::Tensor& top_scores, const at::Tensor& first_keys,
                  const at::Tensor& first_approx, const at::Tensor& first_scores, const at::Tensor& rows,
                  const at::Tensor& drop, const at::Tensor& more_keys, const at::Tensor& more_approx,
                  const at::Tensor& more_scores, int64_t r) {
  const int64_t b_all = top_keys.size(0), b = rows.numel();
  check_round(top_keys, top_approx, top_scores, b_all, "top");
  check_round(first_keys, first_approx, first_scores, b_all, "first");
  check_round(more_keys, more_approx, more_scores, b, "more");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be int64 [b]");
  TORCH_CHECK(drop.dim() == 1 && drop.numel() == b && drop.scalar_type() == at::kBool && drop.is_contiguous(),
              "drop must be bool [b]");
  const int64_t k = top_keys.size(1), w1 = first_keys.size(1), w2 = more_keys.size(1);
  TORCH_CHECK(r >= k, "r must be at least k");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < b_all, "rows must index the top");
  const bool* dp = drop.data_ptr<bool>();
  const int64_t *fk = first_keys.data_ptr<int64_t>(), *mk = more_keys.data_ptr<int64_t>();
  const float *fa = first_approx.data_ptr<float>(), *fs = first_scores.data_ptr<float>();
  const float *ma = more_approx.data_ptr<float>(), *ms = more_scores.data_ptr<float>();
  int64_t* tk = top_keys.data_ptr<int64_t>();
  float *ta = top_approx.data_ptr<float>(), *ts = top_scores.data_ptr<float>();
  at::parallel_for(0, b, 64, [&](int64_t i0, int64_t i1) {
    std::vector<Entry> e;
    SeenKeys seen;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = rp[i];
      e.clear();
      seen.reset(size_t(w1 + w2));
      // a key met again is emptied (the first met kept, as its scores are the same); emptied
      // entries (-1 / -inf) can only be picked as -1 / -inf pads: left out
      const auto add = [&](int64_t key, float a, float s, int64_t col) {
        if (key >= 0 ? seen.insert(key) : (a > kNegInf || s > kNegInf)) e.push_back({a, s, key, col});
      };
      if (!dp[i])
        for (int64_t j = 0; j < w1; ++j) add(fk[row * w1 + j], fa[row * w1 + j], fs[row * w1 + j], j);
      for (int64_t j = 0; j < w2; ++j) add(mk[i * w2 + j], ma[i * w2 + j], ms[i * w2 + j], w1 + j);
      if (w1 + w2 > r && int64_t(e.size()) > r) {  // the best r by approx, in no order
        std::nth_element(e.begin(), e.begin() + r, e.end(), Before<&Entry::approx>());
        e.resize(size_t(r));
      }
      keep_best_scores(e, size_t(k));
      for (int64_t j = 0; j < k; ++j) {
        const bool have = j < int64_t(e.size()) && e[j].score > kNegInf;
        tk[row * k + j] = have ? e[j].key : -1;
        ta[row * k + j] = j < int64_t(e.size()) ? e[j].approx : kNegInf;
        ts[row * k + j] = have ? e[j].score : kNegInf;
      }
    }
  });
}

}  // namespace ivf
