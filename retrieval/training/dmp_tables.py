"""The model's tables sharded over the ranks of a torchrun job by TorchRec's
``DistributedModelParallel``, behind our :class:`~sharded_tables.interface.TableCollection` call.

    {feature: ids [b, L]} (-1 pads)  --to_kjt-->  KeyedJaggedTensor (every feature, one stride b)
    DMP(EmbeddingBagCollection)      input all-to-all -> owners' fbgemm TBE -> output all-to-all
    KeyedTensor [b, sum of D]        --split-->  {feature: pooled [b, D]}

Each rank passes its own slice (``b = batch / W`` pairs) and gets its slice's pooled rows; the
plan (:mod:`retrieval.training.sharding`) says which rank holds which rows and columns. Rows are
updated in backward by fbgemm's fused optimizer on the ranks that hold them (TorchRec's
``fused`` compute kernel, the optimizer ``train.table_optimizer`` names).

Gradient scale: every rank's loss is the mean over its slice, and the loss of the whole step is
the mean over ranks (the dense gradients are averaged, ``distributed.average_gradients``).
TorchRec's output all-to-all divides the pooled rows' gradients by W in backward
(``torchrec.distributed.comm_ops`` gradient division, on by default), so the table update is
the one a single process makes with ``micro_batches = W``
(``tests/retrieval/training/test_distributed.py``).

The DMP module is kept out of the ``nn.Module`` tree (as ``TrainableTables`` keeps its kernel):
``model.parameters()`` and ``model.state_dict()`` hold the dense parts only; the sharded rows
and optimizer state are checkpointed through :meth:`DMPTables.sharded_state`
(``torch.distributed.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from retrieval.training.sharding import quiet_torchrec
from sharded_tables.collection import TableConfig, check_id_features
from sharded_tables.interface import TableHooks


def to_kjt(features: Mapping[str, torch.Tensor], names: list[str], batch: int) -> Any:
    """Padded ids ``{feature: [b, L] int64}`` (-1 = none) -> a ``KeyedJaggedTensor`` with keys
    ``names`` in that order (an absent feature: ``batch`` empty bags)."""
    from torchrec import KeyedJaggedTensor

    values, lengths = [], []
    for name in names:
        ids = features.get(name)
        if ids is None:
            lengths.append(torch.zeros(batch, dtype=torch.int64))
            continue
        present = ids >= 0
        values.append(ids[present])
        lengths.append(present.sum(dim=1))
    empty = torch.zeros(0, dtype=torch.int64)
    return KeyedJaggedTensor(
        keys=names,
        values=torch.cat(values) if values else empty,
        lengths=torch.cat(lengths),
    )


class DMPTables(TableHooks, nn.Module):
    """``{feature: ids [b, L]} -> {feature: [b, D]}`` over tables sharded by TorchRec's DMP.

    Args:
        tables: the model's tables (``retrieval.model.table_configs``).
        plan: the ``ShardingPlan`` of :func:`retrieval.training.sharding.plan_sharding`.
        sharder: the EBC sharder carrying the fused optimizer (``make_sharder``).
        weights: ``{table: float rows [rows, D]}``, the same on every rank (the model's).

    Every rank must build it, call it and call :meth:`float_weights` together (collectives).
    """

    _dmp: Any  # torchrec DistributedModelParallel, outside the module tree

    def __init__(
        self,
        tables: list[TableConfig],
        plan: Any,
        sharder: Any,
        weights: Mapping[str, torch.Tensor],
    ):
        super().__init__()
        from torchrec.distributed.model_parallel import DistributedModelParallel

        from retrieval.training.sharding import make_ebc

        self.configs = {t.name: t for t in tables}
        self._table_of = {f: t.name for t in tables for f in t.feature_names()}
        self.feature_names = [f for t in tables for f in t.feature_names()]
        with quiet_torchrec():
            dmp = DistributedModelParallel(
                make_ebc(tables), device=torch.device("cpu"), plan=plan, sharders=[sharder]
            )
        object.__setattr__(self, "_dmp", dmp)  # not a submodule: see the module docstring
        self.load_float(weights)

    @property
    def table_of(self) -> Mapping[str, str]:
        return self._table_of

    # ---- rows -----------------------------------------------------------------------------------
    def _sharded(self) -> dict[str, Any]:
        """``{table: ShardedTensor}`` of the DMP's weights (local shards are live views)."""
        return {
            k.split(".")[-2]: v for k, v in self._dmp.state_dict().items() if k.endswith(".weight")
        }

    @torch.no_grad()
    def load_float(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies each given table's rows ``[rows, D]`` into this rank's shards of it; -> ``{}``."""
        sharded = self._sharded()
        for name, rows in weights.items():
            if name not in sharded:
                raise ValueError(f"unknown table {name!r} (known: {sorted(sharded)})")
            for shard in sharded[name].local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(rows[r0 : r0 + nr, c0 : c0 + nc])
        return {}

    @torch.no_grad()
    def float_weights(self) -> dict[str, torch.Tensor]:
        """Every table's full float rows on every rank: each rank writes its shards into zeros,
        one all_reduce (sum) per table puts them together. A collective."""
        out = {}
        sharded = self._sharded()
        for name in sorted(self.configs):
            cfg = self.configs[name]
            full = torch.zeros(cfg.num_embeddings, cfg.dim)
            for shard in sharded[name].local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                full[r0 : r0 + nr, c0 : c0 + nc] = shard.tensor
            dist.all_reduce(full)
            out[name] = full
        return out

    def sharded_state(self) -> dict[str, Any]:
        """The rows and the fused optimizer's state as ShardedTensors (each rank its shards),
        for ``torch.distributed.checkpoint``: loading writes into the live tensors."""
        return {
            "tables": self._dmp.state_dict(),
            "table_optimizer": self._dmp.fused_optimizer.state_dict(),
        }

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """Takes back what :meth:`sharded_state` gave, once DCP has filled it."""
        self._dmp.load_state_dict(state["tables"])
        self._dmp.fused_optimizer.load_state_dict(state["table_optimizer"])

    def local_table(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """Live views of a table held whole by this rank (table-wise): its rows ``[rows, D]``
        and the fused optimizer's state (TorchRec's views of fbgemm's); None on other ranks."""
        shards = self._sharded()[name].local_shards()
        if not shards:
            return None
        cfg = self.configs[name]
        whole = (cfg.num_embeddings, cfg.dim)
        if len(shards) != 1 or tuple(shards[0].metadata.shard_sizes) != whole:
            raise ValueError(f"table {name!r} is split over ranks: a hashed table is table-wise")
        state = {}
        for key, states in self._dmp.fused_optimizer.state_dict()["state"].items():
            if key.split(".")[-2] == name:  # embedding_bags.<table>.weight
                for state_name, sharded in states.items():  # <table>.momentum1
                    state[state_name.split(".")[-1]] = sharded.local_shards()[0].tensor
        return shards[0].tensor, state

    def owner_rank(self, name: str) -> int:
        """The rank holding table ``name`` (its first shard's)."""
        return self.placement()[name][0][0]

    def working_state(self) -> None:
        """None: the rows and optimizer state are checkpointed through :meth:`sharded_state`."""
        return None

    def load_working_state(self, state: dict[str, Any] | None) -> None:
        """Nothing: :meth:`load_sharded_state` restores the rows."""

    def placement(self) -> dict[str, list[tuple[int, list[int], list[int]]]]:
        """``{table: [(rank, offsets, sizes)]}`` of every shard (from the plan)."""
        out: dict[str, list[tuple[int, list[int], list[int]]]] = {}
        for name, st in self._sharded().items():
            out[name] = [
                (m.placement.rank(), list(m.shard_offsets), list(m.shard_sizes))
                for m in st.metadata().shards_metadata
            ]
        return out

    # ---- lookups --------------------------------------------------------------------------------
    def table_rows(self) -> dict[str, int | None]:
        return {name: cfg.num_embeddings for name, cfg in self.configs.items()}

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        return {name: (cfg.num_embeddings, cfg.dim) for name, cfg in self.configs.items()}

    def validate(self, features: Mapping[str, torch.Tensor]) -> None:
        """Edge check: known features, ``[b, L]`` int64, ids in range (``ValueError`` naming
        the feature)."""
        check_id_features(features, self._table_of, self.table_rows())

    def forward(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pools every given feature (one stride ``b`` on every rank). Trusts its inputs."""
        if not features:
            return {}
        b = next(iter(features.values())).shape[0]
        kt = self._dmp(to_kjt(features, self.feature_names, b)).wait()
        values = kt.values()  # [b, sum of D]
        pooled = dict(zip(kt.keys(), values.split(kt.length_per_key(), dim=1), strict=True))
        return {f: pooled[f] for f in features}
