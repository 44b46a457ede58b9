"""The exact answers of anti-correlated filtered queries (``retrieval/data/anticorrelated.py``),
the reference the filtered-plan tests measure recall against."""

from __future__ import annotations

import numpy as np
import torch

from retrieval.data.anticorrelated import AntiCorrelated


def filtered_truth(data: AntiCorrelated, selectivity: float, k: int) -> torch.Tensor:
    """Exact top-``k`` item ids over each query's eligible items ``[B, k]`` (``-1`` pads)."""
    q, x = torch.from_numpy(data.q), torch.from_numpy(data.x)
    out = torch.full((len(q), k), -1, dtype=torch.int64)
    for h in np.unique(data.home):
        rows = torch.from_numpy(np.flatnonzero(data.home == h))
        ids = torch.from_numpy(np.flatnonzero(data.keep(int(h), selectivity)))
        top = (q[rows] @ x[ids].T).topk(min(k, len(ids)), dim=1).indices
        out[rows, : top.shape[1]] = ids[top]
    return out
