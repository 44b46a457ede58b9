"""The host tier's device cache (``sharded_tables/device_cache.py``), run on CPU tensors: the
cached tables answer what the uncached ones answer for every dtype, hits and misses are
counted, the cache stays within its bound while it evicts, rewritten rows are forgotten, and
the lookup runs under the device discipline while the admission (a host read) does not."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.device_discipline import DeviceDiscipline, DeviceSyncError
from sharded_tables.device_cache import DeviceRowCache, device_readable
from sharded_tables.planner import SLOT_MAP_BYTES, Budgets, PlacementPlan, plan
from sharded_tables.specs import DType, TableSpec, Tier, row_bytes
from sharded_tables.tbe import LocalTable, LocalTables
from sharded_tables.tiered import TieredEmbeddingCollection

DTYPES = [DType.FP32, DType.FP16, DType.FP8, DType.INT8, DType.INT4]


def _pair(dtype: DType, cache_rows: int = 16) -> tuple[LocalTables, LocalTables]:
    """The same packed rows uncached and cached (two tables share one row store)."""
    tables = [
        LocalTable("a", 400, 16, dtype, ("a", "a2"), cache_rows=cache_rows),
        LocalTable("b", 60, 16, dtype, ("b",), pooling="sum", cache_rows=4),
    ]
    plain = LocalTables([replace(t, cache_rows=0) for t in tables], backend="torch")
    cached = LocalTables(tables, backend="torch", cache_admit_after=1)
    g = torch.Generator().manual_seed(3)
    for t in tables:
        w = torch.randn(t.rows, t.dim, generator=g)
        plain.set_float(t.name, w)
        cached.set_float(t.name, w)
    return plain, cached


def _batch(g: torch.Generator, b: int = 6) -> list[torch.Tensor]:
    hot = [torch.randint(-1, 24, (b, 5), generator=g) for _ in range(2)]  # a skewed head
    return [*hot, torch.randint(-1, 60, (b, 3), generator=g)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
def test_cached_answers_equal_the_uncached_for_every_dtype(dtype: DType) -> None:
    plain, cached = _pair(dtype)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        ids = _batch(g)
        with torch.inference_mode():
            assert torch.equal(cached.forward_padded(ids), plain.forward_padded(ids))
        cached.admit_cached()
    stats = cached.cache_stats()[f"host/{dtype.value}/16"]
    assert stats["hits"] > 0 and stats["misses"] > 0
    assert stats["size"] <= stats["capacity"] == 20  # both tables' rows, pooled


def test_the_jagged_input_reads_through_the_cache() -> None:
    one = [LocalTable("a", 100, 8, DType.INT8, ("a", "a2"), cache_rows=10)]
    cached = LocalTables(one, backend="torch", cache_admit_after=1)
    cached.set_float("a", torch.randn(100, 8))
    indices = torch.tensor([3, 4, 3, 7, 9, 3])
    offsets = torch.tensor([0, 2, 3, 5, 6])  # 2 features x 2 bags
    first = cached(indices, offsets)
    assert cached.admit_cached() == 4  # 3, 4, 7, 9
    with torch.inference_mode(), DeviceDiscipline():
        again = cached(indices, offsets)
    assert torch.equal(first, again)
    assert cached.cache_stats()["host/int8/8"]["hits"] == 0  # counted at the next admission
    cached.admit_cached()
    assert cached.cache_stats()["host/int8/8"]["hits"] == 6


def _cache(capacity: int, policy: str = "lru") -> DeviceRowCache:
    store = torch.arange(50 * 4, dtype=torch.int64).to(torch.uint8).view(50, 4)
    return DeviceRowCache(store, capacity, "cpu", policy=policy, admit_after=1)


def _read(cache: DeviceRowCache, ids: list[int]) -> torch.Tensor:
    rows = torch.tensor(ids).clamp(min=0)
    return cache.read(rows, torch.tensor(ids) >= 0)


def test_hits_and_misses_are_counted_and_eviction_keeps_the_bound() -> None:
    cache = _cache(capacity=3)
    assert torch.equal(_read(cache, [1, 2, -1, 2]), cache.store[[1, 2, 0, 2]])
    assert cache.admit() == 2
    s = cache.stats()
    assert (s["hits"], s["misses"], s["size"]) == (0, 3, 2)  # padding is not looked up
    _read(cache, [1, 2, 5, 6, 7])
    cache.admit()  # 3 new rows for 1 free slot: two of the old ones go (lru: the oldest)
    s = cache.stats()
    assert (s["hits"], s["misses"], s["evictions"], s["size"]) == (2, 6, 2, 3)
    held = (cache.slot_of >= 0).nonzero().squeeze(1)
    assert len(held) == 3 and len(set(cache.slot_of[held].tolist())) == 3  # distinct slots
    for row in held.tolist():  # each held slot holds its row's bytes
        assert torch.equal(cache.rows[cache.slot_of[row]], cache.store[row])
    assert torch.equal(_read(cache, [7, 1, 2, 6, 5]), cache.store[[7, 1, 2, 6, 5]])


def test_admission_waits_for_a_repeat_when_asked() -> None:
    store = torch.randint(0, 255, (30, 6), dtype=torch.uint8)
    cache = DeviceRowCache(store, 8, "cpu", admit_after=2)
    _read(cache, [4, 5])
    assert cache.admit() == 0  # seen once: not kept
    _read(cache, [4])
    assert cache.admit() == 1 and int(cache.slot_of[4]) >= 0 and int(cache.slot_of[5]) < 0


def test_an_overflowing_log_counts_what_it_dropped() -> None:
    store = torch.zeros(20, 4, dtype=torch.uint8)
    cache = DeviceRowCache(store, 8, "cpu", admit_after=1, log_size=5)
    _read(cache, [1, 2, 3])
    _read(cache, [4, 5, 6, 7])  # 7 ids logged in a ring of 5: 1 and 2 are gone
    assert cache.admit() == 5 and cache.unlogged == 2
    assert sorted((cache.slot_of >= 0).nonzero().squeeze(1).tolist()) == [3, 4, 5, 6, 7]
    _read(cache, list(range(8, 16)))  # one batch longer than the log
    cache.admit()
    assert cache.unlogged == 5


def test_rewritten_rows_are_forgotten() -> None:
    plain, cached = _pair(DType.INT8)
    ids = [torch.tensor([[1, 2, 3]]), torch.tensor([[1]]), torch.tensor([[5]])]
    cached.forward_padded(ids)
    cached.admit_cached()
    new = torch.randn(2, 16)
    for module in (plain, cached):
        view = module.rows_view("a")
        view[torch.tensor([1, 2])] = module.packed("a")[[0, 0]]  # rows 1, 2 now equal row 0
        module.rows_written("a", torch.tensor([1, 2]))
    assert torch.equal(cached.forward_padded(ids), plain.forward_padded(ids))
    for module in (plain, cached):
        module.set_float("a", new.repeat(200, 1))  # a whole table: every cached copy goes
    assert torch.equal(cached.forward_padded(ids), plain.forward_padded(ids))


def test_the_lookup_keeps_the_device_discipline_and_the_admission_does_not() -> None:
    _, cached = _pair(DType.FP16)
    g = torch.Generator().manual_seed(1)
    ids = _batch(g)
    cached.forward_padded(ids)
    cached.admit_cached()
    with torch.inference_mode(), DeviceDiscipline():
        cached.forward_padded(ids)  # hits and misses, one fixed-shape path
        with pytest.raises(DeviceSyncError):
            cached.admit_cached()  # a host read: between batches only


def test_the_slot_map_costs_what_the_planner_reserves() -> None:
    cache = _cache(capacity=2)
    assert cache.slot_of.shape == (50,) and cache.slot_of.element_size() == SLOT_MAP_BYTES


def test_the_store_is_read_in_place_on_the_cpu() -> None:
    store = torch.zeros(3, row_bytes(8, DType.INT8), dtype=torch.uint8)
    assert device_readable(store, torch.device("cpu")) is store
    assert device_readable(store, torch.device("cuda")) is None  # not pinned: no alias


@pytest.mark.gpu
def test_on_cuda_the_pinned_store_is_read_by_the_device_and_a_graph_replays_it() -> None:
    tables = [LocalTable("a", 300, 16, DType.INT8, ("a",), cache_rows=32)]
    cpu = LocalTables(tables, backend="torch")
    gpu = LocalTables(tables, tier="host", device="cuda", backend="torch", cache_admit_after=1)
    w = torch.randn(300, 16)
    cpu.set_float("a", w)
    gpu.set_float("a", w)
    cache = gpu._groups[0].cache
    assert cache is not None and cache.rows.is_cuda and cache._reader is not None
    assert cache._reader.is_cuda and cache._reader.data_ptr() == cache.store.data_ptr()
    static = torch.randint(-1, 40, (8, 6), device="cuda")
    with torch.inference_mode():
        gpu.forward_padded([static])  # warm-up: lazily built index tensors
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gpu.forward_padded([static])
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            ids = torch.randint(-1, 40, (8, 6), generator=g)
            static.copy_(ids)
            graph.replay()
            torch.testing.assert_close(out.cpu(), cpu.forward_padded([ids]))
            gpu.admit_cached()
    assert gpu.cache_stats()["host/int8/16"]["hits"] > 0


def _planned(device_bytes: int) -> tuple[list[TableSpec], PlacementPlan]:
    """A host table with a device cache in the plan (the device budget holds a share of it)."""
    specs = [TableSpec("item", 2000, 16, DType.INT8, features=("history",))]
    budgets = Budgets(device=device_bytes, host=1 << 20, has_gpu=True)
    return specs, plan(specs, budgets)


def test_on_a_cpu_the_collection_builds_no_device_cache() -> None:
    specs, placement = _planned(20_000)  # the table (40 000 B) does not fit: host, cached
    assert placement.placement("item").tier is Tier.HOST
    assert placement.placement("item").cache_rows == 200
    coll = TieredEmbeddingCollection(specs, placement)
    coll.load_float({"item": torch.randn(2000, 16)})
    coll({"history": torch.tensor([[1, 2, -1]])})
    coll.between_batches()
    assert coll.cache_stats() == {}  # the host tier is already the fastest copy


@pytest.mark.gpu
def test_on_cuda_the_collection_caches_a_planned_host_table_in_hbm() -> None:
    specs, placement = _planned(20_000)
    weights = {"item": torch.randn(2000, 16)}
    cpu = TieredEmbeddingCollection(specs, placement)
    cpu.load_float(weights)
    gpu = TieredEmbeddingCollection(specs, placement, device="cuda")
    gpu.load_float(weights)
    if gpu.tiers["host"].backend != "torch":
        pytest.skip("fbgemm's CUDA kernel caches host rows itself (UVM)")
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        feats = {"history": torch.randint(-1, 50, (16, 8), generator=g)}
        with torch.inference_mode():
            got = gpu({"history": feats["history"].cuda()})["history"]
        torch.testing.assert_close(got.cpu(), cpu(feats)["history"])
        gpu.between_batches()
    stats = gpu.cache_stats()["host/int8/16"]
    assert stats["hits"] > 0 and stats["capacity"] == 200
