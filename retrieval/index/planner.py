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
               asks for 1, or the catalog is too small for lists (searched_exactly)

Each row's kind (``plan.RowKind``) says which of these it is: ``PLAIN`` rows (no clause, target,
re-rank or exact scan in the batch), ``LISTS``, ``EXACT``, or ``SHARED_EXACT`` where a whole batch
scans exactly under one filter. :class:`PlanCache` keeps the plans a served index repeats.
``sel_b`` is the filter's estimated selectivity, the whole expression's (``selectivity.py``). With the queries, filtered rows that probe lists
skip the lists their filter rules out and get a bound check for a second round
(``retrieval/index/bound.py``), with the slack their recall target reads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from retrieval.filters import COMPILED_FILTERS, FilterBatch
from retrieval.index.bound import with_bounds
from retrieval.index.costs import exact_codes, on_cpu, plan_seconds
from retrieval.index.plan import RowKind, SearchParams, SearchPlan, every, kinds
from retrieval.index.selectivity import estimate
from retrieval.index.targets import row_settings
from retrieval.index.tensors import IndexTensors

FILL = 2
"""A row's lists hold this many times the items it needs (its ``r`` and the items it
excludes): a margin for a filter's estimate, and candidates to choose the best ``r`` from,
which a large ``k`` needs (at 1 x, a ``k`` of half the catalog loses recall)."""

SMALL_CATALOG_FILL = FILL
"""A catalog of at most this many times ``IVFConfig.tune_k`` items is searched exactly: the
build measured its recall curve at K = ``tune_k``, where every sample query's lists had to hold
``FILL`` K items and so were every list (recall 1 at any nprobe), which says nothing of a
smaller K; and such a catalog scans whole in about the time its list plan takes."""


def make_plan(
    t: IndexTensors,
    fb: FilterBatch | None,
    params: SearchParams,
    q: torch.Tensor | None = None,
    batch: int | None = None,
) -> SearchPlan:
    """The plan of B rows (``batch``, else those of ``fb`` or ``q``) under filters ``fb`` (None:
    no clause, nothing excluded) with the settings ``params``; ``q [B, D]`` adds the bound check
    of a second round. Reads only the index's statistics in ``t``, so a router that holds them
    plans for its shards."""
    b = _rows(fb, q, batch)
    cfg, k = t.config, params.k
    r = _candidates(t, params)
    active = fb is not None and fb.active
    verifying = fb is not None and fb.verify is not None
    exact = params.exact or searched_exactly(t)
    rows = None
    if params.target is not None and params.targeted:
        rows = row_settings(
            params.target,
            params.nprobe,
            t.stats.filter_bound_slack,
            t.stats.recall_curve,
            t.stats.slack_curve,
        )
    # per row: Python numbers and NumPy (a batch's few rows: each torch op costs more)
    sel_t = None
    if fb is not None and active:
        sel_t = estimate(t.filter_sample, t.bit_counts, t.ntotal, fb)
    sel = [1.0] * b if sel_t is None else sel_t.tolist()  # [B]
    base = rows.nprobe.tolist() if rows is not None else [params.nprobe] * b
    excluded = excluded_counts(fb, b).tolist()
    keys = list(zip(sel, base, excluded, strict=True))  # few distinct: one each
    lists = {key: lists_for(t, key[0], key[1], r + key[2]) for key in set(keys)}
    p_np = np.array([lists[key] for key in keys], dtype=np.int64)
    p = torch.from_numpy(p_np)
    least, hold = _holding(t, sel, base, excluded, p_np, r)
    if not active and not exact and rows is None and not verifying:  # the common case
        return SearchPlan(k, r, p, every(b, RowKind.PLAIN), least=least, hold=hold)
    scan_exact = (  # sel_t is None exactly when no row has a clause
        cheaper_exact(t, sel_t, p, b) if sel_t is not None else torch.zeros(b, dtype=torch.bool)
    )
    if exact:
        scan_exact = torch.ones(b, dtype=torch.bool)
    if rows is not None:
        scan_exact |= rows.exact
    if verifying:  # exact clauses: their superset's best lists could miss what they keep
        scan_exact |= fb.verify.rows.cpu()  # type: ignore[union-attr]
    plan = SearchPlan(
        k, r, p, _kinds(fb, scan_exact), least=least, hold=hold, exact_rows=scan_exact
    )
    if q is None or cfg.filter_bound <= 0 or sel_t is None or fb is None:
        return plan
    return with_bounds(t, q, fb, plan, sel_t, None if rows is None else rows.slack)


