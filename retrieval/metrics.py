"""Ranking quality against held-out interactions: recall@K and NDCG@K."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ranking_metrics(recs: np.ndarray, relevant: Sequence[set[int]], k: int) -> dict[str, float]:
    """``recs [U, >=K]`` item ids (``-1`` pads), ``relevant[u]`` held-out items of user u.

    recall@K = |top-K ∩ relevant| / min(|relevant|, K); NDCG@K with binary gains. Users with no
    relevant items are skipped. Returns ``{"recall@K": .., "ndcg@K": .., "users": ..}``.
    """
    discounts = 1.0 / np.log2(np.arange(2, k + 2))
    recalls, ndcgs = [], []
    for row, rel in zip(recs[:, :k].tolist(), relevant, strict=True):
        if not rel:
            continue
        hits = np.array([x in rel for x in row], dtype=float)
        ideal = discounts[: min(len(rel), k)].sum()
        recalls.append(hits.sum() / min(len(rel), k))
        ndcgs.append((hits * discounts[: len(hits)]).sum() / ideal)
    return {
        f"recall@{k}": float(np.mean(recalls)) if recalls else 0.0,
        f"ndcg@{k}": float(np.mean(ndcgs)) if ndcgs else 0.0,
        "users": len(recalls),
    }


def popularity_recs(
    train_items: np.ndarray, num_items: int, history: np.ndarray, k: int
) -> np.ndarray:
    """The baseline: the K most popular train items each user has not seen. ``history [U, H]``."""
    order = np.argsort(-np.bincount(train_items, minlength=num_items), kind="stable")
    head = order[: k + history.shape[1]]
    seen = (head[None, :, None] == history[:, None, :]).any(axis=2)  # [U, k+H]
    out = np.full((history.shape[0], k), -1, dtype=np.int64)
    for u in range(history.shape[0]):
        picks = head[~seen[u]][:k]
        out[u, : len(picks)] = picks
    return out


def catalog_coverage(recs: np.ndarray, num_items: int, k: int) -> float:
    """Share of the ``num_items`` catalog in at least one user's top-``k`` (``recs [U, >=K]``,
    ``-1`` pads)."""
    top = recs[:, :k]
    return float(len(np.unique(top[top >= 0]))) / num_items
