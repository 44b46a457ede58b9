"""Bearer tokens and TLS on the serving front end (a real server on 127.0.0.1, the stand-in
repository, a self-signed certificate made for the test): who may call what over gRPC and HTTP,
constant-time checks, no token in any log, and every listener on 127.0.0.1 by default."""

from __future__ import annotations

import hmac
import http.client
import inspect
import json
import logging
import ssl
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from common import security
from common.security import Authenticator, SecurityConfig
from serving.app.config import ConfigError, ServeConfig
from serving.app.server import Server
from serving.frontends import kserve_grpc
from serving.live import admin
from serving.protos import admin_pb2 as apb
from serving.protos.admin_pb2_grpc import AdminStub
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.types import DATATYPES
from support.self_signed import make_cert

WAIT = 10.0
TOKEN = "t0ken-for-the-security-tests-7f3a9c"
WRONG = "wrong-token-that-must-not-be-logged-1d2e"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("tls")
    return {name: make_cert(folder, name) for name in ("server", "client")}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def start(serve_config, repo) -> Iterator[Callable[..., Server]]:
    """``start(security, **config)``: a started server with KServe and admin; stopped after."""
    servers: list[Server] = []

    def make(sec: SecurityConfig, **overrides) -> Server:
        overrides.setdefault("metrics_port", None)
        s = Server(
            serve_config(security=sec, **overrides),
            repo=repo,
            extra_servicers=[kserve_grpc.add_servicer, admin.add_servicer],
        )
        servers.append(s)
        s.start()
        return s

    yield make
    for s in servers:
        s.drain_and_stop(timeout=WAIT)


def tls_channel(address: str, ca: Path, client: tuple[Path, Path] | None = None) -> grpc.Channel:
    key = client[1].read_bytes() if client else None
    chain = client[0].read_bytes() if client else None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes(), key, chain))


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        assert TOKEN not in (e.details() or "") and WRONG not in (e.details() or "")
        return e.code()
    return grpc.StatusCode.OK


def https(server: Server, method: str, path: str, ca: Path, token: str | None = None, body=None):
    """-> (status, headers, body) over HTTPS, verifying the server with ``ca``."""
    host, port = server.addresses.http.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection(host, int(port), timeout=WAIT, context=context)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        conn.request(method, path, body, headers)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


# ---- gRPC ---------------------------------------------------------------------------------------
@pytest.mark.multiproc  # openssl makes the certificate
def test_recommend_over_tls_with_the_ca_and_no_plaintext(start, certs, tiny):
    cert, key = certs["server"]
    server = start(SecurityConfig(tls_cert=cert, tls_key=key))
    with tls_channel(server.addresses.grpc, cert) as channel:
        reply = RecommenderStub(channel).Recommend(tiny.message(3), timeout=WAIT)
    assert (reply.model, len(reply.item_ids)) == ("demo", 10)
    assert server.announce_line().endswith(" security=tls")
    with grpc.insecure_channel(server.addresses.grpc) as plain:
        stub = RecommenderStub(plain)
        assert code_of(lambda: stub.Recommend(tiny.message(3), timeout=2)) == (
            grpc.StatusCode.UNAVAILABLE
        )
    other_ca, _ = certs["client"]  # a certificate the server's is not signed by
    with tls_channel(server.addresses.grpc, other_ca) as channel:
        stub = RecommenderStub(channel)
        assert code_of(lambda: stub.Recommend(tiny.message(3), timeout=2)) == (
            grpc.StatusCode.UNAVAILABLE
        )


@pytest.mark.multiproc  # the certs fixture runs openssl
def test_mutual_tls_needs_a_client_certificate(start, certs, tiny):
    cert, key = certs["server"]
    client_ca = certs["client"][0]  # self-signed: the client certificate is its own CA
    server = start(SecurityConfig(tls_cert=cert, tls_key=key, tls_client_ca=client_ca))
    with tls_channel(server.addresses.grpc, cert) as channel:
        stub = RecommenderStub(channel)
        assert code_of(lambda: stub.Recommend(tiny.message(3), timeout=2)) == (
            grpc.StatusCode.UNAVAILABLE
        )
    with tls_channel(server.addresses.grpc, cert, certs["client"]) as channel:
        assert RecommenderStub(channel).Recommend(tiny.message(3), timeout=WAIT).item_ids


