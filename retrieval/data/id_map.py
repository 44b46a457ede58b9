"""Raw ids <-> dense ids: the user's own ids (strings or integers) and the model's ``0..N-1``.

An :class:`IdMap` holds the raw id of every dense id (row ``i`` of ``raw`` is dense id ``i``);
:class:`IdMaps` pairs the users' and the items' maps. Both directions are vectorised, so a front
end maps a whole batch at once::

    items = IdMap.from_values("item_id", pa.array(["sku-9", "sku-1", "sku-9"]))
    items.raw.to_pylist()                       # ['sku-1', 'sku-9']  (dense 0, 1)
    items.to_dense(pa.array(["sku-9"]))         # array([1])          [B] int64
    items.lookup(["sku-9", "nope"])             # array([ 1, -1])     unknown -> -1
    items.to_raw_lists(np.array([[1, 0, -1]]))  # [["sku-9", "sku-1", None]]  [B] lists of K

On disk (:meth:`IdMaps.write`, :meth:`IdMaps.read`): ``user_ids.parquet`` and ``item_ids.parquet``,
one column ``raw_id`` (int64 or string), row ``i`` = dense id ``i``. The imported data set folder
(``retrieval/data/importer.py``) and the model folder (``retrieval/artifact.py``) both hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import torch

USER_IDS_FILE = "user_ids.parquet"
ITEM_IDS_FILE = "item_ids.parquet"
RAW_COLUMN = "raw_id"

RawValues: TypeAlias = pa.Array | pa.ChunkedArray | np.ndarray | Sequence[int] | Sequence[str]
"""A batch of raw ids ``[B]``: an arrow array, a numpy array or a list."""


def is_id_type(t: pa.DataType) -> bool:
    """The arrow types raw ids may have: integers or strings."""
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


@dataclass(frozen=True)
class IdMap:
    """One kind of id (``name``: ``user_id`` or ``item_id``, used in messages).

    raw: ``[N]`` int64 or string arrow array, unique, no nulls; ``raw[i]`` is dense id ``i``.
    """

    name: str
    raw: pa.Array
    _sorted: np.ndarray = field(init=False, repr=False, compare=False)
    """``raw`` in ascending order ``[N]`` (int64, or object of str)."""
    _order: np.ndarray = field(init=False, repr=False, compare=False)
    """The dense id of each entry of ``_sorted`` ``[N] int64``."""

    def __post_init__(self) -> None:
        raw = self.raw.combine_chunks() if isinstance(self.raw, pa.ChunkedArray) else self.raw
        if pa.types.is_integer(raw.type):
            raw = raw.cast(pa.int64())
        elif pa.types.is_string(raw.type) or pa.types.is_large_string(raw.type):
            raw = raw.cast(pa.string())
        else:
            raise ValueError(f"{self.name}: raw ids must be integers or strings, got {raw.type}")
        if raw.null_count:
            raise ValueError(f"{self.name}: raw ids hold {raw.null_count} nulls")
        values = raw.to_numpy(zero_copy_only=False)
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        dup = np.flatnonzero(ordered[1:] == ordered[:-1])
        if len(dup):
            raise ValueError(f"{self.name}: raw id {ordered[dup[0]]!r} appears twice")
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "_sorted", ordered)
        object.__setattr__(self, "_order", order.astype(np.int64))

    @classmethod
    def from_values(cls, name: str, values: pa.Array | pa.ChunkedArray) -> IdMap:
        """The map of the distinct values of ``values`` ``[M]``, dense ids in ascending raw order."""
        distinct = pc.unique(values)
        return cls(name, distinct.take(pc.array_sort_indices(distinct)))

    def __len__(self) -> int:
        return len(self.raw)

    @property
    def is_int(self) -> bool:
        """True when the raw ids are integers (int64), False for strings."""
        return bool(pa.types.is_integer(self.raw.type))

    def lookup(self, values: RawValues) -> np.ndarray:
        """Raw ids ``[B]`` -> dense ids ``[B] int64``; ``-1`` for an id the map does not know (or
        of the other type: a string never matches an integer map)."""
        query = self._as_query(values)
        if isinstance(query, int):  # a batch of another type: nothing matches
            return np.full(query, -1, dtype=np.int64)
        if not len(self._sorted) or not len(query):
            return np.full(len(query), -1, dtype=np.int64)
        pos = np.searchsorted(self._sorted, query).clip(0, len(self._sorted) - 1)
        found = self._sorted[pos] == query
        return np.where(found, self._order[pos], -1).astype(np.int64)

    def to_dense(self, values: RawValues, where: str = "") -> np.ndarray:
        """Raw ids ``[B]`` -> dense ids ``[B] int64``; ``ValueError`` naming ``where`` (or the
        map), the first unknown id and its position."""
        dense = self.lookup(values)
        missing = np.flatnonzero(dense < 0)
        if missing.size:
            at = int(missing[0])
            shown = _as_list(values)[at]
            raise ValueError(
                f"{where or self.name}: {shown!r} (position {at}) is not a known {self.name} "
                f"({missing.size} unknown of {len(dense)})"
            )
        return dense

    def to_raw(self, dense: np.ndarray | torch.Tensor) -> pa.Array:
        """Dense ids of any shape (``-1``: none) -> their raw ids, flattened ``[B * K]``, null
        where the id is ``-1``."""
        flat = _numpy(dense).astype(np.int64, copy=False).reshape(-1)
        if flat.size and int(flat.max()) >= len(self.raw):
            raise ValueError(f"{self.name}: dense id {int(flat.max())} >= {len(self.raw)}")
        idx = pa.array(flat, mask=flat < 0)
        return self.raw.take(idx)

    def to_raw_lists(self, dense: np.ndarray | torch.Tensor) -> pa.ListArray:
        """An answer ``[B, K]`` of dense ids (``-1`` pads) -> ``[B]`` lists of K raw ids (null
        for a pad, so positions stay aligned with the scores)."""
        arr = _numpy(dense)
        if arr.ndim != 2:
            raise ValueError(f"{self.name}: expected dense ids [B, K], got {list(arr.shape)}")
        b, k = arr.shape
        offsets = pa.array(np.arange(b + 1, dtype=np.int32) * k)  # [B + 1]
        return pa.ListArray.from_arrays(offsets, self.to_raw(arr))

    def _as_query(self, values: RawValues) -> np.ndarray | int:
        """``values`` as a numpy array comparable with ``_sorted``; for a batch of strings asked
        of an integer map, its length (nothing matches)."""
        arr = values if isinstance(values, pa.Array | pa.ChunkedArray) else pa.array(values)
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        if arr.null_count:
            raise ValueError(f"{self.name}: a raw id is null")
        if self.is_int:
            if not pa.types.is_integer(arr.type):
                return len(arr)
            return np.asarray(arr.cast(pa.int64()).to_numpy(), dtype=np.int64)
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
            arr = arr.cast(pa.string())  # integers asked of a string map: their decimal text
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=object)


def _numpy(dense: np.ndarray | torch.Tensor) -> np.ndarray:
    """A numpy view of a numpy array or a (CPU or device) tensor."""
    if hasattr(dense, "detach"):
        return np.asarray(dense.detach().cpu().numpy())
    return np.asarray(dense)


def _as_list(values: RawValues) -> list:
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return values.to_pylist()
    return (
        list(np.asarray(values, dtype=object)) if isinstance(values, np.ndarray) else list(values)
    )


@dataclass(frozen=True)
class IdMaps:
    """The users' and the items' raw ids (see :class:`IdMap`)."""

    users: IdMap
    items: IdMap

    def write(self, directory: Path) -> None:
        """``user_ids.parquet`` + ``item_ids.parquet`` into ``directory`` (which exists)."""
        for m, file in ((self.users, USER_IDS_FILE), (self.items, ITEM_IDS_FILE)):
            pq.write_table(pa.table({RAW_COLUMN: m.raw}), Path(directory) / file)

    @classmethod
    def read(cls, directory: Path) -> IdMaps | None:
        """The maps of ``directory``; None when it has neither file. ``ValueError`` naming the
        file when only one is there or a file is not a map."""
        paths = [Path(directory) / f for f in (USER_IDS_FILE, ITEM_IDS_FILE)]
        present = [p.is_file() for p in paths]
        if not any(present):
            return None
        if not all(present):
            missing = paths[present.index(False)]
            raise ValueError(f"{missing}: missing (the other id map is there)")
        users, items = (
            _read_map(p, name) for p, name in zip(paths, ("user_id", "item_id"), strict=True)
        )
        return cls(users, items)

    def check_sizes(self, num_users: int, num_items: int, where: str) -> None:
        """Refuses maps whose lengths are not the data's or model's ``U`` / ``N``."""
        for m, n in ((self.users, num_users), (self.items, num_items)):
            if len(m) != n:
                raise ValueError(f"{where}: the {m.name} map has {len(m)} ids, expected {n}")


def _read_map(path: Path, name: str) -> IdMap:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"{path}: cannot read as parquet: {e}") from None
    if RAW_COLUMN not in table.column_names:
        raise ValueError(f"{path}: no column {RAW_COLUMN!r}")
    try:
        return IdMap(name, table.column(RAW_COLUMN).combine_chunks())
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
