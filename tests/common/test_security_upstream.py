"""Tokens and TLS behind the router (in this process, real gRPC on 127.0.0.1): shard servers and
embedding servers refuse calls without the token, a router with the token and the CA gets whole
answers over TLS, and ``cluster up`` hands every process the same protections."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from common.grpc_util import ClientAuth
from common.security import SecurityConfig
from recserve import cluster
from serving.app.config import RouterConfig, ServeConfig
from serving.app.server import Server
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository.repository import ModelRepository
from serving.sharding.shard_client import ShardClient
from serving.sharding.shard_server import ShardServer
from sharded_tables.quantize import pack_rows
from sharded_tables.remote.client import RemoteLookupError, RemoteTable, RemoteTables
from sharded_tables.remote.server import EmbeddingServer
from sharded_tables.remote.server_files import ServerTable, write_server_folder
from sharded_tables.specs import DType
from support.self_signed import make_cert

WAIT = 10.0
TOKEN = "cluster-token-for-the-upstream-tests-42"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_cert(tmp_path_factory.mktemp("tls"), "cluster")


@pytest.fixture(scope="module")
def shards(tiny, tls, tmp_path_factory) -> Iterator[tuple[Path, list[str]]]:
    """(repository, addresses): two shard servers of a sharded ``demo`` with token and TLS."""
    root = tmp_path_factory.mktemp("repo")
    ModelRepository(root).publish("demo", tiny.model, shards=2)
    security = SecurityConfig(token=TOKEN, tls_cert=tls[0], tls_key=tls[1]).load()
    servers = [
        ShardServer(ModelRepository(root), "demo", s, poll_s=0, security=security) for s in range(2)
    ]
    addresses = [s.start() for s in servers]
    yield root, addresses
    for s in servers:
        s.stop(0)


@pytest.mark.multiproc  # openssl makes the certificate
def test_shards_answer_only_a_caller_with_the_token_over_tls(shards, tls):
    _, addresses = shards
    ca = tls[0].read_bytes()
    config = RouterConfig(shards=[[a] for a in addresses])
    callers = {
        "plaintext, no token": None,
        "plaintext, token": ClientAuth(token=TOKEN),
        "tls, no token": ClientAuth(ca),
        "tls, wrong token": ClientAuth(ca, token=TOKEN[::-1]),
        "tls, token": ClientAuth(ca, token=TOKEN),
    }
    answered = {}
    for name, auth in callers.items():
        client = ShardClient(config, "demo", CollectorRegistry(), auth)
        answered[name] = sorted(client.infos())
        client.close()
    assert answered == {name: [] for name in callers} | {"tls, token": sorted(addresses)}


@pytest.mark.multiproc  # the tls fixture runs openssl
def test_a_router_with_the_token_gets_whole_answers(shards, tls, tiny):
    root, addresses = shards
    cert, key = tls
    security = SecurityConfig(token=TOKEN, tls_cert=cert, tls_key=key, upstream_ca=cert)
    config = ServeConfig(
        model_repo=root, model="demo", grpc_port=0, poll_s=0, close_linger_s=0,
        router=RouterConfig(shards=[[a] for a in addresses], shard_deadline_ms=5000.0),
        security=security,
    )  # fmt: skip
    router = Server(config)
    router.start()
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(router.addresses.grpc, creds) as channel:
            token = (("authorization", f"Bearer {TOKEN}"),)
            reply = RecommenderStub(channel).Recommend(
                tiny.message(4), timeout=WAIT, metadata=token
            )
        assert not reply.partial and len(reply.item_ids) == 10
        with torch.inference_mode():
            ids, _ = tiny.model(tiny.prep.user_batch(torch.tensor([4]).numpy()), 10)
        assert set(reply.item_ids) == set(ids[0].tolist())
    finally:
        router.drain_and_stop(timeout=WAIT)


def test_embedding_servers_check_the_token(tmp_path):
    rows = pack_rows(torch.randn(100, 8, generator=torch.Generator().manual_seed(0)), DType.FP16)
    folder = tmp_path / "shard"
    write_server_folder(
        folder,
        [
            ServerTable("emb", DType.FP16, 8, "range", 0, 100, rows),
            ServerTable("sessions", DType.FP16, 8, "keyed"),
        ],
    )
    security = SecurityConfig(token=TOKEN, auth_serving=False).load()
    server = EmbeddingServer(folder, interceptors=security.interceptors())
    address = server.start()
    routing = [
        RemoteTable("emb", DType.FP16, 8, (address,), "range", (0, 100)),
        RemoteTable("sessions", DType.FP16, 8, (address,), "keyed"),
    ]
    ids = torch.tensor([3, 99, 3])
    put = (torch.tensor([7]), rows[:1].clone())
    try:
        with RemoteTables(routing, timeout=WAIT) as anonymous:
            assert torch.equal(anonymous.fetch({"emb": ids})["emb"], rows[ids])  # lookups: open
            with pytest.raises(RemoteLookupError, match="UNAUTHENTICATED") as e:
                anonymous.put("sessions", *put)  # a write needs the token
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with RemoteTables(routing, timeout=WAIT, auth=ClientAuth(token=TOKEN)) as trusted:
            trusted.put("sessions", *put)
            assert torch.equal(trusted.fetch({"sessions": put[0]})["sessions"], put[1])
    finally:
        server.stop(0)


@pytest.mark.multiproc  # the tls fixture runs openssl
def test_cluster_up_gives_every_process_the_flags_and_no_host(tmp_path, tls, monkeypatch):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    started: list[cluster.Proc] = []

    def fake_start(name, role, cmd, logs):
        started.append(cluster.Proc(name, role, cmd, pid=0, log=""))
        return started[-1]

    def fake_ready(p, timeout):
        p.address = f"127.0.0.1:{9000 + len(p.name)}"

    monkeypatch.setattr(cluster, "check_version", lambda spec: ("demo", 1))
    monkeypatch.setattr(cluster, "start_proc", fake_start)
    monkeypatch.setattr(cluster, "wait_ready", fake_ready)
    spec = cluster.ClusterSpec(
        model_repo=tmp_path, shards=2, embedding_servers=1, auth_token_file=token,
        tls_cert=tls[0], tls_key=tls[1],
    )  # fmt: skip
    c = cluster.up(spec, tmp_path / "run")
    assert [p.role for p in started] == ["embedding-server", "shard", "shard", "router"]
    for p in started:
        assert TOKEN not in " ".join(p.cmd) and "--host" not in p.cmd
        for flag, value in (("--auth-token-file", token), ("--tls-cert", tls[0])):
            assert p.cmd[p.cmd.index(flag) + 1] == str(value.resolve())
    assert started[-1].cmd[started[-1].cmd.index("--upstream-ca") + 1] == str(tls[0].resolve())
    assert cluster.Cluster.load(tmp_path / "run").tls_ca == c.tls_ca == str(tls[0].resolve())
