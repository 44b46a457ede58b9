"""Embedding tables behind one call: ``{feature: ids [B, L]} -> {feature: pooled [B, D]}``.

Three implementations of that call (typed by :class:`TableCollection`, ``interface``):

* :class:`EmbeddingCollection` -- plain float ``nn.EmbeddingBag`` tables in the process (what
  training uses by default); :class:`TrainableTables` -- the same tables in fbgemm's training
  kernel with a fused row-wise optimizer.
* :class:`TieredEmbeddingCollection` -- tables placed by a :class:`PlacementPlan` over three
  tiers (device / host / remote embedding servers), stored as packed FP32/FP16/FP8/INT8/INT4 rows,
  read through fbgemm's table-batched kernel, with hot-row caches for remote tables; hashed
  (unbounded-id) tables keep their rows by key (``keyed_bag``, or keyed tables on the servers).
* Training hashed tables: :mod:`sharded_tables.hashed_training`, a working table over an id
  transformer whose evicted rows and optimizer state go to the embedding servers.

Files, in the order data flows: ``specs`` (dtypes, tiers, TableSpec) -> ``placement`` /
``planner`` (plan as data, the pure planning function) -> ``quantize`` (packed rows) -> ``tbe``
(local tiers) / ``remote`` (embedding servers) / ``cache`` + ``idmap`` (hot rows) /
``id_transformer`` + ``hashed_training`` + ``keyed_bag`` (hashed ids) -> ``sharded`` (the collection) -> ``export``
(embedding-server folders and routing).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sharded_tables.collection import EmbeddingCollection, TableConfig
    from sharded_tables.interface import TableCollection
    from sharded_tables.placement import Budgets, PlacementPlan, PlanError, TablePlacement
    from sharded_tables.planner import plan
    from sharded_tables.specs import DType, TableSpec, Tier
    from sharded_tables.tiered import TieredEmbeddingCollection
    from sharded_tables.trainable import TrainableTables

# Re-exports resolve on first use (PEP 562), so `import sharded_tables.planner` (pure data, no
# torch) does not load torch and fbgemm through the table modules.
_HOME = {
    "Budgets": "placement",
    "DType": "specs",
    "EmbeddingCollection": "collection",
    "PlacementPlan": "placement",
    "PlanError": "placement",
    "TableCollection": "interface",
    "TableConfig": "collection",
    "TablePlacement": "placement",
    "TableSpec": "specs",
    "Tier": "specs",
    "TieredEmbeddingCollection": "tiered",
    "TrainableTables": "trainable",
    "plan": "planner",
}

__all__ = [
    "Budgets",
    "DType",
    "EmbeddingCollection",
    "PlacementPlan",
    "PlanError",
    "TableCollection",
    "TableConfig",
    "TablePlacement",
    "TableSpec",
    "Tier",
    "TieredEmbeddingCollection",
    "TrainableTables",
    "plan",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
