"""The dataset type every part reads: catalog attributes, user features, timed interactions.

Dimensions: M interactions, U users, N items, V values of a multi-valued attribute, F dense
user features. Ids are dense: users ``0..U-1``, items ``0..N-1``.

Example::

    ds = RecDataset(
        name="tiny", num_users=2, num_items=3,
        item_attributes={"genre": np.array([[1, 0], [0, 1], [1, 1]], bool),   # [N, V] multi
                         "available": np.array([1, 1, 0])},                   # [N] codes
        attribute_values={"genre": ["Comedy", "Drama"], "available": ["false", "true"]},
        user_features={"region": np.array([0, 1])}, user_feature_sizes={"region": 2},
        user_dense=np.zeros((2, 1), np.float32),
        interactions=Interactions(np.array([0, 1]), np.array([2, 0]), np.array([10, 20])),
    )
    ds.validate()

On disk (:func:`write_parquet`, :func:`read_parquet`), one folder:

* ``items.parquet``: ``item_id``, ``item_name`` (when names exist), one column per attribute
  (int64 codes, or ``list<int64>`` of value codes for a multi-valued attribute);
* ``users.parquet``: ``user_id``, one int64 column per categorical feature, ``dense_0..F-1``;
* ``interactions.parquet``: ``user_id``, ``item_id``, ``timestamp`` (int64), optionally
  ``value`` (float32);
* ``meta.json``: name, sizes, vocabularies, key orders;
* ``user_ids.parquet``, ``item_ids.parquet`` (when the data has raw ids, ``ids``): the raw id of
  each dense id (``retrieval/data/id_map.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retrieval.data.id_map import IdMaps

FORMAT_VERSION = 1
META_FILE = "meta.json"
"""The file that makes a folder a data set folder (written last by :func:`write_parquet`)."""


@dataclass
class Interactions:
    """M timed (user, item) events, in no particular order.

    user_id: ``[M] int64`` in ``[0, U)``.
    item_id: ``[M] int64`` in ``[0, N)``.
    timestamp: ``[M] int64`` seconds.
    value: ``[M] float32`` what the event was worth (a rating, a watch fraction), or None: what
    per-task labels such as ``value>=4`` read (``retrieval/training/task_labels.py``).
    """

    user_id: np.ndarray
    item_id: np.ndarray
    timestamp: np.ndarray
    value: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.user_id.shape[0])

    def select(self, mask_or_index: np.ndarray) -> Interactions:
        """The rows picked by a bool mask ``[M]`` or an index array ``[M']``."""
        return Interactions(
            self.user_id[mask_or_index],
            self.item_id[mask_or_index],
            self.timestamp[mask_or_index],
            None if self.value is None else self.value[mask_or_index],
        )

    def validate(self, num_users: int | None = None, num_items: int | None = None) -> None:
        """Raises ``ValueError`` naming the field: 1-d int64 arrays of one length, ids in range."""
        m = None
        for field in ("user_id", "item_id", "timestamp"):
            arr = getattr(self, field)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.int64:
                raise ValueError(f"interactions.{field}: expected int64 [M], got {_describe(arr)}")
            if m is not None and arr.shape[0] != m:
                raise ValueError(f"interactions.{field}: has {arr.shape[0]} rows, user_id has {m}")
            m = arr.shape[0]
        if self.value is not None and (
            not isinstance(self.value, np.ndarray)
            or self.value.shape != (m,)
            or not np.issubdtype(self.value.dtype, np.floating)
        ):
            raise ValueError(
                f"interactions.value: expected float [{m}], got {_describe(self.value)}"
            )
        for field, bound in (("user_id", num_users), ("item_id", num_items)):
            arr = getattr(self, field)
            if arr.size and arr.min() < 0:
                raise ValueError(f"interactions.{field}: negative id {int(arr.min())}")
            if bound is not None and arr.size and arr.max() >= bound:
                raise ValueError(f"interactions.{field}: id {int(arr.max())} is not below {bound}")


@dataclass
class RecDataset:
    """A catalog of N items, U users and their M interactions.

    item_attributes: per attribute, single-valued int64 codes ``[N]`` or multi-valued
        bool ``[N, V]`` (e.g. genres); both index ``attribute_values[attr]``.
    attribute_values: vocabulary per attribute, value code -> string; boolean attributes use
        ``["false", "true"]``. Same keys as ``item_attributes``.
    user_features: categorical int64 codes ``[U]`` per feature.
    user_feature_sizes: vocabulary size per user feature. Same keys as ``user_features``.
    user_dense: ``[U, F] float32``, roughly standardized.
    interactions: the event log (see :class:`Interactions`).
    item_names: ``N`` display names, or None.
    ids: the raw (the user's own) id of every dense user and item id, or None (dense ids are
        the only ids: generated and MovieLens data).
    """

    name: str
    num_users: int
    num_items: int
    item_attributes: dict[str, np.ndarray]
    attribute_values: dict[str, list[str]]
    user_features: dict[str, np.ndarray]
    user_feature_sizes: dict[str, int]
    user_dense: np.ndarray
    interactions: Interactions
    item_names: list[str] | None = None
    ids: IdMaps | None = None

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first field with a wrong shape, dtype or range."""
        if not isinstance(self.name, str):
            raise ValueError(f"name: expected str, got {type(self.name).__name__}")
        for field in ("num_users", "num_items"):
            value = getattr(self, field)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field}: expected an int >= 0, got {value!r}")
        _check_same_keys(
            "item_attributes", self.item_attributes, "attribute_values", self.attribute_values
        )
        for attr, vocab in self.attribute_values.items():
            _check_vocab(f"attribute_values[{attr!r}]", vocab)
            _check_attribute(
                f"item_attributes[{attr!r}]", self.item_attributes[attr], self.num_items, len(vocab)
            )
        _check_same_keys(
            "user_features", self.user_features, "user_feature_sizes", self.user_feature_sizes
        )
        for feat, size in self.user_feature_sizes.items():
            if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
                raise ValueError(
                    f"user_feature_sizes[{feat!r}]: expected an int >= 1, got {size!r}"
                )
            _check_codes(
                f"user_features[{feat!r}]", self.user_features[feat], self.num_users, int(size)
            )
        dense = self.user_dense
        if not isinstance(dense, np.ndarray) or dense.ndim != 2 or dense.dtype != np.float32:
            raise ValueError(f"user_dense: expected float32 [U, F], got {_describe(dense)}")
        if dense.shape[0] != self.num_users:
            raise ValueError(f"user_dense: has {dense.shape[0]} rows, expected U={self.num_users}")
        if not np.isfinite(dense).all():
            raise ValueError("user_dense: has NaN or infinite values")
        self.interactions.validate(self.num_users, self.num_items)
        if self.item_names is not None:
            if len(self.item_names) != self.num_items:
                raise ValueError(
                    f"item_names: expected N={self.num_items} names, got {len(self.item_names)}"
                )
            if not all(isinstance(s, str) for s in self.item_names):
                raise ValueError("item_names: every name must be a str")
        if self.ids is not None:
            self.ids.check_sizes(self.num_users, self.num_items, "ids")

    def display_names(self) -> list[str]:
        """``N`` names to show: the item's name, else its raw id, else ``"item <id>"``."""
        raw = self.ids.items.raw.to_pylist() if self.ids is not None else None
        names = self.item_names or [""] * self.num_items
        return [
            name or (str(raw[i]) if raw is not None else f"item {i}")
            for i, name in enumerate(names)
        ]


def is_multi_valued(arr: np.ndarray) -> bool:
    """True for a multi-valued attribute (bool ``[N, V]``), False for codes ``[N]``."""
    return arr.ndim == 2


def _describe(arr: object) -> str:
    if isinstance(arr, np.ndarray):
        return f"{arr.dtype} {list(arr.shape)}"
    return type(arr).__name__


def _check_same_keys(name_a: str, a: dict, name_b: str, b: dict) -> None:
    if missing := [k for k in a if k not in b]:
        raise ValueError(f"{name_b}: no entry for {missing} (present in {name_a})")
    if extra := [k for k in b if k not in a]:
        raise ValueError(f"{name_a}: no entry for {extra} (present in {name_b})")


def _check_vocab(field: str, vocab: object) -> None:
    if not isinstance(vocab, list) or not all(isinstance(v, str) for v in vocab):
        raise ValueError(f"{field}: expected a list of str")
    if len(set(vocab)) != len(vocab):
        raise ValueError(f"{field}: has duplicate values")


def _check_codes(field: str, arr: object, rows: int, size: int) -> None:
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.int64:
        raise ValueError(f"{field}: expected int64 codes [{rows}], got {_describe(arr)}")
    if arr.shape[0] != rows:
        raise ValueError(f"{field}: has {arr.shape[0]} rows, expected {rows}")
    if arr.size and (arr.min() < 0 or arr.max() >= size):
        raise ValueError(f"{field}: codes must be in [0, {size}), got [{arr.min()}, {arr.max()}]")


def _check_attribute(field: str, arr: object, num_items: int, vocab: int) -> None:
    if isinstance(arr, np.ndarray) and arr.ndim == 2:
        if arr.dtype != np.bool_ or arr.shape != (num_items, vocab):
            raise ValueError(
                f"{field}: multi-valued attributes are bool [N={num_items}, V={vocab}], "
                f"got {_describe(arr)}"
            )
        return
    _check_codes(field, arr, num_items, vocab)


def write_parquet(ds: RecDataset, directory: Path) -> Path:
    """Validates ``ds`` and writes it into ``directory`` (created if needed); returns it."""
    ds.validate()
    for attr in ds.item_attributes:
        if attr in ("item_id", "item_name"):
            raise ValueError(f"item_attributes[{attr!r}]: the name is reserved for a column")
    for feat in ds.user_features:
        if feat == "user_id" or feat.startswith("dense_"):
            raise ValueError(f"user_features[{feat!r}]: the name is reserved for a column")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    items: dict[str, pa.Array] = {"item_id": pa.array(np.arange(ds.num_items, dtype=np.int64))}
    if ds.item_names is not None:
        items["item_name"] = pa.array(ds.item_names, pa.string())
    for attr, arr in ds.item_attributes.items():
        if is_multi_valued(arr):
            offsets = np.r_[0, np.cumsum(arr.sum(axis=1))].astype(np.int32)  # [N + 1]
            codes = np.nonzero(arr)[1].astype(np.int64)  # row-major: each row's codes ascending
            items[attr] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(codes))
        else:
            items[attr] = pa.array(arr)
    pq.write_table(pa.table(items), directory / "items.parquet")

    users: dict[str, pa.Array] = {"user_id": pa.array(np.arange(ds.num_users, dtype=np.int64))}
    users.update({feat: pa.array(arr) for feat, arr in ds.user_features.items()})
    users.update(
        {f"dense_{j}": pa.array(ds.user_dense[:, j]) for j in range(ds.user_dense.shape[1])}
    )
    pq.write_table(pa.table(users), directory / "users.parquet")

    it = ds.interactions
    columns = {"user_id": it.user_id, "item_id": it.item_id, "timestamp": it.timestamp}
    if it.value is not None:
        columns["value"] = it.value
    table = pa.table(columns)
    pq.write_table(table, directory / "interactions.parquet")

    meta = {
        "format_version": FORMAT_VERSION,
        "name": ds.name,
        "num_users": int(ds.num_users),
        "num_items": int(ds.num_items),
        "item_attributes": list(ds.item_attributes),  # key orders survive the round trip
        "multi_valued": [a for a, arr in ds.item_attributes.items() if is_multi_valued(arr)],
        "attribute_values": ds.attribute_values,
        "user_features": list(ds.user_features),
        "user_feature_sizes": {k: int(v) for k, v in ds.user_feature_sizes.items()},
        "dense_dim": int(ds.user_dense.shape[1]),
        "has_item_names": ds.item_names is not None,
    }
    if ds.ids is not None:
        ds.ids.write(directory)
    (directory / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return directory


def read_parquet(directory: Path) -> RecDataset:
    """Reads a folder written by :func:`write_parquet` and validates the result."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{directory}: no meta.json (not a folder written by write_parquet)"
        )
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"meta.json: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    n, u = int(meta["num_items"]), int(meta["num_users"])
    items = _read_table(directory / "items.parquet")
    users = _read_table(directory / "users.parquet")
    inter = _read_table(directory / "interactions.parquet")
    _check_ids(items, "items.parquet", "item_id", n)
    _check_ids(users, "users.parquet", "user_id", u)

    attrs: dict[str, np.ndarray] = {}
    for attr in meta["item_attributes"]:
        vocab = meta["attribute_values"][attr]
        col = _column(items, "items.parquet", attr)
        if attr not in meta["multi_valued"]:
            attrs[attr] = _ints(col)
            continue
        lengths = _ints(pc.list_value_length(col))  # [N]
        codes = _ints(pc.list_flatten(col))  # [sum(lengths)]
        if codes.size and (codes.min() < 0 or codes.max() >= len(vocab)):
            raise ValueError(
                f"items.parquet: column {attr!r} has value codes outside [0, {len(vocab)})"
            )
        matrix = np.zeros((n, len(vocab)), dtype=bool)
        matrix[np.repeat(np.arange(n), lengths), codes] = True
        attrs[attr] = matrix
    names = (
        _column(items, "items.parquet", "item_name").to_pylist() if meta["has_item_names"] else None
    )

    feats = {f: _ints(_column(users, "users.parquet", f)) for f in meta["user_features"]}
    dense = np.zeros((u, meta["dense_dim"]), dtype=np.float32)
    for j in range(meta["dense_dim"]):
        dense[:, j] = _column(users, "users.parquet", f"dense_{j}").to_numpy()

    ds = RecDataset(
        name=meta["name"],
        num_users=u,
        num_items=n,
        item_attributes=attrs,
        attribute_values={a: list(v) for a, v in meta["attribute_values"].items()},
        user_features=feats,
        user_feature_sizes={k: int(v) for k, v in meta["user_feature_sizes"].items()},
        user_dense=dense,
        interactions=Interactions(
            user_id=_ints(_column(inter, "interactions.parquet", "user_id")),
            item_id=_ints(_column(inter, "interactions.parquet", "item_id")),
            timestamp=_ints(_column(inter, "interactions.parquet", "timestamp")),
            value=(
                np.asarray(inter["value"].to_numpy(), dtype=np.float32)
                if "value" in inter.column_names
                else None
            ),
        ),
        item_names=names,
        ids=IdMaps.read(directory),
    )
    ds.validate()
    return ds


def _read_table(path: Path) -> pa.Table:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return pq.read_table(path)


def _column(table: pa.Table, file: str, name: str) -> pa.ChunkedArray:
    if name not in table.column_names:
        raise ValueError(f"{file}: no column {name!r}")
    return table.column(name)


def _ints(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(col.to_numpy(), dtype=np.int64)


def _check_ids(table: pa.Table, file: str, column: str, count: int) -> None:
    ids = _ints(_column(table, file, column))
    if not np.array_equal(ids, np.arange(count)):
        raise ValueError(f"{file}: column {column!r} must be 0..{count - 1} in order")
