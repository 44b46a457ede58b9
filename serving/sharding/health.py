"""Replica health for the router: outlier ejection and the adaptive hedge delay, as pure classes
(the clock is an argument; no gRPC, no threads, no logging -- the router holds the lock, logs
and counts what these return).

Ejection (:class:`Ejection`), per replica of a shard::

    in rotation --N consecutive failures--> ejected for back-off b = base * 2^(k-1) <= max
         ^                                      |  (k: ejections in a row)
         |                                      v  back-off over
         +----------- an answer ------------ probe: one copy of a real request
                                                |  no answer: ejected again, b doubles

The router sends a shard's calls to its replicas in rotation first (rotated per round), then to
the ejected ones as a last resort (a shard whose replicas are all out is still asked). A due
probe is a *copy* of a request that a replica in rotation also gets: it never makes an answer
partial. A failure is what says nothing about the request itself: no answer before the
deadline, unreachable, an internal error (:data:`FAILURE_CODES`).

Hedging (:class:`LatencyWindow`): a shard's call that has not answered after the p95 of that
shard's recent answers (bounded to ``[low, high]``) gets a twin call to the next replica.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

FAILURE_CODES = frozenset(
    {"DEADLINE_EXCEEDED", "UNAVAILABLE", "UNKNOWN", "INTERNAL", "RESOURCE_EXHAUSTED", "ABORTED"}
)
"""gRPC status names that count against a replica. The rest (CANCELLED, INVALID_ARGUMENT,
FAILED_PRECONDITION for a version mid-rollout, ...) are about the call, not the replica."""


class Change(Enum):
    """What a reported outcome did to a replica's place in the rotation."""

    EJECTED = "ejected"
    RETURNED = "returned"


@dataclass
class _Replica:
    failures: int = 0  # consecutive, while in rotation
    ejections: int = 0  # in a row without an answer between them: sets the back-off
    until: float = -math.inf  # ejected until then (monotonic s); -inf: in rotation
    probing: bool = False  # a probe is in flight

    @property
    def ejected(self) -> bool:
        return self.until > -math.inf


class Ejection:
    """Outlier ejection over ``shards`` (per shard, the replica addresses in config order).

    ``after``: consecutive failures that eject a replica (0: never); ``base_s`` / ``max_s``:
    the first back-off and its ceiling. Replicas are keyed ``(shard, address)``."""

    def __init__(self, shards: list[list[str]], after: int, base_s: float, max_s: float):
        assert after >= 0 and 0 < base_s <= max_s, (after, base_s, max_s)
        self.shards = shards
        self.after, self.base_s, self.max_s = after, base_s, max_s
        self._state = {(s, a): _Replica() for s, rs in enumerate(shards) for a in rs}

    def backoff(self, ejections: int) -> float:
        """Seconds out of rotation after the ``ejections``-th ejection in a row (1, 2, ...)."""
        return min(self.base_s * 2.0 ** min(ejections - 1, 60), self.max_s)

    def in_rotation(self, shard: int) -> int:
        return sum(not self._state[shard, a].ejected for a in self.shards[shard])

    def is_ejected(self, shard: int, address: str) -> bool:
        return self._state[shard, address].ejected

    def order(self, shard: int, turn: int, now: float) -> tuple[list[str], str | None]:
        """-> (the replicas to try in order, a replica to probe or None) for one call.

        Replicas in rotation come first, rotated by ``turn``; then the ejected ones, soonest
        back first. The probe is an ejected replica whose back-off is over, while the shard has
        a replica in rotation to answer meanwhile (it is then marked probing until its
        outcome is reported); it is left out of the order."""
        replicas = self.shards[shard]
        n = len(replicas)
        rotated = [replicas[(turn + j) % n] for j in range(n)]
        healthy = [a for a in rotated if not self._state[shard, a].ejected]
        out = sorted(
            (a for a in replicas if self._state[shard, a].ejected),
            key=lambda a: self._state[shard, a].until,
        )
        probe = None
        if healthy and out:
            first = self._state[shard, out[0]]
            if first.until <= now and not first.probing:
                first.probing = True
                probe = out.pop(0)
        return healthy + out, probe

    def succeeded(self, shard: int, address: str) -> Change | None:
        """An answer from the replica: back in rotation if it was out."""
        r = self._state[shard, address]
        r.failures, r.probing = 0, False
        if not r.ejected:
            return None
        r.ejections, r.until = 0, -math.inf
        return Change.RETURNED

    def failed(self, shard: int, address: str, now: float) -> Change | None:
        """A failure of the replica (see :data:`FAILURE_CODES`): ejected after ``after`` in a
        row; a failed probe ejects it again for a longer back-off."""
        r = self._state[shard, address]
        if r.ejected:
            if r.probing:
                r.probing = False
                r.ejections += 1
                r.until = now + self.backoff(r.ejections)
            return None  # a last-resort call to a replica already out: nothing new
        r.failures += 1
        if self.after == 0 or r.failures < self.after:
            return None
        r.failures, r.ejections = 0, r.ejections + 1
        r.until = now + self.backoff(r.ejections)
        return Change.EJECTED

    def abandoned(self, shard: int, address: str) -> None:
        """A probe ended with no outcome about the replica (cancelled): probe again later."""
        self._state[shard, address].probing = False


class LatencyWindow:
    """A shard's recent answer latencies -> its hedge delay: the ``quantile`` of the last
    ``size`` answers, bounded to ``[low_s, high_s]``; ``high_s`` until ``warm`` answers came."""

    def __init__(
        self,
        low_s: float,
        high_s: float,
        quantile: float = 0.95,
        size: int = 200,
        warm: int = 20,
    ):
        assert 0 <= low_s <= high_s and 0 < quantile <= 1 and 1 <= warm <= size
        self.low_s, self.high_s, self.quantile, self.warm = low_s, high_s, quantile, warm
        self._seen: deque[float] = deque(maxlen=size)

    def add(self, latency_s: float) -> None:
        self._seen.append(latency_s)

    def hedge_after(self) -> float:
        """Seconds after which a call gets a twin."""
        if len(self._seen) < self.warm:
            return self.high_s
        ordered = sorted(self._seen)
        q = ordered[min(len(ordered) - 1, math.ceil(self.quantile * len(ordered)) - 1)]
        return min(max(q, self.low_s), self.high_s)
