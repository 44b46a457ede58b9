"""The trainer's side of hashed tables: their working tables over ``[train.hashed]``'s servers.

Checked before any step, naming the field: servers named, reachable, each holding every hashed
table as a keyed FP32 table ``D + S`` wide (``recserve serve training-store`` makes them), a
working table that holds a batch's ids, a fused table optimizer (the trainer checks that).
Under torchrun the hashed tables are table-wise (``retrieval/training/sharding.py``).
"""

from __future__ import annotations

from retrieval.training.config import TrainConfig
from retrieval.training.dmp_tables import DMPTables
from sharded_tables.hashed_training import (
    HashedTable,
    HashedTrainingTables,
    state_width,
    store_tables,
)
from sharded_tables.remote.client import RemoteLookupError, RemoteTables
from sharded_tables.specs import DType
from sharded_tables.trainable import TrainableTables


def hashed_tables(inner: TrainableTables | DMPTables, cfg: TrainConfig) -> HashedTrainingTables:
    """Wraps ``inner``'s hashed tables (those whose configs say ``hashed``) over the servers."""
    hashed = {n: c for n, c in inner.configs.items() if c.hashed}
    servers = cfg.hashed.servers
    if not servers:
        raise ValueError(
            f"train.hashed.servers: the model has hashed tables {sorted(hashed)} "
            "(model.hashed_user_id): name the embedding servers that keep their rows "
            "(start them with `recserve serve training-store`)"
        )
    for name, c in hashed.items():
        if c.num_embeddings < cfg.batch_size:  # one id an example: a batch must fit
            raise ValueError(
                f"model.hashed_user_id: table {name!r} has {c.num_embeddings} working rows, "
                f"fewer than a batch's ids (train.batch_size = {cfg.batch_size}): the ids past "
                "them would not train"
            )
    widths = {n: (c.dim, cfg.table_optimizer) for n, c in hashed.items()}
    store = RemoteTables(store_tables(widths, servers), timeout=cfg.hashed.timeout_s)
    try:
        check_store(store, {n: d + state_width(o, d) for n, (d, o) in widths.items()})
    except BaseException:
        store.close()
        raise
    policy = {
        n: HashedTable(c.num_embeddings, cfg.hashed.policy, cfg.hashed.admit_after)
        for n, c in hashed.items()
    }
    return HashedTrainingTables(inner, policy, store, seed=cfg.seed)


def check_store(store: RemoteTables, widths: dict[str, int]) -> None:
    """Every server holds every table as keyed FP32 ``[width]`` rows, else ``ValueError``
    naming ``train.hashed.servers``."""
    try:
        infos = store.info()
    except RemoteLookupError as e:
        raise ValueError(f"train.hashed.servers: {e}") from None
    for address, info in infos.items():
        held = {t.name: t for t in info.tables}
        for name, width in widths.items():
            t = held.get(name)
            if t is None or t.partition != "keyed" or t.dtype != DType.FP32.value or t.dim != width:
                got = "nothing" if t is None else f"{t.partition} {t.dtype} [{t.dim}]"
                raise ValueError(
                    f"train.hashed.servers: {address} must hold table {name!r} as keyed fp32 "
                    f"rows of {width} floats (the row and its optimizer state), it holds {got} "
                    f"(`recserve serve training-store --table {name}:{width}` starts one)"
                )
