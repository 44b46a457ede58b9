"""Remote tables under an embedding-server fault, against a real ``recserve serve embeddings``
process on 127.0.0.1.

Small ranged tables (``RemoteTables(hold_bytes=...)``) are held whole by the client: fetched
once, then answered from memory, so they answer through a pause or a kill of their server with
the rows they had. A larger table fails fast: within the client's deadline when the server is
paused (SIGSTOP: it holds its socket and never answers; a collection used to override that
deadline with its own 1 s), at once with UNAVAILABLE naming the server when it is killed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from sharded_tables.export import remote_routing, write_server_folders
from sharded_tables.planner import Budgets, plan
from sharded_tables.remote.client import RemoteLookupError, RemoteTables
from sharded_tables.remote.held import HeldTables
from sharded_tables.remote.routing import RemoteTable
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection

pytestmark = pytest.mark.multiproc  # a real embedding-server process

SPECS = [
    TableSpec("user_gender", 2, 8, DType.INT8),  # 24 bytes packed
    TableSpec("user_occupation", 21, 8, DType.INT8),  # 252 bytes
    TableSpec("item", 3000, 8, DType.INT8, features=("history",)),  # 36,000 bytes
]
HOLD_BYTES = 1024  # the two user tables, not the item table
TIMEOUT_S = 0.3  # the client's deadline
BOUND_S = TIMEOUT_S + 0.4  # a failed batch ends within the deadline (slack for a busy host)
# every table on the one server, no whole copies and no hot-row caches: each lookup asks the
# client, so what answers through a fault is the client's held copy alone
BUDGETS = Budgets(
    device=0, host=0, remote_per_server=1 << 20, remote_servers=1, cache_whole_max=0
)  # fmt: skip


@pytest.fixture
def served(servers, tmp_path: Path):
    """(placement, client, collection, the server process, the local twin's answers)."""
    placement = plan(SPECS, BUDGETS)
    assert all(t.tier is Tier.REMOTE and t.cache_rows == 0 for t in placement.tables)
    g = torch.Generator().manual_seed(0)
    weights = {s.name: torch.randn(s.rows, s.dim, generator=g) for s in SPECS}
    rows = TieredEmbeddingCollection(SPECS, placement).load_float(weights)
    folder = write_server_folders(placement, SPECS, rows, tmp_path / "rows")[0]
    (proc,) = servers.start((folder, 0))
    routing = remote_routing(placement, SPECS, [proc.address])
    client = RemoteTables(routing, timeout=TIMEOUT_S, hold_bytes=HOLD_BYTES)
    try:
        yield placement, client, TieredEmbeddingCollection(SPECS, placement, remote=client), proc
    finally:
        client.close()


def _users(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "user_gender": torch.randint(-1, 2, (16, 1), generator=g),
        "user_occupation": torch.randint(0, 21, (16, 2), generator=g),
    }


def _history(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"history": torch.randint(0, 3000, (4, 6), generator=g), **_users(seed)}


def _requests(client: RemoteTables) -> int:
    return sum(client.stats()["requests"].values())


def test_only_small_ranged_tables_are_held():
    tables = [
        RemoteTable("tiny", DType.INT8, 8, ("a:1",), bounds=(0, 10)),  # 120 bytes
        RemoteTable("big", DType.INT8, 8, ("a:1",), bounds=(0, 100)),  # 1,200 bytes
        RemoteTable("keyed", DType.INT8, 8, ("a:1",), "keyed"),  # any process may Put
    ]
    assert HeldTables(tables, 1024).names == {"tiny"}
    assert HeldTables(tables, 0).names == set()
    with pytest.raises(ValueError, match="hold_bytes"):
        HeldTables(tables, -1)


def test_held_tables_send_no_request_and_equal_the_servers_rows(served):
    _, client, coll, _ = served
    assert client.hold() == ["user_gender", "user_occupation"]
    held = _requests(client)
    assert held == 2  # one chunk per table
    with torch.no_grad():
        users = coll(_users(1))
    assert _requests(client) == held  # answered from memory
    with torch.no_grad():
        coll(_history(1))
    assert _requests(client) == held + 1  # the item table: one request for its ids
    with pytest.raises(ValueError, match=r"user_occupation.*id 21 is outside"):
        client.fetch({"user_occupation": torch.tensor([3, 21])})
    # the same rows as a client that holds nothing (it asks the server)
    with RemoteTables(list(client.tables.values()), timeout=5.0) as plain:
        for name in ("user_gender", "user_occupation"):
            ids = torch.arange(SPECS[0 if name == "user_gender" else 1].rows)
            assert torch.equal(client.fetch({name: ids})[name], plain.fetch({name: ids})[name])
    assert set(users) == {"user_gender", "user_occupation"} and users["user_gender"].shape == (
        16,
        8,
    )


def test_a_paused_server_fails_big_table_lookups_within_the_deadline(served):
    """SIGSTOP (always SIGCONT in finally): the item table's lookups end DEADLINE_EXCEEDED
    within the client's deadline, not a collection's own 1 s; the held tables answer, equal to
    before."""
    _, client, coll, proc = served
    client.hold()
    with torch.no_grad():
        before = coll(_users(2))
        coll(_history(3))  # connected
    elapsed: list[float] = []
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        for seed in range(3):
            start = time.monotonic()
            with pytest.raises(RemoteLookupError) as err, torch.no_grad():
                coll(_history(10 + seed))
            elapsed.append(time.monotonic() - start)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert proc.address in str(err.value)
        with torch.no_grad():
            during = coll(_users(2))
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    assert all(TIMEOUT_S * 0.8 < e < BOUND_S for e in elapsed), elapsed
    for f in before:
        assert torch.equal(during[f], before[f])
    with torch.no_grad():
        coll(_history(20))  # answers again after SIGCONT
    print(f"paused: big-table lookups failed after {[round(e, 2) for e in elapsed]} s")


def test_a_killed_server_leaves_small_tables_answering(served):
    """kill -9: every held-table lookup answers with the rows of before; the item table's
    fail at once with UNAVAILABLE naming the server."""
    _, client, coll, proc = served
    client.hold()
    probes = [_users(seed) for seed in range(5)]
    with torch.no_grad():
        before = [coll(p) for p in probes]
    proc.proc.kill()
    proc.proc.wait(5)
    with torch.no_grad():
        for p, want in zip(probes, before, strict=True):
            got = coll(p)
            assert all(torch.equal(got[f], want[f]) for f in want)
        start = time.monotonic()
        with pytest.raises(RemoteLookupError) as err:
            coll(_history(4))
    assert time.monotonic() - start < BOUND_S
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and proc.address in str(err.value)


def test_a_table_that_came_back_zero_filled_is_not_held(served):
    """``fallback="zero"`` with the server killed: nothing is held (zero rows must not become
    a permanent copy); the lookups answer zero rows, counted."""
    _, client, _, proc = served
    routing = list(client.tables.values())
    proc.proc.kill()
    proc.proc.wait(5)
    with RemoteTables(routing, timeout=TIMEOUT_S, fallback="zero", hold_bytes=HOLD_BYTES) as zero:
        assert zero.hold() == []
        asked = _requests(zero)
        rows, found = zero.get("user_gender", torch.tensor([0, 1, 1]))
        assert not bool(rows.any()) and not bool(found.any()) and rows.shape == (3, 12)
        assert not zero.held.is_held("user_gender")
        assert _requests(zero) == asked + 1  # the attempt to hold it, no second call
        assert sum(zero.stats()["zero_filled_ids"].values()) >= 2
