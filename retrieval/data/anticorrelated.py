"""Clustered vectors whose filters are anti-correlated with the queries: each query's eligible
items come from clusters *away* from its own neighbourhood: the hard case for a filtered IVF search.

A filter on an attribute independent of the vectors keeps the same share of every IVF list, so
the lists nearest a query hold its best eligible items too. Here they hold none: the clusters
nearest a query's home are ineligible, and the eligible ones are drawn from the rest. A plan
that probes lists until they *contain* K eligible items then stops at eligible items that are
not the best ones.

* items ``x [N, D] float32``: ``n_centres`` Gaussian centres scaled by 3 plus unit-variance
  noise (as ``bench/ann_data.py``); ``cluster [N] int64`` is each item's centre, the attribute
  filters name (``cluster in {3, 17, ...}``);
* queries ``q [B, D] float32``: ``homes`` centres, ``B / homes`` queries drawn around each
  (``home [B] int64``), so a batch holds only ``homes`` distinct filters;
* :meth:`AntiCorrelated.eligible_clusters`: for a home and a selectivity ``s``, the nearest
  ``neighbourhood`` share of the centres (by inner product with the home's centre, the score
  the index ranks by) are ineligible, and ``round(s * n_centres)`` clusters are drawn at random
  from the others.

Example::

    data = anticorrelated(n=20_000, d=32, n_queries=200, n_centres=200)
    texts = data.filters(0.2)                       # B filter strings, one per query row
    keep = data.keep(home=3, selectivity=0.2)       # [N] bool, the items that filter admits
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CENTRE_SCALE = 3.0
SELECTIVITIES = (0.5, 0.2, 0.1, 0.01, 0.001)
"""The selectivities the filtered benchmarks cover, from a broad filter to a very selective one:
50 / 20 / 10 / 1 / 0.1 %."""


@dataclass(frozen=True)
class AntiCorrelated:
    """Items, queries and the clusters that make up each query's filter.

    ``x [N, D]``, ``cluster [N]``, ``centres [M, D]``, ``q [B, D]``, ``home [B]`` (a centre id);
    ``neighbourhood``: the share of centres nearest a home that its filters exclude.
    """

    x: np.ndarray
    cluster: np.ndarray
    centres: np.ndarray
    q: np.ndarray
    home: np.ndarray
    neighbourhood: float
    seed: int

    @property
    def attribute_values(self) -> dict[str, list[int]]:
        """The vocabulary of the one attribute, ``cluster``: the centre ids."""
        return {"cluster": list(range(len(self.centres)))}

    @property
    def attributes(self) -> dict[str, np.ndarray]:
        return {"cluster": self.cluster}

    def eligible_clusters(self, home: int, selectivity: float) -> np.ndarray:
        """Sorted centre ids ``[m] int64`` admitted for queries of ``home`` at ``selectivity``
        (at least one): drawn from the centres outside the home's neighbourhood."""
        m = len(self.centres)
        order = np.argsort(-(self.centres @ self.centres[home]), kind="stable")  # nearest first
        far = order[int(np.ceil(self.neighbourhood * m)) :]
        count = min(len(far), max(1, round(selectivity * m)))
        rng = np.random.default_rng([self.seed, home, round(selectivity * 1e6)])
        return np.sort(rng.choice(far, size=count, replace=False))

    def keep(self, home: int, selectivity: float) -> np.ndarray:
        """``[N] bool``: the items a query of ``home`` may return at ``selectivity``."""
        return np.isin(self.cluster, self.eligible_clusters(home, selectivity))

    def filters(self, selectivity: float) -> list[str]:
        """One filter string per query row (rows of one home share it)."""
        text = {
            int(h): "cluster in {"
            + ",".join(map(str, self.eligible_clusters(int(h), selectivity)))
            + "}"
            for h in np.unique(self.home)
        }
        return [text[int(h)] for h in self.home]


def anticorrelated(
    n: int,
    d: int,
    n_queries: int,
    *,
    n_centres: int = 1000,
    homes: int = 20,
    neighbourhood: float = 0.05,
    seed: int = 0,
) -> AntiCorrelated:
    """``n`` items around ``n_centres`` centres, ``n_queries`` queries around ``homes`` of them
    (distinct centres, queries spread evenly); see the module docstring."""
    if not 0.0 <= neighbourhood < 1.0:
        raise ValueError(f"neighbourhood: must be in [0, 1), got {neighbourhood}")
    if not 1 <= homes <= n_centres:
        raise ValueError(f"homes: must be in [1, n_centres={n_centres}], got {homes}")
    rng = np.random.default_rng(seed)
    centres = CENTRE_SCALE * rng.standard_normal((n_centres, d), dtype=np.float32)
    cluster = rng.integers(0, n_centres, size=n)
    x = centres[cluster] + rng.standard_normal((n, d), dtype=np.float32)
    home_ids = rng.choice(n_centres, size=homes, replace=False)
    home = home_ids[np.arange(n_queries) % homes]
    q = centres[home] + rng.standard_normal((n_queries, d), dtype=np.float32)
    return AntiCorrelated(
        x=np.ascontiguousarray(x, dtype=np.float32),
        cluster=cluster.astype(np.int64),
        centres=centres,
        q=np.ascontiguousarray(q, dtype=np.float32),
        home=home.astype(np.int64),
        neighbourhood=neighbourhood,
        seed=seed,
    )
