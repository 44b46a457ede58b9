"""The fault relay on 127.0.0.1 (in this process, no namespace): bytes arrive whole and in order
under every profile, a delay and a loss stall each cost what the profile says, the draws
repeat for a seed, and a client that vanishes mid-stream leaves no connection behind."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from random import Random

import pytest

from recserve.hosts.relay import (
    CHUNK,
    MAX_QUEUED,
    MAX_RETRIES,
    MSS,
    PROFILES,
    Profile,
    Relay,
    profile_named,
)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """An echo server on 127.0.0.1 (a thread per connection)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[:2]
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def round_trips(relay: Relay, n: int, size: int = 100) -> list[float]:
    """Seconds of ``n`` echo round trips of ``size`` bytes through ``relay``."""
    out = []
    with socket.create_connection(relay.address, timeout=10) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(n):
            msg = bytes([i % 256]) * size
            start = time.monotonic()
            c.sendall(msg)
            got = b""
            while len(got) < size:
                data = c.recv(size - len(got))
                if not data:  # closed: the relay refused it (over its connection bound)
                    raise ConnectionResetError("the relay closed the connection")
                got += data
            out.append(time.monotonic() - start)
            assert got == msg
    return out


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_delivers_every_byte_in_order(echo, name):
    profile = profile_named(name)
    relay = Relay(("127.0.0.1", 0), echo, Profile(profile.delay_ms, profile.jitter_ms), seed=1)
    relay.start()
    try:
        payload = random.Random(0).randbytes(300_000)
        with socket.create_connection(relay.address, timeout=10) as c:
            reader_got = bytearray()

            def read() -> None:
                while len(reader_got) < len(payload):
                    reader_got.extend(c.recv(65536))

            t = threading.Thread(target=read)
            t.start()
            for i in range(0, len(payload), 7000):  # many chunks, each its own draw
                c.sendall(payload[i : i + 7000])
            t.join(20)
        assert bytes(reader_got) == payload
    finally:
        relay.close()


def test_a_delay_is_paid_each_way_and_jitter_stays_in_its_bounds(echo):
    relay = Relay(("127.0.0.1", 0), echo, Profile(delay_ms=5.0, jitter_ms=2.0)).start()
    try:
        rtts = round_trips(relay, 20)
    finally:
        relay.close()
    # each way 3-7 ms; a busy machine only adds
    assert min(rtts) >= 0.006, min(rtts)
    assert sorted(rtts)[10] < 0.014 + 0.05, sorted(rtts)


def test_a_lost_segment_stalls_its_stream_for_a_retransmission_timeout(echo):
    relay = Relay(("127.0.0.1", 0), echo, Profile(loss=1.0, stall_ms=5.0)).start()
    try:
        rtt = round_trips(relay, 1)[0]
    finally:
        relay.close()
    # its one segment lost MAX_RETRIES times each way: 5 ms doubling, 6 times
    assert rtt >= 2 * 5e-3 * (2**MAX_RETRIES - 1), rtt


def test_loss_draws_count_segments_and_repeat_for_a_seed():
    p = Profile(loss=0.05, stall_ms=200.0)

    def draws() -> list[float]:
        rng = Random("7-1-up")  # the relay's seeding: seed 7, connection 1, upstream
        return [p.one_way_s(rng, 10 * MSS) for _ in range(50)]

    assert draws() == draws() and any(draws())
    rng = random.Random(3)
    small = sum(p.one_way_s(rng, 100) > 0 for _ in range(4000)) / 4000
    large = sum(p.one_way_s(rng, 10 * MSS) > 0 for _ in range(4000)) / 4000
    assert 0.03 < small < 0.07  # one segment: ~5 %
    assert 0.33 < large < 0.47  # ten segments: 1 - 0.95**10 ~ 40 %


def test_a_client_that_sends_half_a_message_and_vanishes_frees_its_connection(echo):
    relay = Relay(("127.0.0.1", 0), echo, Profile(delay_ms=1.0), max_connections=1).start()
    try:
        c = socket.create_connection(relay.address, timeout=10)
        c.sendall(b"half a req")
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        c.close()  # an RST: gone without a goodbye
        deadline = time.monotonic() + 5
        while True:  # the one slot comes back: a new client is served
            try:
                assert round_trips(relay, 1)
                break
            except (ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, "the vanished client's slot was never freed"
                time.sleep(0.05)
    finally:
        relay.close()


def test_a_reader_that_stops_reading_holds_the_relay_to_its_bound_and_loses_nothing(echo):
    relay = Relay(("127.0.0.1", 0), echo, Profile(delay_ms=0.5, jitter_ms=0.5)).start()
    payload = random.Random(2).randbytes(10 * MAX_QUEUED)  # more than both directions may hold
    try:
        with socket.create_connection(relay.address, timeout=20) as c:
            t = threading.Thread(target=c.sendall, args=(payload,), daemon=True)
            t.start()
            # nothing read back for a while: the relay reads no more than its bound lets it
            # (the kernel's socket buffers take the rest, then hold the sender back)
            peak = 0
            for _ in range(50):
                peak = max(peak, relay.queued())
                time.sleep(0.02)
            assert peak <= 2 * (MAX_QUEUED + CHUNK), peak
            got = bytearray()
            while len(got) < len(payload):
                data = c.recv(1 << 20)
                assert data, "the relay closed the connection"
                got.extend(data)
            t.join(20)
        assert bytes(got) == payload
    finally:
        relay.close()


def test_a_target_that_refuses_closes_the_clients_connection():
    closed = socket.create_server(("127.0.0.1", 0))
    target = closed.getsockname()[:2]
    closed.close()  # nothing listens there now
    relay = Relay(("127.0.0.1", 0), target, Profile()).start()
    try:
        with socket.create_connection(relay.address, timeout=10) as c:
            c.sendall(b"hello")
            assert c.recv(10) == b""  # closed, not left open
    finally:
        relay.close()
