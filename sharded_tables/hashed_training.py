"""Training hashed (unbounded-id) tables larger than the process: a working table of the hottest
ids, and the rest, **with their optimizer state**, on the embedding servers.

:class:`HashedTrainingTables` wraps the kernel tables that train: fbgemm's fused-optimizer
:class:`~sharded_tables.trainable.TrainableTables` in one process, TorchRec's DMP over the ranks
of a torchrun job (:class:`KernelTables`). Each hashed table there has ``capacity`` working rows; an
:class:`~sharded_tables.id_transformer.IdTransformer` maps raw 64-bit ids onto them before every
lookup, as the Tencent / TorchRec dynamic-embedding designs do:

* an id the working table must give up (policy eviction) is written to the store first: its
  row and its optimizer state as one FP32 row ``[D + S]`` (``S``: 1 for row-wise Adagrad, ``D``
  for Adagrad, 0 for SGD), acknowledged durable by the servers;
* an admitted id reads its row back (found: row and state restored exactly) or starts fresh
  (:func:`hashed_uniform` of ``init_std``, a pure function of the id, and zero state);
* an id not admitted this batch (``admit_after``) pools as padding.

So training equals training a table of every id whatever the working capacity, up to the
policy's admission (tested). The servers hold the training rows in keyed FP32 tables named like
the model's tables, ``D + S`` wide (:func:`store_tables`).

**Checkpoints** stay consistent across the working table and the servers: the state dict holds
the working rows and state, the transformers, and each server's **mark** (its put log's length,
``Info.log_bytes``). Loading it rewinds every server's log to those marks (``Rewind``), so a
trainer killed after the checkpoint and resumed sees exactly the rows it saw then (resume equals
an uninterrupted run); a row acknowledged before the checkpoint is never lost.

Example::

    store = RemoteTables(store_tables({"user_raw": (32, "rowwise_adagrad")}, ["127.0.0.1:7001"]))
    tables = HashedTrainingTables(TrainableTables([TableConfig("user_raw", 10_000, 32)]),
                                  {"user_raw": HashedTable(10_000)}, store)
    tables({"user_raw": torch.tensor([[123456789012345], [-1]])})  # {"user_raw": [2, 32]}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from sharded_tables.collection import check_id_features
from sharded_tables.id_transformer import IdTransformer
from sharded_tables.interface import RemoteStats, TableHooks
from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.remote.routing import RemoteTable
from sharded_tables.remote.server_files import ServerTable, read_manifest, write_server_folder
from sharded_tables.specs import DType

_M31 = 0x7FFFFFFF


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash on ``int64`` values in ``[0, 2^31)`` (products stay below 2^63)."""
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def hashed_uniform(ids: torch.Tensor, dim: int, scale: float, seed: int = 0) -> torch.Tensor:
    """``ids int64 [a]`` -> ``float32 [a, dim]`` uniform in ``[-scale, scale)``, a pure function
    of ``(seed, id, column)``: an id starts from the same row whatever batch first brings it."""
    h = _mix31((ids & _M31) ^ (seed & _M31))
    h = _mix31(h ^ ((ids >> 31) & _M31))
    h = _mix31(h ^ ((ids >> 62) & 3))  # [a]
    cols = _mix31(torch.arange(1, dim + 1, dtype=torch.int64))  # [dim]
    u = _mix31(h[:, None] ^ cols[None, :]).float() / float(1 << 31)  # [a, dim] in [0, 1)
    return (2 * u - 1) * scale


EXPORT_CHUNK = 1 << 16
"""Ids read from the store per call when exporting a table."""