def searched_exactly(t: IndexTensors) -> bool:
    """Every row of this index scans exactly: a catalog too small for lists to pay
    (:data:`SMALL_CATALOG_FILL`)."""
    return 0 < t.ntotal <= SMALL_CATALOG_FILL * t.config.tune_k


class PlanCache:
    """The plans a served index repeats, kept until anything they read of it changes.

    Plain plans (no clause, no target) by ``(B, k, nprobe, rerank)`` and the count of ids each
    row excludes: one query's plan then costs a lookup, a served user's (its history excluded)
    too. A batch sharing one filter (and excluding nothing): its exact plan (or that it takes
    lists) by filter, so a selective filter's search skips estimating and pricing it again
    (served requests repeat a few filters). Plans are never changed once made, so one serves
    every search that asks for it. Owned by the index's executor."""

    def __init__(self) -> None:
        self._reads: tuple[Any, ...] = (None,) * 7
        self._plain: dict[tuple[Any, ...], SearchPlan] = {}
        self._shared: dict[tuple[Any, ...], SearchPlan | None] = {}

    def plan(
        self, t: IndexTensors, fb: FilterBatch | None, params: SearchParams, q: torch.Tensor
    ) -> SearchPlan:
        """:func:`make_plan` of ``q [B, D]`` under ``fb`` with ``params``, from the cache where
        it holds it."""
        if params.target is not None or params.exact:
            return make_plan(t, fb, params, q)
        if fb is not None and fb.verify is not None:  # exact rows, whatever their filter
            return make_plan(t, fb, params, q)
        excludes = fb is not None and fb.exclude is not None
        if excludes and fb.active:  # type: ignore[union-attr]
            return make_plan(t, fb, params, q)
        if not _same_reads(t, self._reads):
            self._reads, self._plain, self._shared = _reads(t), {}, {}
        b = int(q.shape[0])
        if fb is None or not fb.active:
            key: tuple[Any, ...] = (b, params.k, params.nprobe, params.rerank)
            if excludes:  # a served user's history: its plan hangs on how many ids it excludes
                key += (excluded_counts(fb, b).tobytes(),)
            plan = self._plain.get(key)
            if plan is None:
                if len(self._plain) >= COMPILED_FILTERS:
                    self._plain.clear()
                plan = self._plain[key] = make_plan(t, fb, params, q)
            return plan
        if fb.masks.is_cpu and _one_filter(fb):
            kept = self._shared_exact(t, fb, params, b)
            if kept is not None:
                return kept
        return make_plan(t, fb, params, q)

    def _shared_exact(
        self, t: IndexTensors, fb: FilterBatch, params: SearchParams, b: int
    ) -> SearchPlan | None:
        """The ``SHARED_EXACT`` plan of ``b`` rows sharing ``fb``'s first filter where they scan
        exactly, as :func:`make_plan` decides (``cheaper_exact``); None where they take lists
        (:func:`make_plan` then plans them). Kept per filter and batch size."""
        masks, negate = fb.masks[:1], fb.negate[:1]
        none = None if fb.neg_masks is None else fb.neg_masks[:1]
        filt: tuple[bytes, ...] = (masks.numpy().tobytes(), negate.numpy().tobytes())
        if none is not None:
            filt += (none.numpy().tobytes(),)
        key = (*filt, params.k, params.nprobe, params.rerank, b)
        if key in self._shared:
            return self._shared[key]
        if len(self._shared) >= COMPILED_FILTERS:
            self._shared.clear()
        r = _candidates(t, params)
        sel = estimate(
            t.filter_sample, t.bit_counts, t.ntotal, FilterBatch(masks, negate, None, none)
        )
        lists = lists_for(t, float(sel[0]), params.nprobe, r)
        exact = searched_exactly(t) or bool(cheaper_exact(t, sel, torch.tensor([lists]), b)[0])
        nprobe = torch.full((b,), lists, dtype=torch.int64)
        plan = SearchPlan(params.k, r, nprobe, every(b, RowKind.SHARED_EXACT)) if exact else None
        self._shared[key] = plan
        return plan


