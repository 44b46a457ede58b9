"""A search in three steps, so that a sharded index can run the middle one on every shard:

    plan  = index.plan(filters, params)               global statistics decide, per query row,
                                                      how many lists to probe or to scan exactly
    parts = candidates(tensors, q, filters, plan)     per index (or per shard): the best r
                                                      approximate candidates and their final scores
    top   = select(Candidates.concat(parts), plan)    top-r by approximate score, then top-k by
                                                      final score

:func:`run_search` ties them together. A plan made for the queries (``index.plan(..., q=q)``, ``plan.py``)
names its filtered rows' lists and carries a :class:`BoundCheck` (``retrieval/index/bound.py``): a row
whose k-th result is beaten by the bound of a list it did not probe asks again for just those
lists (a second round, merged with the first), or for an exact scan of its eligible items when
that costs less. Rows that come back with fewer than k results (a filter too narrow for the probed
lists, or short lists) first probe ``WIDEN`` times as many lists when the plan chose their lists
by count, then are re-asked as exact scans.

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

from retrieval.index.plan import BoundCheck, SearchPlan, kinds

NEG_INF = float("-inf")
WIDEN = 4
"""A row whose probed lists held fewer than k items probes this many times as many lists
before it is scanned exactly (a short unfiltered row's exact scan is the whole catalog)."""


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

    def rows(self, rows: torch.Tensor) -> Candidates:
        """The candidates of a subset of rows (``rows [b] int64``)."""
        vec = None if self.vectors is None else self.vectors[rows]
        return Candidates(self.keys[rows], self.approx[rows], self.scores[rows], vec)

    def emptied(self, rows: torch.Tensor) -> Candidates:
        """These candidates with the rows where ``rows [B] bool`` emptied (``-1`` / ``-inf``)."""
        drop = rows.to(self.keys.device)[:, None]
        return self._without(drop.expand_as(self.keys))

    def unique(self) -> Candidates:
        """Each key once per row: a repeat (two rounds may both hold an item) is emptied."""
        keys, order = self.keys.sort(dim=1)
        again = torch.zeros_like(keys, dtype=torch.bool)
        again[:, 1:] = (keys[:, 1:] == keys[:, :-1]) & (keys[:, 1:] >= 0)
        return self._without(torch.zeros_like(again).scatter_(1, order, again))

    def _without(self, drop: torch.Tensor) -> Candidates:
        return Candidates(
            self.keys.masked_fill(drop, -1),
            self.approx.masked_fill(drop, NEG_INF),
            self.scores.masked_fill(drop, NEG_INF),
            self.vectors,
        )

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
        rows = rows.to(self.keys.device)
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
    return select_top(c, plan.k, plan.r)


def select_top(c: Candidates, k: int, r: int) -> Candidates:
    """:func:`select` with the plan's ``k`` and ``r`` as numbers (the device path's)."""
    if c.width == k:
        return c
    if c.width < k:  # fewer candidates than k in total: pad
        pad = Candidates.empty(c.keys.shape[0], k - c.width, c.keys.device)
        if c.vectors is not None:
            pad = replace(pad, vectors=c.vectors.new_zeros(pad.keys.shape + c.vectors.shape[2:]))
        c = Candidates.concat([c, pad])
    if c.width > r:
        c = c.gather(c.approx.topk(r, dim=1).indices)
    top, idx = c.scores.topk(k, dim=1)
    out = c.gather(idx)
    return replace(out, keys=torch.where(top > NEG_INF, out.keys, torch.full_like(out.keys, -1)))


Fetch = Callable[[SearchPlan, torch.Tensor | None], Candidates]
"""``fetch(plan, rows)`` -> the (merged) candidates of query rows ``rows`` (None: every row)."""


def run_search(plan: SearchPlan, fetch: Fetch, first: Candidates | None = None) -> Candidates:
    """Candidates -> select; rows whose results a bound says unprobed lists could beat probe
    those lists (or scan exactly); rows left short after probing lists are re-asked as exact
    scans. ``first``: the first round's candidates where a backend fetched them already."""
    first = fetch(plan, None) if first is None else first
    top = select(first, plan)
    if plan.check is not None:
        _second_round(plan, plan.check, fetch, first, top)
    short = _short_rows(plan, top)
    if not bool(short.any()):
        return top
    if plan.lists is None:  # lists chosen by count: probe WIDEN x as many first
        rows = short.nonzero().flatten()
        sub = replace(  # every widened list: sizes as built can over-count (items removed)
            plan.rows(rows), nprobe=plan.nprobe[rows] * WIDEN, check=None, least=None, hold=None
        )
        top.put(rows, select(fetch(sub, rows), sub))
        short = _short_rows(plan, top)
    if bool(short.any()):
        rows = short.nonzero().flatten()
        sub = plan.rows(rows).all_exact()
        top.put(rows, select(fetch(sub, rows), sub))
    return top


def _short_rows(plan: SearchPlan, top: Candidates) -> torch.Tensor:
    """``[B] bool`` on the CPU: rows that probed lists and hold fewer than ``k`` results
    (results fill each row from the front). NumPy: a batch's few rows, fewer torch ops."""
    keys = top.keys if top.keys.is_cpu else top.keys[:, -1:].cpu()  # a GPU's last column
    return torch.from_numpy((keys.numpy()[:, -1] < 0) & ~plan.exact.cpu().numpy())


def _second_round(
    plan: SearchPlan, check: BoundCheck, fetch: Fetch, first: Candidates, top: Candidates
) -> None:
    """Rows of ``top`` whose k-th score is below the bound of a list they did not probe: their
    candidates from those lists (or an exact scan) merged with ``first``, written into ``top``.
    Rows still short are left to the exact re-ask (their k-th is ``-inf``)."""
    todo, exact, lists = check.second_round(top.scores[:, -1])
    todo = todo.cpu() & ~plan.exact & top.keys[:, -1].ge(0).cpu()
    if not bool(todo.any()):
        return
    rows = todo.nonzero().flatten()
    kth = top.scores[rows.to(top.scores.device), -1]  # what a list's candidate must reach
    second = exact.cpu()[rows]
    # the check's [B, nlist] bounds and the first round's lists are replaced: not copied per row
    sub = replace(
        replace(plan, check=None, lists=None).rows(rows), kind=kinds(second), exact_rows=second,
        lists=lists.cpu()[rows], floor=kth,
    )  # fmt: skip
    more = fetch(sub, rows)
    # list rows: the best of both rounds (what one round over all their lists gives);
    # exact rows: the scan alone
    merge_rounds(top, first, rows, sub, more)


def merge_rounds(
    top: Candidates, first: Candidates, rows: torch.Tensor, sub: SearchPlan, more: Candidates
) -> None:
    """Writes into ``top``'s ``rows [b]`` the ``select`` of each row's first-round candidates
    (``first [B, W1]``; none for ``sub``'s exact rows) beside its second round's (``more
    [b, W2]``), each key once. On the CPU in one C++ pass over blocks of rows: each of the torch
    ops of :func:`merge_rounds_torch`, big enough for torch to run on every thread, paid the
    thread team's wake-up (on a loaded 2-core machine, more than its work); equal scores there
    come in column order (first round first), where torch's top-k leaves their order open.
    ``top`` may be ``first`` itself (the C++ reads a row whole before it writes it)."""
    if not top.keys.is_cpu or first.vectors is not None or more.vectors is not None:
        merge_rounds_torch(top, first, rows, sub, more)
        return
    from retrieval.index.kernels import extension  # the C++ library; loaded on first use

    extension().merge_rounds(
        top.keys, top.approx, top.scores, first.keys.contiguous(), first.approx.contiguous(),
        first.scores.contiguous(), rows.contiguous(), sub.exact.cpu().contiguous(),
        more.keys.contiguous(), more.approx.contiguous(), more.scores.contiguous(), sub.r,
    )  # fmt: skip


def merge_rounds_torch(
    top: Candidates, first: Candidates, rows: torch.Tensor, sub: SearchPlan, more: Candidates
) -> None:
    """:func:`merge_rounds` in torch ops: a GPU's rounds (and candidates with vectors)."""
    earlier = first.rows(rows.to(first.keys.device)).emptied(sub.exact)
    top.put(rows, select(Candidates.concat([earlier, more]).unique(), sub))
