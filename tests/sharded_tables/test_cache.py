"""HotRowCache: hits, misses and evictions on a known sequence; counters; capacity 0."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from sharded_tables.cache import HotRowCache


def _t(keys: list[int]) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int64)


def _rows(keys: list[int], rb: int = 3) -> torch.Tensor:
    """A recognisable packed row per key: every byte is ``key % 256``."""
    return _t(keys).remainder(256).to(torch.uint8)[:, None].expand(-1, rb).contiguous()


def _metric(kind: str, name: str) -> float:
    return REGISTRY.get_sample_value(f"recserve_cache_{kind}_total", {"cache": name}) or 0.0


def test_known_sequence_lru():
    cache = HotRowCache(2, 3, policy="lru", name="test_known_sequence")
    rows, hit = cache.get(_t([1, 2]))
    assert not hit.any() and not rows.any()
    cache.put(_t([1, 2]), _rows([1, 2]))
    rows, hit = cache.get(_t([1, 3]))
    assert hit.tolist() == [True, False]
    assert torch.equal(rows, torch.stack([_rows([1])[0], torch.zeros(3, dtype=torch.uint8)]))
    cache.put(_t([3]), _rows([3]))  # 1 was read after 2: 2 goes
    rows, hit = cache.get(_t([2, 1, 3]))
    assert hit.tolist() == [False, True, True]
    assert torch.equal(rows[1:], _rows([1, 3]))
    stats = cache.stats()
    assert stats == {
        "hits": 3,
        "misses": 4,
        "evictions": 1,
        "size": 2,
        "capacity": 2,
        "hit_rate": 3 / 7,
    }
    assert (_metric("hits", "test_known_sequence"), _metric("misses", "test_known_sequence")) == (
        3,
        4,
    )
    assert _metric("evictions", "test_known_sequence") == 1


def test_lfu_keeps_frequent_rows():
    cache = HotRowCache(2, 3, policy="lfu")
    cache.put(_t([1, 2]), _rows([1, 2]))
    for _ in range(3):
        cache.get(_t([1]))
    cache.get(_t([2]))  # 2 is most recent but 1 is more frequent
    cache.put(_t([3]), _rows([3]))
    assert cache.get(_t([1, 2, 3]))[1].tolist() == [True, False, True]


def test_put_replaces_and_invalidate_forgets():
    cache = HotRowCache(4, 3)
    cache.put(_t([5]), _rows([5]))
    cache.put(_t([5]), _rows([9]))
    assert torch.equal(cache.get(_t([5]))[0], _rows([9]))
    cache.invalidate(_t([5, 77]))
    assert cache.get(_t([5]))[1].tolist() == [False]
    assert cache.stats()["size"] == 0


def test_capacity_zero_always_misses():
    cache = HotRowCache(0, 3, name="test_zero")
    cache.put(_t([1, 2]), _rows([1, 2]))
    rows, hit = cache.get(_t([1, 2]))
    assert not hit.any() and rows.shape == (2, 3)
    assert cache.stats()["hit_rate"] == 0.0


def test_oversized_put_keeps_first_capacity_rows():
    cache = HotRowCache(2, 3)
    cache.put(_t([1, 2, 3]), _rows([1, 2, 3]))
    assert cache.get(_t([1, 2, 3]))[1].tolist() == [True, True, False]


def test_same_name_twice_shares_counters():
    HotRowCache(1, 1, name="test_twice")
    HotRowCache(1, 1, name="test_twice").get(_t([1]))
    assert _metric("misses", "test_twice") == 1


def test_rejects_bad_rows():
    cache = HotRowCache(2, 3)
    with pytest.raises(ValueError, match=r"uint8 \[n, 3\]"):
        cache.put(_t([1]), torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2 rows for 1 ids"):
        cache.put(_t([1]), torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.gpu
def test_rows_live_on_cuda():
    cache = HotRowCache(4, 3, device="cuda")
    cache.put(_t([1, 2]), _rows([1, 2]).cuda())
    rows, hit = cache.get(_t([2, 3]))
    assert rows.is_cuda and hit.tolist() == [True, False]
    assert torch.equal(rows[0].cpu(), _rows([2])[0])


def test_admission_keeps_one_off_ids_out():
    cache = HotRowCache(4, 3, admit_after=2)
    cache.put(_t([1, 2]), _rows([1, 2]))  # first sighting: not kept
    assert cache.get(_t([1, 2]))[1].tolist() == [False, False]
    cache.put(_t([1, 9]), _rows([1, 9]))  # 1 seen twice: kept; 9 once: not
    assert cache.get(_t([1, 9]))[1].tolist() == [True, False]
    with pytest.raises(ValueError, match="admit_after"):
        HotRowCache(4, 3, admit_after=0)


def test_insert_hands_over_the_victims_before_their_slots_take_new_rows() -> None:
    """A caller with its own id -> slot map (the device cache) unmaps victims in time."""
    cache = HotRowCache(capacity_rows=1, row_bytes=2, policy="lru")
    cache.put(torch.tensor([5]), torch.tensor([[1, 1]], dtype=torch.uint8))
    seen = []

    def unmap(evicted: torch.Tensor) -> None:
        seen.append((evicted.tolist(), cache.storage[0].tolist()))

    done = cache.insert(torch.tensor([6]), torch.tensor([[2, 2]], dtype=torch.uint8), unmap)
    assert seen == [([5], [1, 1])]  # the old row still in its slot when the hook ran
    assert (done.ids.tolist(), done.slots.tolist(), done.evicted.tolist()) == ([6], [0], [5])
    assert cache.storage[0].tolist() == [2, 2]
