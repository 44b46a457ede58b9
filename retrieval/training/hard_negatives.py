"""Hard negatives mined from the model's own index while it trains.

In-batch and uniform negatives are mostly easy: items far from the user. The index the model
serves with finds the items the model currently ranks high for a user, and those it ranks high
wrongly are the informative negatives. Once per epoch (from the second on: a random model's
neighbours teach nothing) the item tower embeds the catalog and an IVF index is built over it
(``retrieval.index.build.build_ivf``, the serving index's code). Each step, ``count`` rows of the
batch search it with their current query vectors and each gives one item at a random rank in
``[lo, hi)`` of its result (not its own positive): an item close to the user but, most likely, not
one the user would pick. Skipping the top ``lo`` ranks keeps the user's likely future positives
(false negatives) out.

The mined items join the step's columns like uniform negatives (``TrainConfig.random_negatives``):
the same log-Q correction, each seen by every row of the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from retrieval.features import UserBatch
from retrieval.index.build import build_ivf
from retrieval.index.config import IVFConfig
from retrieval.index.ivf import IVFIndex
from retrieval.index.kmeans import default_nlist
from retrieval.model import RetrievalModel


class HardNegativeMiner:
    """``count`` hard negatives per step from ranks ``[lo, hi)`` of the model's index."""

    def __init__(self, count: int, ranks: tuple[int, int], seed: int):
        lo, hi = ranks
        if count < 0 or not 0 <= lo < hi:
            raise ValueError(f"hard negatives: count >= 0 and 0 <= lo < hi, got {count}, {ranks}")
        self.count, self.lo, self.hi, self.seed = count, lo, hi, seed
        self.index: IVFIndex | None = None
        """The catalog as the item tower saw it at the last :meth:`refresh` (None: not yet)."""

    @torch.no_grad()
    def refresh(
        self, model: RetrievalModel, item_features: Mapping[str, torch.Tensor], chunk: int = 65536
    ) -> None:
        """Embeds the catalog ``item_features {name: [N, L]}`` with the current item tower and
        builds the index searched by :meth:`mine`."""
        vecs = model.catalog_vectors(item_features, chunk)
        nlist = default_nlist(vecs.shape[0])
        cfg = IVFConfig(nlist=nlist, nprobe=max(1, nlist // 4), seed=self.seed)
        self.index = build_ivf(vecs, cfg)

    @torch.no_grad()
    def mine(
        self, model: RetrievalModel, batch: UserBatch, positives: np.ndarray, epoch: int, step: int
    ) -> np.ndarray:
        """Up to ``count`` item ids ``[C] int64`` for the step's users ``batch`` (B rows) and
        their positives ``[B]``; empty before the first :meth:`refresh`. The query vectors come
        from a gradient-free forward of the sampled rows (a fused table steps only in
        backward, so this lookup changes nothing)."""
        if self.index is None or self.count == 0:
            return np.zeros(0, dtype=np.int64)
        rng = np.random.default_rng([self.seed, epoch, step, 2])
        rows = rng.choice(len(positives), min(self.count, len(positives)), replace=False)
        q = model.user_vectors(batch.rows(torch.from_numpy(rows)))  # [C, D]
        hi = min(self.hi, self.index.ntotal)
        ids, _ = self.index.search(q, hi)  # [C, hi]
        pick = rng.integers(min(self.lo, hi - 1), hi, len(rows))
        out = ids.numpy()[np.arange(len(rows)), pick]
        return out[(out >= 0) & (out != positives[rows])]
