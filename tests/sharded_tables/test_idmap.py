"""IdMap (C++) against a plain-Python model of the same policies, plus edge cases and state I/O."""

from __future__ import annotations

import heapq

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables.idmap import POLICIES, IdMap

BIG = 2**63 - 1


class RefIdMap:
    """The documented semantics, written for clarity: dicts, a free-slot heap and a full sort."""

    def __init__(self, capacity: int, policy: str, decay_period: int) -> None:
        self.capacity, self.policy, self.decay = capacity, policy, decay_period
        self.slot_of: dict[int, int] = {}
        self.key: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.epoch_at: dict[int, int] = {}
        self.free = list(range(capacity))
        self.tick = 0

    def _count(self, s: int) -> int:
        if self.policy != "hybrid":
            return self.count[s]
        shift = self.tick // self.decay - self.epoch_at[s]
        return self.count[s] >> shift if shift < 63 else 0

    def _touch(self, s: int) -> None:
        self.count[s] = self._count(s) + 1
        self.epoch_at[s] = self.tick // self.decay
        self.last[s] = self.tick

    def _rank(self, s: int) -> tuple[int, ...]:
        if self.policy == "lru":
            return (self.last[s], s)
        return (self._count(s), self.last[s], s)

    def find(self, keys: list[int], record: bool = True) -> list[int]:
        self.tick += record
        out = []
        for k in keys:
            s = self.slot_of.get(k, -1)
            if record and s >= 0:
                self._touch(s)
            out.append(s)
        return out

    def insert(self, keys: list[int]) -> tuple[list[int], list[int], list[int]]:
        if len(set(keys)) > self.capacity:
            raise ValueError("batch too large")
        self.tick += 1
        now = self.tick
        new: list[int] = []
        occ: dict[int, int] = {}
        for k in keys:
            if k in self.slot_of:
                self._touch(self.slot_of[k])
            else:
                if k not in occ:
                    new.append(k)
                    occ[k] = 0
                occ[k] += 1
        assign = [heapq.heappop(self.free) for _ in range(min(len(new), len(self.free)))]
        need = len(new) - len(assign)
        victims = sorted((s for s in self.key if self.last[s] != now), key=self._rank)[:need]
        evicted = [self.key.pop(s) for s in victims]
        for k in evicted:
            del self.slot_of[k]
        assign += victims
        for k, s in zip(new, assign, strict=True):
            self.slot_of[k], self.key[s] = s, k
            self.count[s], self.last[s], self.epoch_at[s] = occ[k], now, now // self.decay
        return [self.slot_of[k] for k in keys], evicted, victims

    def remove(self, keys: list[int]) -> list[int]:
        out = []
        for k in keys:
            s = self.slot_of.pop(k, -1)
            if s >= 0:
                del self.key[s]
                heapq.heappush(self.free, s)
            out.append(s)
        return out

    def state(self) -> list[tuple[int, int, int, int]]:
        return [(self.key[s], s, self._count(s), self.last[s]) for s in sorted(self.key)]


def _t(keys: list[int]) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int64)


def _apply(m: IdMap, ref: RefIdMap, op: str, keys: list[int]) -> None:
    """Runs one op on both and asserts the same answer (or the same error)."""
    if op == "insert":
        try:
            want = ref.insert(keys)
        except ValueError:
            before = m.state_dict()
            with pytest.raises(ValueError, match="distinct keys"):
                m.insert(_t(keys))
            after = m.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)  # rejected: no change
            return
        slots, ev_keys, ev_slots = m.insert(_t(keys))
        assert (slots.tolist(), ev_keys.tolist(), ev_slots.tolist()) == want
    elif op == "remove":
        assert m.remove(_t(keys)).tolist() == ref.remove(keys)
    else:
        record = op == "find"
        assert m.find(_t(keys), record=record).tolist() == ref.find(keys, record=record)


def _state(m: IdMap) -> list[tuple[int, ...]]:
    s = m.state_dict()
    cols = [s[k].tolist() for k in ("keys", "slots", "counts", "last_access")]
    return list(zip(*cols, strict=True))


