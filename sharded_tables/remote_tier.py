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
* **hot rows**: every other remote table. A batch's distinct ids per table are looked up in the
  table's :class:`~sharded_tables.cache.HotRowCache` (one id-map call); the distinct misses of
  the whole batch are fetched in one request per server; the packed rows of the distinct ids
  (cached and fetched) are decoded once and every feature pools over them (on the CPU one C++
  call, :func:`~sharded_tables.pooled_lookup.pool_cached`; on a GPU ``embedding_bag``); then the
  misses are offered to the cache for later batches. A serving batch holds tens of ids, where
  each torch or NumPy call's dispatch costs more than its work.

Shapes: features ``{name: ids int64 [B, L]}`` (``-1``: none) -> ``{name: pooled float32 [B, D]}``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.nn import functional as F

from common.compile_boundary import eager_under_compile
from sharded_tables.cache import HotRowCache
from sharded_tables.interface import RemoteStats
from sharded_tables.planner import PlacementPlan, TablePlacement
from sharded_tables.pooled_lookup import pool_cached
from sharded_tables.quantize import unpack_rows
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.store import RowStore
from sharded_tables.tbe import LocalTable, LocalTables

WHOLE_FETCH_BYTES = 4 << 20
"""Bytes of rows per request while copying a table whole (each request within the deadline)."""


