"""TieredEmbeddingCollection: executes a plan; remote reads go through cache then one fetch."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from sharded_tables import remote_tier
from sharded_tables.planner import Budgets, PlacementPlan, TablePlacement, plan
from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection

SPECS = [
    TableSpec("item", 500, 16, DType.INT8, features=("history", "item_id")),
    TableSpec("country", 20, 8, DType.FP16, pooling="sum"),
    TableSpec("user", 1000, 8, DType.INT8, expected_hit_rate=0.9),
]


class PackedRows:
    """In-process stand-in for the embedding servers: serves packed rows, counts what it sent."""

    def __init__(self, packed: Mapping[str, torch.Tensor]):
        self.packed = dict(packed)
        self.calls: list[dict[str, list[int]]] = []

    def fetch(self, ids_by_table, timeout=None):
        self.calls.append({t: ids.tolist() for t, ids in ids_by_table.items()})
        return {t: self.packed[t][ids] for t, ids in ids_by_table.items()}


def _placement(cache_rows: int) -> PlacementPlan:
    return PlacementPlan(
        (
            TablePlacement("item", Tier.HOST, DType.INT8, SPECS[0].bytes()),
            TablePlacement("country", Tier.DEVICE, DType.FP16, SPECS[1].bytes()),
            TablePlacement(
                "user",
                Tier.REMOTE,
                DType.INT8,
                SPECS[2].bytes(),
                servers=(0, 1),
                partition="range",
                row_bounds=(0, 500, 1000),
                cache_rows=cache_rows,
            ),
        ),
        Budgets(device=1 << 20, host=1 << 20, remote_per_server=1 << 20, remote_servers=2),
    )


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.rows, s.dim, generator=g) for s in SPECS}


def _reference(weights, features) -> dict[str, torch.Tensor]:
    out = {}
    for f, ids in features.items():
        spec = next(s for s in SPECS if f in s.feature_names())
        w = unpack_rows(pack_rows(weights[spec.name], spec.dtype), spec.dtype, spec.dim)
        present = ids >= 0
        pooled = (w[ids.clamp(min=0)] * present[..., None]).sum(1)
        if spec.pooling == "mean":
            pooled = pooled / present.sum(1, keepdim=True).clamp(min=1)
        out[f] = pooled
    return out


def test_local_and_remote_tables_pool_like_the_reference_and_dedupe_remote_ids():
    weights = _weights()
    coll = TieredEmbeddingCollection(SPECS, _placement(cache_rows=0))
    remote_rows = coll.load_float(weights)
    assert set(remote_rows) == {"user"}
    coll.remote = server = PackedRows(remote_rows)
    features = {
        "history": torch.tensor([[1, 2, -1], [3, -1, -1]]),
        "country": torch.tensor([[4, 4], [-1, -1]]),
        "user": torch.tensor([[7, 7, 900], [7, -1, -1]]),
    }
    out = coll(features)
    for f, want in _reference(weights, features).items():
        torch.testing.assert_close(out[f], want, rtol=1e-5, atol=1e-6)
    assert server.calls == [{"user": [7, 900]}]  # one request, duplicates removed


def test_warm_cache_serves_hot_rows_without_a_request():
    weights = _weights()
    coll = TieredEmbeddingCollection(
        SPECS, _placement(cache_rows=8), cache_policy="lru", cache_admit_after=1
    )
    coll.remote = server = PackedRows(coll.load_float(weights))
    coll({"user": torch.tensor([[1, 2, 3]])})
    out = coll({"user": torch.tensor([[3, 2, 1], [1, 5, -1]])})
    assert server.calls == [{"user": [1, 2, 3]}, {"user": [5]}]
    torch.testing.assert_close(
        out["user"], _reference(weights, {"user": torch.tensor([[3, 2, 1], [1, 5, -1]])})["user"]
    )
    stats = coll.cache_stats()["user"]
    assert (stats["hits"], stats["misses"]) == (4, 4)  # per id looked up: 3 + 1 missed, 4 hit


def test_a_table_cached_whole_is_copied_in_chunks_once_and_pools_like_the_reference(monkeypatch):
    monkeypatch.setattr(remote_tier, "WHOLE_FETCH_BYTES", 100 * SPECS[2].row_bytes())
    weights = _weights()
    coll = TieredEmbeddingCollection(SPECS, _placement(cache_rows=SPECS[2].rows))
    assert coll.remote_tier.whole == {"user"} and coll.cache_stats() == {}
    coll.remote = server = PackedRows(coll.load_float(weights))
    features = {
        "user": torch.tensor([[7, 7, 900], [7, -1, -1]]),
        "country": torch.tensor([[4], [-1]]),
    }
    for _ in range(2):
        out = coll(features)
        for f, want in _reference(weights, features).items():
            torch.testing.assert_close(out[f], want, rtol=1e-5, atol=1e-6)
    assert [len(c["user"]) for c in server.calls] == [100] * 10  # the copy, then no request
    assert coll.remote_stats().fetched == 0
    coll.remote = None  # detached: the copy keeps answering
    torch.testing.assert_close(coll(features)["user"], out["user"], rtol=0, atol=0)
    fresh = TieredEmbeddingCollection(SPECS, _placement(cache_rows=SPECS[2].rows))
    with pytest.raises(RuntimeError, match="need embedding servers"):
        fresh(features)


def test_remote_tables_without_servers_fail_clearly():
    coll = TieredEmbeddingCollection(SPECS, _placement(cache_rows=0))
    coll.load_float(_weights())
    with pytest.raises(RuntimeError, match="need embedding servers"):
        coll({"user": torch.tensor([[1]])})


def test_validation_names_feature_table_and_id():
    coll = TieredEmbeddingCollection(SPECS, _placement(cache_rows=0))
    with pytest.raises(ValueError, match="unknown feature 'nope'"):
        coll.validate({"nope": torch.tensor([[1]])})
    with pytest.raises(ValueError, match="id 500 is out of range for table 'item'"):
        coll.validate({"item_id": torch.tensor([[500]])})
    with pytest.raises(ValueError, match="expected int64"):
        coll.validate({"item_id": torch.tensor([[1.0]])})


def test_hashed_table_serves_its_learned_rows_by_key():
    specs = [TableSpec("query", 4, 8, DType.INT8, hashed=True)]
    placement = plan(specs, Budgets(device=0, host=1 << 20))
    coll = TieredEmbeddingCollection(specs, placement)
    keys = torch.tensor([2**40 + 1, -(2**50), 123456789])
    rows = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    assert coll.load_keyed({"query": (keys, rows)}) == {}  # all local: nothing for servers
    q = unpack_rows(pack_rows(rows, DType.INT8), DType.INT8, 8)
    out = coll({"query": torch.tensor([[2**40 + 1, -1], [999, -(2**50)]])})["query"]
    torch.testing.assert_close(out[0], q[0])
    torch.testing.assert_close(out[1], q[1] / 2)  # mean pooling; 999 was never learned: zeros
    other = TieredEmbeddingCollection(specs, placement)
    other.load_state_dict(coll.state_dict())
    assert torch.equal(other.keyed_rows()["query"][1], coll.keyed_rows()["query"][1])
    with pytest.raises(ValueError, match="not a hashed table"):
        coll.load_keyed({"nope": (keys, rows)})


def test_state_saves_plan_and_rows(tmp_path):
    weights = _weights()
    coll = TieredEmbeddingCollection(SPECS, _placement(cache_rows=0))
    coll.load_float(weights)
    torch.save(coll.state_dict(), tmp_path / "t.pt")
    other = TieredEmbeddingCollection(SPECS, _placement(cache_rows=0))
    other.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=True))
    torch.testing.assert_close(other.local_float("item"), coll.local_float("item"))
    different = TieredEmbeddingCollection(SPECS, _placement(cache_rows=4))
    with pytest.raises(ValueError, match="plan differs"):
        different.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=True))


def test_jagged_input_equals_the_padded_call():
    weights = _weights()
    coll = TieredEmbeddingCollection(SPECS, _placement(cache_rows=0))
    coll.remote = PackedRows(coll.load_float(weights))
    padded = {
        "history": torch.tensor([[1, 2, -1], [3, -1, -1]]),
        "item_id": torch.tensor([[9], [8]]),
        "country": torch.tensor([[4, 4], [-1, -1]]),
        "user": torch.tensor([[7, 900], [-1, -1]]),
    }
    want = coll(padded)
    # the first is exactly the local tier (one kernel call), the others go through padding
    for keys in (["history", "item_id", "country"], ["country"], ["user", "history"]):
        values = torch.cat([padded[k][padded[k] >= 0] for k in keys])
        lengths = torch.cat([(padded[k] >= 0).sum(1) for k in keys])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        got = coll.forward_jagged(keys, values, offsets)
        torch.testing.assert_close(got, torch.cat([want[k] for k in keys], dim=1))


def test_remote_bags_that_are_all_padding_pool_to_zero():
    coll = TieredEmbeddingCollection(SPECS, _placement(cache_rows=0))
    coll.remote = server = PackedRows(coll.load_float(_weights()))
    out = coll({"user": torch.full((2, 3), -1)})
    assert torch.equal(out["user"], torch.zeros(2, 8)) and server.calls == []


def test_a_small_cache_under_churn_never_serves_a_stale_row():
    """Admitting a batch's misses evicts rows; rows that batch hit must be pooled first."""
    weights = _weights()
    coll = TieredEmbeddingCollection(SPECS, _placement(cache_rows=8))
    coll.remote = PackedRows(coll.load_float(weights))
    g = torch.Generator().manual_seed(4)
    for _ in range(30):
        hot = torch.randint(0, 12, (4, 3), generator=g)  # mostly cached
        cold = torch.randint(-1, 1000, (4, 3), generator=g)  # mostly misses, forces evictions
        feats = {"user": torch.cat([hot, cold], dim=1)}
        torch.testing.assert_close(coll(feats)["user"], _reference(weights, feats)["user"])
    assert coll.cache_stats()["user"]["evictions"] > 0


