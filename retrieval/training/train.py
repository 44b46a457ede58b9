"""Trains a :class:`RetrievalModel` on (user, item) interactions.

Run through the CLI (``recserve demo`` trains, builds the index and evaluates). One process;
multi-process training (torchrun) is not built yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from retrieval.features import UserBatch
from retrieval.model import RetrievalModel
from retrieval.training.loss import in_batch_logits, sampled_softmax_loss


@dataclass
class TrainConfig:
    """Optimization settings."""

    epochs: int = 5
    batch_size: int = 512
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    progress: bool = True
    """Show a progress bar with loss and examples/s."""


@dataclass
class TrainingData:
    """Positive pairs and per-user / per-item inputs (all numpy / CPU tensors).

    user_ids, item_ids: ``[M] int64`` pairs; history: ``[U, H] int64`` (-1 padded);
    categorical: ``[U, F] int64``; dense: ``[U, F_dense] float32``;
    item_features: ``{name: [N, L] int64}``; item_log_q: ``[N] float32`` log sampling probability.
    """

    user_ids: np.ndarray
    item_ids: np.ndarray
    history: np.ndarray
    categorical: np.ndarray
    dense: np.ndarray
    item_features: dict[str, torch.Tensor]
    item_log_q: torch.Tensor


def log_q_from_counts(item_ids: np.ndarray, num_items: int) -> torch.Tensor:
    """Log of each item's share of the training pairs (unseen items get half a count)."""
    counts = np.bincount(item_ids, minlength=num_items).astype(np.float64)
    counts = np.maximum(counts, 0.5)
    return torch.from_numpy(np.log(counts / counts.sum())).float()


def batch_inputs(
    model: RetrievalModel, data: TrainingData, users: np.ndarray, items: np.ndarray
) -> UserBatch:
    """User inputs for training pairs; the positive item is hidden from the user's own history."""
    hist = data.history[users]
    hist = np.where(hist == items[:, None], -1, hist)
    fb = model.index.schema.empty(len(users))
    return UserBatch(
        torch.from_numpy(hist),
        torch.from_numpy(data.categorical[users]),
        torch.from_numpy(data.dense[users]),
        fb.masks,
        fb.negate,
    )


def train(model: RetrievalModel, data: TrainingData, cfg: TrainConfig) -> list[float]:
    """Runs ``cfg.epochs`` epochs; returns the mean loss of each epoch. Deterministic for a seed."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model.train()
    m = len(data.user_ids)
    epoch_losses = []
    for epoch in range(cfg.epochs):
        order = rng.permutation(m)
        steps = (
            range(0, m - cfg.batch_size + 1, cfg.batch_size)
            if m >= cfg.batch_size
            else range(0, m, m)
        )
        bar = tqdm(
            steps, desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not cfg.progress, leave=False
        )
        losses, start, seen = [], time.perf_counter(), 0
        for s in bar:
            idx = order[s : s + cfg.batch_size]
            users, items = data.user_ids[idx], data.item_ids[idx]
            q = model.user_vectors(batch_inputs(model, data, users, items))
            it = torch.from_numpy(items)
            v = model.item_vectors({f: t[it] for f, t in data.item_features.items()})
            loss = sampled_softmax_loss(
                in_batch_logits(q, v, model.config.temperature, model.head), it, data.item_log_q[it]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            seen += len(idx)
            bar.set_postfix(  # drawn at tqdm's own pace, not every step
                loss=f"{np.mean(losses[-20:]):.3f}",
                ex_s=f"{seen / (time.perf_counter() - start):.0f}",
                refresh=False,
            )
        epoch_losses.append(float(np.mean(losses)) if losses else float("nan"))
    model.eval()
    return epoch_losses
