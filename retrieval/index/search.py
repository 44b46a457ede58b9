"""A search in three steps, so that a sharded index can run the middle one on every shard:

    plan  = index.plan(filters, k, nprobe, rerank)    global statistics decide, per query row,
                                                      how many lists to probe or to scan exactly
    parts = index.candidates(q, filters, plan)        per index (or per shard): the best r
                                                      approximate candidates and their final scores
    top   = select(Candidates.concat(parts), plan)    top-r by approximate score, then top-k by
                                                      final score

:func:`run_search` ties them together. A plan made for the queries (``index.plan(..., q=q)``)
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

from retrieval.index.scan import second_round_cpu

NEG_INF = float("-inf")
WIDEN = 4
"""A row whose probed lists held fewer than k items probes this many times as many lists
before it is scanned exactly (a short unfiltered row's exact scan is the whole catalog)."""


@dataclass(frozen=True)
class BoundCheck:
    """What a plan needs to decide, after its first round, which rows probe more lists.

    ``bounds [B, nlist] float32``: the best score an eligible item of each list could reach
    (``-inf``: probed in the first round, or holding no item the row's filter admits, or a row
    without a check). ``sizes [nlist] int64``: items per list. ``budget [B] float32``: codes a
    second round may scan before the exact scan of the row's eligible items costs less.
    """

    bounds: torch.Tensor
    sizes: torch.Tensor
    budget: torch.Tensor

    def rows(self, rows: torch.Tensor) -> BoundCheck:
        return replace(self, bounds=self.bounds[rows], budget=self.budget[rows])

    def second_round(self, kth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``kth [B]``: each row's K-th best score after the first round -> ``(todo [B] bool``:
        rows some list could still improve, ``exact [B] bool``: those better scanned exactly,
        ``lists [B, P] int64``: the lists the others probe, ``-1`` padded)."""
        if self.bounds.device.type == "cpu":  # one C++ pass a row (~6 ms of torch ops at B = 1000)
            return second_round_cpu(self.bounds, kth.cpu(), self.sizes.cpu(), self.budget.cpu())
        return self.second_round_torch(kth)

    def second_round_torch(
        self, kth: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`second_round` in torch ops (a GPU's; the CPU's C++ pass gives the same)."""
        need = self.bounds > kth.to(self.bounds.device)[:, None]  # [B, nlist]
        count = need.sum(dim=1)
        todo = count > 0
        codes = (need.long() * self.sizes.to(need.device)).sum(dim=1).float()
        exact = todo & (codes > self.budget.to(need.device))
        p = int(count[todo & ~exact].max()) if bool((todo & ~exact).any()) else 1
        # needed lists first, by list index: the p smallest of (index, or nlist + index where not
        # needed); a top-p, not a stable sort of every [B, nlist] entry (7 ms of a 1000-row batch)
        nlist = need.shape[1]
        idx = torch.arange(nlist, device=need.device)
        key = torch.where(need, idx, idx + nlist)
        order = torch.topk(key, min(p, nlist), dim=1, largest=False, sorted=True).indices
        slot = torch.arange(order.shape[1], device=need.device)
        lists = torch.where(slot < count[:, None], order, torch.full_like(order, -1))
        return todo, exact, lists


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
    lists: torch.Tensor | None = None
    """``[B, P] int64``: when given, the lists each row probes (``-1`` skips a slot) instead of
    its best ``nprobe``, as the planner chose them (a filtered row skips the lists its filter
    rules out; a second round probes what the bound check asks for). Sent to the shards."""
    check: BoundCheck | None = None
    """Bounds on the lists the first round leaves out (the planner's alone: never sent)."""
    floor: torch.Tensor | None = None
    """``[B] float32``: a second round's K-th score so far; candidates below it cannot change
    the answer, and a scan may leave them out. Sent to the shards."""
    least: torch.Tensor | None = None
    """``[B] int64``: when given (with ``hold``), row b probes its best lists in order until
    they hold ``hold[b]`` items by the index's list sizes as built, at least ``least[b]`` (its
    nprobe) and at most ``nprobe[b]`` (``probe.lists_holding``): ``nprobe[b]`` is then a
    count from the average list. Sent to the shards."""
    hold: torch.Tensor | None = None
    """``[B] int64``: items row b's lists must hold (``planner.FILL`` times its ``r`` plus the
    items it excludes)."""

    def rows(self, rows: torch.Tensor) -> SearchPlan:
        """The plan of a subset of rows (``rows [b] int64``)."""
        return replace(
            self,
            nprobe=self.nprobe[rows],
            exact=self.exact[rows],
            lists=None if self.lists is None else self.lists[rows],
            check=None if self.check is None else self.check.rows(rows),
            floor=None if self.floor is None else self.floor[rows],
            least=None if self.least is None else self.least[rows],
            hold=None if self.hold is None else self.hold[rows],
        )

    def all_exact(self) -> SearchPlan:
        """The same rows, each scanned exactly."""
        return replace(self, exact=torch.ones_like(self.exact), lists=None, check=None, floor=None)

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
    """Candidates -> select; rows whose results a bound says unprobed lists could beat probe
    those lists (or scan exactly); rows left short after probing lists are re-asked as exact
    scans."""
    first = fetch(plan, None)
    top = select(first, plan)
    if plan.check is not None:
        _second_round(plan, plan.check, fetch, first, top)
    short = _short_rows(plan, top)
    if not bool(short.any()):
        return top
    if plan.lists is None:  # lists chosen by count: probe 4x as many first
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
    (results fill each row from the front). NumPy: a batch's few rows, ~3 torch ops less."""
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
    sub = replace(
        plan.rows(rows), exact=exact.cpu()[rows], lists=lists.cpu()[rows], check=None, floor=kth
    )
    more = fetch(sub, rows)
    # list rows: the best of both rounds (what one round over all their lists gives);
    # exact rows: the scan alone
    earlier = first.rows(rows.to(first.keys.device)).emptied(sub.exact)
    top.put(rows, select(Candidates.concat([earlier, more]).unique(), sub))
