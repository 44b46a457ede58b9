"""Small remote tables cached whole, against a real embedding server on 127.0.0.1.

The planner caches a small ranged remote table whole; the collection copies it from the server
once and then answers its lookups without a request, equal to the server's rows and to the same
table held locally. A big table still fetches its misses. The copy follows the version its client
reads (the only way ranged rows change); in-place row writes stay refused; a zero-filled answer
is never copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sharded_tables.export import remote_routing, write_server_folders
from sharded_tables.interface import RowUpdateRefusedError
from sharded_tables.planner import Budgets, PlacementPlan, plan
from sharded_tables.remote.client import RemoteTables
from sharded_tables.remote.server import EmbeddingServer
from sharded_tables.remote_tier import WholeTableLoadError
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection

SPECS = [
    TableSpec("user_region", 40, 8, DType.INT8),
    TableSpec("user_age", 7, 8, DType.FP32, pooling="sum"),
    TableSpec("item", 3000, 8, DType.INT8, features=("history",)),
]
BUDGETS = Budgets(
    device=0, host=0, remote_per_server=1 << 20, remote_servers=1, cache=1 << 20,
    cache_whole_max=4096,  # the two user tables, not the item table (48 000 B)
)  # fmt: skip


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.rows, s.dim, generator=g) for s in SPECS}


def publish(placement: PlacementPlan, w: dict[str, torch.Tensor], out: Path) -> Path:
    """The server folder of ``w``'s remote rows (one server)."""
    rows = TieredEmbeddingCollection(SPECS, placement).load_float(w)
    return write_server_folders(placement, SPECS, rows, out)[0]


def local_twin(w: dict[str, torch.Tensor]) -> TieredEmbeddingCollection:
    """The same tables, dtypes and rows in the host tier."""
    local = TieredEmbeddingCollection(SPECS, plan(SPECS, Budgets(device=0, host=1 << 20)))
    local.load_float(w)
    return local


def requests(remote: RemoteTables) -> int:
    return sum(remote.stats()["requests"].values())


@pytest.fixture
def placement() -> PlacementPlan:
    p = plan(SPECS, BUDGETS)
    assert all(t.tier is Tier.REMOTE for t in p.tables)
    assert [t.cache_rows for t in p.tables] == [40, 7, 300]  # whole, whole, 10 % of the items
    return p


@pytest.fixture
def server(placement: PlacementPlan, tmp_path: Path) -> Iterator[tuple[str, dict]]:
    w = weights(0)
    srv = EmbeddingServer(publish(placement, w, tmp_path / "rows"))
    address = srv.start()
    yield address, w
    srv.stop(grace=1.0)


def test_small_tables_are_copied_once_and_read_without_requests(placement, server):
    address, w = server
    local = local_twin(w)
    with RemoteTables(remote_routing(placement, SPECS, [address]), timeout=5.0) as remote:
        coll = TieredEmbeddingCollection(SPECS, placement, remote=remote)
        assert coll.remote_tier.whole == {"user_region", "user_age"}
        assert set(coll.cache_stats()) == {"item"}
        g = torch.Generator().manual_seed(1)
        users = {
            "user_region": torch.randint(-1, 40, (8, 2), generator=g),
            "user_age": torch.randint(0, 7, (8, 1), generator=g),
        }
        with torch.no_grad():
            got = coll(users)
            copied = requests(remote)
            assert copied == 2  # one chunk per table: the copy
            for _ in range(3):
                got = coll(users)
            want = local(users)
        assert requests(remote) == copied  # no request once copied
        for f in users:
            torch.testing.assert_close(got[f], want[f], rtol=0, atol=0)
        # the copy holds the server's rows, byte for byte
        for name in ("user_region", "user_age"):
            served = remote.fetch(
                {name: torch.arange(SPECS[0 if name == "user_region" else 1].rows)}
            )
            torch.testing.assert_close(coll.local_float(name), local.local_float(name))
            module = coll._module_of[name]
            assert torch.equal(module.packed(name), served[name])
        # the big table still goes to the server for its misses, and pools the same
        history = {"history": torch.randint(-1, 3000, (8, 5), generator=g), **users}
        before = requests(remote)
        with torch.no_grad():
            got, want = coll(history), local(history)
        assert requests(remote) == before + 1 and coll.remote_stats().fetched > 0
        for f in history:
            torch.testing.assert_close(got[f], want[f], rtol=1e-6, atol=1e-6)
        # jagged input through the copy (exactly its module's features: one kernel call)
        keys = coll._module_of["user_region"].feature_names
        padded = {k: users[k] for k in keys}
        values = torch.cat([padded[k][padded[k] >= 0] for k in keys])
        lengths = torch.cat([(padded[k] >= 0).sum(1) for k in keys])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        jagged = coll.forward_jagged(keys, values, offsets)
        torch.testing.assert_close(jagged, torch.cat([want[k] for k in keys], dim=1))


def test_the_copy_follows_the_version_its_client_reads(placement, tmp_path):
    """Ranged rows change only with a new version (row writes are refused): a router's client
    names the version it serves, so each version's model copies that version's rows."""
    available = {1: publish(placement, weights(1), tmp_path / "1")}
    srv = EmbeddingServer(available[1], version=1, source=lambda: dict(available), poll_s=60)
    address = srv.start()
    users = {"user_region": torch.arange(40)[:, None], "user_age": torch.arange(40)[:, None] % 7}
    routing = remote_routing(placement, SPECS, [address])
    clients = {v: RemoteTables(routing, timeout=5.0, version=v) for v in (1, 2)}
    try:
        v1 = TieredEmbeddingCollection(SPECS, placement, remote=clients[1])
        with torch.no_grad():
            first = v1(users)
        with pytest.raises(RowUpdateRefusedError, match="remote tier"):
            v1.row_writer("user_region", torch.tensor([3]), torch.zeros(1, 8))
        available[2] = publish(placement, weights(2), tmp_path / "2")
        assert srv.poll() == 2
        v2 = TieredEmbeddingCollection(SPECS, placement, remote=clients[2])
        with torch.no_grad():
            want1, want2 = local_twin(weights(1))(users), local_twin(weights(2))(users)
            for f in users:
                torch.testing.assert_close(v1(users)[f], want1[f], rtol=0, atol=0)
                torch.testing.assert_close(first[f], want1[f], rtol=0, atol=0)
                torch.testing.assert_close(v2(users)[f], want2[f], rtol=0, atol=0)
            v1.remote = clients[2]  # a new fetcher: copied again, from what it reads
            for f in users:
                torch.testing.assert_close(v1(users)[f], want2[f], rtol=0, atol=0)
    finally:
        for c in clients.values():
            c.close()
        srv.stop(grace=1.0)


def test_a_zero_filled_answer_is_not_copied(placement, dead_address):
    routing = remote_routing(placement, SPECS, [dead_address])
    with RemoteTables(routing, timeout=0.5, fallback="zero") as remote:
        coll = TieredEmbeddingCollection(SPECS, placement, remote=remote)
        with pytest.raises(WholeTableLoadError, match=r"'user_age'.*zero-filled"), torch.no_grad():
            coll({"user_age": torch.tensor([[1]])})
