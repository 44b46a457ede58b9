"""The rows one embedding server holds for one model version, in DRAM (``server.py`` serves them).

* :class:`RangedTable`: GLOBAL rows ``[lo, hi)`` of a table, ``uint8 [hi - lo, row_bytes]``.
* :class:`KeyedTable`: rows under raw 64-bit keys, with a durable put log.
* :func:`load_tables`: a server folder's tables, refused (:class:`MemoryBudgetError`) over a budget.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch

from sharded_tables.remote.server_files import (
    KeyLog,
    latest_positions,
    read_manifest,
    read_table,
    replay_log,
    replay_records,
    select_tables,
)
from sharded_tables.specs import DType, row_bytes


class MemoryBudgetError(ValueError):
    """The folder's rows (or a put) do not fit the server's memory budget."""


class RequestError(Exception):
    """A bad request: becomes the gRPC status ``code`` with ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def wire_ids(raw: bytes, table: str) -> np.ndarray:
    """Wire ids (little-endian int64 bytes) -> ``int64 [n]`` (read-only view)."""
    if len(raw) % 8:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"table {table!r}: ids has {len(raw)} bytes, not a multiple of 8 (int64 ids)",
        )
    return np.frombuffer(raw, "<i8")


@dataclass
class RangedTable:
    """Global rows ``[lo, hi)`` of a table: ``rows uint8 [hi - lo, row_bytes]``, read-only."""

    name: str
    dtype: DType
    dim: int
    lo: int
    hi: int
    rows: torch.Tensor
    served: int = 0

    def lookup(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """``ids int64 [n]`` (global) -> (n packed rows, b"": all found)."""
        local = ids - self.lo  # [n], a fresh writable array
        if len(ids) and (local.min() < 0 or local.max() >= self.hi - self.lo):
            bad = ids[(local < 0) | (local >= self.hi - self.lo)][0]
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"table {self.name!r}: id {bad} is outside this server's rows "
                f"[{self.lo}, {self.hi})",
            )
        # numpy, not torch.index_select: torch's OpenMP workers spin between calls and take the
        # cores from the gRPC threads of this and other servers on the host
        return np.take(self.rows.numpy(), local, axis=0).tobytes(), b""  # [n, row_bytes]

    def nbytes(self) -> int:
        return self.rows.numel()


class KeyedTable:
    """Rows under raw 64-bit keys: ``key -> slot`` dict over a growable ``uint8 [cap, rb]``."""

    def __init__(
        self, name: str, dtype: DType, dim: int, log: KeyLog, keys: np.ndarray, rows: np.ndarray
    ) -> None:
        self.name, self.dtype, self.dim = name, DType(dtype), dim
        self.rb = row_bytes(dim, self.dtype)
        self.log = log
        self.served = 0
        self._lock = threading.Lock()
        self._load(keys, rows)

    def _load(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self._slot: dict[int, int] = dict(zip(keys.tolist(), range(len(keys)), strict=True))
        self._rows = np.zeros((max(1024, len(keys)), self.rb), np.uint8)
        self._rows[: len(keys)] = rows

    def lookup(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """``ids int64 [n]`` -> (n packed rows, zeros where missing; n found bytes)."""
        with self._lock:
            get = self._slot.get
            slots = np.fromiter((get(k, -1) for k in ids.tolist()), np.int64, len(ids))
            found = slots >= 0
            rows = self._rows[np.where(found, slots, 0)]  # [n, rb], a copy
        rows[~found] = 0
        return rows.tobytes(), found.astype(np.uint8).tobytes()

    def new_keys(self, ids: np.ndarray) -> int:
        """How many distinct keys of ``ids`` are not stored yet."""
        return sum(1 for k in set(ids.tolist()) if k not in self._slot)

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Logs (durably) and stores ``rows uint8 [n, rb]`` under ``ids int64 [n]``."""
        last = latest_positions(ids)  # a key repeated in one put keeps its last row
        ids, rows = ids[last], rows[last]
        with self._lock:  # log order == apply order, so a replay rebuilds exactly this table
            self.log.append(ids, rows)
            slots = np.empty(len(ids), np.int64)
            for i, k in enumerate(ids.tolist()):
                slots[i] = self._slot.setdefault(k, len(self._slot))
            if len(self._slot) > len(self._rows):
                grown = np.zeros((max(len(self._slot), 2 * len(self._rows)), self.rb), np.uint8)
                grown[: len(self._rows)] = self._rows
                self._rows = grown
            self._rows[slots] = rows

    def keys(self) -> np.ndarray:
        """``int64 [k]``: every stored key (in the order they were first stored)."""
        with self._lock:
            return np.fromiter(self._slot, np.int64, len(self._slot))

    @property
    def log_bytes(self) -> int:
        """Bytes of whole records in the put log: a mark :meth:`rewind` returns to."""
        return self.log.size

    def rewind(self, log_bytes: int) -> int:
        """Forgets the puts after the mark ``log_bytes`` (the log is cut there, durably, and the
        table reloaded from it) -> keys stored. Raises ``ValueError`` for a mark past the log's
        end or inside a record."""
        with self._lock:
            if not 0 <= log_bytes <= self.log.size:
                raise ValueError(
                    f"table {self.name!r}: mark {log_bytes} is outside the log's "
                    f"{self.log.size} bytes"
                )
            keys, rows, whole = replay_records(self.log.read(log_bytes), self.rb, self.name)
            if whole != log_bytes:
                raise ValueError(
                    f"table {self.name!r}: mark {log_bytes} is inside a record (the records "
                    f"before it end at byte {whole}): pass a log_bytes that Info reported"
                )
            self.log.cut(log_bytes)
            self._load(keys, rows)
            return len(keys)

    def nbytes(self) -> int:
        return len(self._slot) * self.rb


Table = RangedTable | KeyedTable


def close_tables(tables: dict[str, Table]) -> None:
    """Closes the put logs of a version's keyed tables (the version is no longer served)."""
    for t in tables.values():
        if isinstance(t, KeyedTable):
            t.log.close()


def load_tables(
    folder: Path, memory_budget: int | None, names: list[str] | None, verify: bool
) -> dict[str, Table]:
    """Loads the folder's tables, refusing (``MemoryBudgetError``) a folder over the budget."""
    entries = select_tables(read_manifest(folder), names)
    ranged = sum(e["bytes"] for e in entries if e["partition"] == "range")
    check_budget(ranged, memory_budget, f"folder {folder} (ranged tables)")
    tables: dict[str, Table] = {}
    for e in entries:
        if e["partition"] == "range":
            t = read_table(folder, e, verify)
            assert t.rows is not None
            tables[t.name] = RangedTable(t.name, t.dtype, t.dim, t.lo, t.hi, t.rows)
        else:
            path = folder / e["file"]
            keys, rows, valid = replay_log(path, e["row_bytes"])
            log = KeyLog(path, valid)
            tables[e["name"]] = KeyedTable(e["name"], e["dtype"], e["dim"], log, keys, rows)
    check_budget(sum(t.nbytes() for t in tables.values()), memory_budget, f"folder {folder}")
    return tables


def check_budget(need: int, budget: int | None, what: str) -> None:
    if budget is not None and need > budget:
        raise MemoryBudgetError(
            f"{what} needs {need} bytes, {need - budget} bytes over the memory budget of "
            f"{budget} bytes"
        )
