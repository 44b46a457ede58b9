"""A seeded fault-injecting TCP relay: what ``netem`` would do to a host's links, done in user
space because this kernel has no ``netem``.

It listens on one address and forwards every connection to one target, both directions, with a
:class:`Profile`'s faults on each chunk of bytes it reads:

* **delay and jitter**: a chunk goes on ``delay_ms`` +- ``jitter_ms`` (uniform) after it
  arrived, each direction (a round trip pays it twice). A TCP stream is delivered in order, so
  a chunk never overtakes the one before it: jitter shows as head-of-line waits, as it does
  for a TCP receiver whose packets arrive reordered.
* **loss**: TCP loses no bytes; a lost segment costs its stream a retransmission. Each chunk
  counts as ``ceil(len / MSS)`` segments, each lost with probability ``loss``; a chunk with a
  lost segment is held back ``stall_ms`` (the retransmission timeout, by default Linux's
  minimum ``TCP_RTO_MIN``, doubled for each further loss of the same segment), and everything
  behind it in that direction waits too. Real stacks often recover a loss sooner (fast retransmit, tail loss
  probes a few round trips later), so this is the pessimistic case of a short RPC whose only
  segment is lost. No connection is reset and no byte is dropped: a partition (no packet at
  all) is the host's link going down (``netns.py``), not this relay.

The relay's own hop costs tens of microseconds and a sleep overshoots by about as much, so a
round trip through it is somewhat slower than its profile says (measured in
``bench/RELIABILITY.md``). Bandwidth caps are the kernel's (``tc tbf`` on the host's link,
``netns.py``); the profile carries the rate for whoever sets up the link.

Draws are seeded: connection ``c`` direction ``d`` draws from ``Random(f"{seed}-{c}-{d}")``, so
a run makes the same fault decisions for the same sequence of chunks (the chunking and the
timing are the network's). Two threads per direction (a reader stamps each chunk with when it
is due, a writer sleeps until then: a delay never serialises the chunks behind it), bounded:
at most ``max_connections`` at once, each direction holding at most ``MAX_QUEUED`` bytes
before its reader waits (TCP's window).

In a test or a cluster a relay runs on the host it fronts (``python -m recserve.hosts.relay``,
inside the host's namespace) and re-reads its profile file when it changes, so a test can
raise a loss or jitter spike while traffic flows.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

MSS = 1448
"""Bytes of one TCP segment on a 1500-byte Ethernet link."""
MAX_QUEUED = 4 << 20
CHUNK = 65536
MAX_RETRIES = 6
"""Losses of one segment counted at most (then it gets through): bounds a chunk's stall."""
CONNECT_TIMEOUT_S = 2.0
WATCH_S = 0.05
"""How often the profile file is checked for a change."""


@dataclass(frozen=True)
class Profile:
    """The faults of a host's links (see the module docstring for what each means)."""

    delay_ms: float = 0.0
    """One-way delay of a chunk, each direction."""
    jitter_ms: float = 0.0
    """The one-way delay varies uniformly by +- this (never below 0)."""
    loss: float = 0.0
    """Probability that a segment is lost (and retransmitted after ``stall_ms``)."""
    stall_ms: float = 200.0
    """What one loss costs the stream: a retransmission timeout (Linux's ``TCP_RTO_MIN``)."""
    rate: str = ""
    """Bandwidth cap of the host's link (a tc rate, ``"10mbit"``; "" none): set by
    ``netns.HostSet.rate``, not by the relay."""

    def one_way_s(self, rng: random.Random, nbytes: int) -> float:
        """Seconds a chunk of ``nbytes`` waits before it goes on (delay, jitter, losses)."""
        d = self.delay_ms
        if self.jitter_ms > 0:
            d = max(0.0, d + rng.uniform(-self.jitter_ms, self.jitter_ms))
        if self.loss > 0:
            stall = self.stall_ms
            for _ in range(math.ceil(nbytes / MSS)):
                for _ in range(MAX_RETRIES):  # lost, and maybe its retransmissions too
                    if rng.random() >= self.loss:
                        break
                    d += stall
                    stall *= 2
        return d / 1000.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(**d)


