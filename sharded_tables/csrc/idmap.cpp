// IdMap: raw int64 keys -> slots [0, capacity) with exact, policy-driven eviction.
//
// Keys live in a flat open-addressing table (linear probing, load <= 1/2, backward-shift deletion,
// so no tombstones and no per-node allocation). Per-slot metadata (key, access count, last access
// tick, decay epoch) sits in plain vectors indexed by slot.
//
// Time is counted in batches: every recording call (find with record=true, insert) advances the
// tick by one, and every occurrence of a key in that call is one access at that tick. A slot whose
// last access equals the current tick was touched by this batch and is never a victim of it.
//
// Victims (only when the batch's new keys outnumber the free slots) are chosen exactly, ties broken
// by slot index, so results are deterministic and match a plain reference model. LRU keeps a queue
// of (tick, slot) in access order (an entry goes stale when its slot is touched again or freed) and
// pops victims from its front: O(victims) a batch, amortized. Hybrid keeps the occupied slots
// whose decayed count is 0 ordered by (last access, slot), fed by a heap of the epochs at which
// counts reach 0: its victims come from the front of that order, O(victims log capacity), and only
// a batch that needs more victims than there are such slots ranks every slot. LFU ranks the
// untouched occupied slots by their score with nth_element (O(capacity)):
//   lru    (last access, slot)
//   lfu    (count, last access, slot)
//   hybrid (count >> epochs since its last access, last access, slot), epoch = tick / decay_period,
//          i.e. LFU whose counts halve every decay_period batches (lazily, on read).
// New keys of a batch (first-occurrence order) take free slots lowest first, then victim slots in
// rank order. Every batch call releases the GIL and holds the map's own mutex.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <queue>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kEmpty = -1;
constexpr int64_t kPrefetchAhead = 16;

inline uint64_t mix64(uint64_t x) {  // splitmix64 finalizer: ids are often sequential or strided
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

struct Entry {
  int64_t key;
  int64_t value;  // kEmpty marks a free bucket, so every int64 key is usable
};

class FlatMap {
 public:
  explicit FlatMap(int64_t expected) {
    uint64_t n = 4;
    while (n < 2 * uint64_t(std::max<int64_t>(expected, 1))) n <<= 1;
    table_.assign(n, Entry{0, kEmpty});
    mask_ = n - 1;
  }

  uint64_t home(int64_t key) const { return mix64(uint64_t(key)) & mask_; }

  void prefetch(int64_t key) const { __builtin_prefetch(&table_[home(key)]); }

  int64_t find(int64_t key) const {
    for (uint64_t i = home(key);; i = (i + 1) & mask_) {
      const Entry& e = table_[i];
      if (e.value == kEmpty) return kEmpty;
      if (e.key == key) return e.value;
    }
  }

  void insert(int64_t key, int64_t value) {  // key must be absent
    uint64_t i = home(key);
    while (table_[i].value != kEmpty) i = (i + 1) & mask_;
    table_[i] = Entry{key, value};
  }

  // Removes key; returns its value or kEmpty. Later entries of the probe run shift back into the
  // hole unless their home lies cyclically in (hole, j], which keeps every lookup path intact.
  int64_t erase(int64_t key) {
    uint64_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (table_[i].value == kEmpty) return kEmpty;
      if (table_[i].key == key) break;
    }
    const int64_t value = table_[i].value;
    uint64_t hole = i;
    for (uint64_t j = (hole + 1) & mask_; table_[j].value != kEmpty; j = (j + 1) & mask_) {
      const uint64_t h = home(table_[j].key);
      if (((j - h) & mask_) >= ((j - hole) & mask_)) {
        table_[hole] = table_[j];
        hole = j;
      }
    }
    table_[hole].value = kEmpty;
    return value;
  }

  void clear() { std::fill(table_.begin(), table_.end(), Entry{0, kEmpty}); }

 private:
  std::vector<Entry> table_;
  uint64_t mask_;
};

struct Rank {  // lexicographic victim order: smallest first
  int64_t a, b, slot;
  bool operator<(const Rank& o) const { return std::tie(a, b, slot) < std::tie(o.a, o.b, o.slot); }
};

at::Tensor to_tensor(const std::vector<int64_t>& v) {
  auto t = at::empty({int64_t(v.size())}, at::kLong);
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

void check_keys(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(),
              name, " must be a contiguous CPU int64 [n] tensor");
}

