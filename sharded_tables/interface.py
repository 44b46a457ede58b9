"""TableCollection: the one call every embedding-table collection answers, as a typed seam.

``{feature: ids [B, L] int64, -1 = none} -> {feature: pooled [B, D] float32}``, plus what the
layers above need besides the lookup: the edge check, the tables' shapes, float rows in and
out, in-place row writes (live updates) and the counters of the remote tier. Three collections
implement it (torchrec's ``EmbeddingBagCollectionInterface`` plays this part there):

* :class:`~sharded_tables.collection.EmbeddingCollection`: float ``nn.EmbeddingBag`` tables;
* :class:`~sharded_tables.trainable.TrainableTables`: fbgemm's training kernel, fused optimizer;
* :class:`~sharded_tables.tiered.TieredEmbeddingCollection`: tiers device / host / remote,
  quantized rows.

Callers type against :class:`TableCollection` and call its methods; no ``isinstance`` on the
kind of collection, no ``getattr`` probes. Hooks that only some collections fill (row writes,
remote counters) have a stated default in :class:`TableHooks`. A lookup that fails for the
servers' sake, not the caller's, raises :class:`TablesUnavailableError`.

Example::

    def pooled_user(tables: TableCollection, history: torch.Tensor) -> torch.Tensor:
        tables.validate({"history": history})       # at the edge: ValueError names the feature
        return tables({"history": history})["history"]  # [B, D]

This module loads no torch (only for type checking): the planner's side of ``sharded_tables``
imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class RemoteStats:
    """Counters of lookups that leave the local tiers: ids read (remote and hashed tables),
    distinct ids of hashed tables, rows fetched from the servers. Cache hits and misses are
    the caches' own (:meth:`TableCollection.cache_stats`). All zero for in-process tables."""

    ids: int = 0
    unique: int = 0
    fetched: int = 0


class RowUpdateRefusedError(ValueError):
    """The table's rows cannot be written in place (rows on embedding servers, rows that follow
    hashed ids, tables spread over training ranks); the message names the table and says why."""


class TablesUnavailableError(RuntimeError):
    """A lookup the tables could not answer because a server holding their rows is down, too
    slow or failing, not because of the lookup itself: the same lookup may succeed when retried.
    Remote tiers raise it (``sharded_tables.remote.client``); a caller above the tables tells
    its own caller to retry (serving: UNAVAILABLE) and lets every other error through."""


class TableCollection(Protocol):
    """Pooled lookups over named tables: ``{feature: ids [B, L]} -> {feature: [B, D]}``."""

    @property
    def table_of(self) -> Mapping[str, str]:
        """``{feature: table}``: several features may read one table."""
        ...

    def __call__(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pools every feature ``ids [B, L] int64`` (-1 pads) into ``[B, D] float32``. Trusts
        its inputs (:meth:`validate` runs at the edge)."""
        ...

    def validate(self, features: Mapping[str, torch.Tensor]) -> None:
        """Edge check: known features, ``int64 [B, L]``, ids in range; ``ValueError`` naming
        the feature, its table and the first bad id."""
        ...

    def table_rows(self) -> dict[str, int | None]:
        """``{table: rows}``: ids must be in ``[0, rows)``; None for a hashed table (any id)."""
        ...

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        """``{table: (rows, D)}`` of every table."""
        ...

    def float_weights(self) -> dict[str, torch.Tensor]:
        """``{table: float rows [rows, D]}`` (detached). ``ValueError`` where the float rows
        are gone (quantized, or on embedding servers)."""
        ...

    def load_float(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Takes float rows ``{table: [rows, D]}`` (quantizing where the tables are packed).
        -> the packed rows of tables that live on embedding servers (``{}`` when none)."""
        ...

    def row_writer(
        self, table: str, rows: torch.Tensor, values: torch.Tensor
    ) -> Callable[[], None]:
        """Prepares an in-place write of ``values [n, D] float32`` (finite, CPU) into
        ``rows [n] int64`` (in range) of ``table``; -> the write, run later between batches.
        Raises :class:`RowUpdateRefusedError` when the table is not written in place, and
        ``ValueError`` when the values do not fit its storage (the message says its dtype)."""
        ...

    def keyed_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{hashed table: (keys int64 [n], float rows [n, D])}``: every row a hashed table
        learned, sorted by key (``{}``: none here, or they live on embedding servers)."""
        ...

    def load_keyed(
        self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Takes ``{hashed table: (keys, float rows)}`` (what :meth:`keyed_rows` gives; packed
        where the tables are) -> ``{table: (keys, packed rows)}`` of hashed tables that live on
        embedding servers (``{}`` when none)."""
        ...

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """``{table: counters}`` of the hot-row caches of remote tables, and ``{row store:
        counters}`` of device caches of host tables (``{}``: none)."""
        ...

    def between_batches(self) -> None:
        """Work the tables do between two batches, outside the forward (device caches admit
        the rows the last lookups missed); the served model's runner calls it after each."""
        ...

    def remote_stats(self) -> RemoteStats:
        """Counters of lookups that left the local tiers (zeros: none did)."""
        ...


class TableHooks:
    """Defaults of :class:`TableCollection`'s optional hooks, for a collection whose tables all
    live in this process: no caches, no remote lookups, rows not written in place (a collection
    that can write them overrides :meth:`row_writer`)."""

    def row_writer(
        self, table: str, rows: torch.Tensor, values: torch.Tensor
    ) -> Callable[[], None]:
        raise RowUpdateRefusedError(
            f"table {table!r}: {type(self).__name__} tables are not updated in place"
        )

    def keyed_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {}

    def load_keyed(
        self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        raise ValueError(f"{type(self).__name__} tables take no keyed rows (no hashed tables)")

    def cache_stats(self) -> dict[str, dict[str, float]]:
        return {}

    def between_batches(self) -> None:
        return None

    def remote_stats(self) -> RemoteStats:
        return RemoteStats()
