"""Hashed tables in training: a small working table whose evicted rows and optimizer state live
on real embedding servers (in-process, loopback) trains exactly like a table of every id, and a
checkpoint rewinds the servers so a resumed run equals an uninterrupted one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from sharded_tables.collection import TableConfig
from sharded_tables.hashed_training import (
    HashedTable,
    HashedTrainingTables,
    hashed_uniform,
    state_width,
    store_tables,
)
from sharded_tables.remote.client import RemoteLookupError, RemoteTables
from sharded_tables.remote.server import EmbeddingServer
from sharded_tables.remote.server_files import ServerTable, write_server_folder
from sharded_tables.specs import DType
from sharded_tables.trainable import TrainableTables

D = 8
IDS = torch.tensor([10**15 + 7 * i for i in range(24)])  # raw ids far past any table's rows


def start_servers(tmp: Path, n: int, optimizer: str) -> list[EmbeddingServer]:
    width = D + state_width(optimizer, D)
    out = []
    for i in range(n):
        folder = tmp / f"server-{i}"
        write_server_folder(folder, [ServerTable("user_raw", DType.FP32, width, "keyed")])
        srv = EmbeddingServer(folder)
        srv.start()
        out.append(srv)
    return out


@pytest.fixture(params=["rowwise_adagrad", "sgd", "adagrad"])
def optimizer(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(tmp_path: Path, optimizer: str) -> Iterator[RemoteTables]:
    servers = start_servers(tmp_path, 2, optimizer)
    client = RemoteTables(store_tables({"user_raw": (D, optimizer)}, [s.address for s in servers]))
    yield client
    client.close()
    for s in servers:
        s.stop(grace=0)


def hashed_tables(store: RemoteTables, optimizer: str, capacity: int) -> HashedTrainingTables:
    inner = TrainableTables(
        [TableConfig("user_raw", capacity, D), TableConfig("item", 5, D)],
        optimizer=optimizer, learning_rate=0.3, seed=0,
    )  # fmt: skip
    return HashedTrainingTables(inner, {"user_raw": HashedTable(capacity)}, store, seed=3)


def batches(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        pick = torch.randint(0, len(IDS), (6, 2), generator=g)
        raw = IDS[pick]
        raw[0, 1] = -1  # padding
        out.append({"user_raw": raw, "item": torch.randint(0, 5, (6, 1), generator=g)})
    return out


def train(tables: torch.nn.Module, steps: list[dict[str, torch.Tensor]]) -> None:
    target = torch.linspace(-1, 1, 2 * D)
    for feats in steps:
        out = tables(feats)
        loss = ((torch.cat([out["user_raw"], out["item"]], 1) - target) ** 2).sum()
        loss.backward()  # the fused optimizer steps the rows read


def test_a_small_working_table_trains_like_every_id_resident(
    store: RemoteTables, optimizer: str
) -> None:
    steps = batches(30)
    small = hashed_tables(store, optimizer, capacity=12)  # 24 ids: half evicted at any time
    item0 = small.inner.weights()["item"].clone()
    train(small, steps)
    assert small.moved.evicted > 0 and small.moved.restored > 0

    # the reference: one kernel row per id, starting from the same per-id rows
    full = TrainableTables(
        [TableConfig("user_raw", len(IDS), D), TableConfig("item", 5, D)],
        optimizer=optimizer, learning_rate=0.3, seed=0,
    )  # fmt: skip
    full.load_weights({"user_raw": hashed_uniform(IDS, D, small.scale, small.seed), "item": item0})
    position = {int(x): i for i, x in enumerate(IDS)}
    as_rows = [
        {**f, "user_raw": f["user_raw"].apply_(lambda x: position.get(x, -1))} for f in batches(30)
    ]
    train(full, as_rows)

    ids, rows = small.export("user_raw")
    seen = torch.unique(torch.cat([f["user_raw"].flatten() for f in steps]))
    seen = seen[seen != -1]
    assert torch.equal(ids, seen)
    expect = full.weights()["user_raw"][[position[int(x)] for x in ids]]
    torch.testing.assert_close(rows, expect, rtol=0, atol=1e-6)
    torch.testing.assert_close(small.inner.weights()["item"], full.weights()["item"])


def test_loading_a_checkpoint_rewinds_the_servers(store: RemoteTables, optimizer: str) -> None:
    steps = batches(24)
    straight = hashed_tables(store, optimizer, capacity=6)
    train(straight, steps)
    want_ids, want_rows = straight.export("user_raw")

    # a second run on the same servers: checkpoint after 10 steps, go on (the servers take
    # newer rows), then "crash" and resume from the checkpoint in a fresh process's tables
    store.rewind("user_raw", {a: 0 for a in store.marks("user_raw")})
    first = hashed_tables(store, optimizer, capacity=6)
    train(first, steps[:10])
    saved = {k: v for k, v in first.state_dict().items()}
    train(first, steps[10:17])
    resumed = hashed_tables(store, optimizer, capacity=6)
    resumed.load_state_dict(saved)
    train(resumed, steps[10:])
    ids, rows = resumed.export("user_raw")
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=0)


def test_keys_marks_and_rewind_on_the_server(tmp_path: Path) -> None:
    (srv,) = start_servers(tmp_path, 1, "sgd")
    client = RemoteTables(store_tables({"user_raw": (D, "sgd")}, [srv.address]))
    try:
        rows = lambda n: torch.arange(n * D * 4, dtype=torch.uint8).view(n, D * 4)  # noqa: E731
        client.put("user_raw", torch.tensor([5, 9]), rows(2))
        mark = client.marks("user_raw")
        client.put("user_raw", torch.tensor([9, 11]), rows(2) + 1)
        assert sorted(client.keys("user_raw").tolist()) == [5, 9, 11]
        assert client.rewind("user_raw", mark) == 2
        assert sorted(client.keys("user_raw").tolist()) == [5, 9]
        got, found = client.get("user_raw", torch.tensor([9, 11]))
        assert found.tolist() == [True, False] and torch.equal(got[0], rows(2)[1])
        address = srv.address
        with pytest.raises(RemoteLookupError, match="inside a record") as e:
            client.rewind("user_raw", {address: mark[address] - 1})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(RemoteLookupError, match="outside the log"):
            client.rewind("user_raw", {address: mark[address] + 10**6})
        with pytest.raises(ValueError, match="another set of embedding servers"):
            client.rewind("user_raw", {"127.0.0.1:1": 0})
    finally:
        client.close()
        srv.stop(grace=0)
    # the rewind is durable: a restarted server replays the cut log
    again = EmbeddingServer(tmp_path / "server-0")
    assert sorted(again.tables["user_raw"].keys().tolist()) == [5, 9]  # type: ignore[union-attr]
