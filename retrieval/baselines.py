"""Strong simple baselines scored like the model: item-kNN (cosine) and EASE.

Both are an item-item weight matrix ``W [N, N]`` fitted on the training interactions
``X [U, N]`` (binary: user u consumed item n); a user's scores are ``x_u W`` over their
consumed items ``x_u [N]``, seen items are excluded and the top K returned, as
:func:`recommend_items` does for both.

* item-kNN: ``W[i, j] = cos(X[:, i], X[:, j])`` (zero diagonal), each column keeping its
  ``neighbours`` largest weights (0: all).
* EASE (Steck, "Embarrassingly Shallow Autoencoders", WWW 2019): ``P = (X^T X + lambda I)^-1``,
  ``W = -P / diag(P)`` column-wise, ``diag(W) = 0``. A dense ``N x N`` inverse in float64: refused
  above ``max_bytes`` (:func:`ease_bytes`), where item-kNN (or a sampled catalog) is the choice.

Example (two users, three items; user 0 consumed items 0 and 1, user 1 item 1)::

    seen = SeenSets.of(np.array([0, 0, 1]), np.array([0, 1, 1]), num_users=2)
    w = ease_weights(gram_of(seen, 3), lam=1.0)                        # [3, 3]
    users = np.arange(2)
    recommend_items(w, seen.indicator(users, 3), seen.rows(users), k=1)  # [[2], [0]]
"""

from __future__ import annotations

import numpy as np
import torch

from retrieval.seen import SeenSets

EASE_MAX_BYTES = 4 << 30
"""Default memory EASE may use for its dense matrices (about 16,000 items)."""


def gram_of(seen: SeenSets, num_items: int, chunk: int = 4096) -> torch.Tensor:
    """``X^T X [N, N] float64`` of the binary interaction matrix of ``seen``'s users, built
    ``chunk`` users at a time (never the whole ``[U, N]``)."""
    gram = torch.zeros(num_items, num_items, dtype=torch.float64)
    for s in range(0, seen.num_users, chunk):
        x = seen.indicator(np.arange(s, min(s + chunk, seen.num_users)), num_items).double()
        gram += x.T @ x
    return gram


def ease_bytes(num_items: int) -> int:
    """Memory of EASE's dense float64 matrices (the Gram matrix and its inverse)."""
    return 2 * 8 * num_items * num_items


def ease_weights(gram: torch.Tensor, lam: float, max_bytes: int = EASE_MAX_BYTES) -> torch.Tensor:
    """EASE's item-item weights ``[N, N] float32`` from ``gram = X^T X [N, N]``; ``lam > 0``.

    Raises ``ValueError`` when the catalog's dense inverse needs more than ``max_bytes``."""
    n = int(gram.shape[0])
    if gram.shape != (n, n):
        raise ValueError(f"gram: expected a square [N, N] matrix, got {list(gram.shape)}")
    if lam <= 0:
        raise ValueError(f"lam: EASE's L2 weight must be > 0, got {lam}")
    if ease_bytes(n) > max_bytes:
        raise ValueError(
            f"EASE: a catalog of {n} items needs a dense {n} x {n} inverse "
            f"({ease_bytes(n) / 2**30:.1f} GiB > max_bytes {max_bytes / 2**30:.1f} GiB); "
            "use item-kNN or a sampled catalog"
        )
    g = gram.double() + lam * torch.eye(n, dtype=torch.float64)
    p = torch.linalg.inv(g)
    w = -p / p.diagonal()[None, :]  # column j divided by P[j, j]
    w.fill_diagonal_(0.0)
    return w.float()


def itemknn_weights(gram: torch.Tensor, neighbours: int = 0) -> torch.Tensor:
    """Cosine item-item similarity ``[N, N] float32`` from ``gram = X^T X``, zero diagonal;
    ``neighbours > 0`` keeps each column's ``neighbours`` largest similarities (the items most
    like item j that vote for it), 0 keeps all."""
    n = int(gram.shape[0])
    if neighbours < 0:
        raise ValueError(f"neighbours: expected >= 0 (0: all), got {neighbours}")
    norm = gram.diagonal().double().sqrt().clamp(min=1e-12)
    sim = (gram.double() / norm[:, None] / norm[None, :]).float()
    sim.fill_diagonal_(0.0)
    if 0 < neighbours < n:
        keep = sim.topk(neighbours, dim=0).indices  # [neighbours, N]
        pruned = torch.zeros_like(sim)
        pruned.scatter_(0, keep, sim.gather(0, keep))
        sim = pruned
    return sim


def recommend_items(
    weights: torch.Tensor, profiles: torch.Tensor, exclude: torch.Tensor, k: int
) -> torch.Tensor:
    """Top-``k`` item ids ``[B, k] int64`` (``-1`` pads) of ``profiles [B, N]`` (binary consumed
    items) scored ``profiles @ weights [N, N]``, never an item of ``exclude [B, S]`` (-1 pads).
    Ties keep the lower item id first."""
    b, n = profiles.shape
    if weights.shape != (n, n):
        raise ValueError(f"weights: expected [{n}, {n}], got {list(weights.shape)}")
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1..{n}, got {k}")
    scores = torch.cat([profiles @ weights, torch.zeros(b, 1)], dim=1)  # [B, N + 1]
    scores.scatter_(1, torch.where(exclude >= 0, exclude, n), float("-inf"))
    scores = scores[:, :n]
    # a stable order: sort descending by score, ascending id breaks ties
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    top, ids = order.values[:, :k], order.indices[:, :k]
    return torch.where(top > float("-inf"), ids, torch.full_like(ids, -1))
