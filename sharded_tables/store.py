"""Keyed row stores: where rows of hashed tables live when they are not in a local table.

In training, an id transformer (:mod:`sharded_tables.id_transformer`) keeps the hottest raw ids
of a hashed table in working rows; rows it evicts are written to the embedding servers'
keyed store (:class:`~sharded_tables.remote.client.RemoteTables`, a :class:`RowStore`) and read
back when the id returns (:mod:`sharded_tables.hashed_training`), so no learned row is lost.
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
