"""Trainable tables: fbgemm's training TBE with the optimizer fused into backward.

:class:`TrainableTables` has the call shape of :class:`EmbeddingCollection`
(``{feature: ids [B, L] int64, -1 = none} -> {feature: pooled [B, D] float32}``), but every
feature of every table is looked up by **one** call of fbgemm's
``SplitTableBatchedEmbeddingBagsCodegen`` per forward, and the rows are updated **during
backward** by a fused row-sparse optimizer (exact SGD, exact Adagrad, exact row-wise Adagrad:
gradients of a row repeated in a batch are summed first, then one update is applied).

Combining with the model's torch optimizer: the kernel module is deliberately kept out of the
``nn.Module`` tree, so the tables contribute **no** ``nn.Parameter`` to ``model.parameters()``.
A training loop stays as it is::

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)  # towers, heads: not the tables
    loss = loss_fn(model(...))
    opt.zero_grad()
    loss.backward()  # the table rows read by this batch are updated here
    opt.step()       # the dense parameters are updated here

Every ``backward`` through a forward call is one optimizer step for the rows that call read:
there is no gradient accumulation, a second backward through one graph updates again, and a
table read by two forward calls of one step (the item table: user history, then item ids) takes
two Adagrad steps. Call once per step with all features when that matters.

Padding: fbgemm's CPU training kernel does **not** skip id ``-1`` (it raises), so the padded
matrices are compacted to jagged ids (``ids[ids >= 0]``) with offsets from the counts. That is
also the fast path: the unweighted kernel reads only present ids, where ``per_sample_weights``
(0 for padding, ``1/n`` for means) would read and "update" a dummy row per padding slot. Mean
tables are sum-pooled and then divided by the count of present ids (an empty bag stays 0);
autograd hands the kernel ``grad / n``, the same gradient as ``EmbeddingCollection``.

State: ``state_dict()`` holds one ``_extra_state`` entry: a copy of every table's float rows and
optimizer state (Adagrad's ``sum``), keyed by table name, plus the optimizer name; loading it
continues training identically. The tables stay on the device they were built on (``.to()``
does not move them); inputs are moved there and outputs back to the inputs' device.

Example::

    tables = TrainableTables([TableConfig("item", 1682, 32, features=("history", "item_id"))],
                             optimizer="rowwise_adagrad", learning_rate=0.05, seed=0)
    out = tables({"history": torch.tensor([[3, 7, -1]])})  # {"history": [1, 32]}
    out["history"].sum().backward()  # rows 3 and 7 move; no optimizer.step() for them
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from sharded_tables.collection import TableConfig, check_id_features
from sharded_tables.interface import TableHooks

OPTIMIZERS: dict[str, str] = {
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adagrad": "EXACT_ADAGRAD",
    "sgd": "EXACT_SGD",
}
"""Our optimizer names -> fbgemm ``EmbOptimType`` members (the ones with CPU kernels)."""

_STATE_NAMES: dict[str, tuple[str, ...]] = {
    "rowwise_adagrad": ("sum",),  # [rows]: running mean over D of squared gradients
    "adagrad": ("sum",),  # [rows, D]: running squared gradients
    "sgd": (),
}


class TrainableTables(TableHooks, nn.Module):
    """Pooled lookups with fused row-sparse training: ``{feature: [B, L]} -> {feature: [B, D]}``
    (a :class:`~sharded_tables.interface.TableCollection`).

    Args:
        tables: the tables (``dim`` a multiple of 4, a kernel requirement).
        optimizer: ``"rowwise_adagrad"`` | ``"adagrad"`` | ``"sgd"``.
        learning_rate, eps: the fused optimizer's settings (``eps`` for the Adagrads).
        init_std: rows start as ``N(0, init_std^2)``, drawn table by table in order.
        seed: seeds the init generator (``None``: torch's global generator).
        device: where the rows live and the kernel runs.
    """

    _tbe: Any  # fbgemm SplitTableBatchedEmbeddingBagsCodegen

    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: str = "rowwise_adagrad",
        learning_rate: float = 0.01,
        eps: float = 1e-8,
        init_std: float = 0.05,
        seed: int | None = None,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
        if not tables:
            raise ValueError("tables: need at least one table")
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.configs = {t.name: t for t in tables}
        if len(self.configs) != len(tables):
            raise ValueError(f"tables: duplicate table names in {[t.name for t in tables]}")
        self.table_names = [t.name for t in tables]
        self.table_of: dict[str, str] = {}
        self.feature_names: list[str] = []  # the kernel's feature order (table order)
        feature_table: list[int] = []
        for i, t in enumerate(tables):
            if t.pooling not in ("mean", "sum"):
                raise ValueError(
                    f"table {t.name!r}: pooling must be 'mean' or 'sum', got {t.pooling!r}"
                )
            if t.num_embeddings < 1 or t.dim < 4 or t.dim % 4:
                raise ValueError(
                    f"table {t.name!r}: need num_embeddings >= 1 and dim a positive multiple "
                    f"of 4, got {t.num_embeddings} x {t.dim}"
                )
            for f in t.feature_names():
                if f in self.table_of:
                    raise ValueError(f"feature {f!r} is assigned to two tables")
                self.table_of[f] = t.name
                self.feature_names.append(f)
                feature_table.append(i)
        dims = [tables[i].dim for i in feature_table]
        # column range of each feature in the kernel's output [B, sum of D]
        self._columns: dict[str, tuple[int, int]] = {}
        start = 0
        for f, d in zip(self.feature_names, dims, strict=True):
            self._columns[f] = (start, start + d)
            start += d
        self._feature_index = {f: j for j, f in enumerate(self.feature_names)}
        # set past nn.Module.__setattr__ so the kernel module is not a submodule: its weights
        # must not reach model.parameters() (see the module docstring)
        tbe = _make_tbe(tables, feature_table, optimizer, learning_rate, eps, device)
        object.__setattr__(self, "_tbe", tbe)
        self._init_weights(init_std, seed)

    def _init_weights(self, init_std: float, seed: int | None) -> None:
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, rows in self.weights().items():
            cfg = self.configs[name]
            drawn = torch.randn(cfg.num_embeddings, cfg.dim, generator=g) * init_std
            rows.copy_(drawn)

    # ---- rows and optimizer state -------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """``{table: rows [rows, D] float32}``: views of the live rows (backward updates them;
        writing into them writes the table). Detached: no autograd."""
        return dict(zip(self.table_names, self._tbe.split_embedding_weights(), strict=True))

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{table: {state: tensor}}``, views: row-wise Adagrad ``sum [rows]``, Adagrad
        ``sum [rows, D]``, SGD none."""
        names = _STATE_NAMES[self.optimizer]
        if not names:
            return {t: {} for t in self.table_names}
        splits = self._tbe.split_optimizer_states()  # [tables][states]
        return {
            t: dict(zip(names, states, strict=True))
            for t, states in zip(self.table_names, splits, strict=True)
        }

    def local_table(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Live views of table ``name``'s rows and optimizer state (hashed tables' kernel)."""
        return self.weights()[name], self.optimizer_state()[name]

    def owner_rank(self, name: str) -> int:
        """0: one process holds every table."""
        return 0

    def working_state(self) -> dict[str, Any]:
        """:meth:`get_extra_state` (rows and optimizer state, copies)."""
        return self.get_extra_state()

    def load_working_state(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("saved hashed tables carry no rows (written by a torchrun job)")
        self.set_extra_state(state)

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies float rows ``{table: [rows, D]}`` into the named tables (others unchanged).
        Optimizer state is left as is."""
        live = self.weights()
        for name, w in weights.items():
            if name not in live:
                raise ValueError(f"unknown table {name!r} (known: {self.table_names})")
            if tuple(w.shape) != tuple(live[name].shape) or not w.is_floating_point():
                raise ValueError(
                    f"table {name!r}: expected float {list(live[name].shape)} rows, "
                    f"got {w.dtype} {list(w.shape)}"
                )
        for name, w in weights.items():
            live[name].copy_(w)

    def float_weights(self) -> dict[str, torch.Tensor]:
        """``{table: rows [rows, D]}``: :meth:`weights` (live views)."""
        return self.weights()

    def load_float(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`load_weights`; -> ``{}`` (no table lives on embedding servers)."""
        self.load_weights(weights)
        return {}

    def row_writer(
        self, table: str, rows: torch.Tensor, values: torch.Tensor
    ) -> Callable[[], None]:
        """The write of ``values [n, D]`` into ``rows [n]`` of ``table`` (checked by the caller);
        the rows' optimizer state is left as is."""
        weight = self.weights()[table]

        def write() -> None:
            with torch.no_grad():
                weight[rows.to(weight.device)] = values.to(weight.device, weight.dtype)

        return write

    @property
    def learning_rate(self) -> float:
        return float(self._tbe.get_learning_rate())

    def set_learning_rate(self, lr: float) -> None:
        """The fused optimizer's learning rate from now on (for schedules)."""
        self._tbe.set_learning_rate(lr)

    def get_extra_state(self) -> dict[str, Any]:
        """Copies (not views) of rows and optimizer state, so a checkpoint stays a snapshot."""
        state = self.optimizer_state()
        return {
            "optimizer": self.optimizer,
            "weights": {t: w.detach().cpu().clone() for t, w in self.weights().items()},
            "optimizer_state": {
                t: {n: s.cpu().clone() for n, s in s_t.items()} for t, s_t in state.items()
            },
        }

    @torch.no_grad()
    def set_extra_state(self, state: dict[str, Any]) -> None:
        if state["optimizer"] != self.optimizer:
            raise ValueError(
                f"saved tables were trained with optimizer {state['optimizer']!r}, "
                f"these use {self.optimizer!r}"
            )
        if set(state["weights"]) != set(self.table_names):
            raise ValueError(
                f"saved tables {sorted(state['weights'])} differ from {sorted(self.table_names)}"
            )
        live = self.optimizer_state()
        for t, saved in state["optimizer_state"].items():
            for n, s in saved.items():
                if s.shape != live[t][n].shape:
                    raise ValueError(
                        f"table {t!r}: saved optimizer state {n!r} is {list(s.shape)}, "
                        f"expected {list(live[t][n].shape)}"
                    )
        self.load_weights(state["weights"])
        for t, saved in state["optimizer_state"].items():
            for n, s in saved.items():
                live[t][n].copy_(s)

    # ---- lookups ------------------------------------------------------------------------------
    def table_rows(self) -> dict[str, int | None]:
        """Rows of each table (ids must be in ``[0, rows)``)."""
        return {name: cfg.num_embeddings for name, cfg in self.configs.items()}

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        """``{table: (rows, D)}``."""
        return {name: (cfg.num_embeddings, cfg.dim) for name, cfg in self.configs.items()}

    def validate(self, features: Mapping[str, torch.Tensor]) -> None:
        """Edge check: known features, ``[B, L]`` int64 with one B, ids in range
        (raises ``ValueError`` naming the feature, its table and the bad id)."""
        check_id_features(features, self.table_of, self.table_rows())
        sizes = {name: ids.shape[0] for name, ids in features.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"features have different batch sizes {sizes} (one kernel call needs one B)"
            )

    def forward(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pools every given feature in one kernel call. Trusts its inputs (:meth:`validate`
        runs at the edge): ids in range, one batch size."""
        if not features:
            return {}
        first = next(iter(features.values()))
        b, out_device = first.shape[0], first.device
        indices, lengths = [], []
        empty = torch.zeros(b, dtype=torch.int64, device=self.device)
        for f in self.feature_names:  # absent features go as B empty bags
            ids = features.get(f)
            if ids is None:
                lengths.append(empty)
                continue
            ids = ids.to(self.device)
            present = ids >= 0  # the training kernel does not skip -1
            indices.append(ids[present])
            lengths.append(present.sum(dim=1))
        counts = torch.stack(lengths)  # [F, B]
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(counts.flatten(), 0, out=offsets[1:])
        pooled = self._tbe(torch.cat(indices), offsets)  # [B, sum of D], sum-pooled
        out = {}
        for f in features:
            lo, hi = self._columns[f]
            x = pooled[:, lo:hi]  # [B, D]
            if self.configs[self.table_of[f]].pooling == "mean":
                n = counts[self._feature_index[f]].clamp(min=1)  # [B]
                x = x / n[:, None].to(x.dtype)
            out[f] = x.to(out_device)
        return out


def _make_tbe(
    tables: list[TableConfig],
    feature_table: list[int],
    optimizer: str,
    learning_rate: float,
    eps: float,
    device: torch.device | str,
) -> Any:
    """fbgemm's training TBE over all tables (float32 rows, sum pooling, fused optimizer)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    cuda = torch.device(device).type == "cuda"
    location = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
    compute = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(t.num_embeddings, t.dim, location, compute) for t in tables],
        feature_table_map=feature_table,
        optimizer=EmbOptimType[OPTIMIZERS[optimizer]],
        learning_rate=learning_rate,
        eps=eps,
        pooling_mode=PoolingMode.SUM,  # mean is a division by counts after the call
        bounds_check_mode=BoundsCheckMode.NONE,  # ids are checked at the edge (validate)
        device=torch.device(device),
        table_names=[t.name for t in tables],
    )
