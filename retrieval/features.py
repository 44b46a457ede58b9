"""Requests as tensors: what the user tower reads and what the filter admits.

A :class:`UserBatch` holds B requests; the item side is a dict of padded id matrices, one per
item feature (``item_id`` and one per attribute).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from retrieval.filter_verify import FilterVerify
from retrieval.filters import Clause, Expr, FilterBatch, FilterSchema


@dataclass
class UserBatch:
    """B requests.

    history: ``[B, H] int64`` most recent item ids, ``-1`` padded.
    categorical: ``[B, F] int64`` one code per categorical user feature (config order).
    dense: ``[B, F_dense] float32``.
    filter_masks / filter_negate: ``[B, C, W] int64`` / ``[B, C] bool`` (see ``filters``).
    seen: ``[B, S] int64`` every item the user consumed, ``-1`` padded, any order, or None. When
    given, these items are never recommended, in addition to the history window the model
    excludes (``retrieval/seen.py``); None keeps the window only.
    recall_target: ``[B] float32`` recall@K against exact search each request asks for, in (0,
    1] (0: the index's settings), or None (``retrieval/index/targets.py``).
    user: ``[B] int64`` the requests' users (dense user index, ``-1``: none), whose seen items a
    model with a seen store excludes too (``retrieval/seen_store.py``), or None.
    filter_none: ``[B, C, W] int64`` each clause's "or none of these bits" part
    (``FilterBatch.neg_masks``), or None where no clause has one.
    filter_verify: the exact clauses of requests whose filter names a multi-valued hashed
    attribute (``FilterBatch.verify``), or None where none does.
    """

    history: torch.Tensor
    categorical: torch.Tensor
    dense: torch.Tensor
    filter_masks: torch.Tensor
    filter_negate: torch.Tensor
    seen: torch.Tensor | None = None
    recall_target: torch.Tensor | None = None
    user: torch.Tensor | None = None
    filter_none: torch.Tensor | None = None
    filter_verify: FilterVerify | None = None

    @property
    def size(self) -> int:
        return int(self.history.shape[0])

    @property
    def filters(self) -> FilterBatch:
        return FilterBatch(
            self.filter_masks, self.filter_negate, None, self.filter_none, self.filter_verify
        )

    def rows(self, rows: torch.Tensor) -> UserBatch:
        """The requests ``rows [B'] int64`` of this batch."""
        return UserBatch(
            self.history[rows],
            self.categorical[rows],
            self.dense[rows],
            self.filter_masks[rows],
            self.filter_negate[rows],
            None if self.seen is None else self.seen[rows],
            None if self.recall_target is None else self.recall_target[rows],
            None if self.user is None else self.user[rows],
            None if self.filter_none is None else self.filter_none[rows],
            None if self.filter_verify is None else self.filter_verify.take(rows),
        )

    def to(self, device: torch.device | str) -> UserBatch:
        """This batch on ``device``. To a GPU, host tensors go through pinned memory with
        asynchronous copies: the forward queues behind them instead of waiting for each."""
        dev = torch.device(device)
        gpu = dev.type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            if gpu and t.device.type == "cpu":
                return t.pin_memory().to(dev, non_blocking=True)
            return t.to(dev)

        return UserBatch(
            move(self.history),
            move(self.categorical),
            move(self.dense),
            move(self.filter_masks),
            move(self.filter_negate),
            None if self.seen is None else move(self.seen),
            None if self.recall_target is None else move(self.recall_target),
            None if self.user is None else move(self.user),
            None if self.filter_none is None else move(self.filter_none),
            None if self.filter_verify is None else self.filter_verify.to(dev),
        )


def make_user_batch(
    history: np.ndarray | torch.Tensor,
    categorical: np.ndarray | torch.Tensor,
    dense: np.ndarray | torch.Tensor,
    schema: FilterSchema,
    filters: Sequence[str | Expr | Sequence[Clause] | None] | None = None,
    seen: np.ndarray | torch.Tensor | None = None,
) -> UserBatch:
    """Builds a batch from per-request arrays; ``filters`` is one entry per request (or None);
    ``seen [B, S]``: every item each request's user consumed (None: the history window only)."""
    h = torch.as_tensor(history, dtype=torch.int64)
    fb = schema.compile(filters) if filters is not None else schema.empty(h.shape[0])
    return UserBatch(
        h,
        torch.as_tensor(categorical, dtype=torch.int64),
        torch.as_tensor(dense, dtype=torch.float32),
        fb.masks,
        fb.negate,
        None if seen is None else torch.as_tensor(seen, dtype=torch.int64),
        filter_none=fb.neg_masks,
        filter_verify=fb.verify,
    )


def item_feature_ids(
    item_attributes: Mapping[str, np.ndarray], num_items: int
) -> dict[str, torch.Tensor]:
    """Item tower inputs: ``item_id [N, 1]`` and, per attribute, value ids ``[N, L]`` (-1 padded).

    Single-valued attributes (codes ``[N]``) give ``[N, 1]``; multi-valued (bool ``[N, V]``)
    give the set values, padded to the most any item has.
    """
    out = {"item_id": torch.arange(num_items, dtype=torch.int64)[:, None]}
    for name, arr in item_attributes.items():
        arr = np.asarray(arr)
        if arr.ndim == 1:
            out[f"item_{name}"] = torch.as_tensor(arr, dtype=torch.int64)[:, None]
        else:
            width = max(int(arr.sum(axis=1).max()), 1) if arr.size else 1
            # stable argsort of ~present puts the present value ids first, in value order
            order = np.argsort(~arr.astype(bool), axis=1, kind="stable")[:, :width]
            present = np.take_along_axis(arr.astype(bool), order, axis=1)
            out[f"item_{name}"] = torch.as_tensor(np.where(present, order, -1), dtype=torch.int64)
    return out
