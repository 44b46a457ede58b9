"""TableCollection: the three collections answer the same calls the same way (lookups, shapes,
float rows in and out, row writes), and the optional hooks have their stated defaults."""

from __future__ import annotations

import pytest
import torch

from sharded_tables.collection import EmbeddingCollection, TableConfig
from sharded_tables.interface import RemoteStats, RowUpdateRefusedError, TableCollection
from sharded_tables.planner import Budgets, PlacementPlan, TablePlacement
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection
from sharded_tables.trainable import TrainableTables

CONFIGS = [
    TableConfig("item", 50, 8, features=("history", "item_id")),
    TableConfig("country", 10, 4, pooling="sum"),
]
FEATURES = {
    "history": torch.tensor([[1, 2, -1], [3, -1, -1]]),
    "item_id": torch.tensor([[7], [49]]),
    "country": torch.tensor([[4, 4], [-1, -1]]),
}


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {c.name: torch.randn(c.num_embeddings, c.dim, generator=g) for c in CONFIGS}


def _tiered(remote_item: bool = False) -> TieredEmbeddingCollection:
    """FP32 rows (lookups equal the float tables'); ``remote_item``: the item table on servers."""
    specs = [
        TableSpec(c.name, c.num_embeddings, c.dim, DType.FP32, c.pooling, features=c.features)
        for c in CONFIGS
    ]
    placed = [
        TablePlacement(s.name, Tier.HOST, DType.FP32, s.bytes())
        if not (remote_item and s.name == "item")
        else TablePlacement(
            s.name,
            Tier.REMOTE,
            DType.FP32,
            s.bytes(),
            servers=(0,),
            partition="range",
            row_bounds=(0, s.rows),
        )
        for s in specs
    ]
    budgets = Budgets(device=0, host=1 << 20, remote_per_server=1 << 20, remote_servers=1)
    return TieredEmbeddingCollection(specs, PlacementPlan(tuple(placed), budgets))


def _collections() -> dict[str, TableCollection]:
    weights = _weights()
    made: dict[str, TableCollection] = {
        "plain": EmbeddingCollection(CONFIGS),
        "trainable": TrainableTables(CONFIGS, seed=0),
        "tiered": _tiered(),
    }
    for tables in made.values():
        assert tables.load_float(weights) == {}  # no table on embedding servers
    return made


def test_the_three_collections_answer_alike() -> None:
    made = _collections()
    reference = made["plain"]
    with torch.no_grad():
        expected = reference(FEATURES)
        for name, tables in made.items():
            assert tables.table_of == {"history": "item", "item_id": "item", "country": "country"}
            assert tables.table_rows() == {"item": 50, "country": 10}, name
            assert tables.table_shapes() == {"item": (50, 8), "country": (10, 4)}, name
            tables.validate(FEATURES)
            with pytest.raises(ValueError, match="out of range for table 'country'"):
                tables.validate({"country": torch.tensor([[10]])})
            got = tables(FEATURES)
            for f, pooled in expected.items():
                torch.testing.assert_close(got[f], pooled, msg=f"{name}: {f}")


def test_float_rows_go_out_as_they_came_in_where_they_are_kept() -> None:
    weights = _weights()
    made = _collections()
    for name in ("plain", "trainable"):
        out = made[name].float_weights()
        assert set(out) == set(weights)
        for t, w in weights.items():
            assert torch.equal(out[t], w), f"{name}: {t}"
    with pytest.raises(ValueError, match="already tiered"):
        made["tiered"].float_weights()


def test_row_writer_writes_only_when_called() -> None:
    rows, values = torch.tensor([3, 9]), torch.randn(2, 8)
    one_row = {"history": torch.tensor([[3]])}
    for name, tables in _collections().items():
        with torch.no_grad():
            before = tables(one_row)["history"]
            write = tables.row_writer("item", rows, values)
            assert torch.equal(tables(one_row)["history"], before), name  # not yet
            write()
            torch.testing.assert_close(tables(one_row)["history"][0], values[0], msg=name)


def test_remote_tables_refuse_row_writes_and_count_their_lookups() -> None:
    tiered = _tiered(remote_item=True)
    packed = tiered.load_float(_weights())
    assert set(packed) == {"item"}
    with pytest.raises(RowUpdateRefusedError, match="table 'item' lives on the remote tier"):
        tiered.row_writer("item", torch.tensor([1]), torch.zeros(1, 8))

    class Servers:
        def fetch(self, ids_by_table, timeout=None):
            return {t: packed[t][ids] for t, ids in ids_by_table.items()}

    tiered.remote = Servers()
    with torch.no_grad():
        tiered({"history": torch.tensor([[1, 2, 2]])})
    assert tiered.remote_stats() == RemoteStats(ids=3, unique=0, fetched=2)
    assert set(tiered.cache_stats()) == {"item"}


def test_in_process_collections_have_no_remote_counters() -> None:
    plain = EmbeddingCollection(CONFIGS)
    with torch.no_grad():
        plain(FEATURES)
    assert plain.remote_stats() == RemoteStats() and plain.cache_stats() == {}
