"""Fetching a served request's remote rows at admission, ahead of its batch.

A served request is checked in its gRPC handler thread, queued, and then waits while the batcher
finishes what runs before it. When its hot-row tables miss the cache, the batch that takes it
would block on one RPC to the embedding servers, and so would every request queued behind it.
Instead, admission registers the request's missing ids as a :class:`Flight`, and the handler
thread, which would only wait, fetches them right after queueing the request
(:meth:`FetchAhead.run`). The batch's lookup takes those rows, waiting for a flight still under
way, and fetches only the ids no flight holds. An id that another admitted request is fetching
already is not fetched again: the misses of concurrent requests merge.

Only range-partitioned tables fetch ahead: their rows never change under a client
(``remote_tier``), so a row fetched ahead is exactly the row the batch would fetch. Landed rows
stay, oldest flights forgotten first, while the flights hold at most ``limit`` ids; a failed or
cancelled flight leaves nothing behind, so its batch fetches those ids itself, with the tier's own
error handling (raise, or zero rows).

Example (what ``RemoteTier`` does)::

    ahead = AheadRows()
    flight = ahead.register({"item": np.array([3, 17])})  # at admission
    ahead.land(flight, remote.fetch(...))                    # in the handler thread
    found = ahead.find("item", np.array([3, 5, 17]))        # in the batch: 3 and 17 are ahead
    at, rows = ahead.collect("item", found, timeout=1.0)    # positions 0 and 2, their rows
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

AHEAD_ROWS = 1 << 16
"""Ids the flights of a tier may hold before the oldest are forgotten (64 Ki rows: a few MiB)."""


@dataclass(eq=False)
class Flight:
    """The ids one admitted request fetches ahead, and (once landed) their packed rows."""

    ids: dict[str, np.ndarray]
    """``{table: ids int64 [n]}``, distinct."""
    rows: dict[str, np.ndarray] | None = None
    """``{table: uint8 [n, row_bytes]}`` in ``ids`` order; None until landed, or failed."""
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.ids.values())


Found = list[tuple[int, Flight, int]]
"""``[(position among the looked-up ids, flight, position among the flight's ids of the table)]``."""


class AheadRows:
    """The flights of one remote tier, by table and id (thread-safe)."""

    def __init__(self, limit: int = AHEAD_ROWS):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._where: dict[str, dict[int, tuple[Flight, int]]] = {}
        self._flights: deque[Flight] = deque()
        self._held = 0
        self._lock = threading.Lock()

    def register(self, wanted: Mapping[str, np.ndarray]) -> Flight | None:
        """``{table: distinct ids int64 [n]}`` -> a flight of those no flight holds yet (None:
        every one is held). Forgets the oldest flights beyond ``limit`` ids."""
        with self._lock:
            new: dict[str, np.ndarray] = {}
            for table, ids in wanted.items():
                where = self._where.get(table, {})
                fresh = [i for i in ids.tolist() if i not in where]
                if fresh:
                    new[table] = np.array(fresh, np.int64)
            if not new:
                return None
            flight = Flight(new)
            for table, ids in new.items():
                where = self._where.setdefault(table, {})
                for j, i in enumerate(ids.tolist()):
                    where[i] = (flight, j)
            self._flights.append(flight)
            self._held += flight.size
            while self._held > self.limit and len(self._flights) > 1:
                self._forget(self._flights.popleft())
            return flight

    def _forget(self, flight: Flight) -> None:
        """Drops the ids ``flight`` holds (lock held)."""
        for table, ids in flight.ids.items():
            where = self._where[table]
            for i in ids.tolist():
                if where.get(i, (None,))[0] is flight:
                    del where[i]
        self._held -= flight.size

    def land(self, flight: Flight, rows: Mapping[str, np.ndarray] | None) -> None:
        """The flight's fetch ended: ``rows`` per table (in its ids' order), or None (failed,
        cancelled): then its ids are forgotten, for their batch to fetch."""
        if rows is None:
            with self._lock:
                if flight in self._flights:
                    self._flights.remove(flight)
                    self._forget(flight)
        else:
            flight.rows = dict(rows)
        flight.done.set()

    def find(self, table: str, ids: np.ndarray) -> Found:
        """Which of ``ids int64 [n]`` a flight holds (landed or not)."""
        with self._lock:
            where = self._where.get(table)
            if not where:
                return []
            get = where.get
            return [(k, *hit) for k, i in enumerate(ids.tolist()) if (hit := get(i)) is not None]

    def collect(
        self, table: str, found: Found, timeout: float | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows of ``found`` whose flights land within ``timeout`` seconds (each) ->
        (their positions ``int64 [m]``, rows ``uint8 [m, row_bytes]``, None when m = 0). The
        other positions' flights failed or are late: their ids are the caller's to fetch."""
        by_flight: dict[Flight, tuple[list[int], list[int]]] = {}
        for k, flight, j in found:
            at, of = by_flight.setdefault(flight, ([], []))
            at.append(k)
            of.append(j)
        positions, parts = [], []
        for flight, (at, of) in by_flight.items():
            if flight.done.wait(timeout) and flight.rows is not None:
                positions.extend(at)
                parts.append(flight.rows[table][of])
        if not parts:
            return np.zeros(0, np.int64), None
        return np.array(positions, np.int64), np.concatenate(parts) if len(parts) > 1 else parts[0]


class FetchAhead:
    """One admitted request's flight: :meth:`run` fetches it in the caller's thread (after the
    request is queued); :meth:`cancel` gives it up (the request was refused). Exactly one of
    them must be called: a batch waits for the flight until its deadline otherwise."""

    def __init__(
        self,
        ahead: AheadRows,
        flight: Flight,
        fetch: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]],
    ):
        self._ahead, self.flight, self._fetch = ahead, flight, fetch

    def run(self) -> None:
        """Fetches the flight's rows. A failure is not raised: the batch fetches those ids
        itself and reports the failure as any fetch of its own."""
        rows = None
        try:
            rows = self._fetch(self.flight.ids)
        except Exception:  # the batch's own fetch raises it where it belongs
            rows = None
        finally:
            self._ahead.land(self.flight, rows)

    def cancel(self) -> None:
        self._ahead.land(self.flight, None)