def _candidates(t: IndexTensors, params: SearchParams) -> int:
    """``r``: the candidates a row keeps before re-ranking (``k`` without a re-rank)."""
    return max(params.k, params.rerank) if params.rerank and t.keeps_exact_copy else params.k


def _reads(t: IndexTensors) -> tuple[Any, ...]:
    """What a kept plan reads of the index besides the request: the config and the build's
    statistics (frozen: its pricing and measurements change only with them), the centroids (the
    lists and the device), the catalog's size, the bit counts and list sizes (with their in-place
    versions). Held, not their ids: a freed object's id may come back."""
    counts, sizes = t.bit_counts, t.built_sizes
    return (
        t.config, t.centroids, t.ntotal, counts, counts._version, sizes, sizes._version, t.stats
    )  # fmt: skip


def _same_reads(t: IndexTensors, held: tuple[Any, ...]) -> bool:
    """Whether ``t`` reads as ``held`` (:func:`_reads`), compared by identity."""
    counts, sizes = t.bit_counts, t.built_sizes
    return (
        t.config is held[0] and t.centroids is held[1] and t.ntotal == held[2]
        and counts is held[3] and counts._version == held[4]
        and sizes is held[5] and sizes._version == held[6] and t.stats is held[7]
    )  # fmt: skip


def _rows(fb: FilterBatch | None, q: torch.Tensor | None, batch: int | None) -> int:
    if batch is not None:
        return batch
    if fb is not None:
        return int(fb.masks.shape[0])
    if q is None:
        raise ValueError("make_plan: give the filters, the queries or the batch size")
    return int(q.shape[0])


def _kinds(fb: FilterBatch | None, exact: torch.Tensor) -> torch.Tensor:
    """``[B] int8``: exact rows ``SHARED_EXACT`` where the whole batch is exact under one filter
    and excludes nothing (one scan serves every row), else ``EXACT``; the others ``LISTS``."""
    out = kinds(exact)
    if not bool(exact.all()) or (fb is not None and fb.exclude is not None):
        return out
    if fb is None or not fb.active or _one_filter(fb):
        out.fill_(int(RowKind.SHARED_EXACT))
    return out


def _one_filter(fb: FilterBatch) -> bool:
    """Every row of ``fb`` has the first row's clauses."""
    masks, negate = fb.masks, fb.negate
    if masks.shape[0] <= 1:
        return True
    same = bool((masks == masks[:1]).all()) and bool((negate == negate[:1]).all())
    none = fb.neg_masks
    same = same and (none is None or bool((none == none[:1]).all()))
    if same and fb.verify is not None:
        key = fb.verify.key()
        same = bool((key == key[:1]).all())
    return same


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
    index: IndexTensors,
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
    index: IndexTensors, sel: torch.Tensor, lists: torch.Tensor, batch: int
) -> torch.Tensor:
    """``[B] bool``: rows (selectivity ``sel [B]``, first round of ``lists [B]``) whose exact
    scan costs no more than their list plan, by the times the build measured on this machine
    (``retrieval/index/costs.py``), else by ``exact_cost`` against the lists' codes. A row
    admitting every item takes lists, as it does alone: its plan, and so its
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


def lists_for(index: IndexTensors, sel: float, base: int, need: int) -> int:
    """Lists for a row admitting ``sel`` of the items, probing ``base`` at least: widened as
    ``sel ** -exponent``, and enough lists of average size to hold ``FILL need`` eligible
    items. Python floats: a batch has few distinct rows, and tensor arithmetic costs more than
    the arithmetic for one request."""
    nlist = max(index.nlist, 1)
    s = max(sel, 1e-9)
    widen = base * s**-index.config.filter_nprobe_exponent
    fill = FILL * need / (index.ntotal / nlist * s)
    return int(min(nlist, max(base, math.ceil(max(widen, fill)))))
