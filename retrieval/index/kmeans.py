"""Coarse quantizer training and assignment (faiss k-means on CPU).

faiss asks for at least ``MIN_POINTS_PER_CENTROID`` (39) points per centroid and prints a
"please provide at least N training points" line on stderr for every smaller training set.
:func:`default_nlist` keeps catalog-sized defaults above that bound; a larger ``nlist`` asked for
explicitly still trains (its centroids are noisier) and is explained once per process in our
log instead of once per build on stderr.
"""

from __future__ import annotations

import logging
import math

import faiss
import numpy as np
import torch

log = logging.getLogger(__name__)

MIN_POINTS_PER_CENTROID = 39
"""faiss's ``ClusteringParameters.min_points_per_centroid``: fewer points per centroid warn."""
_explained: set[tuple[int, int]] = set()


def default_nlist(num_items: int) -> int:
    """Inverted lists for a catalog of ``num_items``: about sqrt(N), but never fewer than
    ``MIN_POINTS_PER_CENTROID`` items per list (80 items: 2 lists; 10,000: 100)."""
    return max(1, min(math.isqrt(num_items), num_items // MIN_POINTS_PER_CENTROID))


def train_centroids(
    x: torch.Tensor,
    nlist: int,
    *,
    iters: int = 20,
    seed: int = 0,
    max_points_per_centroid: int = 256,
    by: str = "l2",
) -> torch.Tensor:
    """k-means centroids of ``x [N, D]`` -> ``[nlist, D] float32`` (``nlist <= N``); each
    iteration assigns points by ``by``: "l2" (nearest), "ip" (largest x·c, as faiss trains an
    inner-product IVF)."""
    assert x.dim() == 2, f"x must be [N, D], got {tuple(x.shape)}"
    xn = np.ascontiguousarray(x.detach().cpu().float().numpy())
    _explain_small(len(xn), nlist)
    cp = faiss.ClusteringParameters()
    cp.niter, cp.seed, cp.verbose = iters, seed, False
    cp.max_points_per_centroid = max_points_per_centroid
    cp.min_points_per_centroid = 1  # faiss's own warning, said once by _explain_small instead
    clustering = faiss.Clustering(xn.shape[1], nlist, cp)
    clustering.train(xn, _flat(xn.shape[1], by))
    centroids = faiss.vector_to_array(clustering.centroids).reshape(nlist, xn.shape[1])
    return torch.from_numpy(np.ascontiguousarray(centroids)).float()


def _flat(d: int, by: str) -> faiss.Index:
    return faiss.IndexFlatIP(d) if by == "ip" else faiss.IndexFlatL2(d)


def _explain_small(n: int, nlist: int) -> None:
    """Logs once per (n, nlist) that k-means has fewer points per list than faiss asks for."""
    if nlist <= 1 or n >= nlist * MIN_POINTS_PER_CENTROID or (n, nlist) in _explained:
        return
    _explained.add((n, nlist))
    log.warning(
        "k-means of %d vectors into nlist = %d lists: %.1f per list, fewer than the %d faiss "
        "asks for, so centroids are noisy (the index still works; nprobe is tuned for recall). "
        "Leave [model.index] nlist unset for %d lists on this catalog, or lower it.",
        n, nlist, n / nlist, MIN_POINTS_PER_CENTROID, default_nlist(n),
    )  # fmt: skip


def assign(x: torch.Tensor, centroids: torch.Tensor, by: str = "l2") -> torch.Tensor:
    """The list of every row by ``by`` ("l2": nearest centroid, "ip": largest x·c):
    ``x [N, D]`` -> ``[N] int64``."""
    quantizer = _flat(centroids.shape[1], by)
    quantizer.add(np.ascontiguousarray(centroids.cpu().float().numpy()))
    _, nearest = quantizer.search(np.ascontiguousarray(x.detach().cpu().float().numpy()), 1)
    return torch.from_numpy(nearest[:, 0]).long()
