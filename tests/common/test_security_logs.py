"""What refused calls write to the log (``common/security.py`` with ``common/logs.py``): a
forged line cannot be injected through a path, and a flood of refusals is a few lines."""

from __future__ import annotations

import http.client
import logging
from collections.abc import Iterator

import grpc
import pytest

from common.logs import BURST
from common.security import SecurityConfig
from serving.app.server import Server
from serving.protos.recommend_pb2_grpc import RecommenderStub

TOKEN = "t0ken-for-the-security-log-tests-2b8e"
WAIT = 10.0


@pytest.fixture
def server(serve_config, repo) -> Iterator[Server]:
    sec = SecurityConfig(token=TOKEN)
    s = Server(
        serve_config(security=sec, http_port=0, metrics_port=None), repo=repo, extra_servicers=[]
    )
    s.start()
    yield s
    s.drain_and_stop(timeout=WAIT)


def refusals(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "common.security"]


def test_a_forged_newline_in_a_path_is_one_escaped_line(server, caplog):
    caplog.set_level(logging.INFO)
    host, port = server.addresses.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    conn.request(
        "GET", "/v2/models/demo%0A2026-01-01%2000:00:00%20INFO%20admin:%20token%20rotated%0D/ready"
    )
    assert conn.getresponse().status == 401
    conn.close()
    (line,) = refusals(caplog)
    text = logging.Formatter("%(levelname)s %(name)s: %(message)s").format(line)
    assert text == (
        "WARNING common.security: http: refused GET /v2/models/demo\\n2026-01-01 00:00:00 "
        "INFO admin: token rotated\\r/ready: no bearer token"
    )
    assert "\n" not in text and "\r" not in text


def test_a_thousand_refused_calls_are_a_few_lines(server, tiny, caplog):
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.addresses.grpc) as channel:
        stub = RecommenderStub(channel)
        calls = [stub.Recommend.future(tiny.message(1), timeout=WAIT) for _ in range(1000)]
        codes = {c.exception().code() for c in calls}
    assert codes == {grpc.StatusCode.UNAUTHENTICATED}
    assert 1 <= len(refusals(caplog)) <= BURST  # within one 10 s window: the burst, no more
    assert not [r for r in caplog.records if r.exc_info]
