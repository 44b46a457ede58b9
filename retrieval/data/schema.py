"""The dataset type every part reads: catalog attributes, user features, timed interactions.

Parquet layout of :func:`write_parquet` (one folder): ``items.parquet`` (item_id + one column per
attribute: int codes, or a list of value codes for multi-valued attributes), ``users.parquet``
(user_id, categorical codes, ``dense_<j>`` columns), ``interactions.parquet`` (user_id, item_id,
timestamp) and ``meta.json`` (name, sizes, vocabularies, item names).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


@dataclass
class Interactions:
    """M timed (user, item) events: ``user_id``, ``item_id``, ``timestamp`` are ``[M] int64``."""

    user_id: np.ndarray
    item_id: np.ndarray
    timestamp: np.ndarray

    def __len__(self) -> int:
        return int(self.user_id.shape[0])

    def select(self, rows: np.ndarray) -> Interactions:
        """A subset by boolean mask or index array."""
        return Interactions(self.user_id[rows], self.item_id[rows], self.timestamp[rows])


@dataclass
class RecDataset:
    """A catalog of N items, U users and their interactions.

    item_attributes: single-valued -> int64 codes ``[N]``; multi-valued -> bool ``[N, V]``.
    attribute_values: vocabulary per attribute (boolean attributes use ``["false", "true"]``).
    user_features: categorical codes ``[U] int64``, vocabulary sizes in ``user_feature_sizes``.
    user_dense: ``[U, F_dense] float32``, roughly standardized.
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

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first inconsistent field."""
        n, u = self.num_items, self.num_users
        for name, arr in self.item_attributes.items():
            vocab = self.attribute_values.get(name)
            if vocab is None:
                raise ValueError(f"attribute_values[{name!r}] is missing")
            if arr.ndim == 1:
                if arr.shape != (n,) or (arr.size and (arr.min() < 0 or arr.max() >= len(vocab))):
                    raise ValueError(f"item_attributes[{name!r}]: expected codes [N={n}] in [0, {len(vocab)})")
            elif arr.shape != (n, len(vocab)) or arr.dtype != bool:
                raise ValueError(f"item_attributes[{name!r}]: expected bool [N={n}, V={len(vocab)}], got {arr.dtype} {arr.shape}")
        for name, arr in self.user_features.items():
            size = self.user_feature_sizes.get(name)
            if size is None:
                raise ValueError(f"user_feature_sizes[{name!r}] is missing")
            if arr.shape != (u,) or (arr.size and (arr.min() < 0 or arr.max() >= size)):
                raise ValueError(f"user_features[{name!r}]: expected codes [U={u}] in [0, {size})")
        if self.user_dense.ndim != 2 or self.user_dense.shape[0] != u:
            raise ValueError(f"user_dense: expected [U={u}, F], got {self.user_dense.shape}")
        it = self.interactions
        if not (it.user_id.shape == it.item_id.shape == it.timestamp.shape) or it.user_id.ndim != 1:
            raise ValueError("interactions: user_id, item_id and timestamp must be [M] each")
        if len(it) and (it.user_id.min() < 0 or it.user_id.max() >= u):
            raise ValueError(f"interactions.user_id: must be in [0, {u})")
        if len(it) and (it.item_id.min() < 0 or it.item_id.max() >= n):
            raise ValueError(f"interactions.item_id: must be in [0, {n})")
        if self.item_names is not None and len(self.item_names) != n:
            raise ValueError(f"item_names: expected {n} names, got {len(self.item_names)}")


def write_parquet(ds: RecDataset, directory: Path) -> Path:
    """Writes ``ds`` as parquet + ``meta.json`` into ``directory``."""
    ds.validate()
    directory.mkdir(parents=True, exist_ok=True)
    items: dict[str, object] = {"item_id": np.arange(ds.num_items)}
    for name, arr in ds.item_attributes.items():
        items[name] = arr if arr.ndim == 1 else pa.array([np.flatnonzero(r).tolist() for r in arr], pa.list_(pa.int64()))
    pq.write_table(pa.table(items), directory / "items.parquet")
    users: dict[str, object] = {"user_id": np.arange(ds.num_users), **ds.user_features}
    users.update({f"dense_{j}": ds.user_dense[:, j] for j in range(ds.user_dense.shape[1])})
    pq.write_table(pa.table(users), directory / "users.parquet")
    it = ds.interactions
    pq.write_table(pa.table({"user_id": it.user_id, "item_id": it.item_id, "timestamp": it.timestamp}),
                   directory / "interactions.parquet")
    meta = {"name": ds.name, "num_users": ds.num_users, "num_items": ds.num_items,
            "attribute_values": ds.attribute_values, "user_feature_sizes": ds.user_feature_sizes,
            "multi_valued": [n for n, a in ds.item_attributes.items() if a.ndim == 2],
            "dense_dim": int(ds.user_dense.shape[1]), "item_names": ds.item_names}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def read_parquet(directory: Path) -> RecDataset:
    """Reads a folder written by :func:`write_parquet`."""
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory}: no meta.json (not a dataset folder written by write_parquet)")
    meta = json.loads(meta_path.read_text())
    items = pq.read_table(directory / "items.parquet")
    n = meta["num_items"]
    attrs: dict[str, np.ndarray] = {}
    for name, vocab in meta["attribute_values"].items():
        col = items.column(name)
        if name in meta["multi_valued"]:
            m = np.zeros((n, len(vocab)), dtype=bool)
            for row, vals in enumerate(col.to_pylist()):
                m[row, vals] = True
            attrs[name] = m
        else:
            attrs[name] = col.to_numpy().astype(np.int64)
    users = pq.read_table(directory / "users.parquet")
    feats = {k: users.column(k).to_numpy().astype(np.int64) for k in meta["user_feature_sizes"]}
    dense = np.stack([users.column(f"dense_{j}").to_numpy() for j in range(meta["dense_dim"])], axis=1)
    it = pq.read_table(directory / "interactions.parquet")
    ds = RecDataset(
        meta["name"], meta["num_users"], n, attrs, meta["attribute_values"], feats,
        meta["user_feature_sizes"], dense.astype(np.float32).reshape(meta["num_users"], meta["dense_dim"]),
        Interactions(*(it.column(c).to_numpy().astype(np.int64) for c in ("user_id", "item_id", "timestamp"))),
        meta["item_names"],
    )
    ds.validate()
    return ds