class MarkedStore(Protocol):
    """A keyed row store whose tables can be marked and rewound (:class:`RemoteTables`)."""

    def get(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None: ...

    def keys(self, table: str) -> torch.Tensor: ...

    def marks(self, table: str) -> dict[str, int]: ...

    def rewind(self, table: str, marks: Mapping[str, int]) -> int: ...


@dataclass(frozen=True)
class HashedTable:
    """How one hashed table trains: ``capacity`` working rows, the transformer's policy."""

    capacity: int
    policy: str = "lru"
    admit_after: int = 1


def state_width(optimizer: str, dim: int) -> int:
    """Optimizer state floats per row: row-wise Adagrad 1, Adagrad ``dim``, SGD 0."""
    return {"rowwise_adagrad": 1, "adagrad": dim, "sgd": 0}[optimizer]


def store_tables(
    tables: Mapping[str, tuple[int, str]], servers: Sequence[str]
) -> list[RemoteTable]:
    """The keyed FP32 training tables ``{table: (D, optimizer)}`` over ``servers``, as the
    client's routing entries (each row ``D + S`` floats: the row, then its optimizer state)."""
    return [
        RemoteTable(name, DType.FP32, dim + state_width(opt, dim), tuple(servers), "keyed")
        for name, (dim, opt) in tables.items()
    ]


def store_folder(folder: Path, widths: Mapping[str, int]) -> Path:
    """An embedding server's folder holding keyed FP32 tables ``{name: width}`` (empty), made
    if ``folder`` does not exist; an existing one must hold them (``ValueError`` otherwise)."""
    folder = Path(folder)
    if not folder.exists():
        write_server_folder(
            folder, [ServerTable(n, DType.FP32, w, "keyed") for n, w in widths.items()]
        )
        return folder
    held = {e["name"]: e for e in read_manifest(folder)["tables"]}
    for name, width in widths.items():
        e = held.get(name)
        if e is None or e["partition"] != "keyed" or e["dtype"] != "fp32" or e["dim"] != width:
            raise ValueError(
                f"{folder} exists without a keyed fp32 table {name!r} of width {width} "
                "(use a new folder)"
            )
    return folder


@dataclass
class MovedRows:
    """Rows moved between the working tables and the store since construction."""

    evicted: int = 0
    """Rows (with state) written to the store."""
    restored: int = 0
    """Rows (with state) read back from it."""
    fresh: int = 0
    """Admitted ids the store did not hold (initialised)."""


class KernelTables(Protocol):
    """What hashed tables need of the tables that train them: fbgemm's one-process
    :class:`TrainableTables`, or TorchRec's DMP over ranks (``retrieval/training/dmp_tables``)."""

    @property
    def table_of(self) -> Mapping[str, str]: ...

    def __call__(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def validate(self, features: Mapping[str, torch.Tensor]) -> None: ...

    def table_rows(self) -> dict[str, int | None]: ...

    def table_shapes(self) -> dict[str, tuple[int, int]]: ...

    def float_weights(self) -> dict[str, torch.Tensor]: ...

    def load_float(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def local_table(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """Live views of a whole table's rows ``[rows, D]`` and optimizer state (``[rows]`` or
        ``[rows, D]`` each) where this process holds it; None where another rank does."""
        ...

    def owner_rank(self, name: str) -> int:
        """The rank holding the whole table (0 in one process)."""
        ...

    def working_state(self) -> dict[str, Any] | None:
        """Rows and optimizer state to checkpoint with the hashed tables (None: checkpointed
        by ``torch.distributed.checkpoint`` instead)."""
        ...

    def load_working_state(self, state: dict[str, Any] | None) -> None: ...


class HashedTrainingTables(TableHooks, nn.Module):
    """Kernel tables whose ``hashed`` tables take raw ids (see the module doc).

    Args:
        inner: the kernel tables; each hashed table has ``capacity`` rows there, whole on one
            rank when sharded (table-wise).
        hashed: ``{table: HashedTable}``.
        store: the servers' client, holding :func:`store_tables` for every hashed table.
        init_std: scale of a fresh row (uniform, the same standard deviation).
        seed: seed of fresh rows and of the transformers' sketches.

    Under torchrun (a process group of several ranks) every rank gathers the batch's distinct
    raw ids of all ranks and runs the same transformer on them, so every rank maps an id to the
    same working row; only the rank holding a table moves its rows to and from the servers.
    Calls are then collectives: every rank calls :meth:`forward` and :meth:`keyed_rows`.
    """

    inner: KernelTables

    def __init__(
        self,
        inner: KernelTables,
        hashed: Mapping[str, HashedTable],
        store: MarkedStore,
        init_std: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        shapes = inner.table_shapes()
        for name, h in hashed.items():
            if name not in shapes:
                raise ValueError(f"hashed table {name!r} is not one of {sorted(shapes)}")
            if shapes[name][0] != h.capacity:
                raise ValueError(
                    f"hashed table {name!r}: the kernel table has {shapes[name][0]} rows, "
                    f"its capacity is {h.capacity}"
                )
        object.__setattr__(self, "inner", inner)  # no parameters: as TrainableTables keeps it
        self.hashed = dict(hashed)
        self.store = store
        self.scale = init_std * math.sqrt(3.0)  # uniform [-a, a) has std a / sqrt(3)
        self.seed = seed
        self.transformers = {
            t: IdTransformer(h.capacity, h.policy, h.admit_after, seed=seed)
            for t, h in hashed.items()
        }
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.moved = MovedRows()
        """Rows this process moved (the owner of a table moves all of its rows)."""
        self.stats = RemoteStats()

    # ---- the seam ---------------------------------------------------------------------------
    @property
    def table_of(self) -> Mapping[str, str]:
        return self.inner.table_of

    def table_rows(self) -> dict[str, int | None]:
        rows = self.inner.table_rows()
        return {t: (None if t in self.hashed else r) for t, r in rows.items()}

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        return self.inner.table_shapes()

    def validate(self, features: Mapping[str, torch.Tensor]) -> None:
        check_id_features(features, self.inner.table_of, self.table_rows())
        self.inner.validate(self._as_rows_shape(features))

    def _as_rows_shape(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hashed features with every id as padding (for the inner shape check)."""
        return {
            f: ids.new_full(ids.shape, -1) if self.inner.table_of[f] in self.hashed else ids
            for f, ids in features.items()
        }

    def remote_stats(self) -> RemoteStats:
        return self.stats

    def float_weights(self) -> dict[str, torch.Tensor]:
        """Float rows of the plain tables (a collective under torchrun); a hashed table's rows
        are :meth:`keyed_rows`'."""
        w = self.inner.float_weights()
        return {t: rows for t, rows in w.items() if t not in self.hashed}

    def load_float(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        bad = sorted(set(weights) & set(self.hashed))
        if bad:
            raise ValueError(f"tables {bad} are hashed: their rows follow raw ids")
        return self.inner.load_float(weights)

    # ---- lookups ----------------------------------------------------------------------------
    def forward(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Maps hashed features' raw ids to working rows (moving rows to and from the store),
        then pools everything in one kernel call."""
        mapped = dict(features)
        by_table: dict[str, list[str]] = {}
        for f in features:
            t = self.inner.table_of[f]
            if t in self.hashed:
                by_table.setdefault(t, []).append(f)
        for table, feats in by_table.items():
            mats = [features[f] for f in feats]
            present = torch.cat([m[m != -1] for m in mats]).cpu()
            self.stats.ids += present.numel()
            uniq = self._all_ranks(torch.unique(present))  # sorted, the same on every rank
            self.stats.unique += uniq.numel()
            rows = self._admit(table, uniq)[torch.searchsorted(uniq, present)]  # [n], -1: none
            start = 0
            for f, m in zip(feats, mats, strict=True):
                out = m.new_full(m.shape, -1)
                keep = m != -1
                n = int(keep.sum())
                out[keep] = rows[start : start + n].to(m.device)
                start += n
                mapped[f] = out
        return self.inner(mapped)

    def _all_ranks(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's distinct ids ``[u]`` -> every rank's, distinct and sorted."""
        if self.world == 1:
            return ids
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([len(ids)]))
        longest = int(max(c.item() for c in counts))
        padded = torch.full((longest,), -1, dtype=torch.int64)
        padded[: len(ids)] = ids
        parts = [torch.empty(longest, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        every = torch.cat([p[: int(c.item())] for p, c in zip(parts, counts, strict=True)])
        return torch.unique(every)

    @torch.no_grad()
    def _admit(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """``ids int64 [U]`` distinct -> working rows ``[U]`` (-1: not admitted); the rank
        holding ``table`` saves evicted rows and restores admitted ones."""
        r = self.transformers[table].transform(ids)
        local = self.inner.local_table(table)
        if local is None:
            return r.rows
        weight, state = local
        dim = weight.shape[1]
        if len(r.evicted_ids):  # saved before the admitted ids below take their rows
            at = r.evicted_rows.to(weight.device)
            packed = pack_rows(_join(weight[at], state, at), DType.FP32).cpu()
            self.store.put(table, r.evicted_ids, packed)
            self.moved.evicted += len(r.evicted_ids)
        if len(r.admitted_ids):
            at = r.admitted_rows.to(weight.device)
            packed, found = self.store.get(table, r.admitted_ids)
            self.stats.fetched += int(found.sum())
            stored = unpack_rows(packed, DType.FP32, dim + _width(state, dim))  # [a, D + S]
            fresh = hashed_uniform(r.admitted_ids, dim, self.scale, self.seed)
            rows = torch.where(found[:, None], stored[:, :dim], fresh)
            weight[at] = rows.to(weight.device)
            for s in state.values():  # one state tensor at most (Adagrad's sum)
                saved = stored[:, dim:].reshape(len(at), *s.shape[1:])
                s[at] = torch.where(_expand(found, saved), saved, 0.0).to(s.device, s.dtype)
            self.moved.restored += int(found.sum())
            self.moved.fresh += int((~found).sum())
        return r.rows

    # ---- rows out -----------------------------------------------------------------------------
    @torch.no_grad()
    def export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every trained row of a hashed table -> ``(ids int64 [n], rows float32 [n, D])``
        (the store's rows, the working table's over them), sorted by id. Only where the table
        is held (:meth:`keyed_rows` hands them to every rank)."""
        local = self.inner.local_table(table)
        if local is None:
            raise ValueError(
                f"hashed table {table!r} is held by rank {self.inner.owner_rank(table)}"
            )
        weight, state = local
        dim = weight.shape[1]
        held, slots = self.transformers[table].map.keys_and_slots()
        stored = self.store.keys(table)
        away = stored[~torch.isin(stored, held)]
        parts_ids, parts_rows = [held], [weight[slots.to(weight.device)].cpu()]
        width = dim + _width(state, dim)
        for lo in range(0, len(away), EXPORT_CHUNK):
            ids = away[lo : lo + EXPORT_CHUNK]
            packed, _ = self.store.get(table, ids)
            parts_ids.append(ids)
            parts_rows.append(unpack_rows(packed, DType.FP32, width)[:, :dim])
        ids, rows = torch.cat(parts_ids), torch.cat(parts_rows)
        order = torch.argsort(ids)
        return ids[order], rows[order]

    def keyed_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`export` of every hashed table, on every rank (a collective under torchrun)."""
        out = {}
        for t in self.hashed:
            owner = self.inner.owner_rank(t)
            box = [self.export(t) if self.rank == owner else None]
            if self.world > 1:
                dist.broadcast_object_list(box, src=owner)
            assert box[0] is not None
            out[t] = box[0]
        return out

    def clear_store(self) -> None:
        """Empties the store's tables (their logs cut to nothing): a fresh run's start."""
        self._on_one_rank(lambda: [self.store.rewind(t, dict.fromkeys(self.store.marks(t), 0))
                                   for t in self.hashed])  # fmt: skip

    def _on_one_rank(self, work: Callable[[], object]) -> None:
        """Runs ``work`` on rank 0 while the others wait (store writes no rank may race)."""
        if self.rank == 0:
            work()
        if self.world > 1:
            dist.barrier()

    # ---- checkpoints ------------------------------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        """The working tables (rows, optimizer state: unless the kernel checkpoints them
        itself), the transformers and the store's marks: a snapshot (copies)."""
        return {
            "tables": self.inner.working_state(),
            "transformers": {t: x.state_dict() for t, x in self.transformers.items()},
            "marks": {t: self.store.marks(t) for t in self.hashed},
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Loads a snapshot and rewinds the store's tables to its marks."""
        if set(state["marks"]) != set(self.hashed):
            raise ValueError(
                f"saved hashed tables {sorted(state['marks'])} differ from {sorted(self.hashed)}"
            )
        self._on_one_rank(
            lambda: [self.store.rewind(t, marks) for t, marks in state["marks"].items()]
        )
        self.inner.load_working_state(state["tables"])
        for t, saved in state["transformers"].items():
            self.transformers[t].load_state_dict(saved)


def _width(state: Mapping[str, torch.Tensor], dim: int) -> int:
    """State floats per row: ``sum [rows]`` -> 1, ``sum [rows, D]`` -> D, none -> 0."""
    return sum(1 if s.dim() == 1 else dim for s in state.values())


def _join(rows: torch.Tensor, state: Mapping[str, torch.Tensor], at: torch.Tensor) -> torch.Tensor:
    """``rows [m, D]`` and the state rows ``at [m]`` -> ``[m, D + S]`` float32."""
    parts = [rows] + [s[at].reshape(len(at), -1).float() for s in state.values()]
    return torch.cat(parts, dim=1)


def _expand(found: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``found [a]`` broadcast to ``like [a, ...]``."""
    return found.view(-1, *([1] * (like.dim() - 1))).expand_as(like)
