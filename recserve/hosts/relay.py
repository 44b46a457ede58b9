"""A seeded fault-injecting TCP relay: a host's links as a :class:`Profile` says, done in user
space because this kernel has no ``netem`` (``profiles.py`` says what delay, jitter and loss mean
on a TCP stream).

It listens on one address and forwards every connection to one target, both directions, with the
profile's faults on each chunk of bytes it reads. One thread serves every connection: a
``select`` loop (its timeout has microseconds, where epoll's has whole milliseconds, so a delay
under a millisecond is kept) reads what arrives, stamps each chunk with when it is due, and sends
every due chunk of a direction in one ``send``; a chunk due at once (no delay drawn) goes on from
the read itself. So what the relay adds is its profile's delay, and of its own only a wake-up
and a copy per chunk: no hand-off between threads, no sleep per chunk. The loop's thread asks
the kernel for a tight timer slack and wakes as much earlier than a chunk is due as its wake-ups
have come late (a running average, at most ``MAX_EARLY_S``), so a chunk goes on when due on
average rather than a scheduling delay later. Bounded: at most ``max_connections`` at once (a
socket numbered past ``select``'s limit is refused as over the bound), each direction holding at
most ``MAX_QUEUED`` bytes before its source is no longer read (TCP's window); a connect to the
target not finished in ``CONNECT_TIMEOUT_S`` closes the client's connection.

Draws are seeded: connection ``c`` direction ``d`` draws from ``Random(f"{seed}-{c}-{d}")``, so a
run makes the same fault decisions for the same sequence of chunks (the chunking and the timing
are the network's).

In a test or a cluster a relay runs on the host it fronts (``python -m recserve.hosts.relay``,
inside the host's namespace) and re-reads its profile file when it changes, so a test can raise
a loss or jitter spike while traffic flows.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import selectors
import socket
import threading
import time
from collections import deque
from pathlib import Path
from random import Random

from recserve.hosts.profiles import (
    MAX_RETRIES,
    MSS,
    PROFILES,
    Profile,
    profile_named,
    read_profile,
    write_profile,
)

MAX_QUEUED = 4 << 20
CHUNK = 65536
CONNECT_TIMEOUT_S = 2.0
WATCH_S = 0.05
"""How often the profile file is checked for a change."""
FD_LIMIT = 1024
"""``select``'s ``FD_SETSIZE``: a socket numbered at or past it cannot be watched."""
TIMER_SLACK_NS = 1000
MAX_EARLY_S = 100e-6
"""The loop wakes this much earlier at most than a chunk is due, to make up for a wake-up's
lateness (scheduling on a busy machine): a chunk goes on when due on average."""
LATE_WEIGHT = 0.1
"""Weight of each timed wake-up's lateness in the running average."""
_PR_SET_TIMERSLACK = 29
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class _Direction:
    """One direction of one connection: chunks read from ``src``, each sent to ``dst`` when due
    (in order: a chunk is never due before the one ahead of it)."""

    __slots__ = (
        "blocked",
        "conn",
        "done",
        "dst",
        "eof",
        "last_due",
        "queue",
        "queued",
        "rng",
        "src",
    )

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket, rng: Random):
        self.conn, self.src, self.dst, self.rng = conn, src, dst, rng
        self.queue: deque[tuple[float, bytes]] = deque()  # (due, bytes); b"": the stream's end
        self.queued = 0
        self.last_due = 0.0
        self.eof = False  # src ended (its b"" queued)
        self.done = False  # the end passed on: dst shut for writing
        self.blocked = False  # dst's buffer was full: waits until it is writable

    def push(self, data: bytes, now: float, profile: Profile) -> None:
        due = max(now + profile.one_way_s(self.rng, len(data)), self.last_due)
        self.last_due = due
        self.queue.append((due, data))
        self.queued += len(data)
        self.eof = not data

    def flush(self, now: float) -> None:
        """Sends every chunk due by ``now``, joined into one send (what a full buffer refuses
        stays at the head); passes the stream's end on once it is due. Raises ``OSError``."""
        q = self.queue
        parts: list[bytes] = []
        due = 0.0
        while q and q[0][0] <= now and q[0][1]:
            due, data = q.popleft()
            parts.append(data)
        self.blocked = False
        if parts:
            buf = parts[0] if len(parts) == 1 else b"".join(parts)
            try:
                n = self.dst.send(buf)
            except BlockingIOError:
                n = 0
            self.queued -= n
            if n < len(buf):
                q.appendleft((due, buf[n:]))
                self.blocked = True
                return
        if q and q[0][0] <= now and not q[0][1]:
            q.popleft()
            self.dst.shutdown(socket.SHUT_WR)
            self.done = True


