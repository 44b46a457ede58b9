"""The tables' sharding plan for a torchrun job: TorchRec's planner over our table configs.

Planning is pure data: :func:`plan_sharding` turns the model's tables, ``[train.sharding]``
and the world size into a ``torchrec`` ``ShardingPlan`` (which rank holds which rows and
columns of which table) without touching a process group, so every rank computes the same plan
and a plan that cannot be made is refused on every rank alike, before any step. Applying it is
:class:`retrieval.training.dmp_tables.DMPTables`' job (``DistributedModelParallel``).

    tables (TableConfig)  ->  EmbeddingBagConfig on the meta device (no memory)
    [train.sharding]      ->  Topology(world, cpu, ddr_cap / hbm_cap per rank)
                              ParameterConstraints(sharding_types, min_partition) per table
    EmbeddingShardingPlanner.plan(ebc, [sharder])  ->  ShardingPlan

Refusals name the field: a sharding type TorchRec's sharder does not offer on this compute
device (``train.sharding.types``: row-wise needs CUDA in torchrec 1.8), a budget the tables
cannot fit in (``train.sharding.ddr_budget`` / ``hbm_budget``, with the tables' bytes).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from retrieval.training.config import ShardingConfig
from sharded_tables.collection import TableConfig
from sharded_tables.trainable import OPTIMIZERS

FBGEMM_DIM_STEP = 4
"""fbgemm's training kernels need every (shard's) width to be a multiple of 4."""


@contextlib.contextmanager
def quiet_torchrec() -> Iterator[None]:
    """Silences TorchRec's planner tables and warnings and fbgemm's kernel settings (logged to
    the root logger at INFO), printed at every plan and sharding otherwise."""
    loggers = [logging.getLogger("torchrec"), logging.getLogger()]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    loggers[0].setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def make_ebc(tables: list[TableConfig], device: torch.device | str = "meta") -> nn.Module:
    """A ``torchrec.EmbeddingBagCollection`` with ``tables`` (pooling as configured); on the
    meta device it holds no rows (sharding materializes them)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    pooling = {"mean": PoolingType.MEAN, "sum": PoolingType.SUM}
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names()),
            pooling=pooling[t.pooling],
        )
        for t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device(device))


def make_sharder(optimizer: str, learning_rate: float, eps: float = 1e-8) -> Any:
    """TorchRec's EBC sharder with fbgemm's fused optimizer ``optimizer`` (our names:
    ``sharded_tables.trainable.OPTIMIZERS``), the settings of the one-process path."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"train.table_optimizer: sharded tables take a fused one ({sorted(OPTIMIZERS)}), "
            f"got {optimizer!r}"
        )
    fused = {
        "optimizer": EmbOptimType[OPTIMIZERS[optimizer]],
        "learning_rate": learning_rate,
        "eps": eps,
    }
    return EmbeddingBagCollectionSharder(fused_params=fused)


def offered_types(sharder: Any, compute_device: str) -> list[str]:
    """The sharding types TorchRec's ``sharder`` offers on ``compute_device``, less
    ``data_parallel`` (replicated tables train outside the fused optimizer)."""
    return [t for t in sharder.sharding_types(compute_device) if t != "data_parallel"]


def check_types(cfg: ShardingConfig, sharder: Any, compute_device: str) -> None:
    """Refuses a type of ``cfg.types`` that TorchRec does not offer on ``compute_device``."""
    offered = offered_types(sharder, compute_device)
    refused = [t for t in cfg.types if t not in offered]
    if refused:
        raise ValueError(
            f"train.sharding.types: TorchRec does not shard {refused} on the {compute_device} "
            f"backend (it offers {offered} there)"
        )


def table_bytes(tables: list[TableConfig]) -> dict[str, int]:
    """Float32 bytes of each table's rows (optimizer state not included)."""
    return {t.name: t.num_embeddings * t.dim * 4 for t in tables}


def shard_dim(table: TableConfig, cfg: ShardingConfig, world: int) -> int:
    """Width of a column-wise shard of ``table``: the config's, or ``dim / world`` rounded up
    to fbgemm's step (the whole width when that does not split it)."""
    if cfg.column_shard_dim is not None:
        return min(cfg.column_shard_dim, table.dim)
    step = FBGEMM_DIM_STEP
    per_rank = -(-table.dim // world)
    return min(table.dim, -(-per_rank // step) * step)


def plan_sharding(
    tables: list[TableConfig],
    cfg: ShardingConfig,
    world: int,
    sharder: Any,
    compute_device: str = "cpu",
) -> Any:
    """``tables`` over ``world`` ranks as TorchRec plans them -> ``ShardingPlan``. Pure: no
    process group; the same inputs give the same plan on every rank. ``ValueError`` naming
    ``train.sharding.types`` or the budget field when TorchRec refuses."""
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.planner.types import PlannerError

    check_types(cfg, sharder, compute_device)
    for t in tables:
        if "column_wise" in cfg.types and shard_dim(t, cfg, world) % FBGEMM_DIM_STEP:
            raise ValueError(
                f"train.sharding.column_shard_dim: table {t.name!r} ({t.dim} wide) would split "
                f"into shards not a multiple of {FBGEMM_DIM_STEP} wide"
            )
    hashed = [t.name for t in tables if t.hashed]
    if hashed and "table_wise" not in cfg.types:
        raise ValueError(
            f"train.sharding.types: hashed tables {hashed} are sharded table-wise (their "
            "working rows move to and from the embedding servers on one rank): add table_wise"
        )
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=["table_wise"] if t.hashed else list(cfg.types),
            min_partition=shard_dim(t, cfg, world),
        )
        for t in tables
    }
    try:
        with quiet_torchrec():
            topology = Topology(
                world_size=world,
                compute_device=compute_device,
                hbm_cap=cfg.hbm_budget,
                ddr_cap=cfg.ddr_budget,
            )
            planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
            return planner.plan(make_ebc(tables), [sharder])
    except (PlannerError, RuntimeError) as e:
        field = "hbm_budget" if compute_device == "cuda" else "ddr_budget"
        budget = getattr(cfg, field)
        sizes = table_bytes(tables)
        raise ValueError(
            f"train.sharding.{field}: TorchRec's planner cannot place the tables on {world} "
            f"ranks of {budget if budget is not None else 'its default'} bytes each (the "
            f"tables' rows alone: {sum(sizes.values())} bytes, the largest "
            f"{max(sizes, key=lambda n: sizes[n])!r} {max(sizes.values())} bytes; optimizer "
            f"state and buffers come on top): {_first_line(e)}"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
