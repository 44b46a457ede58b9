"""HTTP request heads are bounded (``serving/frontends/http_conn.py``), against a real uvicorn on
127.0.0.1 (``Server`` in-process, the stand-in repository): a header slowloris is closed within
``limits.http_head_timeout_s``, random bytes are answered 400 at once, a connection past
``limits.max_http_connections`` gets 503, and well-formed clients (slow ones too) are served."""

from __future__ import annotations

import http.client
import itertools
import logging
import random
import socket
import time
from collections.abc import Iterator

import pytest

from serving.app.config import BatchingConfig
from serving.app.server import Server
from serving.frontends.http_conn import check_request_line
from serving.limits import LimitsConfig
from support.waiting import wait_until

WAIT = 10.0
HEAD_TIMEOUT_S = 1.0
SLACK_S = 2.0
"""Past the head timeout, by when every stalled connection must be closed (loaded CI)."""
CONNECTIONS = 8
SLOWLORIS = 50
PARTIAL_HEAD = b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture
def server(serve_config, repo) -> Iterator[Server]:
    config = serve_config(
        http_port=0,
        metrics_port=None,
        batching=BatchingConfig(max_batch_size=8, max_queue_delay_ms=0.0),
        limits=LimitsConfig(
            http_head_timeout_s=HEAD_TIMEOUT_S, max_http_connections=SLOWLORIS + CONNECTIONS
        ),
    )
    s = Server(config, repo=repo, extra_servicers=[])
    s.start()
    yield s
    s.drain_and_stop(timeout=WAIT)


def connect(server: Server) -> socket.socket:
    host, port = server.addresses.http.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=WAIT)


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def open_connections(server: Server) -> int:
    return len(server._uvicorn.server_state.connections)


def ready(server: Server) -> int:
    host, port = server.addresses.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_header_slowloris_is_closed_within_the_head_timeout(server, caplog):
    caplog.set_level(logging.WARNING)
    socks = [connect(server) for _ in range(SLOWLORIS)]
    try:
        start = time.monotonic()
        for s in socks:
            s.sendall(PARTIAL_HEAD)  # and never the blank line
        answers = [read_to_close(s) for s in socks]
        took = time.monotonic() - start
    finally:
        for s in socks:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0][:200]
    assert b"limits.http_head_timeout_s" in answers[0]
    assert HEAD_TIMEOUT_S * 0.8 < took < HEAD_TIMEOUT_S + SLACK_S, took
    wait_until(lambda: open_connections(server) == 0, WAIT, "the server let every one go")
    lines = [r for r in caplog.records if r.name == "serving.frontends.http_conn"]
    assert 1 <= len(lines) <= 5 and not [r for r in lines if r.exc_info]  # rate-limited
    assert ready(server) == 200


def test_a_connection_that_sends_nothing_is_closed_silently(server):
    sock = connect(server)
    start = time.monotonic()
    assert read_to_close(sock) == b""
    assert HEAD_TIMEOUT_S * 0.8 < time.monotonic() - start < HEAD_TIMEOUT_S + SLACK_S
    sock.close()


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_get_400_at_once(server, seed):
    garbage = random.Random(seed).randbytes(2000)
    sock = connect(server)
    start = time.monotonic()
    sock.sendall(garbage)
    answer = read_to_close(sock)
    took = time.monotonic() - start
    sock.close()
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert took < HEAD_TIMEOUT_S * 0.8, took  # refused on its bytes, not by the timeout


def test_a_connection_past_the_cap_gets_503_and_the_server_serves_on(server):
    cap = SLOWLORIS + CONNECTIONS
    held = [connect(server) for _ in range(cap)]
    try:
        wait_until(lambda: open_connections(server) == cap, WAIT, "every connection opened")
        extra = connect(server)
        answer = read_to_close(extra)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b"limits.max_http_connections" in answer
    finally:
        for s in held:
            s.close()
    wait_until(lambda: open_connections(server) == 0, WAIT, "the held ones closed")
    assert ready(server) == 200


def test_a_head_split_anywhere_is_served(server):
    head = (
        b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Note: a\tb \xe9\r\n"
        b"Connection: close\r\n\r\n"
    )
    cuts = [0, 2, 9, 29, 30, 31, 40, 50, 55, len(head)]  # mid-method, mid-target, CR | LF ...
    sock = connect(server)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for start, end in itertools.pairwise(cuts):
        sock.sendall(head[start:end])
        time.sleep(0.005)  # separate reads on the server
    answer = read_to_close(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_a_kept_alive_connection_times_its_next_head_from_its_first_byte(server):
    host, port = server.addresses.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    conn.request("GET", "/v2/health/ready")
    response = conn.getresponse()
    response.read()
    assert response.status == 200
    time.sleep(HEAD_TIMEOUT_S * 1.2)  # idle past the head timeout: it is no head's time yet
    conn.request("GET", "/v2/health/live")
    second = conn.getresponse()
    assert second.status == 200 and second.read()
    conn.sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")  # a third head that stalls
    start = time.monotonic()
    assert read_to_close(conn.sock).startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - start < HEAD_TIMEOUT_S + SLACK_S
    conn.close()


@pytest.mark.parametrize(
    ("chunks", "valid", "complete"),
    [
        ([b"GET / HTTP/1.1\r\nHost: x\t\xe9\r\n\r\n"], True, True),
        ([b"GE", b"T / HTTP/1.1\r", b"\nX: \xff"], True, True),
        ([b"POST /v2/models/m/in"], True, False),
        ([b"\x16\x03\x01\x02\x00\x01"], False, False),  # a TLS ClientHello on a plaintext port
        ([b"GET /\xff HTTP/1.1\r\n"], False, True),
    ],
)
def test_check_request_line(chunks, valid, complete):
    ok, done = True, False
    for chunk in chunks:
        ok, done = check_request_line(chunk)
        if done or not ok:
            break
    assert (ok, done) == (valid, complete)