@pytest.mark.parametrize("dtype", list(DType))
def test_hot_rows_of_every_dtype_pool_like_the_reference(dtype):
    """The hot-row path decodes each packed dtype (cached rows and fetched ones in one batch)."""
    specs = [TableSpec("user", 1000, 8, dtype, features=("user", "friends"))]
    placement = PlacementPlan(
        (
            TablePlacement(
                "user", Tier.REMOTE, dtype, specs[0].bytes(), servers=(0,), partition="range",
                row_bounds=(0, 1000), cache_rows=8,
            ),
        ),
        Budgets(device=0, host=0, remote_per_server=1 << 20, remote_servers=1),
    )  # fmt: skip
    coll = TieredEmbeddingCollection(specs, placement, cache_policy="lru", cache_admit_after=1)
    weights = {"user": torch.randn(1000, 8, generator=torch.Generator().manual_seed(1))}
    coll.remote = server = PackedRows(coll.load_float(weights))
    w = unpack_rows(pack_rows(weights["user"], dtype), dtype, 8)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        feats = {
            "user": torch.randint(0, 12, (3, 1), generator=g),
            "friends": torch.randint(-1, 12, (3, 4), generator=g),
        }
        out = coll(feats)
        for f, ids in feats.items():
            present = (ids >= 0).float()
            want = (w[ids.clamp(min=0)] * present[..., None]).sum(1)
            want = want / present.sum(1, keepdim=True).clamp(min=1)
            torch.testing.assert_close(out[f], want, rtol=1e-5, atol=1e-5)
    assert coll.cache_stats()["user"]["hits"] > 0 and len(server.calls) > 1
