"""Embedding servers as real processes on 127.0.0.1, read through ``RemoteTables``.

Two servers split two ranged tables by row range (int8 ``emb_a``, fp16 ``emb_b``) and share one
keyed table (``sessions``); other tests start their own servers to kill, stop or restart them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from common.stop_signals import EXIT_MARGIN_S
from recserve.cli import app
from sharded_tables.interface import TablesUnavailableError
from sharded_tables.quantize import pack_rows
from sharded_tables.remote import embedding_pb2 as pb
from sharded_tables.remote.client import RemoteLookupError, RemoteTable, RemoteTables
from sharded_tables.remote.embedding_pb2_grpc import EmbeddingServiceStub
from sharded_tables.remote.server import EmbeddingServer
from sharded_tables.remote.server_files import ServerTable, write_server_folder
from sharded_tables.specs import DType

pytestmark = pytest.mark.multiproc

A_BOUNDS, B_BOUNDS = (0, 1700, 3000), (0, 1000, 2000)


@dataclass
class Cluster:
    addresses: tuple[str, ...]
    emb_a: torch.Tensor  # uint8 [3000, 20] packed int8 rows, dim 16
    emb_b: torch.Tensor  # uint8 [2000, 16] packed fp16 rows, dim 8

    def routing(self, a_bounds: tuple[int, ...] = A_BOUNDS) -> list[RemoteTable]:
        return [
            RemoteTable("emb_a", DType.INT8, 16, self.addresses, "range", a_bounds),
            RemoteTable("emb_b", DType.FP16, 8, self.addresses, "range", B_BOUNDS),
            RemoteTable("sessions", DType.FP16, 8, self.addresses, "keyed"),
        ]


def build_shards(root: Path) -> tuple[list[Path], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb_a = pack_rows(torch.randn(3000, 16, generator=g), DType.INT8)
    emb_b = pack_rows(torch.randn(2000, 8, generator=g), DType.FP16)
    folders = []
    for s in range(2):
        (a_lo, a_hi), (b_lo, b_hi) = A_BOUNDS[s : s + 2], B_BOUNDS[s : s + 2]
        folders.append(root / f"shard{s}")
        write_server_folder(
            folders[-1],
            [
                ServerTable("emb_a", DType.INT8, 16, "range", a_lo, a_hi, emb_a[a_lo:a_hi]),
                ServerTable("emb_b", DType.FP16, 8, "range", b_lo, b_hi, emb_b[b_lo:b_hi]),
                ServerTable("sessions", DType.FP16, 8, "keyed"),
            ],
        )
    return folders, emb_a, emb_b


@pytest.fixture(scope="module")
def cluster(module_servers, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    folders, emb_a, emb_b = build_shards(tmp_path_factory.mktemp("cluster"))
    procs = module_servers.start(*((f, 0) for f in folders))
    return Cluster(tuple(p.address for p in procs), emb_a, emb_b)


def one_keyed_server(servers, folder: Path, port: int = 0):
    if not folder.exists():
        write_server_folder(folder, [ServerTable("sessions", DType.FP16, 8, "keyed")])
    (proc,) = servers.start((folder, port))
    table = RemoteTable("sessions", DType.FP16, 8, (proc.address,), "keyed")
    return proc, table


def test_fetch_returns_exactly_the_packed_rows(cluster: Cluster):
    g = torch.Generator().manual_seed(1)
    ids_a, ids_b = (
        torch.randint(0, 3000, (4096,), generator=g),
        torch.randint(0, 2000, (300,), generator=g),
    )
    with RemoteTables(cluster.routing()) as remote:
        out = remote.fetch({"emb_a": ids_a, "emb_b": ids_b}, timeout=5.0)
        assert out["emb_a"].dtype == torch.uint8 and out["emb_a"].shape == (4096, 20)
        assert torch.equal(out["emb_a"], cluster.emb_a[ids_a])
        assert torch.equal(out["emb_b"], cluster.emb_b[ids_b])
        assert remote.fetch({"emb_a": torch.zeros(0, dtype=torch.int64)})["emb_a"].shape == (0, 20)


def test_duplicates_are_sent_once_in_one_lookup_per_server(cluster: Cluster):
    with RemoteTables(cluster.routing()) as remote:
        before = remote.info()
        ids = {
            "emb_a": torch.tensor([5, 5, 5, 1800, 1800, 7]),
            "emb_b": torch.tensor([1999, 1999, 0]),
        }
        out = remote.fetch(ids)
        after = remote.info()
        assert torch.equal(out["emb_a"], cluster.emb_a[ids["emb_a"]])
        s0, s1 = cluster.addresses
        # server 0: emb_a {5, 7} and emb_b {0}; server 1: emb_a {1800} and emb_b {1999}
        for address, unique in ((s0, 3), (s1, 2)):
            assert after[address].requests - before[address].requests == 1
            assert after[address].ids_served - before[address].ids_served == unique
        assert remote.stats()["ids"] == {s0: 3, s1: 2}
        assert remote.stats()["requests"] == {s0: 1, s1: 1}


def test_info_and_health(cluster: Cluster):
    with RemoteTables(cluster.routing()) as remote:
        info = remote.info()[cluster.addresses[1]]
    tables = {t.name: t for t in info.tables}
    assert (tables["emb_a"].partition, tables["emb_a"].row_lo, tables["emb_a"].row_hi) == (
        "range",
        1700,
        3000,
    )
    assert tables["emb_a"].bytes == 1300 * 20 and tables["sessions"].partition == "keyed"
    assert info.memory_budget == 4 << 30 and info.bytes_used >= 1300 * 20 + 1000 * 16
    for address in cluster.addresses:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="recserve.embedding.v1.EmbeddingService"),
                timeout=5,
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_keyed_put_then_get_across_servers(cluster: Cluster):
    g = torch.Generator().manual_seed(2)
    keys = torch.cat([torch.randint(-(2**62), 2**62, (200,), generator=g), torch.tensor([-1, 0])])
    rows = pack_rows(torch.randn(len(keys), 8, generator=g), DType.FP16)
    with RemoteTables(cluster.routing()) as remote:
        remote.put("sessions", keys, rows)
        remote.put("sessions", torch.tensor([0, 0]), rows[:2])  # last row wins
        expect = rows.clone()
        expect[-1] = rows[1]
        perm = torch.randperm(len(keys), generator=g)
        query = torch.cat([keys[perm], torch.tensor([12345678901])])
        got, found = remote.get("sessions", query)
        assert torch.equal(got[:-1], expect[perm]) and found[:-1].all()
        assert not found[-1] and not got[-1].any()
        assert torch.equal(remote.fetch({"sessions": query})["sessions"], got)
        held = [{t.name: t for t in i.tables}["sessions"].keys for i in remote.info().values()]
        assert sum(held) == len(keys) and min(held) > 0


def test_server_names_the_table_and_the_id_out_of_its_range(cluster: Cluster):
    # The routing wrongly says server 0 holds emb_a rows up to 2500.
    remote = RemoteTables(cluster.routing(a_bounds=(0, 2500, 3000)), fallback="zero")
    with remote, pytest.raises(RemoteLookupError) as err:  # fallback never hides a caller bug
        remote.fetch({"emb_a": torch.tensor([3, 2000])})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not isinstance(err.value, TablesUnavailableError)  # a retry would fail the same way
    assert "'emb_a'" in str(err.value) and "id 2000" in str(err.value)
    assert err.value.address == cluster.addresses[0]


def test_unknown_table_is_named(cluster: Cluster):
    ghost = RemoteTable("ghost", DType.FP16, 8, cluster.addresses, "keyed")
    with RemoteTables([ghost]) as remote:
        with pytest.raises(RemoteLookupError, match=r"NOT_FOUND.*'ghost'") as err:
            remote.fetch({"ghost": torch.tensor([1])})
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(KeyError, match="unknown table 'emb_a'"):
            remote.fetch({"emb_a": torch.tensor([1])})


def test_put_to_a_ranged_table_is_refused(cluster: Cluster):
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = EmbeddingServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(pb.PutRequest(table="emb_a", ids=b"\0" * 8, rows=b"\0" * 20), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ranged" in err.value.details()


@pytest.mark.parametrize("method", ["Lookup", "Put", "Info"])
def test_bytes_that_are_no_request_get_invalid_argument_not_internal(cluster: Cluster, method):
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        call = channel.unary_unary(f"/recserve.embedding.v1.EmbeddingService/{method}")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff\xff", timeout=5)  # a field key whose varint never ends
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    want = f"request: not a valid recserve.embedding.v1.{method}Request message"
    assert err.value.details().startswith(want), err.value.details()


def test_fallback_zero_fills_a_dead_servers_rows_and_counts_them(
    cluster: Cluster, dead_address: str
):
    live = cluster.addresses[0]
    routing = [RemoteTable("emb_a", DType.INT8, 16, (live, dead_address), "range", A_BOUNDS)]
    ids = torch.tensor([1, 2000, 2, 2000, 2999])
    counter = "recserve_remote_zero_filled_ids_total"
    before = REGISTRY.get_sample_value(counter, {"server": dead_address}) or 0.0
    with RemoteTables(routing, fallback="zero", timeout=2.0) as remote:
        out = remote.fetch({"emb_a": ids})
        assert torch.equal(out["emb_a"][[0, 2]], cluster.emb_a[[1, 2]])
        assert not out["emb_a"][[1, 3, 4]].any()
        stats = remote.stats()
    assert stats["zero_filled_ids"] == {live: 0, dead_address: 2}
    assert stats["failures"][dead_address] == 1
    assert REGISTRY.get_sample_value(counter, {"server": dead_address}) == before + 2


def test_keyed_rows_survive_kill_9_and_restart(servers, tmp_path: Path):
    folder = tmp_path / "keyed"
    proc, table = one_keyed_server(servers, folder)
    keys = torch.tensor([7, -(2**63), 2**63 - 1, 42])
    rows = pack_rows(torch.randn(4, 8), DType.FP16)
    with RemoteTables([table], timeout=5.0) as remote:
        remote.put("sessions", keys, rows)
        remote.put("sessions", keys[:1], rows[3:])
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(5)

    _, table = one_keyed_server(servers, folder, proc.port)  # same folder, same port
    with RemoteTables([table], timeout=5.0) as remote:
        got, found = remote.get("sessions", keys)
    assert found.all()
    assert torch.equal(got, torch.cat([rows[3:], rows[1:]]))


def test_killed_server_raises_unavailable_quickly(servers, tmp_path: Path):
    proc, table = one_keyed_server(servers, tmp_path / "keyed")
    with RemoteTables([table], timeout=5.0) as remote:
        remote.get("sessions", torch.tensor([1]))  # connected
        proc.proc.kill()
        proc.proc.wait(5)
        start = time.monotonic()
        with pytest.raises(RemoteLookupError) as err:
            remote.fetch({"sessions": torch.tensor([1, 2])})
        assert time.monotonic() - start < 1.0
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert isinstance(err.value, TablesUnavailableError)  # what the serving engine catches
    assert proc.address in str(err.value) and "UNAVAILABLE" in str(err.value)


def test_stopped_server_misses_the_deadline_then_stops_on_sigterm(servers, tmp_path: Path):
    proc, table = one_keyed_server(servers, tmp_path / "keyed")
    with RemoteTables([table], timeout=5.0) as remote:
        remote.get("sessions", torch.tensor([1]))  # connected
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RemoteLookupError) as err:
                remote.fetch({"sessions": torch.tensor([1])}, timeout=0.5)
            elapsed = time.monotonic() - start
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and proc.address in str(err.value)
    assert isinstance(err.value, TablesUnavailableError)
    assert 0.4 < elapsed < 1.0
    proc.proc.terminate()
    try:  # the server's watchdog ends it (status 1, its stacks in the log) past grace + margin
        rc = proc.proc.wait(5.0 + EXIT_MARGIN_S + 5.0)
    except subprocess.TimeoutExpired:
        rc = None
    assert rc == 0, f"exit status {rc}; the server's log:\n{proc.stderr.read_text()[-8000:]}"


def test_cli_refuses_a_shard_over_the_memory_budget(tmp_path: Path):
    folders, _, _ = build_shards(tmp_path)
    need = 1700 * 20 + 1000 * 16

    def serve(budget: str):
        args = ["serve", "embeddings", "--folder", str(folders[0]), "--grpc-port", "0"]
        return CliRunner().invoke(app, [*args, "--memory-budget", budget])

    out = serve("1000")
    assert out.exit_code == 2
    assert f"{need - 1000} bytes over the memory budget of 1000 bytes" in out.output
    out = serve("4XB")
    assert out.exit_code == 2 and "(--memory-budget): cannot read '4XB'" in out.output


def test_server_can_hold_a_subset_of_the_shards_tables(tmp_path: Path):
    folders, _, _ = build_shards(tmp_path)
    server = EmbeddingServer(folders[1], tables=["emb_b"])
    assert list(server.tables) == ["emb_b"] and server.tables["emb_b"].lo == 1000
    with pytest.raises(ValueError, match=r"tables: \['nope'\] not in the server folder"):
        EmbeddingServer(folders[1], tables=["nope"])


def test_put_over_the_budget_is_refused_and_nothing_is_stored(tmp_path: Path):
    write_server_folder(tmp_path / "keyed", [ServerTable("sessions", DType.FP16, 8, "keyed")])
    server = EmbeddingServer(tmp_path / "keyed", memory_budget=3 * 16)  # three fp16 rows of dim 8
    address = server.start()
    table = RemoteTable("sessions", DType.FP16, 8, (address,), "keyed")
    rows = torch.ones(4, 16, dtype=torch.uint8)
    try:
        with RemoteTables([table], timeout=5.0) as remote:
            remote.put("sessions", torch.tensor([1, 2, 3, 3]), rows)  # 3 distinct keys fit
            with pytest.raises(
                RemoteLookupError, match="16 bytes over the memory budget of 48"
            ) as err:
                remote.put("sessions", torch.tensor([4]), rows[:1])
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            _, found = remote.get("sessions", torch.tensor([1, 2, 3, 4]))
            assert found.tolist() == [True, True, True, False]
    finally:
        server.stop(grace=0)
