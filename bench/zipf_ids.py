"""Zipf(s) ids over a table's rows, truncated to the table: rank r in ``[1, rows]`` is drawn with
probability ``r^-s / H(rows, s)`` and mapped through a fixed permutation of the rows (so a
table's hot rows are the same in every batch and not simply the low ids).

``bench/tables.py``'s ``make_ids("zipf")`` instead draws from the unbounded Zipf and replaces
ranks beyond the table by uniform ids: at 1.1 that folds ~24 % of the draws of a 1M-row table
(and ~60 % of a 100-row one) into a uniform tail that no cache can hold, so it understates
every hit rate. These benches use the truncated law.

Example::

    ids = ZipfIds(rows=1_000_000, s=1.1, table_seed=3)
    batch = ids.draw((8, 10), np.random.default_rng(0))  # int64 [8, 10]
    ids.top_share(50_000)  # 0.889: the hit rate of a cache holding exactly the 50k hottest rows
"""

from __future__ import annotations

import numpy as np
import torch


class ZipfIds:
    """Draws ids of one table (``rows`` rows) from the truncated Zipf(``s``) law."""

    def __init__(self, rows: int, s: float = 1.1, table_seed: int = 0):
        pmf = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** s
        self.cdf = np.cumsum(pmf)
        self.cdf /= self.cdf[-1]
        self.perm = np.random.default_rng(10_000 + table_seed).permutation(rows)

    def draw(self, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
        """``int64`` ids of ``shape``."""
        ranks = np.searchsorted(self.cdf, rng.random(shape), side="right")
        return torch.from_numpy(self.perm[np.minimum(ranks, len(self.perm) - 1)])

    def top_share(self, k: int) -> float:
        """Probability that a draw is one of the ``k`` most frequent rows."""
        return float(self.cdf[min(k, len(self.cdf)) - 1]) if k > 0 else 0.0