class IdMap {
 public:
  IdMap(int64_t capacity, int64_t policy, int64_t decay_period)
      : capacity_(capacity), policy_(policy), decay_(decay_period), map_(capacity) {
    if (capacity < 0) throw std::invalid_argument("capacity must be >= 0");
    if (policy < 0 || policy > 2) throw std::invalid_argument("policy must be 0 (lru), 1 (lfu) or 2 (hybrid)");
    if (decay_period < 1) throw std::invalid_argument("decay_period must be >= 1");
    key_.assign(capacity, 0);
    count_.assign(capacity, 0);
    last_.assign(capacity, kEmpty);
    epoch_at_.assign(capacity, 0);
    zero_last_.assign(capacity, kEmpty);
    reset_free();
  }

  int64_t capacity() const { return capacity_; }
  int64_t size() const { return size_; }
  int64_t tick() const { return tick_; }

  at::Tensor find(const at::Tensor& keys, bool record) {
    check_keys(keys, "keys");
    const int64_t n = keys.size(0);
    auto out = at::empty({n}, at::kLong);
    const int64_t* k = keys.data_ptr<int64_t>();
    int64_t* o = out.data_ptr<int64_t>();
    py::gil_scoped_release no_gil;
    std::lock_guard<std::mutex> lock(mu_);
    if (record) ++tick_;
    for (int64_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n) map_.prefetch(k[i + kPrefetchAhead]);
      const int64_t s = map_.find(k[i]);
      o[i] = s;
      if (record && s >= 0) touch(s);
    }
    return out;
  }

  // keys [n] (any order, repeats; -1 = padding) -> (the distinct present keys ascending [u], their
  // slots [u] (-1: absent), each key's position among them [n] (0 for padding), hits, misses).
  // With record it is one batch of find: every present occurrence is one access.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t> find_distinct(const at::Tensor& keys,
                                                                                 bool record) {
    check_keys(keys, "keys");
    const int64_t n = keys.size(0);
    const int64_t* k = keys.data_ptr<int64_t>();
    auto pos = at::zeros({n}, at::kLong);
    int64_t* p = pos.data_ptr<int64_t>();
    std::vector<std::pair<int64_t, int64_t>> present;  // (key, position in keys)
    present.reserve(n);
    for (int64_t i = 0; i < n; ++i)
      if (k[i] != -1) present.emplace_back(k[i], i);
    std::sort(present.begin(), present.end());
    std::vector<int64_t> distinct, occurrences;
    for (const auto& [key, i] : present) {
      if (distinct.empty() || distinct.back() != key) {
        distinct.push_back(key);
        occurrences.push_back(0);
      }
      ++occurrences.back();
      p[i] = int64_t(distinct.size()) - 1;
    }
    const int64_t u = int64_t(distinct.size());
    auto slots = at::empty({u}, at::kLong);
    int64_t* o = slots.data_ptr<int64_t>();
    int64_t hits = 0;
    {
      py::gil_scoped_release no_gil;
      std::lock_guard<std::mutex> lock(mu_);
      if (record) ++tick_;
      for (int64_t j = 0; j < u; ++j) {
        const int64_t s = map_.find(distinct[j]);
        o[j] = s;
        if (s < 0) continue;
        hits += occurrences[j];
        if (record)
          for (int64_t r = 0; r < occurrences[j]; ++r) touch(s);
      }
    }
    return {to_tensor(distinct), slots, pos, hits, int64_t(present.size()) - hits};
  }

  // -> (slots [n], evicted keys [m], evicted slots [m], new keys [u], new slots [u])
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> insert(const at::Tensor& keys) {
    check_keys(keys, "keys");
    const int64_t n = keys.size(0);
    auto out = at::empty({n}, at::kLong);
    const int64_t* k = keys.data_ptr<int64_t>();
    int64_t* o = out.data_ptr<int64_t>();
    std::vector<int64_t> evicted_keys, assign, new_keys;
    {
      py::gil_scoped_release no_gil;
      std::lock_guard<std::mutex> lock(mu_);
      const int64_t now = ++tick_;
      // Pass 1: look up; mark hit slots touched (old ticks kept so a rejected batch changes nothing).
      std::vector<std::pair<int64_t, int64_t>> touched;  // (slot, previous last access)
      std::vector<int64_t> miss_pos;
      for (int64_t i = 0; i < n; ++i) {
        if (i + kPrefetchAhead < n) map_.prefetch(k[i + kPrefetchAhead]);
        const int64_t s = map_.find(k[i]);
        o[i] = s;
        if (s < 0) {
          miss_pos.push_back(i);
        } else if (last_[s] != now) {
          touched.emplace_back(s, last_[s]);
          last_[s] = now;
          queue_touch(s);
        }
      }
      // Distinct new keys in first-occurrence order; o[] holds -2 - (their index) until assigned.
      FlatMap batch(int64_t(miss_pos.size()));
      std::vector<int64_t> occurrences;
      for (int64_t p : miss_pos) {
        int64_t j = batch.find(k[p]);
        if (j < 0) {
          j = int64_t(new_keys.size());
          batch.insert(k[p], j);
          new_keys.push_back(k[p]);
          occurrences.push_back(0);
        }
        ++occurrences[j];
        o[p] = -2 - j;
      }
      const int64_t distinct = int64_t(new_keys.size() + touched.size());
      if (distinct > capacity_) {
        for (auto& [s, prev] : touched) last_[s] = prev;
        --tick_;
        throw std::invalid_argument("insert: the batch holds " + std::to_string(distinct) +
                                    " distinct keys but the map has capacity " + std::to_string(capacity_));
      }
      for (int64_t i = 0; i < n; ++i)
        if (o[i] >= 0) touch(o[i]);
      // Slots for the new keys: free ones lowest first, then exact victims in rank order.
      const int64_t from_free = std::min<int64_t>(int64_t(new_keys.size()), int64_t(free_.size()));
      for (int64_t j = 0; j < from_free; ++j) assign.push_back(pop_free());
      const int64_t need = int64_t(new_keys.size()) - from_free;
      if (need > 0) {
        const std::vector<int64_t> victims =
            policy_ == 0 ? lru_victims(need, now) : policy_ == 2 ? hybrid_victims(need, now) : ranked_victims(need, now);
        for (const int64_t s : victims) {
          evicted_keys.push_back(key_[s]);
          map_.erase(key_[s]);
          assign.push_back(s);
        }
        size_ -= need;
      }
      const int64_t epoch_now = now / decay_;
      for (size_t j = 0; j < new_keys.size(); ++j) {
        const int64_t s = assign[j];
        map_.insert(new_keys[j], s);
        key_[s] = new_keys[j];
        count_[s] = occurrences[j];
        last_[s] = now;
        epoch_at_[s] = epoch_now;
        queue_touch(s);
        track(s);
      }
      size_ += int64_t(new_keys.size());
      for (int64_t p : miss_pos) o[p] = assign[-2 - o[p]];
    }
    std::vector<int64_t> evicted_slots(assign.end() - int64_t(evicted_keys.size()), assign.end());
    return {out, to_tensor(evicted_keys), to_tensor(evicted_slots), to_tensor(new_keys), to_tensor(assign)};
  }

  // -> slots [n] the keys held (-1 where absent, and for repeats of a key already removed)
  at::Tensor remove(const at::Tensor& keys) {
    check_keys(keys, "keys");
    const int64_t n = keys.size(0);
    auto out = at::empty({n}, at::kLong);
    const int64_t* k = keys.data_ptr<int64_t>();
    int64_t* o = out.data_ptr<int64_t>();
    py::gil_scoped_release no_gil;
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = map_.erase(k[i]);
      o[i] = s;
      if (s >= 0) {
        zero_erase(s);
        last_[s] = kEmpty;
        count_[s] = 0;
        free_.push_back(s);
        std::push_heap(free_.begin(), free_.end(), std::greater<int64_t>());
        --size_;
      }
    }
    return out;
  }

  // -> (keys, slots, counts, last access) of occupied slots in slot order, and the tick. Hybrid
  // counts are exported already decayed, so a loaded map continues exactly where this one stands.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t> state() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> keys, slots, counts, last;
    for (int64_t s = 0; s < capacity_; ++s) {
      if (last_[s] == kEmpty) continue;
      keys.push_back(key_[s]);
      slots.push_back(s);
      counts.push_back(count(s));
      last.push_back(last_[s]);
    }
    return {to_tensor(keys), to_tensor(slots), to_tensor(counts), to_tensor(last), tick_};
  }

  void load(const at::Tensor& keys, const at::Tensor& slots, const at::Tensor& counts, const at::Tensor& last,
            int64_t tick) {
    check_keys(keys, "keys");
    check_keys(slots, "slots");
    check_keys(counts, "counts");
    check_keys(last, "last_access");
    const int64_t n = keys.size(0);
    if (slots.size(0) != n || counts.size(0) != n || last.size(0) != n)
      throw std::invalid_argument("keys, slots, counts and last_access must have the same length");
    if (n > capacity_)
      throw std::invalid_argument("state holds " + std::to_string(n) + " keys, capacity is " + std::to_string(capacity_));
    if (tick < 0) throw std::invalid_argument("tick must be >= 0");
    const int64_t *kp = keys.data_ptr<int64_t>(), *sp = slots.data_ptr<int64_t>();
    const int64_t *cp = counts.data_ptr<int64_t>(), *lp = last.data_ptr<int64_t>();
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
    std::fill(last_.begin(), last_.end(), kEmpty);
    size_ = 0;
    tick_ = tick;
    auto fail = [&](const std::string& msg) {  // a rejected state leaves the map empty
      map_.clear();
      std::fill(last_.begin(), last_.end(), kEmpty);
      size_ = 0;
      reset_free();
      queue_.clear();
      queued_ = 0;
      rebuild_decays();
      throw std::invalid_argument(msg);
    };
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = sp[i];
      if (s < 0 || s >= capacity_) fail("slots: " + std::to_string(s) + " is outside [0, capacity)");
      if (last_[s] != kEmpty) fail("slots: " + std::to_string(s) + " appears twice");
      if (map_.find(kp[i]) >= 0) fail("keys: " + std::to_string(kp[i]) + " appears twice");
      if (cp[i] < 0) fail("counts must be >= 0");
      if (lp[i] < 0 || lp[i] > tick) fail("last_access must be in [0, tick]");
      map_.insert(kp[i], s);
      key_[s] = kp[i];
      count_[s] = cp[i];
      last_[s] = lp[i];
      epoch_at_[s] = tick / decay_;
      ++size_;
    }
    reset_free();
    if (policy_ == 0) rebuild_queue();
    rebuild_decays();
  }

 private:
  // Access count as the policy sees it now (hybrid: halved once per epoch boundary crossed).
  int64_t count(int64_t s) const {
    if (policy_ != 2) return count_[s];
    const int64_t shift = tick_ / decay_ - epoch_at_[s];
    return shift >= 63 ? 0 : (count_[s] >> shift);
  }

  void touch(int64_t s) {
    count_[s] = count(s) + 1;
    epoch_at_[s] = tick_ / decay_;
    if (last_[s] != tick_) {
      last_[s] = tick_;
      queue_touch(s);
    }
    track(s);
  }

  // Hybrid's order of zero-count slots. count_[s] is as of epoch epoch_at_[s], so the decayed
  // count reaches 0 at epoch epoch_at_[s] + bit length of count_[s] and stays 0 until a touch.
  int64_t zero_epoch(int64_t s) const {
    const uint64_t c = uint64_t(count_[s]);
    return epoch_at_[s] + (c == 0 ? 0 : 64 - __builtin_clzll(c));
  }

  void zero_erase(int64_t s) {
    if (zero_last_[s] == kEmpty) return;
    zero_.erase({zero_last_[s], s});
    zero_last_[s] = kEmpty;
  }

  void zero_insert(int64_t s) {
    zero_.emplace(last_[s], s);
    zero_last_[s] = last_[s];
  }

  // s's count just rose (a touch, a new key): it leaves the zero order until its count decays
  // again (heap entries go stale on later touches; rebuilt when they outnumber slots 4 to 1).
  void track(int64_t s) {
    if (policy_ != 2) return;
    zero_erase(s);
    decays_.emplace(zero_epoch(s), s);
    if (int64_t(decays_.size()) > 4 * capacity_ + 1024) rebuild_decays();
  }

  // Slots whose counts have decayed to 0 by now join the zero order.
  void drain() {
    const int64_t epoch = tick_ / decay_;
    while (!decays_.empty() && decays_.top().first <= epoch) {
      const auto [at, s] = decays_.top();
      decays_.pop();
      if (last_[s] != kEmpty && zero_last_[s] == kEmpty && zero_epoch(s) == at) zero_insert(s);
    }
  }

  void rebuild_decays() {
    if (policy_ != 2) return;
    zero_.clear();
    std::fill(zero_last_.begin(), zero_last_.end(), kEmpty);
    decays_ = {};
    for (int64_t s = 0; s < capacity_; ++s) {
      if (last_[s] == kEmpty) continue;
      if (count(s) == 0) {
        zero_insert(s);
      } else {
        decays_.emplace(zero_epoch(s), s);
      }
    }
  }

  // Hybrid: the `need` smallest ranks, in rank order. Zero-count slots rank first, by (last access,
  // slot), and none was touched by this batch (a touch makes a count >= 1); when they are too few,
  // every untouched slot is ranked.
  std::vector<int64_t> hybrid_victims(int64_t need, int64_t now) {
    drain();
    std::vector<int64_t> out;
    if (int64_t(zero_.size()) >= need) {
      for (auto it = zero_.begin(); int64_t(out.size()) < need;) {
        out.push_back(it->second);
        zero_last_[it->second] = kEmpty;
        it = zero_.erase(it);
      }
      return out;
    }
    out = ranked_victims(need, now);
    for (const int64_t s : out) zero_erase(s);
    return out;
  }

  // LRU's access queue: one bucket per tick, in tick order, holding the slots whose last access
  // moved to that tick (appended as it happens); an entry is live while last_[slot] equals the
  // bucket's tick. A bucket is sorted (and deduplicated) once, when eviction first reaches it.
  // Rebuilt from last_ when entries outnumber slots four to one (amortized O(1) an access).
  struct Bucket {
    int64_t tick;
    std::vector<int64_t> slots;
    size_t head = 0;  // slots before head were taken or found stale
    bool sorted = false;
  };

  void queue_touch(int64_t s) {
    if (policy_ != 0) return;
    if (queue_.empty() || queue_.back().tick != last_[s]) queue_.push_back(Bucket{last_[s], {}});
    queue_.back().slots.push_back(s);
    if (++queued_ > 4 * capacity_ + 1024) rebuild_queue();
  }

  void rebuild_queue() {
    queue_.clear();
    queued_ = 0;
    std::vector<std::pair<int64_t, int64_t>> live;
    for (int64_t s = 0; s < capacity_; ++s)
      if (last_[s] != kEmpty) live.emplace_back(last_[s], s);
    std::sort(live.begin(), live.end());
    for (const auto& [t, s] : live) {
      if (queue_.empty() || queue_.back().tick != t) queue_.push_back(Bucket{t, {}, 0, true});
      queue_.back().slots.push_back(s);
      ++queued_;
    }
  }

  // The `need` least recent untouched slots, (last access, slot) ascending: bucket by bucket from
  // the queue's front (a slot may be queued twice in one tick after a refused batch: once counts).
  // Slots of the current tick are never victims.
  std::vector<int64_t> lru_victims(int64_t need, int64_t now) {
    std::vector<int64_t> out;
    while (int64_t(out.size()) < need) {
      if (queue_.empty()) throw std::logic_error("idmap: LRU queue ran out of victims");
      Bucket& b = queue_.front();
      if (b.tick >= now) throw std::logic_error("idmap: LRU victims reached the current batch");
      if (!b.sorted) {
        std::sort(b.slots.begin(), b.slots.end());
        const auto end = std::unique(b.slots.begin(), b.slots.end());
        queued_ -= int64_t(b.slots.end() - end);
        b.slots.erase(end, b.slots.end());
        b.sorted = true;
      }
      while (b.head < b.slots.size() && int64_t(out.size()) < need) {
        const int64_t s = b.slots[b.head++];
        --queued_;
        if (last_[s] == b.tick) out.push_back(s);
      }
      if (b.head == b.slots.size()) queue_.pop_front();
    }
    return out;
  }

  // LFU / hybrid: the `need` smallest ranks among the untouched occupied slots, in rank order.
  std::vector<int64_t> ranked_victims(int64_t need, int64_t now) {
    ranks_.clear();
    for (int64_t s = 0; s < capacity_; ++s)
      if (last_[s] != kEmpty && last_[s] != now) ranks_.push_back(rank(s));
    std::nth_element(ranks_.begin(), ranks_.begin() + need, ranks_.end());
    std::sort(ranks_.begin(), ranks_.begin() + need);
    std::vector<int64_t> out;
    for (int64_t v = 0; v < need; ++v) out.push_back(ranks_[v].slot);
    return out;
  }

  Rank rank(int64_t s) const {
    if (policy_ == 0) return Rank{last_[s], 0, s};
    return Rank{count(s), last_[s], s};
  }

  int64_t pop_free() {
    std::pop_heap(free_.begin(), free_.end(), std::greater<int64_t>());
    const int64_t s = free_.back();
    free_.pop_back();
    return s;
  }

  void reset_free() {  // every slot without a key, as a min-heap (ascending order already is one)
    free_.clear();
    for (int64_t s = 0; s < capacity_; ++s)
      if (last_[s] == kEmpty) free_.push_back(s);
  }

  const int64_t capacity_, policy_, decay_;
  FlatMap map_;
  std::vector<int64_t> key_, count_, last_, epoch_at_;  // per slot; last_ == kEmpty: slot is free
  std::vector<int64_t> free_;                           // min-heap of free slots
  std::vector<Rank> ranks_;                             // reused victim-ranking buffer (LFU, hybrid)
  std::set<std::pair<int64_t, int64_t>> zero_;          // hybrid: (last access, slot), decayed count 0
  std::vector<int64_t> zero_last_;                      // hybrid: a slot's key in zero_; kEmpty: absent
  std::priority_queue<std::pair<int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>,
                      std::greater<>>
      decays_;  // hybrid: (epoch a count reaches 0, slot), min first; stale entries skipped
  std::deque<Bucket> queue_;                            // LRU: slots by the tick of their access
  int64_t queued_ = 0;                                  // LRU: entries in queue_
  int64_t tick_ = 0, size_ = 0;
  std::mutex mu_;
};

