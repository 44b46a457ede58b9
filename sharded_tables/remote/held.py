"""Small remote tables a client holds whole (``RemoteTables(hold_bytes=...)``): answered from
its memory, so they keep answering while their embedding servers are paused, killed or
restarting.

A range-partitioned table of at most ``hold_bytes`` (rows x packed row bytes: a user's gender,
age bucket or country table is a few hundred bytes) is fetched whole by the client the first
time it is asked for (:meth:`HeldTables.load`; a router asks at load, before the version
serves), in requests of at most :data:`HOLD_FETCH_BYTES`; from then on its lookups send no
request. Larger tables, and keyed (hashed) tables whose rows any process may ``Put``, are
fetched as before and fail fast when their server does not answer.

The held rows stay equal to the servers' because ranged rows never change under a client:
an embedding server's ranged rows are read-only (``Put`` takes keyed tables only) and a client
reads one model version (a router builds a new client, and holds the rows anew, for each version
it loads). A table whose rows come back zero-filled (``fallback="zero"``: a server did not
answer) is not held: the lookup that asked gets zero rows, as the fallback gives, and the
next lookup asks again.

Example::

    held = HeldTables([RemoteTable("user_gender", DType.INT8, 8, ("a:1",), bounds=(0, 2))], 1024)
    held.names                                  # frozenset({'user_gender'})
    held.load("user_gender", fetch_all)         # fetch_all(ids [n]) -> (rows [n, 12], found [n])
    held.rows("user_gender", np.array([1, 1]))  # uint8 [2, 12], no request
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from sharded_tables.remote.routing import RemoteTable, server_of

HOLD_FETCH_BYTES = 4 << 20
"""Bytes of rows per request while a table is fetched whole (each request within the deadline)."""

FetchRows = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
"""``fetch(ids int64 [n])`` -> (packed rows ``uint8 [n, row_bytes]``, found ``bool [n]``)."""


def table_bytes(table: RemoteTable) -> int:
    """Bytes of a ranged table's packed rows (rows x row bytes)."""
    return (table.bounds[-1] - table.bounds[0]) * table.row_bytes


class HeldTables:
    """The tables of ``tables`` that a client holds whole: ranged, at most ``max_bytes`` each
    (0: none). Thread-safe: lookups read a held table without a lock once it is loaded."""

    def __init__(self, tables: Sequence[RemoteTable], max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"hold_bytes: must be >= 0, got {max_bytes}")
        self.specs = {
            t.name: t
            for t in tables
            if max_bytes and t.partition == "range" and table_bytes(t) <= max_bytes
        }
        self.names = frozenset(self.specs)
        self._rows: dict[str, np.ndarray] = {}  # name -> uint8 [rows, row_bytes]
        self._lock = threading.Lock()

    def is_held(self, name: str) -> bool:
        return name in self._rows

    def load(self, name: str, fetch: FetchRows) -> bool:
        """Fetches table ``name`` whole unless it is held already; -> whether it is held now
        (False: some rows came back zero-filled, so nothing was kept). A failed request raises
        what ``fetch`` raises."""
        if name in self._rows:
            return True
        with self._lock:  # one fetch per table, however many batches ask at once
            if name in self._rows:
                return True
            spec = self.specs[name]
            lo, hi = spec.bounds[0], spec.bounds[-1]
            step = max(1, HOLD_FETCH_BYTES // spec.row_bytes)
            parts = []
            for start in range(lo, hi, step):
                rows, found = fetch(np.arange(start, min(start + step, hi), dtype=np.int64))
                if not found.all():
                    return False
                parts.append(rows)
            whole = np.concatenate(parts) if parts else np.zeros((0, spec.row_bytes), np.uint8)
            self._rows[name] = whole
            return True

    def rows(self, name: str, ids: np.ndarray, held: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Rows of table ``name`` for ``ids int64 [n]`` -> (``uint8 [n, row_bytes]``, found
        ``bool [n]``): the held rows, all found; ``held=False`` (a table that came back
        zero-filled): zero rows, none found. An id outside the table raises ``ValueError``
        naming it, as a fetch does."""
        spec = self.specs[name]
        lo, hi = spec.bounds[0], spec.bounds[-1]
        if len(ids) and (ids.min() < lo or ids.max() >= hi):
            server_of(spec, ids)  # raises, naming the table and the id
        if not held:
            return np.zeros((len(ids), spec.row_bytes), np.uint8), np.zeros(len(ids), bool)
        return self._rows[name][ids - lo], np.ones(len(ids), dtype=bool)
