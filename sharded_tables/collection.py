"""A keyed collection of pooled embedding tables (the interface the towers call).

Each feature is a padded id matrix ``[B, L] int64`` with ``-1`` for "no id"; its table pools the
present ids (mean or sum) into ``[B, D]``. Several features may share one table (the item table
is read both by the user's history and by the item tower).

Example::

    tables = EmbeddingCollection([TableConfig("item", 1682, 32, features=("history", "item_id"))])
    out = tables({"history": torch.tensor([[3, 7, -1]]), "item_id": torch.tensor([[5]])})
    out["history"].shape  # (1, 32): mean of rows 3 and 7
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from sharded_tables.interface import TableHooks
from sharded_tables.keyed_bag import KeyedBag
from sharded_tables.pooled_lookup import pooled_lookup


@dataclass(frozen=True)
class TableConfig:
    """One embedding table."""

    name: str
    num_embeddings: int
    """Rows (ids must be in ``[0, num_embeddings)``)."""
    dim: int
    features: tuple[str, ...] = field(default_factory=tuple)
    """Feature names that read this table (default: the table's own name)."""
    pooling: str = "mean"
    """"mean" or "sum" over a feature's ids."""
    hashed: bool = False
    """Ids are raw 64-bit keys (any int64, -1 pads); ``num_embeddings`` is the working rows
    of training (:mod:`sharded_tables.hashed_training`)."""

    def feature_names(self) -> tuple[str, ...]:
        return self.features or (self.name,)


def check_id_features(
    features: Mapping[str, torch.Tensor],
    table_of: Mapping[str, str],
    rows: Mapping[str, int | None],
) -> None:
    """The edge check every table collection runs: known features, ``int64 [B, L]`` ids, and
    ids in ``[0, rows)`` or ``-1`` (padding); ``rows[table] = None`` means raw hashed ids (any
    value). Raises ``ValueError`` naming the feature, its table and the first bad id."""
    for name, ids in features.items():
        if name not in table_of:
            raise ValueError(f"unknown feature {name!r} (known: {sorted(table_of)})")
        if ids.dim() != 2 or ids.dtype != torch.int64:
            raise ValueError(
                f"feature {name!r}: expected int64 [B, L], got {ids.dtype} {tuple(ids.shape)}"
            )
        table = table_of[name]
        n = rows[table]
        if n is None or not ids.numel() or _within(ids, n):
            continue
        bad = ids[(ids < -1) | (ids >= n)]
        if bad.numel():
            raise ValueError(
                f"feature {name!r}: id {int(bad[0])} is out of range for table {table!r} "
                f"(rows 0..{n - 1}, -1 for padding)"
            )


def _within(ids: torch.Tensor, rows: int) -> bool:
    """Every id in ``[-1, rows)``: two NumPy reductions on the CPU (a torch mask and gather
    per feature cost a served request more in dispatch than the lookup), one ``aminmax``
    elsewhere."""
    if ids.device.type == "cpu":
        a = ids.numpy()
        return bool(a.min() >= -1 and a.max() < rows)
    lo, hi = torch.aminmax(ids)
    return bool(lo >= -1) and bool(hi < rows)


class EmbeddingCollection(TableHooks, nn.Module):
    """Pooled lookups for many features: ``{feature: ids [B, L]} -> {feature: [B, D]}``
    (a :class:`~sharded_tables.interface.TableCollection`)."""

    def __init__(self, tables: list[TableConfig], init_std: float = 0.05):
        super().__init__()
        self.configs = {t.name: t for t in tables}
        self.tables = nn.ModuleDict()
        self.table_of: dict[str, str] = {}
        for t in tables:
            if t.pooling not in ("mean", "sum"):
                raise ValueError(
                    f"table {t.name!r}: pooling must be 'mean' or 'sum', got {t.pooling!r}"
                )
            if t.hashed:  # rows arrive from training (load_keyed)
                self.tables[t.name] = KeyedBag(t.dim)
            else:
                bag = nn.EmbeddingBag(t.num_embeddings, t.dim, mode="sum")
                nn.init.normal_(bag.weight, std=init_std)
                self.tables[t.name] = bag
            for f in t.feature_names():
                if f in self.table_of:
                    raise ValueError(f"feature {f!r} is assigned to two tables")
                self.table_of[f] = t.name
        self._hashed = frozenset(t.name for t in tables if t.hashed)

    def bags(self) -> dict[str, nn.EmbeddingBag]:
        """``{table: its nn.EmbeddingBag}`` (weights ``[rows, D]``)."""
        return {name: bag for name, bag in self.tables.items() if isinstance(bag, nn.EmbeddingBag)}

    def keyed(self) -> dict[str, KeyedBag]:
        """``{table: its KeyedBag}`` of the hashed tables."""
        return {name: t for name, t in self.tables.items() if isinstance(t, KeyedBag)}

    def keyed_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{hashed table: (keys int64 [n], rows [n, D])}``, sorted by key."""
        return {name: (t.keys, t.rows) for name, t in self.keyed().items()}

    def load_keyed(
        self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Takes ``{hashed table: (keys, rows)}`` (what training exports); -> ``{}``."""
        keyed = self.keyed()
        for name, (keys, values) in rows.items():
            if name not in keyed:
                raise ValueError(f"{name!r} is not a hashed table (hashed: {sorted(keyed)})")
            keyed[name].load(keys, values)
        return {}

    def table_rows(self) -> dict[str, int | None]:
        """Rows of each table (ids must be in ``[0, rows)``); None for a hashed table."""
        return {
            name: None if cfg.hashed else cfg.num_embeddings for name, cfg in self.configs.items()
        }

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        """``{table: (rows, D)}``."""
        return {name: (cfg.num_embeddings, cfg.dim) for name, cfg in self.configs.items()}

    def float_weights(self) -> dict[str, torch.Tensor]:
        """``{table: rows [rows, D]}``: the live weights, detached (writing writes the table)."""
        return {name: bag.weight.detach() for name, bag in self.bags().items()}

    @torch.no_grad()
    def load_float(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies float rows ``{table: [rows, D]}`` into the named tables (others unchanged);
        -> ``{}`` (no table lives on embedding servers)."""
        bags = self.bags()
        for name, w in weights.items():
            if name not in bags:
                raise ValueError(f"unknown table {name!r} (known: {sorted(bags)})")
            if tuple(w.shape) != tuple(bags[name].weight.shape):
                raise ValueError(
                    f"table {name!r}: expected rows {list(bags[name].weight.shape)}, "
                    f"got {list(w.shape)}"
                )
        for name, w in weights.items():
            bags[name].weight.copy_(w)
        return {}

    def row_writer(
        self, table: str, rows: torch.Tensor, values: torch.Tensor
    ) -> Callable[[], None]:
        """The write of ``values [n, D]`` into ``rows [n]`` of ``table`` (checked by the caller)."""
        weight = self.bags()[table].weight

        def write() -> None:
            with torch.no_grad():
                weight[rows.to(weight.device)] = values.to(weight.device, weight.dtype)

        return write

    def validate(self, features: Mapping[str, torch.Tensor]) -> None:
        """Edge check (:func:`check_id_features`); raises ``ValueError``."""
        check_id_features(features, self.table_of, self.table_rows())

    def forward(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pools every feature. Trusts its inputs (:meth:`validate` runs at the edge). Without
        gradients on CPU (serving, index builds) all features go through one fused call
        (:func:`~sharded_tables.pooled_lookup.pooled_lookup`, the same sums)."""
        out: dict[str, torch.Tensor] = {}
        if self._hashed:  # keyed rows: looked up by raw id (KeyedBag)
            for name, ids in features.items():
                cfg = self.configs[self.table_of[name]]
                if cfg.hashed:
                    out[name] = self.tables[cfg.name](ids, mean=cfg.pooling == "mean")
            features = {n: ids for n, ids in features.items() if n not in out}
        if not torch.is_grad_enabled() and features:
            bags = self.bags()
            tables = [bags[self.table_of[n]].weight for n in features]
            if all(_fusable(w, ids) for w, ids in zip(tables, features.values(), strict=True)):
                pooled = pooled_lookup(
                    tables,
                    list(features.values()),
                    [self.configs[self.table_of[n]].pooling == "mean" for n in features],
                )
                return {**out, **dict(zip(features, pooled, strict=True))}
        for name, ids in features.items():
            cfg = self.configs[self.table_of[name]]
            present = ids >= 0
            weights = present.float()
            if cfg.pooling == "mean":
                weights = weights / present.sum(dim=1, keepdim=True).clamp(min=1)
            out[name] = self.tables[cfg.name](ids.clamp(min=0), per_sample_weights=weights)
        return out


def _fusable(weight: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the fused CPU kernel can pool ``ids`` from ``weight``."""
    return (
        weight.device.type == "cpu"
        and ids.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.is_contiguous()
    )
