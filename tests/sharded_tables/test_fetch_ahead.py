"""Fetching a request's remote rows at admission: the flights, and a batch that takes their rows."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from sharded_tables.fetch_ahead import AheadRows
from sharded_tables.planner import Budgets, PlacementPlan, TablePlacement
from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection

USER = TableSpec("user", 1000, 8, DType.INT8, pooling="sum")


class Servers:
    """In-process stand-in for the embedding servers: packed rows; records each call's ids and
    thread; ``fail``: how many calls to fail first; ``gate``: an event each call waits for."""

    def __init__(self, packed: Mapping[str, torch.Tensor], fail: int = 0):
        self.packed, self.fail = dict(packed), fail
        self.calls: list[tuple[str, dict[str, list[int]]]] = []
        self.gate: threading.Event | None = None

    def fetch(self, ids_by_table, timeout=None):
        if self.gate is not None:
            assert self.gate.wait(10.0)
        self.calls.append(
            (threading.current_thread().name, {t: i.tolist() for t, i in ids_by_table.items()})
        )
        if self.fail:
            self.fail -= 1
            raise ConnectionError("server down")
        return {t: self.packed[t][ids] for t, ids in ids_by_table.items()}


def _collection(cache_rows: int) -> tuple[TieredEmbeddingCollection, Servers, torch.Tensor]:
    placement = PlacementPlan(
        (
            TablePlacement(
                "user",
                Tier.REMOTE,
                DType.INT8,
                USER.bytes(),
                servers=(0,),
                partition="range",
                row_bounds=(0, 1000),
                cache_rows=cache_rows,
            ),
        ),
        Budgets(device=0, host=0, remote_per_server=1 << 20, remote_servers=1),
    )
    coll = TieredEmbeddingCollection([USER], placement, cache_admit_after=1)
    weights = torch.randn(1000, 8, generator=torch.Generator().manual_seed(0))
    servers = Servers(coll.load_float({"user": weights}))
    coll.remote = servers
    exact = unpack_rows(pack_rows(weights, DType.INT8), DType.INT8, 8)
    return coll, servers, exact


def _pooled(exact: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return (exact[ids.clamp(min=0)] * (ids >= 0)[..., None]).sum(1)


# ---- the flights ----------------------------------------------------------------------------------
def test_a_flight_holds_only_ids_no_other_flight_holds_and_lands_their_rows():
    ahead = AheadRows()
    first = ahead.register({"t": np.array([3, 17])})
    assert first is not None and first.ids["t"].tolist() == [3, 17]
    second = ahead.register({"t": np.array([17, 40])})
    assert second is not None and second.ids["t"].tolist() == [40]
    assert ahead.register({"t": np.array([3, 40])}) is None  # all held
    ahead.land(first, {"t": np.array([[3], [17]], np.uint8)})
    found = ahead.find("t", np.array([40, 5, 3, 17]))
    assert [(k, j) for k, _, j in found] == [(0, 0), (2, 0), (3, 1)]
    ahead.land(second, {"t": np.array([[40]], np.uint8)})
    at, rows = ahead.collect("t", found, timeout=1.0)
    assert rows is not None
    assert dict(zip(at.tolist(), rows[:, 0].tolist(), strict=True)) == {0: 40, 2: 3, 3: 17}


def test_a_failed_flight_is_forgotten_and_the_oldest_go_beyond_the_limit():
    ahead = AheadRows(limit=3)
    failed = ahead.register({"t": np.array([1, 2])})
    assert failed is not None
    ahead.land(failed, None)
    assert ahead.find("t", np.array([1, 2])) == []
    assert ahead.register({"t": np.array([1, 2])}) is not None  # fetchable again
    ahead.register({"t": np.array([3, 4])})  # 4 ids > 3: the oldest flight goes
    assert [k for k, _, _ in ahead.find("t", np.array([1, 2, 3, 4]))] == [2, 3]


# ---- a batch and the flights ----------------------------------------------------------------------
def test_a_batch_takes_the_rows_fetched_ahead_and_fetches_only_the_rest():
    coll, servers, exact = _collection(cache_rows=0)
    flight = coll.fetch_ahead({"user": torch.tensor([[7, 900, 7, -1]])})
    assert flight is not None
    flight.run()
    ids = torch.tensor([[7, 900, 3], [3, -1, -1]])
    torch.testing.assert_close(coll({"user": ids})["user"], _pooled(exact, ids))
    assert [c for _, c in servers.calls] == [{"user": [7, 900]}, {"user": [3]}]
    stats = coll.remote_stats()
    assert (stats.fetched_ahead, stats.fetched) == (2, 1)


def test_a_batch_waits_for_a_flight_under_way_instead_of_fetching_its_ids_again():
    coll, servers, exact = _collection(cache_rows=0)
    flight = coll.fetch_ahead({"user": torch.tensor([[5, 6]])})
    assert flight is not None
    servers.gate = threading.Event()
    runner = threading.Thread(target=flight.run, name="handler")
    runner.start()  # blocked in its fetch until the gate opens
    ids = torch.tensor([[5, 6, 8]])
    out: dict[str, torch.Tensor] = {}
    batch = threading.Thread(target=lambda: out.update(coll({"user": ids})), name="batcher")
    batch.start()
    servers.gate.set()
    runner.join(10.0)
    batch.join(10.0)
    torch.testing.assert_close(out["user"], _pooled(exact, ids))
    assert sorted(servers.calls) == [("batcher", {"user": [8]}), ("handler", {"user": [5, 6]})]


@pytest.mark.parametrize("how", ["failed", "cancelled"])
def test_a_flight_that_failed_or_was_cancelled_leaves_its_ids_to_the_batch(how):
    coll, servers, exact = _collection(cache_rows=0)
    servers.fail = 1 if how == "failed" else 0
    flight = coll.fetch_ahead({"user": torch.tensor([[11, 12]])})
    assert flight is not None
    flight.run() if how == "failed" else flight.cancel()  # a failure is not raised here
    ids = torch.tensor([[11, 12]])
    torch.testing.assert_close(coll({"user": ids})["user"], _pooled(exact, ids))
    assert [c for _, c in servers.calls][-1] == {"user": [11, 12]}
    assert coll.remote_stats().fetched_ahead == 0


def test_cached_rows_and_rows_already_in_flight_are_not_fetched_ahead():
    coll, servers, _ = _collection(cache_rows=16)
    coll({"user": torch.tensor([[1, 2]])})  # now cached
    assert coll.fetch_ahead({"user": torch.tensor([[2, 1]])}) is None
    first = coll.fetch_ahead({"user": torch.tensor([[1, 3]])})
    assert first is not None and first.flight.ids["user"].tolist() == [3]
    assert coll.fetch_ahead({"user": torch.tensor([[3]])}) is None
    hits = coll.cache_stats()["user"]["hits"]
    coll.fetch_ahead({"user": torch.tensor([[1, 2, 4]])})
    assert coll.cache_stats()["user"]["hits"] == hits  # a look ahead is not an access
    assert servers.calls == [("MainThread", {"user": [1, 2]})]  # nothing fetched until run
