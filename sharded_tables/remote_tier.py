"""RemoteTier: how a :class:`~sharded_tables.tiered.TieredEmbeddingCollection` reads the tables
its plan put on embedding servers. Two ways, per table, by the plan's cache size:

* **whole**: a range-partitioned table whose cache holds every row (the planner does so for
  tables of at most ``Budgets.cache_whole_max`` bytes, from ``Budgets.cache``) is copied from the
  servers into a local TBE once, before the first batch that reads it (the model host's warm-up),
  in chunks of ``WHOLE_FETCH_BYTES``; from then on it is read like a host table: no network, no
  cache bookkeeping. A copy is made again when the collection's fetcher is replaced.

  The copy stays equal to the servers' rows because those rows never change under it: ranged
  rows are read-only on an embedding server (``Put`` takes keyed tables only), the collection's
  ``row_writer`` refuses remote tables (live updates name them as not updatable in place), and
  a client reads one model version (the router pins its ``RemoteTables`` to the version it
  serves, and a new version is a new model with a new copy). Keyed (hashed) tables are never
  copied whole: any process may ``Put`` their rows.
* **hot rows**: every other remote table. A batch's ids map to slots of the table's
  :class:`~sharded_tables.cache.HotRowCache` (rows held in one TBE, so the kernel pools cached
  rows by slot); the distinct misses of the whole batch are fetched in one request per server,
  pooled with ``embedding_bag``, then offered to the cache for later batches.

Shapes: features ``{name: ids int64 [B, L]}`` (``-1``: none) -> ``{name: pooled float32 [B, D]}``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from sharded_tables.cache import HotRowCache
from sharded_tables.interface import RemoteStats
from sharded_tables.planner import PlacementPlan, TablePlacement
from sharded_tables.quantize import unpack_rows
from sharded_tables.specs import TableSpec, Tier
from sharded_tables.store import RowStore
from sharded_tables.tbe import LocalTable, LocalTables

if TYPE_CHECKING:
    from sharded_tables.tiered import RemoteFetcher

WHOLE_FETCH_BYTES = 4 << 20
"""Bytes of rows per request while copying a table whole (each request within the deadline)."""


class WholeTableLoadError(RuntimeError):
    """A table to be copied whole came back incomplete (a server answered with zero-filled rows)."""


def is_whole(spec: TableSpec, placement: TablePlacement) -> bool:
    """Whether the plan caches this remote table whole (all its rows; ranged, not hashed)."""
    return (
        placement.tier is Tier.REMOTE
        and placement.partition == "range"
        and not spec.hashed
        and placement.cache_rows >= spec.rows
    )


def present_ids(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """``ids [B, L]`` -> bool mask of present ids (raw ids of hashed tables may be any int64
    but -1; row ids are >= 0)."""
    return ids != -1 if spec.hashed else ids >= 0


def pool_rows(
    spec: TableSpec,
    ids: torch.Tensor,
    u: torch.Tensor,
    dense: torch.Tensor,
    mean: bool,
) -> torch.Tensor:
    """Pools ``ids [B, L]`` over ``dense [U, D]``, the rows of the sorted distinct ids ``u [U]``
    (same device as ``dense``; every present id is in ``u``) -> ``[B, D]``."""
    present = present_ids(spec, ids)
    if dense.shape[0] == 0:
        return torch.zeros(ids.shape[0], spec.dim, device=dense.device)
    pos = torch.searchsorted(u, ids).clamp_(max=len(u) - 1)  # absent ids: any row, weight 0
    weights = present.float()
    if mean:
        weights /= present.sum(dim=1, keepdim=True).clamp(min=1)
    return F.embedding_bag(pos, dense, mode="sum", per_sample_weights=weights)


class RemoteTier:
    """The remote tables of one collection: whole copies, hot-row caches, fetches of misses.

    ``whole_modules``: ``{key: LocalTables}`` holding the whole copies (the collection pools
    them with its local tiers); ``caches``: ``{table: HotRowCache}`` of the other remote tables.
    """

    def __init__(
        self,
        specs: Mapping[str, TableSpec],
        plan: PlacementPlan,
        device: torch.device,
        backend: Mapping[str, str | None],
        cache_policy: str,
        cache_admit_after: int,
    ):
        """``backend``: ``{table: None (fbgemm) or "torch"}``, the kernel for its dtype."""
        self.specs, self.plan, self.device = specs, plan, device
        remote = [(s, plan.placement(n)) for n, s in specs.items()]
        remote = [(s, p) for s, p in remote if p.tier is Tier.REMOTE]
        self.whole = frozenset(s.name for s, p in remote if is_whole(s, p))
        self.whole_modules: dict[str, LocalTables] = {}
        tier = "device" if device.type == "cuda" else "host"
        for kind in (None, "torch"):
            tables = [
                LocalTable(s.name, s.rows, s.dim, p.dtype, s.feature_names(), s.pooling)
                for s, p in remote
                if s.name in self.whole and backend[s.name] == kind
            ]
            if tables:
                key = "remote-whole" + ("/torch" if kind else "")
                self.whole_modules[key] = LocalTables(
                    tables, tier=tier, device=device, backend=kind
                )
        self._whole_module = {t.name: m for m in self.whole_modules.values() for t in m.tables}
        hot = [(s, p) for s, p in remote if s.name not in self.whole]
        self.cache_tables = self._make_cache_tables(hot, backend)
        self.caches: dict[str, HotRowCache] = {}
        for s, p in hot:
            cached = self.cache_tables is not None and p.cache_rows > 0
            self.caches[s.name] = HotRowCache(
                p.cache_rows,
                s.row_bytes(p.dtype),
                device=device,
                name=s.name,
                storage=self.cache_tables.rows_view(s.name) if cached else None,  # type: ignore[union-attr]
                policy=cache_policy,
                admit_after=cache_admit_after,
            )
        self._copied_from: object | None = None  # the fetcher the copies came from
        self._copy_lock = threading.Lock()

    def _make_cache_tables(
        self, hot: list[tuple[TableSpec, TablePlacement]], backend: Mapping[str, str | None]
    ) -> LocalTables | None:
        """The hot-row caches' rows in one TBE (sum pooling: the kernel pools cached rows by
        slot); a cache of 0 rows is no cache."""
        cached = [(s, p) for s, p in hot if p.cache_rows > 0]
        if not cached:
            return None
        cuda = self.device.type == "cuda"
        return LocalTables(
            [
                LocalTable(s.name, p.cache_rows, s.dim, p.dtype, s.feature_names(), "sum")
                for s, p in cached
            ],
            tier="device" if cuda else "host",
            device=self.device,
            # CUDA: the torch path (slot views of fbgemm's UVM storage are not exposed)
            backend="torch" if cuda or any(backend[s.name] for s, _ in cached) else None,
        )

    # ---- whole copies -------------------------------------------------------------------------
    @torch.compiler.disable  # I/O, once
    def copy_whole(self, remote: RemoteFetcher | None, timeout: float | None) -> None:
        """Copies every whole table from ``remote`` unless its rows came from it already (with
        no ``remote``, a copy made before keeps answering)."""
        if self._copied_from is not None and (remote is None or remote is self._copied_from):
            return
        with self._copy_lock:
            if remote is not None and self._copied_from is remote:
                return  # another batch copied them meanwhile
            if remote is None:
                raise RuntimeError(f"remote tables {sorted(self.whole)} need embedding servers")
            for name in sorted(self.whole):
                self._whole_module[name].set_packed(name, self._fetch_all(remote, name, timeout))
            self._copied_from = remote

    def _fetch_all(self, remote: RemoteFetcher, name: str, timeout: float | None) -> torch.Tensor:
        """Rows ``[0, rows)`` of one table, ``uint8 [rows, row_bytes]``, in chunked requests.
        A store that says which rows it found (``RemoteTables``) must have found them all: a
        zero-filled answer (``fallback="zero"``) must not become a permanent copy."""
        spec, dtype = self.specs[name], self.plan.placement(name).dtype
        step = max(1, WHOLE_FETCH_BYTES // spec.row_bytes(dtype))
        parts = []
        for lo in range(0, spec.rows, step):
            ids = torch.arange(lo, min(lo + step, spec.rows), dtype=torch.int64)
            if isinstance(remote, RowStore):
                rows, found = remote.get(name, ids)
                if not bool(found.all()):
                    raise WholeTableLoadError(
                        f"table {name!r}: rows {int(ids[~found][0])}.. came back zero-filled "
                        "(an embedding server did not answer); not copied"
                    )
            else:
                rows = remote.fetch({name: ids}, timeout=timeout)[name]
            parts.append(rows)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    # ---- hot rows -----------------------------------------------------------------------------
    @torch.compiler.disable  # data-dependent: cache slots, fetches
    def lookup(
        self,
        by_table: Mapping[str, list[str]],
        features: Mapping[str, torch.Tensor],
        remote: RemoteFetcher | None,
        timeout: float | None,
        stats: RemoteStats,
    ) -> dict[str, torch.Tensor]:
        """Pools the features of hot-row tables ``by_table`` (``{table: [feature]}``): cached
        rows by slot, the batch's distinct misses fetched in one request per server. Rows of
        cached slots are pooled before any miss is admitted (admitting may evict them)."""
        ids = {f: features[f].cpu() for feats in by_table.values() for f in feats}  # [B, L]
        present = {f: present_ids(self.specs[t], ids[f]) for t, fs in by_table.items() for f in fs}
        slots = {f: self._cache_slots(t, ids[f]) for t, fs in by_table.items() for f in fs}
        misses: dict[str, torch.Tensor] = {}
        for table, feats in by_table.items():
            missed = [ids[f][(slots[f] < 0) & present[f]] for f in feats]
            u = torch.unique(missed[0] if len(missed) == 1 else torch.cat(missed))
            stats.ids += sum(int(present[f].sum()) for f in feats)
            if u.numel():
                misses[table] = u
        fetched: dict[str, torch.Tensor] = {}
        if misses:
            if remote is None:
                raise RuntimeError(f"remote tables {sorted(misses)} need embedding servers")
            fetched = remote.fetch(misses, timeout=timeout)
            stats.fetched += sum(len(u) for u in misses.values())
        b = next(iter(ids.values())).shape[0]
        out: dict[str, torch.Tensor] = {}
        if self.cache_tables is not None:  # misses are slot -1: the kernel skips them
            names = self.cache_tables.feature_names
            empty = torch.empty(b, 0, dtype=torch.int64)
            pooled = self.cache_tables.forward_padded(
                [slots.get(f, empty).to(self.cache_tables.device) for f in names]
            ).split(self.cache_tables.feature_dims, dim=1)
            out.update({f: pooled[i] for i, f in enumerate(names) if f in slots})
        for table, u in misses.items():
            spec = self.specs[table]
            dense = unpack_rows(fetched[table], self.plan.placement(table).dtype, spec.dim)
            dense, u_dev = dense.to(self.device), u.to(self.device)
            for f in by_table[table]:
                uncached = torch.where(slots[f] < 0, ids[f], -1).to(self.device)
                extra = pool_rows(spec, uncached, u_dev, dense, mean=False)
                out[f] = out[f] + extra if f in out else extra
            if self.caches[table].capacity:
                self.caches[table].put(u, fetched[table])
        for table, feats in by_table.items():
            spec = self.specs[table]
            for f in feats:
                if f not in out:  # no cache and nothing fetched: every bag is empty
                    out[f] = torch.zeros(b, spec.dim, device=self.device)
                if spec.pooling == "mean":
                    n = present[f].sum(dim=1, keepdim=True).clamp(min=1)
                    out[f] = out[f] / n.to(out[f].device)
        return out

    def _cache_slots(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Cache slots of ``ids [B, L]`` (``-1``: not cached or padding), on CPU."""
        cache = self.caches[table]
        if cache.capacity == 0:
            return torch.full(ids.shape, -1, dtype=torch.int64)
        return cache.lookup_slots(ids.reshape(-1)).view(ids.shape)
