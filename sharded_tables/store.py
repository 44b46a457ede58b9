"""Keyed row stores: where rows of hashed tables live when they are not in a local table.

An id transformer (:mod:`sharded_tables.id_transformer`) keeps the hottest raw ids of a hashed
table in local rows; rows it evicts are written to a :class:`RowStore` (in production the remote
embedding servers) and read back when the id returns, so no learned row is lost.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class RowStore(ABC):
    """Packed rows (:func:`sharded_tables.quantize.pack_rows`) keyed by raw 64-bit id, per table."""

    @abstractmethod
    def get(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids int64 [n]`` -> (rows ``uint8 [n, row_bytes]``, found ``bool [n]``).

        Rows of ids never stored are zero and ``found`` is False for them.
        """

    @abstractmethod
    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores (or replaces) ``rows uint8 [n, row_bytes]`` under ``ids int64 [n]``."""


class MemoryRowStore(RowStore):
    """An in-process store (tests, single-process use): a dict per table."""

    def __init__(self, row_bytes: dict[str, int]):
        self.row_bytes = dict(row_bytes)
        self._rows: dict[str, dict[int, torch.Tensor]] = {t: {} for t in row_bytes}

    def _table(self, table: str) -> dict[int, torch.Tensor]:
        if table not in self._rows:
            raise KeyError(f"unknown table {table!r} (known: {sorted(self._rows)})")
        return self._rows[table]

    def get(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows_of = self._table(table)
        out = torch.zeros(len(ids), self.row_bytes[table], dtype=torch.uint8)
        found = torch.zeros(len(ids), dtype=torch.bool)
        for i, key in enumerate(ids.tolist()):
            row = rows_of.get(key)
            if row is not None:
                out[i] = row
                found[i] = True
        return out, found

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        rows_of = self._table(table)
        if rows.shape != (len(ids), self.row_bytes[table]) or rows.dtype != torch.uint8:
            raise ValueError(
                f"table {table!r}: expected uint8 rows [{len(ids)}, {self.row_bytes[table]}], "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        for key, row in zip(ids.tolist(), rows.clone(), strict=True):
            rows_of[key] = row
