"""The training pairs and what one step reads of them.

:class:`TrainingData` holds M positive (user, item) pairs, in timeline order when
:func:`retrieval.training.prepare.prepare` made them, with the per-user and per-item inputs;
:func:`batch_inputs` cuts a step's user inputs (the causal or static history of each pair,
``retrieval/training/histories.py``); :func:`batch_starts` splits an epoch into steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from retrieval.features import UserBatch
from retrieval.model import RetrievalModel
from retrieval.training.histories import causal_history, static_history


@dataclass
class TrainingData:
    """Positive pairs and per-user / per-item inputs (all numpy / CPU tensors).

    user_ids, item_ids: ``[M] int64`` pairs; history: ``[U, H] int64`` (-1 padded);
    categorical: ``[U, F] int64``; dense: ``[U, F_dense] float32``;
    item_features: ``{name: [N, L] int64}``; item_log_q: ``[N] float32`` log sampling probability.
    pair_first: ``[M] int64`` when the pairs are in timeline order (by user, then time): each
    pair's user's first pair (``retrieval/training/histories.py``); what ``history="causal"``
    needs. None: pairs in no particular order (static histories only).
    task_labels: ``[M, T] float32`` each pair's label per head task
    (``retrieval/training/task_labels.py``), or None: the head learns through the softmax only.
    """

    user_ids: np.ndarray
    item_ids: np.ndarray
    history: np.ndarray
    categorical: np.ndarray
    dense: np.ndarray
    item_features: dict[str, torch.Tensor]
    item_log_q: torch.Tensor
    pair_first: np.ndarray | None = None
    task_labels: np.ndarray | None = None


def log_q_from_counts(item_ids: np.ndarray, num_items: int) -> torch.Tensor:
    """Log of each item's share of the training pairs (unseen items get half a count)."""
    counts = np.bincount(item_ids, minlength=num_items).astype(np.float64)
    counts = np.maximum(counts, 0.5)
    return torch.from_numpy(np.log(counts / counts.sum())).float()


def batch_inputs(
    model: RetrievalModel, data: TrainingData, idx: np.ndarray, history: str = "causal"
) -> UserBatch:
    """User inputs for the training pairs ``idx [B]``: each user's history at the pair's time
    (``"causal"``), or the user's whole history with the positive hidden (``"static"``)."""
    users = data.user_ids[idx]
    if history == "causal":
        if data.pair_first is None:
            raise ValueError(
                "train.history='causal' needs the pairs in timeline order "
                "(TrainingData.pair_first, as prepare() gives them); use 'static' otherwise"
            )
        hist = causal_history(data.item_ids, data.pair_first, idx, model.config.history_len)
    else:
        hist = static_history(data.history, users, data.item_ids[idx])
    fb = model.index.schema.empty(len(users))
    return UserBatch(
        torch.from_numpy(hist),
        torch.from_numpy(data.categorical[users]),
        torch.from_numpy(data.dense[users]),
        fb.masks,
        fb.negate,
    )


def batch_starts(num_pairs: int, batch_size: int) -> list[int]:
    """Start of every full batch (one short batch when there are fewer pairs than a batch)."""
    if num_pairs < batch_size:
        return [0]
    return list(range(0, num_pairs - batch_size + 1, batch_size))
