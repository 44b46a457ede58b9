"""The search plan: per query row, how many lists to probe, or an exact scan of its eligible items.

Reads only an index's statistics (``ntotal``, ``nlist``, ``bit_counts``, ``list_radius``,
``list_bits``) and its config, so a router that holds them plans for its shards. Per row b::

    base_b   = nprobe, or what the row's recall target reads off the recall curve (targets.py)
    lists_b  = max(base_b * sel_b ** -exponent,                  widened as the filter narrows
                   2 (r + S_b) / (items per list * sel_b))         enough to hold the candidates
                                                                   and the S_b items it excludes
               a row without a filter clause: its best lists until they hold 2 (r + S_b)
               items by their sizes as built, at least base_b, at most lists_b
               (probe.lists_holding)
    exact_b  = the exact scan of its eligible items costs no more than its list plan, by the
               times the build measured on this machine (``retrieval/index/costs.py``; an index
               without them: sel_b * N * exact_cost <= lists_b * items per list), or its target
               asks for 1

``sel_b`` is the filter's estimated selectivity. With the queries, filtered rows that probe lists
skip the lists their filter rules out and get a bound check for a second round
(``retrieval/index/bound.py``), with the slack their recall target reads.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

from retrieval.filters import FilterBatch, estimate_selectivity
from retrieval.index.bound import ListedIndex, with_bounds
from retrieval.index.costs import exact_codes, on_cpu, plan_seconds
from retrieval.index.search import SearchPlan
from retrieval.index.targets import row_settings

FILL = 2
"""A row's lists hold this many times the items it needs (its ``r`` and the items it
excludes): a margin for a filter's estimate, and candidates to choose the best ``r`` from,
which a large ``k`` needs (K = 10,000 of 20,000 items in 128 lists: recall 0.973 at 1 x,
0.999 at 2 x)."""


class PlannedIndex(ListedIndex, Protocol):
    """What the planner reads of an index (a protocol: see :class:`ListedIndex`)."""

    bit_counts: torch.Tensor
    built_sizes: torch.Tensor

    @property
    def keeps_exact_copy(self) -> bool: ...


def make_plan(
    index: PlannedIndex,
    fb: FilterBatch,
    k: int,
    nprobe: int,
    rerank: int,
    exact: bool = False,
    q: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
) -> SearchPlan:
    """The plan of B rows under filters ``fb``: ``k`` results each, ``nprobe`` lists at least
    (rows with a ``target [B]`` recall above 0 read theirs off the index's curves), ``exact``
    for every row; ``q [B, D]`` adds the bound check of a second round."""
    b = fb.masks.shape[0]
    cfg = index.config
    r = max(k, rerank) if rerank and index.keeps_exact_copy else k
    rows = None
    if target is not None and bool((target > 0).any()):
        rows = row_settings(
            target,
            nprobe,
            index.stats.filter_bound_slack,
            index.stats.recall_curve,
            index.stats.slack_curve,
        )
    # per row: Python numbers and NumPy (a batch's few rows: each torch op costs ~5 us)
    sel_t = estimate_selectivity(fb, index.bit_counts, index.ntotal).cpu() if fb.active else None
    sel = [1.0] * b if sel_t is None else sel_t.tolist()  # [B]
    base = rows.nprobe.tolist() if rows is not None else [nprobe] * b
    excluded = excluded_counts(fb, b).tolist()
    keys = list(zip(sel, base, excluded, strict=True))  # few distinct: one each
    lists = {key: lists_for(index, key[0], key[1], r + key[2]) for key in set(keys)}
    p_np = np.array([lists[key] for key in keys], dtype=np.int64)
    p = torch.from_numpy(p_np)
    least, hold = _holding(index, sel, base, excluded, p_np, r)
    if not fb.active and not exact and rows is None:  # the common case
        return SearchPlan(k, r, p, torch.zeros(b, dtype=torch.bool), least=least, hold=hold)
    scan_exact = (  # sel_t is None exactly when no row has a clause
        cheaper_exact(index, sel_t, p, b) if sel_t is not None else torch.zeros(b, dtype=torch.bool)
    )
    if exact:
        scan_exact = torch.ones(b, dtype=torch.bool)
    if rows is not None:
        scan_exact |= rows.exact
    plan = SearchPlan(k, r, p, scan_exact, least=least, hold=hold)
    if q is None or cfg.filter_bound <= 0 or sel_t is None:
        return plan
    return with_bounds(index, q, fb, plan, sel_t, None if rows is None else rows.slack)


def excluded_counts(fb: FilterBatch | None, b: int) -> np.ndarray:
    """``[B] int64``: the item ids each of ``b`` rows excludes (``fb.exclude >= 0``; None or no
    exclusions: zeros). NumPy: a batch's few rows, no torch op."""
    if fb is None or fb.exclude is None or not fb.exclude.numel():
        return np.zeros(b, dtype=np.int64)
    return (fb.exclude.cpu().numpy() >= 0).sum(axis=1).astype(np.int64)


def hold_counts(need: int, excluded: np.ndarray) -> np.ndarray:
    """``[B] int64``: the items each row's lists must hold, ``FILL`` times its ``need`` plus the
    ids it excludes (``excluded [B]``, :func:`excluded_counts`)."""
    return FILL * (need + excluded.astype(np.int64))


def _holding(
    index: PlannedIndex,
    sel: list[float],
    base: list[int],
    excluded: list[int],
    lists: np.ndarray,
    r: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(least [B], hold [B])`` of a plan (``SearchPlan.least``): rows without a filter clause
    probe their lists until these hold ``FILL`` times ``r`` plus what they exclude (by their
    sizes, where ``lists`` counted lists of average size), at least ``base``; a filtered row's
    ``least`` is its ``lists`` (what its lists hold of its filter is an estimate). None where no row would probe fewer than ``lists``, or the index has no sizes
    as built (saved before them)."""
    if not index.built_sizes.numel():
        return None, None
    plain = np.array(sel) >= 1.0
    least = np.where(plain, np.array(base, dtype=np.int64), lists)
    if not (least < lists).any():
        return None, None
    hold = hold_counts(r, np.array(excluded))
    return torch.from_numpy(least), torch.from_numpy(hold)


def cheaper_exact(
    index: PlannedIndex, sel: torch.Tensor, lists: torch.Tensor, batch: int
) -> torch.Tensor:
    """``[B] bool``: rows (selectivity ``sel [B]``, first round of ``lists [B]``) whose exact
    scan costs no more than their list plan, by the times the build measured on this machine
    (``retrieval/index/costs.py``), else by ``exact_cost`` against the lists' codes. A row
    admitting every item takes lists, as it does alone (``plain.py``): its plan, and so its
    scores (the scan's int8 query, the exact scan's floats), must not hinge on whether a
    filtered request shares its batch."""
    cfg, n, measured = index.config, index.ntotal, on_cpu(index)
    per_list = n / max(index.nlist, 1)

    def cheaper(s: float, p: int) -> bool:
        if s >= 1.0:
            return False
        times = plan_seconds(index.stats, n, s, p, batch, measured)
        if times is not None:
            return times[0] <= times[1]
        return exact_codes(cfg, index.stats, n, s, batch, measured=False) <= p * per_list

    keys = list(zip(sel.tolist(), lists.tolist(), strict=True))  # few distinct: one each
    answer = {key: cheaper(*key) for key in set(keys)}
    return torch.tensor([answer[key] for key in keys], dtype=torch.bool)


def lists_for(index: PlannedIndex, sel: float, base: int, need: int) -> int:
    """Lists for a row admitting ``sel`` of the items, probing ``base`` at least: widened as
    ``sel ** -exponent``, and enough lists of average size to hold ``FILL need`` eligible
    items. Python floats: a batch has few distinct rows, and tensor arithmetic costs ~20x more
    for one request."""
    nlist = max(index.nlist, 1)
    s = max(sel, 1e-9)
    widen = base * s**-index.config.filter_nprobe_exponent
    fill = FILL * need / (index.ntotal / nlist * s)
    return int(min(nlist, max(base, math.ceil(max(widen, fill)))))