KEYS = st.one_of(st.integers(0, 12), st.sampled_from([-1, -(2**63), BIG, 1 << 40, (1 << 40) + 16]))
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "insert", "find", "peek", "remove"]),
        st.lists(KEYS, max_size=8),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(0, 6),
    policy=st.sampled_from(POLICIES),
    decay=st.integers(1, 3),
    ops=OPS,
)
def test_matches_reference_model(capacity, policy, decay, ops):
    m, ref = IdMap(capacity, policy, decay), RefIdMap(capacity, policy, decay)
    for op, keys in ops:
        _apply(m, ref, op, keys)
        assert m.size == len(ref.key)
    assert _state(m) == ref.state()
    keys, slots = m.keys_and_slots()
    assert list(zip(keys.tolist(), slots.tolist(), strict=True)) == [s[:2] for s in ref.state()]


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(POLICIES), before=OPS, after=OPS)
def test_state_round_trip_continues_identically(policy, before, after):
    m, ref = IdMap(5, policy, 2), RefIdMap(5, policy, 2)
    for op, keys in before:
        _apply(m, ref, op, keys)
    loaded = IdMap.from_state_dict(m.state_dict(), policy, 2)
    assert _state(loaded) == _state(m)
    for op, keys in after:
        _apply(loaded, ref, op, keys)
    assert _state(loaded) == ref.state()


@pytest.mark.parametrize("policy", POLICIES)
def test_large_random_batches_with_removes(policy):
    """Thousands of keys: stresses probing and backward-shift deletion in the flat table."""
    g = torch.Generator().manual_seed(0)
    m, ref = IdMap(1500, policy, 4), RefIdMap(1500, policy, 4)
    for step in range(30):
        # strided keys land in few home buckets of a naive hash; the map must not care
        keys = (torch.randint(0, 4000, (600,), generator=g) * (1 << 20)).tolist()
        _apply(m, ref, "remove" if step % 5 == 4 else "insert", keys)
        _apply(m, ref, "find", keys[::3])
    assert _state(m) == ref.state()


def test_lru_evicts_least_recent_untouched():
    m = IdMap(3, "lru")
    m.insert(_t([1, 2, 3]))
    m.find(_t([1]))
    slots, ev_keys, ev_slots = m.insert(_t([2, 4]))  # 2 is touched by this batch; 3 is oldest
    assert ev_keys.tolist() == [3] and ev_slots.tolist() == [2] and slots.tolist() == [1, 2]


def test_lfu_evicts_least_frequent_ties_to_older():
    m = IdMap(3, "lfu")
    m.insert(_t([1, 1, 1, 2, 3]))  # counts 3, 1, 1 (each occurrence counts)
    m.find(_t([3]))  # 3: count 2
    m.insert(_t([5]))  # only 2 has count 1
    assert m.find(_t([2]), record=False).tolist() == [-1]
    m.find(_t([5]))  # 5: count 2, same as 3 but more recent
    _, ev_keys, _ = m.insert(_t([6]))
    assert ev_keys.tolist() == [3]


@pytest.mark.parametrize("policy,victim", [("hybrid", 1), ("lfu", 2)])
def test_hybrid_forgets_old_popularity(policy, victim):
    m = IdMap(2, policy, decay_period=1)
    m.insert(_t([1] * 8))  # key 1: 8 accesses at tick 1
    for _ in range(4):
        m.find(_t([2]))
        m.insert(_t([2]))  # key 2: 7 accesses over ticks 3..9
    # At tick 10 hybrid sees 1 as 8 >> 9 = 0 and 2 as 7 >> 1 = 3; plain LFU sees 8 vs 7.
    _, ev_keys, _ = m.insert(_t([3]))
    assert ev_keys.tolist() == [victim]


def test_duplicates_share_a_slot_and_count_each_occurrence():
    m = IdMap(4, "lfu")
    slots, _, _ = m.insert(_t([7, 7, 8, 7]))
    assert slots.tolist() == [0, 0, 1, 0]
    assert m.state_dict()["counts"].tolist() == [3, 1]