class _Connection:
    """A client's connection and its upstream one to the target, a direction each way."""

    __slots__ = ("client", "connect_by", "connecting", "down", "masks", "up", "upstream")

    def __init__(self, index: int, client: socket.socket, upstream: socket.socket, seed: int):
        self.client, self.upstream = client, upstream
        self.up = _Direction(self, client, upstream, Random(f"{seed}-{index}-up"))
        self.down = _Direction(self, upstream, client, Random(f"{seed}-{index}-down"))
        self.connecting = True
        self.connect_by = time.monotonic() + CONNECT_TIMEOUT_S
        self.masks = {client: 0, upstream: 0}

    def reading(self, s: socket.socket) -> _Direction:
        return self.up if s is self.client else self.down

    def writing(self, s: socket.socket) -> _Direction:
        return self.down if s is self.client else self.up

    def wants(self, s: socket.socket) -> int:
        """The events to watch ``s`` for: readable while its direction has room, writable
        while connecting (the upstream) or while its incoming direction is blocked."""
        r, w = self.reading(s), self.writing(s)
        mask = _READ if not r.eof and r.queued <= MAX_QUEUED else 0
        if (s is self.upstream and self.connecting) or w.blocked:
            mask |= _WRITE
        return mask


class Relay:
    """Forwards connections to ``listen`` on to ``target`` with ``profile``'s faults."""

    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        profile: Profile,
        seed: int = 0,
        max_connections: int = 256,
    ):
        self.target, self.profile, self.seed = target, profile, seed
        self.max_connections = max_connections
        family, _, _, _, addr = socket.getaddrinfo(*target, type=socket.SOCK_STREAM)[0]
        self._family, self._target_addr = family, addr
        self._server = socket.create_server(listen, backlog=128)
        self._server.setblocking(False)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.SelectSelector()
        self._conns: set[_Connection] = set()
        self._active: set[_Direction] = set()  # those with chunks queued
        self._count = 0
        self._late = 0.0  # how late a timed wake-up comes, on average (seconds)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)

    def start(self) -> Relay:
        self._thread.start()
        return self

    def set_profile(self, profile: Profile) -> None:
        """Applies to every chunk read from now on (those queued keep their times)."""
        self.profile = profile

    def queued(self) -> int:
        """Bytes read and not yet sent on, over every direction of every connection (a
        snapshot from another thread: it may lag the loop by a chunk)."""
        return sum(d.queued for d in list(self._active))

    def close(self) -> None:
        """Stops the loop; every connection and the listener are closed."""
        self._stop = True
        if not self._thread.is_alive():  # never started: nothing else closes them
            for s in (self._server, self._wake_r, self._wake_w):
                s.close()
            return
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(5.0)

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        _tight_timer_slack()
        self._sel.register(self._server, _READ)
        self._sel.register(self._wake_r, _READ)
        try:
            while not self._stop:
                now = time.monotonic()
                timeout = self._timeout(now)
                ready = self._sel.select(timeout)
                if timeout and not ready:  # woken by its timeout: learn how late wake-ups come
                    late = min(max(time.monotonic() - now - timeout, 0.0), MAX_EARLY_S)
                    self._late += LATE_WEIGHT * (late - self._late)
                for key, events in ready:
                    if key.fileobj is self._server:
                        self._accept()
                    elif key.data is not None:
                        assert isinstance(key.fileobj, socket.socket)
                        self._on_ready(key.data, key.fileobj, events)
                self._send_due(time.monotonic() + self._late)
        finally:
            for conn in list(self._conns):
                self._drop(conn)
            self._sel.close()
            for s in (self._server, self._wake_r, self._wake_w):
                s.close()

    def _timeout(self, now: float) -> float | None:
        """Seconds until the next chunk is due or a connect times out (None: nothing waits)."""
        soonest = min(
            (d.queue[0][0] for d in self._active if not d.blocked and not d.conn.connecting),
            default=None,
        )
        for conn in self._conns:
            if conn.connecting and (soonest is None or conn.connect_by < soonest):
                soonest = conn.connect_by
        return None if soonest is None else max(0.0, soonest - now - self._late)

    def _accept(self) -> None:
        for _ in range(self.max_connections):  # bounded: at most what the backlog holds
            try:
                client, _ = self._server.accept()
            except OSError:  # nothing more waiting (or the listener closed)
                return
            if len(self._conns) >= self.max_connections or client.fileno() >= FD_LIMIT:
                client.close()  # over the bound: refused, as a full backlog would
                continue
            upstream = socket.socket(self._family, socket.SOCK_STREAM)
            for s in (client, upstream):
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = upstream.connect_ex(self._target_addr)
            if upstream.fileno() >= FD_LIMIT or err not in (0, errno.EINPROGRESS):
                client.close()
                upstream.close()
                continue
            self._count += 1
            conn = _Connection(self._count, client, upstream, self.seed)
            self._conns.add(conn)
            self._watch(conn)

    def _on_ready(self, conn: _Connection, s: socket.socket, events: int) -> None:
        now = time.monotonic()
        try:
            if events & _WRITE and s is conn.upstream and conn.connecting:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    raise ConnectionRefusedError
                conn.connecting = False
                self._flush(conn.up, now)
            elif events & _WRITE:
                self._flush(conn.writing(s), now)
            if events & _READ:
                d = conn.reading(s)
                data = s.recv(CHUNK)
                d.push(data, now, self.profile)
                self._active.add(d)
                if not conn.connecting:
                    self._flush(d, now)  # due at once: no wait for the loop's next turn
        except OSError:
            self._drop(conn)
            return
        self._settle(conn)

    def _send_due(self, now: float) -> None:
        """Flushes every direction with a chunk due by ``now`` (the loop's clock plus how late
        its wake-ups come); drops connections past their connect deadline."""
        touched = set()
        for d in list(self._active):
            conn = d.conn
            if conn.connecting or d.blocked or d.queue[0][0] > now:
                continue
            try:
                self._flush(d, now)
            except OSError:
                self._drop(conn)
                continue
            touched.add(conn)
        for conn in list(self._conns):
            if conn.connecting and now > conn.connect_by:
                self._drop(conn)
        for conn in touched & self._conns:
            self._settle(conn)

    def _flush(self, d: _Direction, now: float) -> None:
        d.flush(now)
        if not d.queue:
            self._active.discard(d)

    def _settle(self, conn: _Connection) -> None:
        """Closes ``conn`` once both ends are passed on, else watches what it now needs."""
        if conn.up.done and conn.down.done:
            self._drop(conn)
        else:
            self._watch(conn)

    def _watch(self, conn: _Connection) -> None:
        for s in (conn.client, conn.upstream):
            old, new = conn.masks[s], conn.wants(s)
            if old == new:
                continue
            if old == 0:
                self._sel.register(s, new, conn)
            elif new == 0:
                self._sel.unregister(s)
            else:
                self._sel.modify(s, new, conn)
            conn.masks[s] = new

    def _drop(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        for d in (conn.up, conn.down):
            self._active.discard(d)
        for s in (conn.client, conn.upstream):
            if conn.masks[s]:
                self._sel.unregister(s)
                conn.masks[s] = 0
            s.close()


def _tight_timer_slack() -> None:
    """Asks Linux to wake this thread within ``TIMER_SLACK_NS`` of its timeouts (the default
    slack is tens of microseconds, as much as a short delay itself)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)


def _watch_file(relay: Relay, path: Path) -> None:
    """Re-reads ``path`` (a profile's JSON) whenever its modification time changes."""
    seen = None
    while True:
        try:
            mtime = path.stat().st_mtime_ns
            if mtime != seen:
                seen = mtime
                relay.set_profile(read_profile(path))
        except (OSError, ValueError, TypeError):
            pass  # a half-written or removed file: keep the last profile
        time.sleep(WATCH_S)


def main(argv: list[str] | None = None) -> None:
    """``python -m recserve.hosts.relay --host IP --grpc-port P --to IP:PORT --profile-file F
    --seed N``: prints a ready line (``common/ready.py``, role ``relay``) once it listens."""
    import argparse

    from common.ready import announce

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--grpc-port", type=int, default=0, help="port to listen on (0: any)")
    ap.add_argument("--to", required=True, help="host:port to forward to")
    ap.add_argument("--profile-file", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    host, port = a.to.rsplit(":", 1)
    profile = read_profile(a.profile_file)
    relay = Relay((a.host, a.grpc_port), (host, int(port)), profile, a.seed).start()
    threading.Thread(target=_watch_file, args=(relay, a.profile_file), daemon=True).start()
    announce("relay", grpc=f"{relay.address[0]}:{relay.address[1]}", to=a.to)
    threading.Event().wait()


if __name__ == "__main__":
    main()


__all__ = [
    "MAX_RETRIES",
    "MSS",
    "PROFILES",
    "Profile",
    "Relay",
    "main",
    "profile_named",
    "write_profile",
]
