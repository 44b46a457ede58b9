"""Embedding servers follow publishes: the version bookkeeping as pure classes, and an in-process
server that loads a new version's rows beside the old, answers each lookup from the version it
names, keeps the 2 newest, and refuses a version over its memory budget while serving the held.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from sharded_tables.quantize import pack_rows
from sharded_tables.remote.client import (
    EmbeddingVersions,
    RemoteLookupError,
    RemoteTable,
    RemoteTables,
)
from sharded_tables.remote.server import EmbeddingServer
from sharded_tables.remote.server_files import ServerTable, write_server_folder
from sharded_tables.remote.versions import HeldVersions, VersionNotHeldError, next_version
from sharded_tables.specs import DType

ROWS, DIM = 100, 8
ROW_BYTES = 4 * DIM  # fp32


def test_held_versions_keep_the_newest_two_and_answer_by_version():
    held: HeldVersions[str] = HeldVersions(keep=2)
    held.add(1, "v1")
    assert held.get(0) == "v1" and held.get(1) == "v1"
    assert held.make_room() == []
    held.add(2, "v2")
    assert held.versions() == [1, 2] and held.get(0) == "v2" and held.get(1) == "v1"
    with pytest.raises(ValueError, match="make_room"):
        held.add(3, "v3")
    assert held.make_room() == ["v1"]
    held.add(3, "v3")
    assert held.versions() == [2, 3]
    with pytest.raises(VersionNotHeldError, match=r"version 1 is not held \(holds \[2, 3\]\)"):
        held.get(1)
    with pytest.raises(ValueError, match="not newer"):
        held.add(2, "again")


def test_an_unversioned_folder_answers_every_version():
    held: HeldVersions[str] = HeldVersions()
    held.add(0, "folder")
    assert held.get(0) == held.get(7) == "folder"
    with pytest.raises(VersionNotHeldError, match="no version loaded"):
        HeldVersions[str]().get(0)


def test_next_version_is_the_newest_unseen_and_not_refused():
    assert next_version({1: "a"}, held=[1], refused=()) is None
    assert next_version({1: "a", 2: "b", 3: "c"}, held=[1], refused=()) == 3  # skips 2
    assert next_version({1: "a", 2: "b", 3: "c"}, held=[1], refused={3}) is None
    assert next_version({1: "a", 3: "c", 4: "d"}, held=[1], refused={3}) == 4
    assert next_version({1: "a"}, held=[], refused=()) == 1
    assert next_version({1: "a"}, held=[2], refused=()) is None  # never back


def publish_rows(root: Path, version: int, rows: int = ROWS) -> tuple[Path, torch.Tensor]:
    """Version ``version``'s folder: one fp32 ranged table ``item`` whose row i is all
    ``version * 1000 + i`` (the version is readable from every row)."""
    values = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, DIM) + 1000 * version
    packed = pack_rows(values, DType.FP32)
    folder = root / str(version)
    write_server_folder(folder, [ServerTable("item", DType.FP32, DIM, "range", 0, rows, packed)])
    return folder, packed


def test_server_loads_new_versions_beside_the_old_and_refuses_one_over_budget(tmp_path: Path):
    available: dict[int, Path] = {}
    v1, rows1 = publish_rows(tmp_path, 1)
    available[1] = v1
    budget = 2 * ROWS * ROW_BYTES  # two versions of the table
    server = EmbeddingServer(
        v1, memory_budget=budget, version=1, source=lambda: dict(available), poll_s=60
    )
    address = server.start()
    table = RemoteTable("item", DType.FP32, DIM, (address,), "range", (0, ROWS))
    ids = torch.tensor([0, 5, 99])
    clients = {v: RemoteTables([table], timeout=5.0, version=v) for v in (0, 1, 2, 3)}
    probe = EmbeddingVersions([address])
    try:
        assert server.poll() is None and probe.held() == {1}
        assert torch.equal(clients[0].fetch({"item": ids})["item"], rows1[ids])
        v2, rows2 = publish_rows(tmp_path, 2)
        available[2] = v2
        assert server.poll() == 2 and server.versions() == [1, 2] and probe.held() == {1, 2}
        # each client reads the rows of the version it names; 0 is the newest
        assert torch.equal(clients[1].fetch({"item": ids})["item"], rows1[ids])
        assert torch.equal(clients[2].fetch({"item": ids})["item"], rows2[ids])
        assert torch.equal(clients[0].fetch({"item": ids})["item"], rows2[ids])
        with pytest.raises(RemoteLookupError, match=r"version 3 is not held") as err:
            clients[3].fetch({"item": ids})
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        info = clients[0].info()[address]
        assert list(info.versions) == [1, 2] and info.bytes_used == budget
        assert sorted(t.version for t in info.tables) == [1, 2]
        # version 3 replaces the oldest: the server never holds more than 2
        v3, rows3 = publish_rows(tmp_path, 3)
        available[3] = v3
        assert server.poll() == 3 and server.versions() == [2, 3]
        assert torch.equal(clients[3].fetch({"item": ids})["item"], rows3[ids])
        with pytest.raises(RemoteLookupError, match=r"version 1 is not held \(holds \[2, 3\]\)"):
            clients[1].fetch({"item": ids})
        # version 4 is twice as large: it does not fit beside version 3, so it is refused once
        # (not retried), counted, and version 3 keeps serving
        available[4], _ = publish_rows(tmp_path, 4, rows=2 * ROWS)
        assert server.poll() is None and server.poll() is None
        assert server.versions() == [3]  # 2 made room for 4
        info = clients[0].info()[address]
        assert info.versions_refused == 1 and list(info.versions) == [3]
        assert torch.equal(clients[0].fetch({"item": ids})["item"], rows3[ids])
        # a later publish that fits is loaded
        available[5], rows5 = publish_rows(tmp_path, 5)
        assert server.poll() == 5 and server.versions() == [3, 5]
        assert torch.equal(clients[0].fetch({"item": ids})["item"], rows5[ids])
    finally:
        probe.close()
        for c in clients.values():
            c.close()
        server.stop(grace=1.0)


def test_a_version_without_rows_here_is_held_empty(tmp_path: Path):
    v1, _ = publish_rows(tmp_path, 1)
    server = EmbeddingServer(v1, version=1, source=lambda: {1: v1, 2: tmp_path / "missing"})
    assert server.poll() == 2 and server.versions() == [1, 2] and server.tables == {}


def test_an_unversioned_folder_reports_no_versions(tmp_path: Path):
    v1, rows1 = publish_rows(tmp_path, 1)
    server = EmbeddingServer(v1)
    address = server.start()
    try:
        probe = EmbeddingVersions([address])
        assert probe.held() is None  # no constraint for a router
        probe.close()
        table = RemoteTable("item", DType.FP32, DIM, (address,), "range", (0, ROWS))
        with RemoteTables([table], timeout=5.0, version=9) as remote:
            assert torch.equal(remote.fetch({"item": torch.tensor([3])})["item"], rows1[[3]])
    finally:
        server.stop(grace=1.0)