def test_capacity_zero_and_one():
    z = IdMap(0)
    assert z.find(_t([1, 2])).tolist() == [-1, -1]
    assert z.insert(_t([]))[0].tolist() == []
    with pytest.raises(ValueError, match="capacity 0"):
        z.insert(_t([1]))
    one = IdMap(1, "lfu")
    assert one.insert(_t([5, 5]))[0].tolist() == [0, 0]
    slots, ev_keys, ev_slots = one.insert(_t([6]))
    assert (slots.tolist(), ev_keys.tolist(), ev_slots.tolist()) == ([0], [5], [0])
    with pytest.raises(ValueError, match="2 distinct keys"):
        one.insert(_t([6, 7]))
    assert one.find(_t([6, 7])).tolist() == [0, -1]


def test_insert_detailed_reports_new_keys():
    m = IdMap(2)
    m.insert(_t([1]))
    r = m.insert_detailed(_t([1, 9, 9]))
    assert r.new_keys.tolist() == [9] and r.new_slots.tolist() == [1]


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.tensor([1.0]), "keys must be an int64"),
        (torch.tensor([[1]]), "keys must be an int64"),
    ],
)
def test_rejects_bad_keys(bad, match):
    with pytest.raises(ValueError, match=match):
        IdMap(2).find(bad)


def test_rejects_bad_config_and_state():
    with pytest.raises(ValueError, match="policy"):
        IdMap(2, "fifo")
    with pytest.raises(ValueError, match="capacity"):
        IdMap(-1)
    m = IdMap(3)
    m.insert(_t([1, 2]))
    state = m.state_dict()
    with pytest.raises(ValueError, match="capacity"):
        IdMap(4).load_state_dict(state)
    with pytest.raises(ValueError, match="slots"):
        IdMap(3).load_state_dict({**state, "slots": _t([0, 0])})
    with pytest.raises(ValueError, match="keys"):
        IdMap(3).load_state_dict({**state, "keys": _t([4, 4])})
    with pytest.raises(ValueError, match="last_access"):
        IdMap(3).load_state_dict({**state, "tick": torch.tensor(0)})
    with pytest.raises(ValueError, match="missing"):
        IdMap(3).load_state_dict({"keys": state["keys"]})


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(POLICIES), before=OPS, batch=st.lists(KEYS, max_size=12))
def test_find_distinct_is_one_find_batch_of_the_distinct_keys(policy, before, batch):
    """``-1`` is padding; the present keys get the slots and accesses (state) of ``find`` on
    them; distinct keys ascending, each key's position among them, hits and misses counted per
    present occurrence."""
    m, ref = IdMap(5, policy, 2), RefIdMap(5, policy, 2)
    for op, keys in before:
        _apply(m, ref, op, keys)
    other = IdMap.from_state_dict(m.state_dict(), policy, 2)
    keys = torch.tensor(batch, dtype=torch.int64)
    present = keys != -1
    got = m.find_distinct(keys)
    slots = other.find(keys[present])
    distinct = sorted(set(keys[present].tolist()))
    assert got.keys.tolist() == distinct
    assert got.positions[present].tolist() == [distinct.index(k) for k in keys[present].tolist()]
    assert got.positions[~present].tolist() == [0] * int((~present).sum())
    assert got.slots[got.positions[present]].tolist() == slots.tolist()
    assert (got.hits, got.misses) == (int((slots >= 0).sum()), int((slots < 0).sum()))
    assert _state(m) == _state(other)


@pytest.mark.parametrize("policy", POLICIES)
def test_find_distinct_counts_every_occurrence_of_a_held_key(policy):
    m, other = IdMap(4, policy, 2), IdMap(4, policy, 2)
    for x in (m, other):
        x.insert(torch.tensor([3, 4]))
    got = m.find_distinct(torch.tensor([4, 3, 4, -1, 9]))
    other.find(torch.tensor([4, 3, 4, 9]))
    assert got.keys.tolist() == [3, 4, 9] and got.slots.tolist()[2] == -1
    assert got.positions.tolist() == [1, 0, 1, 0, 2] and (got.hits, got.misses) == (3, 1)
    assert _state(m) == _state(other)