class RemoteFetcher(Protocol):
    """What the collection needs from the remote tier (``RemoteTables`` implements it)."""

    def fetch(
        self, ids_by_table: Mapping[str, torch.Tensor], timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """``{table: ids int64 [n]}`` -> ``{table: packed rows uint8 [n, row_bytes]}``."""
        ...


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
    pos = torch.searchsorted(u, ids.contiguous()).clamp_(max=len(u) - 1)  # absent: weight 0
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
        self.caches = {
            s.name: HotRowCache(
                p.cache_rows,
                s.row_bytes(p.dtype),
                device=device,
                name=s.name,
                policy=cache_policy,
                admit_after=cache_admit_after,
            )
            for s, p in remote
            if s.name not in self.whole
        }
        self._copied_from: object | None = None  # the fetcher the copies came from
        self._copy_lock = threading.Lock()

    # ---- whole copies -------------------------------------------------------------------------
    @eager_under_compile  # I/O, once
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
    @eager_under_compile  # data-dependent: cache slots, fetches
    def lookup(
        self,
        by_table: Mapping[str, list[str]],
        features: Mapping[str, torch.Tensor],
        remote: RemoteFetcher | None,
        timeout: float | None,
        stats: RemoteStats,
    ) -> dict[str, torch.Tensor]:
        """Pools the features of hot-row tables ``by_table`` (``{table: [feature]}``): the
        batch's distinct ids per table are read from the cache where it holds them and fetched
        otherwise (one request per server for the whole batch); the packed rows of the distinct
        ids are unpacked once and each feature pools over them. Cached rows are read before any
        miss is admitted (admitting may evict them)."""
        batch = {t: self._distinct(t, [features[f] for f in fs]) for t, fs in by_table.items()}
        misses = {t: torch.from_numpy(d.misses) for t, d in batch.items() if len(d.misses)}
        stats.ids += sum(d.present for d in batch.values())
        fetched: dict[str, torch.Tensor] = {}
        if misses:
            if remote is None:
                raise RuntimeError(f"remote tables {sorted(misses)} need embedding servers")
            fetched = remote.fetch(misses, timeout=timeout)
            stats.fetched += sum(len(u) for u in misses.values())
        out: dict[str, torch.Tensor] = {}
        for table, feats in by_table.items():
            d, spec = batch[table], self.specs[table]
            if not len(d.slots):  # every bag empty
                out.update({f: torch.zeros(d.b, spec.dim, device=self.device) for f in feats})
                continue
            out.update(zip(feats, self._pool(table, d, fetched.get(table)), strict=True))
            if table in misses and self.caches[table].capacity:
                self.caches[table].put(misses[table], fetched[table])
        return out

    def _distinct(self, table: str, id_mats: list[torch.Tensor]) -> _Distinct:
        """The distinct present ids of one table's features ``[B, L_f]``, their cache slots and
        each id's position among them, in one call of the id map."""
        mats = [m.cpu().numpy() for m in id_mats]
        flat = np.concatenate([m.reshape(-1) for m in mats]) if len(mats) > 1 else mats[0].ravel()
        ids = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.int64))
        # every present id counts as a hit or a miss; u [U] ascending, positions [n]
        u, slots_u, positions, present = self.caches[table].lookup_distinct(ids)
        return _Distinct(
            b=mats[0].shape[0], dtype=self.plan.placement(table).dtype, slots=slots_u,
            misses=u[slots_u < 0], present=present, ids=ids,
            positions=positions, widths=[m.shape[1] for m in mats],
        )  # fmt: skip

    def _pool(self, table: str, d: _Distinct, fetched: torch.Tensor | None) -> list[torch.Tensor]:
        """Each feature's pooled rows ``[B, D]`` over the batch's distinct ids: cached ones read
        from the cache storage by slot, the others from ``fetched`` (rows of ``d.misses``)."""
        spec, storage = self.specs[table], self.caches[table].storage
        mean = spec.pooling == "mean"
        if storage.device.type == "cpu":  # one C++ call: a batch's rows are few
            missed = fetched if fetched is not None else storage[:0]
            return pool_cached(
                storage, torch.from_numpy(d.slots), missed.contiguous(), d.ids,
                torch.from_numpy(d.positions), d.widths, d.b, mean, d.dtype, spec.dim,
            )  # fmt: skip
        dense = unpack_rows(self._packed_on_device(storage, d, fetched), d.dtype, spec.dim)
        ids = d.ids.to(storage.device)
        positions = torch.from_numpy(d.positions).to(storage.device)
        out, at = [], 0
        for width in d.widths:
            n = d.b * width
            bag_ids, pos = ids[at : at + n].view(d.b, width), positions[at : at + n]
            weights = (bag_ids != -1).float()
            if mean:
                weights /= weights.sum(dim=1, keepdim=True).clamp(min=1)
            out.append(
                F.embedding_bag(pos.view(d.b, width), dense, mode="sum",
                                per_sample_weights=weights)
            )  # fmt: skip
            at += n
        return out

    @staticmethod
    def _packed_on_device(
        storage: torch.Tensor, d: _Distinct, fetched: torch.Tensor | None
    ) -> torch.Tensor:
        """Packed rows ``uint8 [U, row_bytes]`` of the distinct ids on the storage's device."""
        if fetched is None:  # all cached
            return storage[torch.from_numpy(d.slots).to(storage.device)]
        hit = d.slots >= 0
        if not hit.any():
            return fetched.to(storage.device)
        rows = torch.empty(len(d.slots), storage.shape[1], dtype=torch.uint8, device=storage.device)
        at_hit = torch.from_numpy(np.flatnonzero(hit)).to(storage.device)
        rows[at_hit] = storage[torch.from_numpy(d.slots[hit]).to(storage.device)]
        rows[torch.from_numpy(np.flatnonzero(~hit)).to(storage.device)] = fetched.to(storage.device)
        return rows


@dataclass
class _Distinct:
    """One table's ids in one batch, reduced to its distinct present ids (U of them)."""

    b: int
    """Batch size B."""
    dtype: DType
    slots: np.ndarray
    """``int64 [U]``: cache slot of each distinct id (sorted by id), -1 where not cached."""
    misses: np.ndarray
    """``int64 [M]``: the distinct ids not cached, ascending (to fetch)."""
    present: int
    """Present ids (counting repeats)."""
    ids: torch.Tensor
    """``int64 [n]``: every feature's ``[B, L_f]`` ids end to end (``-1``: none)."""
    positions: np.ndarray
    """``int64 [n]``: each id's position among the distinct ids (0 if absent)."""
    widths: list[int]
    """``L_f`` per feature."""