PROFILES: dict[str, Profile] = {
    "none": Profile(),
    # one datacentre: sub-millisecond round trips
    "dc": Profile(delay_ms=0.1, jitter_ms=0.05),
    # across the zones of a region: round trips of a millisecond or two, rare losses
    "zone": Profile(delay_ms=0.75, jitter_ms=0.25, loss=0.001),
    # a bad link: round trips that vary as much as they take, frequent losses, a thin pipe
    "bad": Profile(delay_ms=2.5, jitter_ms=2.5, loss=0.01, rate="20mbit"),
}
"""The named network profiles (``recserve cluster up --network NAME``)."""


def profile_named(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"network profile: one of {sorted(PROFILES)}, got {name!r}") from None


class _Pipe:
    """One direction of one connection: a reader stamps chunks, a writer sends them when due."""

    def __init__(self, relay: Relay, src: socket.socket, dst: socket.socket, rng: random.Random):
        self.relay, self.src, self.dst, self.rng = relay, src, dst, rng
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.cond = threading.Condition()
        self.closed = False

    def read(self) -> None:
        last = 0.0
        try:
            while True:
                data = self.src.recv(CHUNK)
                now = time.monotonic()
                due = max(now + self.relay.profile.one_way_s(self.rng, len(data)), last)
                last = due
                with self.cond:
                    while self.queued > MAX_QUEUED and not self.closed:
                        self.cond.wait(0.1)
                    self.queue.append((due, data))  # b"": the end of the stream, in order
                    self.queued += len(data)
                    self.cond.notify_all()
                if not data or self.closed:
                    return
        except OSError:
            self._close()

    def write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait(0.5)
                    if not self.queue:
                        return
                    due, data = self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
        except OSError:
            self._close()

    def _close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for s in (self.src, self.dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


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
        self._server = socket.create_server(listen, backlog=128)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._slots = threading.BoundedSemaphore(max_connections)
        self._count = 0
        self._stop = threading.Event()

    def start(self) -> Relay:
        self._spawn(self._accept, "relay-accept")
        return self

    def set_profile(self, profile: Profile) -> None:
        """Applies to every chunk read from now on (those queued keep their times)."""
        self.profile = profile

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                client.close()  # over the bound: refused, as a full backlog would
                continue
            self._count += 1
            self._spawn(self._serve, f"relay-conn-{self._count}", client, self._count)

    def _serve(self, client: socket.socket, index: int) -> None:
        try:
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
            except OSError:
                client.close()
                return
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pipes = [
                _Pipe(self, client, upstream, random.Random(f"{self.seed}-{index}-up")),
                _Pipe(self, upstream, client, random.Random(f"{self.seed}-{index}-down")),
            ]
            workers = [
                threading.Thread(target=f, daemon=True) for p in pipes for f in (p.read, p.write)
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            client.close()
            upstream.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self._server.close()


def _watch(relay: Relay, path: Path) -> None:
    """Re-reads ``path`` (a profile's JSON) whenever its modification time changes."""
    seen = None
    while True:
        try:
            mtime = path.stat().st_mtime_ns
            if mtime != seen:
                seen = mtime
                relay.set_profile(Profile.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            pass  # a half-written or removed file: keep the last profile
        time.sleep(WATCH_S)


def write_profile(path: Path, profile: Profile) -> None:
    """Writes ``profile`` where a relay watches (replaced whole: a reader never sees half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_json()))
    tmp.replace(path)


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
    relay = Relay(
        (a.host, a.grpc_port),
        (host, int(port)),
        Profile.from_json(json.loads(a.profile_file.read_text())),
        a.seed,
    ).start()
    threading.Thread(target=_watch, args=(relay, a.profile_file), daemon=True).start()
    announce("relay", grpc=f"{relay.address[0]}:{relay.address[1]}", to=a.to)
    threading.Event().wait()


if __name__ == "__main__":
    main()


__all__ = ["PROFILES", "Profile", "Relay", "main", "profile_named", "write_profile"]
