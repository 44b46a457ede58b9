"""Embedding tables behind one call: ``{feature: ids [B, L]} -> {feature: pooled [B, D]}``.

Two implementations of that call:

* :class:`EmbeddingCollection` -- plain float ``nn.EmbeddingBag`` tables in the process (what
  training uses by default); :class:`TrainableTables` -- the same tables in fbgemm's training
  kernel with a fused row-wise optimizer.
* :class:`TieredEmbeddingCollection` -- tables placed by a :class:`PlacementPlan` over three
  tiers (device / host / remote embedding servers), stored as packed FP32/FP16/FP8/INT8/INT4 rows,
  read through fbgemm's table-batched kernel, with hot-row caches for remote tables and id
  transformers for hashed (unbounded) id spaces.

Files, in the order data flows: ``specs`` (dtypes, tiers, TableSpec) -> ``placement`` /
``planner`` (plan as data, the pure planning function) -> ``quantize`` (packed rows) -> ``tbe``
(local tiers) / ``remote`` (embedding servers) / ``cache`` + ``idmap`` (hot rows) /
``id_transformer`` + ``dynamic_table`` (hashed ids) -> ``sharded`` (the collection) -> ``export``
(shard folders and routing for the servers).
"""

from sharded_tables.collection import EmbeddingCollection, TableConfig
from sharded_tables.placement import Budgets, PlacementPlan, PlanError, TablePlacement
from sharded_tables.planner import plan
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection
from sharded_tables.trainable import TrainableTables

__all__ = [
    "Budgets",
    "DType",
    "EmbeddingCollection",
    "PlacementPlan",
    "PlanError",
    "TableConfig",
    "TablePlacement",
    "TableSpec",
    "Tier",
    "TieredEmbeddingCollection",
    "TrainableTables",
    "plan",
]
