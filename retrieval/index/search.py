"""A search in three steps, so that a sharded index can run the middle one on every shard:

    plan  = index.plan(filters, k, nprobe, rerank)    global statistics decide, per query row,
                                                      how many lists to probe or to scan exactly
    parts = index.candidates(q, filters, plan)        per index (or per shard): the best r
                                                      approximate candidates and their final scores
    top   = select(Candidates.concat(parts), plan)    top-r by approximate score, then top-k by
                                                      final score

:func:`run_search` ties them together and re-asks, as exact scans, the rows that came back with
fewer than k results (a filter too narrow for the probed lists).

Why a sharded search equals the unsharded one: an item's approximate score (its list's
centroid plus its code) and its exact score do not depend on which other items an index holds,
and every shard probes the same lists (the centroids are global). So the best r approximate
candidates of the whole catalog are among the union of every shard's best r, and ``select``
over that union picks exactly the unsharded top-r, then the same top-k. Whether a row is short
is decided on the merged result, so one shard's short answer never triggers an exact scan the
unsharded index would not make.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SearchPlan:
    """What every index (or shard) does for each of B query rows."""

    k: int
    """Results wanted per row."""
    r: int
    """Approximate candidates kept before re-ranking by exact score (``k`` without re-rank)."""
    nprobe: torch.Tensor
    """``[B] int64``: lists each row probes."""
    exact: torch.Tensor
    """``[B] bool``: rows scanned exactly over their eligible items instead."""

    def rows(self, rows: torch.Tensor) -> SearchPlan:
        """The plan of a subset of rows (``rows [b] int64``)."""
        return replace(self, nprobe=self.nprobe[rows], exact=self.exact[rows])

    def all_exact(self) -> SearchPlan:
        """The same rows, each scanned exactly."""
        return replace(self, exact=torch.ones_like(self.exact))

    @property
    def reranks(self) -> bool:
        """Re-ranked: candidates carry exact scores that differ from their approximate ones."""
        return self.r > self.k


@dataclass(frozen=True)
class Candidates:
    """Candidates of B rows, ``-1`` / ``-inf`` padded, in no particular order across parts.

    ``keys [B, R] int64``: positions in one index, or item ids once a shard mapped them.
    ``approx [B, R] float32``: the score the first cut ranks by (top-r).
    ``scores [B, R] float32``: the final score (exact after re-rank; else ``approx``).
    ``vectors [B, R, D] float32``: the candidates' vectors, when a scoring head needs them.
    """

    keys: torch.Tensor
    approx: torch.Tensor
    scores: torch.Tensor
    vectors: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return int(self.keys.shape[1])

    def gather(self, idx: torch.Tensor) -> Candidates:
        """Columns ``idx [B, R']`` of every field."""
        vec = None
        if self.vectors is not None:
            vec = self.vectors.gather(1, idx.unsqueeze(-1).expand(-1, -1, self.vectors.shape[2]))
        return Candidates(
            self.keys.gather(1, idx), self.approx.gather(1, idx), self.scores.gather(1, idx), vec
        )

    @staticmethod
    def concat(parts: Sequence[Candidates]) -> Candidates:
        """Side by side (every part has the same B rows)."""
        if len(parts) == 1:
            return parts[0]
        vec = None
        if all(p.vectors is not None for p in parts):
            vec = torch.cat([p.vectors for p in parts if p.vectors is not None], dim=1)
        return Candidates(
            torch.cat([p.keys for p in parts], dim=1),
            torch.cat([p.approx for p in parts], dim=1),
            torch.cat([p.scores for p in parts], dim=1),
            vec,
        )

    @staticmethod
    def empty(b: int, width: int, device: torch.device | str = "cpu") -> Candidates:
        return Candidates(
            torch.full((b, width), -1, dtype=torch.int64, device=device),
            torch.full((b, width), NEG_INF, device=device),
            torch.full((b, width), NEG_INF, device=device),
        )

    def put(self, rows: torch.Tensor, other: Candidates) -> None:
        """Writes ``other``'s columns into ``rows`` (``other`` may be narrower: the rest pads)."""
        w = other.width
        self.keys[rows] = -1
        self.approx[rows] = NEG_INF
        self.scores[rows] = NEG_INF
        self.keys[rows, :w], self.approx[rows, :w], self.scores[rows, :w] = (
            other.keys,
            other.approx,
            other.scores,
        )
        if self.vectors is not None and other.vectors is not None:
            self.vectors[rows] = 0.0
            self.vectors[rows, :w] = other.vectors


def select(c: Candidates, plan: SearchPlan) -> Candidates:
    """Top-``r`` by approximate score, then top-``k`` by final score -> ``[B, k]``, best first.

    A part of width ``k`` is taken as it is: one index's candidates are already best first by
    their final score when there is no re-rank (the only case in which the width is ``k``).
    """
    k = plan.k
    if c.width == k:
        return c
    if c.width < k:  # fewer candidates than k in total: pad
        pad = Candidates.empty(c.keys.shape[0], k - c.width, c.keys.device)
        if c.vectors is not None:
            pad = replace(pad, vectors=c.vectors.new_zeros(pad.keys.shape + c.vectors.shape[2:]))
        c = Candidates.concat([c, pad])
    if c.width > plan.r:
        c = c.gather(c.approx.topk(plan.r, dim=1).indices)
    top, idx = c.scores.topk(k, dim=1)
    out = c.gather(idx)
    return replace(out, keys=torch.where(top > NEG_INF, out.keys, torch.full_like(out.keys, -1)))


Fetch = Callable[[SearchPlan, torch.Tensor | None], Candidates]
"""``fetch(plan, rows)`` -> the (merged) candidates of query rows ``rows`` (None: every row)."""


def run_search(plan: SearchPlan, fetch: Fetch) -> Candidates:
    """Candidates -> select; rows left short after probing lists are re-asked as exact scans."""
    top = select(fetch(plan, None), plan)
    short = ~plan.exact & top.keys[:, -1].lt(0)  # results fill each row from the front
    if bool(short.any()):
        rows = short.nonzero().flatten()
        sub = plan.rows(rows).all_exact()
        top.put(rows, select(fetch(sub, rows), sub))
    return top
