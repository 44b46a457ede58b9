"""``HotRowCache``: the hottest packed rows of a table, kept in a faster tier.

Rows are packed (:func:`sharded_tables.quantize.pack_rows`), so one cache serves any dtype.
Storage is ``uint8 [capacity, row_bytes]`` on ``device``; an :class:`~sharded_tables.idmap.IdMap`
maps ids to its rows and picks victims (``lru`` / ``lfu`` / ``hybrid``, see that module).

Example::

    cache = HotRowCache(capacity_rows=1000, row_bytes=68, policy="lru", name="user_id")
    rows, hit = cache.get(ids)               # rows uint8 [n, 68], hit bool [n]
    cache.put(ids[~hit], fetch(ids[~hit]))   # fill the misses from the slower tier
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from prometheus_client import Counter

from sharded_tables.id_transformer import AdmissionSketch
from sharded_tables.idmap import DEFAULT_DECAY_PERIOD, IdMap, as_keys

# Module-level so that building many caches (tests, reloads) never registers a metric twice.
CACHE_HITS = Counter("recserve_cache_hits", "Hot-row cache lookups that hit", ["cache"])
CACHE_MISSES = Counter("recserve_cache_misses", "Hot-row cache lookups that missed", ["cache"])
CACHE_EVICTIONS = Counter(
    "recserve_cache_evictions", "Rows evicted from a hot-row cache", ["cache"]
)


class Admitted(NamedTuple):
    """What one :meth:`HotRowCache.insert` changed (``int64``, CPU)."""

    ids: torch.Tensor
    """``[m]`` the ids kept (those admitted, at most ``capacity``)."""
    slots: torch.Tensor
    """``[m]`` their storage slots."""
    evicted: torch.Tensor
    """``[e]`` the ids evicted to make room (their slots are among ``slots``)."""


_NONE = torch.empty(0, dtype=torch.int64)
_NOTHING = Admitted(_NONE, _NONE, _NONE)


class HotRowCache:
    """Packed rows keyed by int64 id, at most ``capacity_rows`` of them.

    Args:
        capacity_rows: rows held (``0``: every ``get`` misses and ``put`` keeps nothing).
        row_bytes: bytes of one packed row.
        policy: eviction policy of the id map.
        device: where the rows live (ids are mapped on CPU either way).
        name: the ``cache`` label of the Prometheus counters.
        decay_period: batches between count halvings (``hybrid`` only).
        storage: ``uint8 [capacity_rows, row_bytes]`` to hold the rows in (e.g. a view into a
            TBE kernel's weights, so the kernel pools cached rows by slot); default: new zeros.
        admit_after: a row offered to :meth:`put` is kept only once its id has been offered
            this many times (a count-min sketch, TinyLFU-style), so one-off ids of a long tail
            do not flush hot rows; ``1`` admits everything.
    """

    def __init__(
        self,
        capacity_rows: int,
        row_bytes: int,
        policy: str = "lru",
        device: str | torch.device = "cpu",
        name: str = "",
        decay_period: int = DEFAULT_DECAY_PERIOD,
        storage: torch.Tensor | None = None,
        admit_after: int = 1,
    ) -> None:
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0, got {capacity_rows}")
        if row_bytes < 1:
            raise ValueError(f"row_bytes must be >= 1, got {row_bytes}")
        self.row_bytes = row_bytes
        self.device = torch.device(device)
        self.name = name
        if storage is None:
            storage = torch.zeros(capacity_rows, row_bytes, dtype=torch.uint8, device=self.device)
        if storage.dtype != torch.uint8 or tuple(storage.shape) != (capacity_rows, row_bytes):
            raise ValueError(
                f"storage must be uint8 [{capacity_rows}, {row_bytes}], "
                f"got {storage.dtype} {tuple(storage.shape)}"
            )
        self.storage = storage
        if admit_after < 1:
            raise ValueError(f"admit_after must be >= 1, got {admit_after}")
        self.admit_after = admit_after
        self._sketch = AdmissionSketch(max(1024, 4 * capacity_rows)) if admit_after > 1 else None
        self._map = IdMap(capacity_rows, policy, decay_period)
        # A get gathers rows after the map answered; a concurrent put must not reuse them between.
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0
        self._metrics = (
            CACHE_HITS.labels(cache=name),
            CACHE_MISSES.labels(cache=name),
            CACHE_EVICTIONS.labels(cache=name),
        )

    @property
    def capacity(self) -> int:
        return self._map.capacity

    def get(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids int64 [n]`` (unique) -> (rows ``uint8 [n, row_bytes]`` on ``device``, zero for
        misses; hit ``bool [n]`` on CPU). Hits count as accesses for the policy."""
        with self._lock:
            slots = self._map.find(ids)  # [n] on CPU
            hit = slots >= 0
            rows = torch.zeros(len(slots), self.row_bytes, dtype=torch.uint8, device=self.device)
            if bool(hit.any()):
                idx = hit.nonzero().squeeze(1).to(self.device)
                rows[idx] = self.storage[slots[hit].to(self.device)]
            n_hit = int(hit.sum())
            self._hits += n_hit
            self._misses += len(slots) - n_hit
        self._metrics[0].inc(n_hit)
        self._metrics[1].inc(len(slots) - n_hit)
        return rows, hit

    def lookup_distinct(self, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``ids int64 [n]`` (any order, repeats, ``-1`` = padding) -> (the distinct present ids
        ``[U]`` ascending, their storage slots ``[U]`` with ``-1`` for misses, each id's position
        among them ``[n]``, 0 for padding, the present ids counting repeats), in one call of the
        id map. Every present id counts as a hit or a miss (a cache of capacity 0 counts
        nothing).

        The slots stay valid until the next :meth:`put` / :meth:`admit` (callers that read
        storage by slot do so before admitting more rows)."""
        record = self.capacity > 0
        with self._lock:
            found = self._map.find_distinct(ids, record)
            if record:
                self._hits += found.hits
                self._misses += found.misses
        if record:
            self._metrics[0].inc(found.hits)
            self._metrics[1].inc(found.misses)
        present = found.hits + found.misses
        return found.keys.numpy(), found.slots.numpy(), found.positions.numpy(), present

    def admit(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """:meth:`put` that returns each id's slot ``[n]`` (``-1`` for ids beyond capacity)."""
        self.put(ids, rows)
        with self._lock:
            return self._map.find(ids, record=False)

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Admits ``rows uint8 [n, row_bytes]`` under ``ids int64 [n]`` (unique), evicting per
        policy; ids already cached get their row replaced. Only the first ``capacity`` ids of a
        larger batch are kept (a batch may not evict itself)."""
        self.insert(ids, rows)

    def insert(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        before_write: Callable[[torch.Tensor], None] | None = None,
    ) -> Admitted:
        """:meth:`put` that says what changed: the ids kept, their slots and the ids evicted
        (a caller holding its own id -> slot map on a device updates it from these).
        ``before_write(evicted ids)`` runs after the map chose the victims and before their
        slots are overwritten (such a caller unmaps them there, so no reader of its map meets
        a slot holding another id's row)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.row_bytes:
            raise ValueError(
                f"rows must be uint8 [n, {self.row_bytes}], got {rows.dtype} {tuple(rows.shape)}"
            )
        if rows.shape[0] != len(ids):
            raise ValueError(f"rows has {rows.shape[0]} rows for {len(ids)} ids")
        ids = as_keys(ids, "ids")
        if self._sketch is not None:
            with self._lock:
                admitted = self._sketch.add(ids).numpy() >= self.admit_after
            if not admitted.all():  # NumPy: a miss of a served batch is a few ids
                if not admitted.any():
                    return _NOTHING  # none seen often enough yet: nothing to keep
                at = np.flatnonzero(admitted)
                ids = torch.from_numpy(ids.numpy()[at])
                on_cpu = rows.device.type == "cpu"
                rows = torch.from_numpy(rows.numpy()[at]) if on_cpu else rows[torch.from_numpy(at)]
        if len(ids) > self.capacity:
            ids, rows = ids[: self.capacity], rows[: self.capacity]
        with self._lock:
            slots, evicted, _ = self._map.insert(ids)
            if before_write is not None:
                before_write(evicted)
            if self.device.type == "cpu":  # NumPy: a served batch's misses are a few rows
                self.storage.numpy()[slots.numpy()] = rows.cpu().numpy()
            else:
                self.storage[slots.to(self.device)] = rows.to(self.device)
            self._evictions += len(evicted)
        self._metrics[2].inc(len(evicted))
        return Admitted(ids, slots, evicted)

    def invalidate(self, ids: torch.Tensor) -> None:
        """Forgets ``ids int64 [n]`` (absent ones are ignored); their rows are free again."""
        with self._lock:
            self._map.remove(ids)

    def stats(self) -> dict[str, float]:
        """``hits, misses, evictions`` since construction, ``size, capacity`` in rows and
        ``hit_rate`` (``hits / (hits + misses)``, 0 before any lookup)."""
        with self._lock:
            looked_up = self._hits + self._misses
            return {
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "size": self._map.size,
                "capacity": self.capacity,
                "hit_rate": self._hits / looked_up if looked_up else 0.0,
            }