def test_a_token_guards_serving_and_admin_but_not_health(start, token_file, tiny):
    server = start(SecurityConfig(token_file=token_file))
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        rec, kserve = RecommenderStub(channel), kpb_grpc.GRPCInferenceServiceStub(channel)
        adm, health = AdminStub(channel), health_pb2_grpc.HealthStub(channel)
        for md in [(), bearer(WRONG), (("authorization", TOKEN),), bearer(TOKEN[:-1])]:
            call = partial(rec.Recommend, tiny.message(1), timeout=WAIT, metadata=md)
            assert code_of(call) == grpc.StatusCode.UNAUTHENTICATED
        assert rec.Recommend(tiny.message(1), timeout=WAIT, metadata=bearer(TOKEN)).item_ids
        meta = kpb.ModelMetadataRequest(name="demo")
        assert code_of(lambda: kserve.ModelMetadata(meta)) == grpc.StatusCode.UNAUTHENTICATED
        assert kserve.ModelMetadata(meta, metadata=bearer(TOKEN)).name == "demo"
        upsert = apb.UpsertItemsRequest()
        assert code_of(lambda: adm.UpsertItems(upsert)) == grpc.StatusCode.UNAUTHENTICATED
        # probes stay open
        check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert kserve.ServerLive(kpb.ServerLiveRequest(), timeout=WAIT).live
        assert kserve.ServerReady(kpb.ServerReadyRequest(), timeout=WAIT).ready
    assert server.announce_line().endswith(" security=token")


