"""``DeviceRowCache``: the hottest rows of a host row store, kept on the device, read in fixed
shapes with no host synchronisation (so a CUDA graph of the forward can hold the lookup).

The host tier's packed rows live in pinned host memory; a lookup that reads them all crosses the
bus for every id. This cache keeps a bounded set of them in device memory:

* ``slot_of int32 [R]`` (device): each store row's cache slot, ``-1`` when not cached. A lookup
  gathers it, then the cached rows ``uint8 [C, row_bytes]`` (device) at the hits' slots and the
  store's rows at the misses (read by index through a device-readable alias of the pinned
  store: :func:`device_readable`), and picks one per id with ``torch.where``. Every shape is
  the batch's; nothing is read back to the host.
* The lookup also appends its ids to a ring log on the device. **Between batches**, outside the
  forward (:meth:`DeviceRowCache.admit`), the log is read back once and handed to the remote
  tier's :class:`~sharded_tables.cache.HotRowCache`, which keeps the policy (its id map ranks
  the rows, LRU / LFU / decayed LFU, its count-min sketch admits a row on its
  ``admit_after``-th miss) and writes admitted rows into the cache storage it owns: the device
  rows. The slot map then takes the admitted rows' slots and forgets the evicted ones.

Between two :meth:`admit` calls the cache does not change, so the hits and misses the policy
counts from the log are those the lookups saw (ids beyond the log's size between two calls are
neither counted nor ranked: :attr:`DeviceRowCache.unlogged` counts them). Lookups and
admissions are ordered by running on one stream (a graph replay is one launch; the eager
lookup enqueues its reads under the cache's lock), and an admission unmaps its victims before
their slots take new rows and maps the new ids last, so a lookup that runs between its steps
reads a row it asked for or a miss, never another id's row.

On a CPU the same code runs on CPU tensors (the "device" is the host; the store is read
directly), which is how the tests check it.

Example::

    cache = DeviceRowCache(store, capacity_rows=1000, device="cuda", name="host/int8/64")
    packed = cache.read(rows, present)   # rows int64 [n] on the device -> uint8 [n, row_bytes]
    cache.admit()                         # between batches: the policy's admissions
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from sharded_tables.cache import HotRowCache

LOG_SIZE = 1 << 16
"""Ids a cache logs between two admissions (a ring: older ones are overwritten)."""


class _CudaArray:
    """A CUDA array interface over a pinned host tensor's bytes (it keeps the tensor alive)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": tuple(host.shape),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def device_readable(store: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``store uint8 [R, row_bytes]`` on the host -> a tensor on ``device`` that reads the same
    bytes (on a CPU: ``store`` itself; on CUDA: an alias of the pinned memory, which unified
    addressing maps into the device's address space, so a gather kernel reads rows over the bus
    by index with no copy and no host synchronisation). None where no alias can be made (the
    store is not pinned, or this CUDA runtime refuses the pointer)."""
    if device.type == "cpu":
        return store
    if device.type != "cuda" or not store.is_pinned() or not store.is_contiguous():
        return None
    try:
        alias = torch.as_tensor(_CudaArray(store), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    return alias if alias.data_ptr() == store.data_ptr() else None


class DeviceRowCache:
    """At most ``capacity_rows`` rows of ``store`` on ``device``, read by :meth:`read` and
    refilled by :meth:`admit` (see the module docstring).

    Args:
        store: ``uint8 [R, row_bytes]`` packed rows on the host (pinned on CUDA).
        capacity_rows: rows the device holds (``0``: every read goes to the store).
        device: where the cached rows, the slot map and the log live.
        policy / admit_after / name: the :class:`HotRowCache` policy, admission threshold and
            Prometheus label.
        log_size: ids logged between two admissions.
    """

    def __init__(
        self,
        store: torch.Tensor,
        capacity_rows: int,
        device: torch.device | str,
        policy: str = "hybrid",
        admit_after: int = 2,
        name: str = "",
        log_size: int = LOG_SIZE,
    ) -> None:
        if store.dtype != torch.uint8 or store.dim() != 2:
            raise ValueError(f"store must be uint8 [R, row_bytes], got {store.dtype} {store.shape}")
        if log_size < 1:
            raise ValueError(f"log_size must be >= 1, got {log_size}")
        self.device = torch.device(device)
        self.store = store
        reader = device_readable(store, self.device)
        self._reader = reader
        """The store as the device reads it; None: rows are copied through the host."""
        capacity = min(capacity_rows, store.shape[0])
        self.policy = HotRowCache(
            capacity, store.shape[1], policy, self.device, name, admit_after=admit_after
        )
        self.rows = self.policy.storage  # uint8 [C, row_bytes] on the device
        self.slot_of = torch.full((store.shape[0],), -1, dtype=torch.int32, device=self.device)
        self._log = torch.full((log_size,), -1, dtype=torch.int64, device=self.device)
        self._cursor = torch.zeros((), dtype=torch.int64, device=self.device)  # ids ever logged
        self._read_to = 0  # the cursor at the last admission (host)
        self.unlogged = 0
        """Ids overwritten in the log before an admission read them."""
        self._aranges: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    # ---- the request path: fixed shapes, no host read -----------------------------------------
    def read(self, rows: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """``rows int64 [n]`` (store rows, in range: padding clamped by the caller) and
        ``present bool [n]`` (which are real ids), on the device -> their packed rows
        ``uint8 [n, row_bytes]`` on the device. Trusts its inputs."""
        if self.capacity == 0:
            return self._from_store(rows)
        with self._lock:  # an admission may not rewrite a slot between these reads
            slot = self.slot_of[rows]  # [n] int32, -1 = not cached
            hit = slot >= 0
            cached = self.rows[slot.clamp(min=0).long()]  # [n, row_bytes]
            # hits read store row 0 instead of their own: one row, not n, crosses the bus
            fetched = self._from_store(torch.where(hit, 0, rows))
            self._log_ids(torch.where(present, rows, -1))
        return torch.where(hit[:, None], cached, fetched)

    def _from_store(self, rows: torch.Tensor) -> torch.Tensor:
        if self._reader is not None:
            return self._reader[rows]
        # no device alias: through the host (this synchronises; graphs need the alias)
        return self.store[rows.to(self.store.device)].to(self.device, non_blocking=True)

    def _log_ids(self, ids: torch.Tensor) -> None:
        """Appends ``ids [n]`` (-1 = padding) to the ring log: positions from the device cursor."""
        n, size = ids.shape[0], self._log.shape[0]
        skip = max(0, n - size)  # only the last ``size`` fit; the rest count as unlogged
        at = (self._cursor + (skip + self._arange(n - skip))) % size
        self._log.index_copy_(0, at, ids[skip:])
        self._cursor.add_(n)

    def _arange(self, n: int) -> torch.Tensor:
        got = self._aranges.get(n)
        if got is None:
            got = self._aranges[n] = torch.arange(n, device=self.device)
        return got

    # ---- between batches: the policy's decisions, on the host ---------------------------------
    def admit(self) -> int:
        """Reads the ids logged since the last call (one host read), counts them as hits and
        misses in the policy and admits the misses it keeps -> rows admitted. Runs outside the
        forward (a graph's replay only reads)."""
        if self.capacity == 0:
            return 0
        # inference mode: the cache's tensors may have been made under it (a model loaded so)
        with self._lock, torch.inference_mode():
            end = int(self._cursor)  # the host read, outside any graph
            n = end - self._read_to
            size = self._log.shape[0]
            if n > size:
                self.unlogged += n - size
                n = size
            self._read_to = end
            if n == 0:
                return 0
            at = (torch.arange(end - n, end) % size).to(self.device)
            ids = self._log[at].cpu()
            keys, slots, _, _ = self.policy.lookup_distinct(ids)  # counts hits and misses
            missed = torch.from_numpy(keys[slots < 0])
            if len(missed) == 0:
                return 0
            # evicted ids unmapped before their slots take new rows, new ids mapped after
            forget = lambda evicted: self._set_slots(evicted, None)  # noqa: E731
            done = self.policy.insert(missed, self.store[missed], before_write=forget)
            self._set_slots(done.ids, done.slots)
            return len(done.ids)

    def _set_slots(self, ids: torch.Tensor, slots: torch.Tensor | None) -> None:
        if len(ids) == 0:
            return
        at = ids.to(self.device)
        if slots is None:
            self.slot_of[at] = -1
        else:
            self.slot_of[at] = slots.to(device=self.device, dtype=torch.int32)

    def invalidate(self, rows: torch.Tensor) -> None:
        """Forgets store rows ``rows int64 [n]`` (their store bytes were rewritten)."""
        if self.capacity == 0 or len(rows) == 0:
            return
        with self._lock, torch.inference_mode():
            rows = rows.cpu()
            self.policy.invalidate(rows)
            self._set_slots(rows, None)

    def stats(self) -> dict[str, float]:
        """The policy's counters (:meth:`HotRowCache.stats`: hits and misses as of the last
        :meth:`admit`) and ``unlogged``."""
        return {**self.policy.stats(), "unlogged": self.unlogged}
