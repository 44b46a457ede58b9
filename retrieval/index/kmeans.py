"""Coarse quantizer training and assignment (faiss k-means on CPU)."""

from __future__ import annotations

import faiss
import numpy as np
import torch


def train_centroids(
    x: torch.Tensor,
    nlist: int,
    *,
    iters: int = 20,
    seed: int = 0,
    max_points_per_centroid: int = 256,
) -> torch.Tensor:
    """k-means centroids of ``x [N, D]`` -> ``[nlist, D] float32`` (``nlist <= N``)."""
    assert x.dim() == 2, f"x must be [N, D], got {tuple(x.shape)}"
    xn = np.ascontiguousarray(x.detach().cpu().float().numpy())
    km = faiss.Kmeans(
        xn.shape[1],
        nlist,
        niter=iters,
        seed=seed,
        max_points_per_centroid=max_points_per_centroid,
        verbose=False,
    )
    km.train(xn)
    return torch.from_numpy(np.ascontiguousarray(km.centroids)).float()


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid (L2) of every row: ``x [N, D]`` -> ``[N] int64``."""
    quantizer = faiss.IndexFlatL2(centroids.shape[1])
    quantizer.add(np.ascontiguousarray(centroids.cpu().float().numpy()))
    _, nearest = quantizer.search(np.ascontiguousarray(x.detach().cpu().float().numpy()), 1)
    return torch.from_numpy(nearest[:, 0]).long()