def test_admin_needs_the_token_even_when_serving_is_open(start, token_file, tiny):
    server = start(SecurityConfig(token_file=token_file, auth_serving=False))
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        rec, adm = RecommenderStub(channel), AdminStub(channel)
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        assert rec.Recommend(tiny.message(1), timeout=WAIT).item_ids  # no token needed
        upsert = apb.UpsertItemsRequest()
        assert code_of(lambda: adm.UpsertItems(upsert)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: adm.UpsertItems(upsert, metadata=bearer(WRONG))) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        # the token gets it past the check: this server has live updates off
        assert code_of(lambda: adm.UpsertItems(upsert, metadata=bearer(TOKEN))) == (
            grpc.StatusCode.FAILED_PRECONDITION
        )
        load = kpb.RepositoryModelLoadRequest(model_name="demo")
        assert code_of(lambda: kserve.RepositoryModelLoad(load)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        assert code_of(lambda: kserve.RepositoryModelLoad(load, metadata=bearer(TOKEN))) == (
            grpc.StatusCode.UNIMPLEMENTED
        )


# ---- HTTP ---------------------------------------------------------------------------------------
@pytest.mark.multiproc  # the certs fixture runs openssl
def test_https_with_a_token(start, certs, token_file, tiny):
    cert, key = certs["server"]
    server = start(SecurityConfig(token_file=token_file, tls_cert=cert, tls_key=key), http_port=0)
    inputs = [
        {"name": n, "datatype": DATATYPES[n], "shape": list(x.shape), "data": x.ravel().tolist()}
        for n, x in tiny.inputs(np.array([0, 1])).items()
    ]
    body = json.dumps({"inputs": inputs})
    infer = "/v2/models/demo/infer"
    assert https(server, "GET", "/v2/health/ready", cert)[0] == 200  # probes stay open
    for token in (None, WRONG):
        status, headers, text = https(server, "POST", infer, cert, token, body)
        assert status == 401 and headers["www-authenticate"].startswith("Bearer ")
        assert TOKEN.encode() not in text and WRONG.encode() not in text
        assert https(server, "GET", "/v2/models/demo", cert, token)[0] == 401
    status, _, text = https(server, "POST", infer, cert, TOKEN, body)
    assert status == 200, text
    assert json.loads(text)["outputs"][0]["shape"] == [2, 10]
    host, port = server.addresses.http.rsplit(":", 1)
    plain = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    with pytest.raises((http.client.HTTPException, OSError)):
        plain.request("GET", "/v2/health/ready")
        plain.getresponse()
    plain.close()


@pytest.mark.multiproc  # the certs fixture runs openssl
def test_http_admin_paths_need_the_token_when_serving_is_open(start, certs, token_file):
    cert, key = certs["server"]
    sec = SecurityConfig(token_file=token_file, auth_serving=False, tls_cert=cert, tls_key=key)
    server = start(sec, http_port=0)
    assert https(server, "GET", "/v2/models/demo", cert)[0] == 200
    load = "/v2/repository/models/demo/load"
    assert https(server, "POST", load, cert, None, b"{}")[0] == 401
    assert https(server, "POST", load, cert, TOKEN, b"{}")[0] == 404  # past the check: no route


# ---- the check itself, logs, config -------------------------------------------------------------
def test_tokens_are_compared_in_constant_time(monkeypatch):
    seen = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    auth = Authenticator(TOKEN)
    assert auth.check(f"Bearer {TOKEN}") is None
    assert auth.check(f"bearer {WRONG}") == "invalid bearer token"
    assert auth.check("Bearer \udcff") == "invalid bearer token"  # not ASCII: still compared
    assert auth.check(None) == "no bearer token" and auth.check(f"Basic {TOKEN}") is not None
    assert [b for _, b in seen] == [TOKEN.encode()] * 3
    assert TOKEN not in repr(auth)


def test_no_token_in_logs_answers_or_reprs(start, token_file, tiny, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    sec = SecurityConfig(token_file=token_file)
    server = start(sec, http_port=0, metrics_port=0)
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        rec = RecommenderStub(channel)
        assert code_of(lambda: rec.Recommend(tiny.message(1), metadata=bearer(WRONG))) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        assert rec.Recommend(tiny.message(1), timeout=WAIT, metadata=bearer(TOKEN)).item_ids
    host, port = server.addresses.http.rsplit(":", 1)
    for token in (WRONG, TOKEN):
        conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
        conn.request("GET", "/v2/models/demo", headers={"Authorization": f"Bearer {token}"})
        assert conn.getresponse().status == (200 if token == TOKEN else 401)
        conn.close()
    assert "refused /recserve.serving.v1.Recommender/Recommend: invalid bearer token" in caplog.text
    assert "refused GET /v2/models/demo: invalid bearer token" in caplog.text
    shown = [
        caplog.text,
        *capfd.readouterr(),
        server.announce_line(),
        repr(server.config),
        repr(server.security),
    ]
    for text in shown:
        assert TOKEN not in text and WRONG not in text


@pytest.mark.multiproc  # the certs fixture runs openssl
def test_a_bad_security_config_names_the_field_and_not_the_token(tmp_path, certs, monkeypatch):
    cert = certs["server"][0]
    short = tmp_path / "short"
    short.write_text("abc123")
    spaced = tmp_path / "spaced"
    spaced.write_text("has a space in it, the token")
    monkeypatch.delenv("RECSERVE_TEST_TOKEN", raising=False)
    cases = [
        (SecurityConfig(tls_cert=cert), "security.tls_key (--tls-key): TLS needs both"),
        (SecurityConfig(tls_cert=cert, tls_key=tmp_path / "none"), "security.tls_key"),
        (SecurityConfig(tls_cert=cert, tls_key=certs["client"][1]), "security.tls_cert, tls_key"),
        (SecurityConfig(tls_client_ca=cert), "security.tls_client_ca (--tls-client-ca)"),
        (SecurityConfig(token_file=short), "security.token_file (--auth-token-file): the token"),
        (SecurityConfig(token_file=spaced), "security.token_file"),
        (SecurityConfig(token_env="RECSERVE_TEST_TOKEN"), "RECSERVE_TEST_TOKEN is not set"),
        (SecurityConfig(token_file=short, token_env="X"), "security.token_env"),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
            config.load()
        assert "abc123" not in str(e.value) and "has a space" not in str(e.value)
    monkeypatch.setenv("RECSERVE_TEST_TOKEN", TOKEN)
    assert SecurityConfig(token_env="RECSERVE_TEST_TOKEN").load().auth is not None


def test_serve_toml_security_table(tmp_path, token_file):
    toml = tmp_path / "serve.toml"
    toml.write_text(f'[security]\ntoken_file = "{token_file}"\nauth_serving = false\n')
    cfg = ServeConfig.from_toml(toml)
    assert cfg.security == SecurityConfig(token_file=token_file, auth_serving=False)
    toml.write_text(f'[security]\ntoken = "{TOKEN}"\n')
    with pytest.raises(ConfigError, match=r"security\.token: use token_file or token_env") as e:
        ServeConfig.from_toml(toml)
    assert TOKEN not in str(e.value)
    toml.write_text("[security]\ntls_cert = 3\n")
    with pytest.raises(ConfigError, match=r"security\.tls_cert \(--tls-cert\): expected"):
        ServeConfig.from_toml(toml)


@pytest.mark.multiproc  # the certs fixture runs openssl
def test_serve_flags_reach_the_config(tmp_path, token_file, certs, monkeypatch):
    from typer.testing import CliRunner

    import serving.app.main
    from recserve.cli import app

    got = []
    monkeypatch.setattr(serving.app.main, "serve", lambda cfg: got.append(cfg))
    toml = tmp_path / "serve.toml"
    toml.write_text('[security]\ntoken_env = "SOME_VAR"\n')
    cert, key = certs["server"]
    args = ["serve", "model", "--model-repo", str(tmp_path), "--config", str(toml),
            "--auth-token-file", str(token_file), "--no-auth-serving",
            "--tls-cert", str(cert), "--tls-key", str(key)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert got[0].security == SecurityConfig(
        token_file=token_file, auth_serving=False, tls_cert=cert, tls_key=key
    )


# ---- where servers listen -----------------------------------------------------------------------
def test_every_server_binds_loopback_unless_told_otherwise(start):
    from recserve import serve_cli
    from serving.frontends.recommend_grpc import GrpcServer
    from serving.sharding.shard_server import ShardServer
    from sharded_tables.remote.server import EmbeddingServer, serve

    assert ServeConfig().host == "127.0.0.1"
    for fn in (GrpcServer.__init__, ShardServer.__init__, EmbeddingServer.__init__, serve):
        assert inspect.signature(fn).parameters["host"].default == "127.0.0.1", fn
    # the CLI: serve's --host defaults to the config's; the others' to 127.0.0.1
    for command, default in ((serve_cli.serve_model, None), (serve_cli.serve_router, None),
                             (serve_cli.serve_shard_cmd, "127.0.0.1"),
                             (serve_cli.serve_embeddings, "127.0.0.1")):  # fmt: skip
        assert inspect.signature(command).parameters["host"].default.default == default
    server = start(SecurityConfig(), http_port=0, metrics_port=0)
    a = server.addresses
    assert all(x.startswith("127.0.0.1:") for x in (a.grpc, a.http, a.metrics)), a


def test_listening_beyond_loopback_without_tls_and_a_token_is_logged(caplog, token_file):
    caplog.set_level(logging.WARNING, logger="common.security")
    for host in ("127.0.0.1", "::1", "localhost"):
        security.NO_SECURITY.warn_if_exposed(host, "serve")
    assert not caplog.records
    security.NO_SECURITY.warn_if_exposed("0.0.0.0", "serve")
    SecurityConfig(token_file=token_file).load().warn_if_exposed("10.1.2.3", "shard-server 0")
    assert [r.getMessage() for r in caplog.records] == [
        "serve listens on 0.0.0.0 without TLS and a token",
        "shard-server 0 listens on 10.1.2.3 without TLS",
    ]