// Count-min sketch update (sharded_tables/id_transformer.py's AdmissionSketch): one sighting of
// every element of ids int64 [n] in counts int32 [depth, width] (in place), then each id's
// estimate, the minimum of its depth counters -> int64 [n]. Row r hashes an id with its 32-bit
// halves lo, hi as ((lo a_r) mod p + (hi b_r) mod p + c_r) mod p mod width, p = 2^31 - 1,
// coef int64 [3, depth, 1] holding a, b, c (each < p, so every product fits in 63 bits): the
// same buckets as the NumPy reference. Every sighting is added before any estimate is read.
at::Tensor sketch_add(at::Tensor counts, const at::Tensor& coef, const at::Tensor& ids) {
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kInt && counts.dim() == 2 &&
                  counts.is_contiguous(),
              "counts must be a contiguous int32 [depth, width] CPU tensor");
  const int64_t depth = counts.size(0), width = counts.size(1);
  TORCH_CHECK(coef.device().is_cpu() && coef.scalar_type() == at::kLong && coef.numel() == 3 * depth,
              "coef must be int64 [3, depth, 1] on the CPU");
  check_keys(ids, "ids");
  const at::Tensor c = coef.contiguous();
  const int64_t* a = c.data_ptr<int64_t>();  // a[r], b = a[depth + r], c = a[2 depth + r]
  const int64_t n = ids.size(0);
  const int64_t* k = ids.data_ptr<int64_t>();
  int32_t* cnt = counts.data_ptr<int32_t>();
  auto out = at::empty({n}, at::kLong);
  int64_t* est = out.data_ptr<int64_t>();
  constexpr uint64_t kPrime = (uint64_t(1) << 31) - 1;
  std::vector<int64_t> at_(n * depth);
  {
    py::gil_scoped_release no_gil;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t lo = uint64_t(k[i]) & 0xFFFFFFFFULL, hi = uint64_t(k[i]) >> 32;
      for (int64_t r = 0; r < depth; ++r) {
        const uint64_t h = ((lo * uint64_t(a[r])) % kPrime + (hi * uint64_t(a[depth + r])) % kPrime +
                            uint64_t(a[2 * depth + r])) % kPrime;
        const int64_t bucket = r * width + int64_t(h % uint64_t(width));
        at_[i * depth + r] = bucket;
        ++cnt[bucket];
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      int64_t m = cnt[at_[i * depth]];
      for (int64_t r = 1; r < depth; ++r) m = std::min<int64_t>(m, cnt[at_[i * depth + r]]);
      est[i] = m;
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<IdMap>(m, "IdMap")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("capacity"), py::arg("policy"), py::arg("decay_period"))
      .def("capacity", &IdMap::capacity)
      .def("size", &IdMap::size)
      .def("tick", &IdMap::tick)
      .def("find", &IdMap::find, py::arg("keys"), py::arg("record"))
      .def("find_distinct", &IdMap::find_distinct, py::arg("keys"), py::arg("record"))
      .def("insert", &IdMap::insert, py::arg("keys"))
      .def("remove", &IdMap::remove, py::arg("keys"))
      .def("state", &IdMap::state)
      .def("load", &IdMap::load, py::arg("keys"), py::arg("slots"), py::arg("counts"), py::arg("last"),
           py::arg("tick"));
  m.def("sketch_add", &sketch_add, py::arg("counts"), py::arg("coef"), py::arg("ids"));
}
