"""One executor runs any search plan on one index, choosing a backend by the plan's data.

    plan = plans.plan(tensors, filters, params, q)      planner.py (kept plans: PlanCache)
    backend "device": the whole search in fixed      device_search.py (the plan decided on
          shapes, no host read; on a GPU from a        the device: device_plan.py)
          CUDA graph per bucket
    keyed by id, a few CPU queries:  one C++ call      cpu_backend.py (where the plan allows)
    else: the rounds of search.run_search, each a      candidates.py (C++ scan on the CPU,
          fetch of candidates; a plain plan's first     Triton on a GPU); gpu_backend.py
          round on a GPU replayed from a CUDA graph

Every backend answers what the rounds answer, id for id: a one-call backend returns None
where a row would need a later round, and the rounds answer instead. The executor owns the
caches a search keeps (the planner's kept plans, the GPU's graphs), so nothing is written into
the index.

With live updates (``fresh.py``), the index's :class:`~retrieval.index.fresh.LiveSegment` joins
every step: the main index's scan excludes its tombstones, and each fetch's candidates take the
fresh rows' exact candidates beside them, so the rounds' own top-K is the merge of main and
fresh; a one-call backend's answer is merged with them in one top-K (``fresh.take_top_k``).
"""

from __future__ import annotations

import os

import torch

from retrieval.filters import FilterBatch
from retrieval.index.candidates import candidates, keyed_by_id
from retrieval.index.cpu_backend import lists_ids, shared_exact_ids
from retrieval.index.device_search import graphed_search, ids_of
from retrieval.index.fresh import LiveSegment, merged, take_top_k
from retrieval.index.gpu_backend import plain_first_round
from retrieval.index.plan import RowKind, SearchParams, SearchPlan
from retrieval.index.planner import PlanCache
from retrieval.index.readout import ids_at
from retrieval.index.search import Candidates, run_search
from retrieval.index.tensors import IndexTensors

BACKEND_ENV = "RECSERVE_INDEX_BACKEND"
"""``device`` / ``auto``: the backend every served index takes, whatever its device
(:func:`backend_for`); unset: the device's own."""


def backend_for(device: str | torch.device) -> str:
    """The backend an index served on ``device`` runs: ``"device"`` on a GPU (fixed shapes,
    the plan decided on the device, what a CUDA graph records), ``"auto"`` elsewhere (the
    host-planned rounds and their C++ backends); ``$RECSERVE_INDEX_BACKEND`` overrides both."""
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        return chosen
    return "device" if torch.device(device).type == "cuda" else "auto"


class Executor:
    """Runs plans on one index's tensors (given per call: a live update or a reload changes
    them) and keeps what searches repeat (:class:`~retrieval.index.planner.PlanCache`; on a GPU
    the CUDA graphs, kept per executor by ``cuda_graphs.run_graphed``)."""

    def __init__(self, backend: str | None = None) -> None:
        self.plans = PlanCache()
        self.backend = backend or os.environ.get(BACKEND_ENV, "auto")
        """``"device"``: every search through ``device_search`` (fixed shapes, the plan decided
        on the device, nothing read back: what a CUDA graph records, and what the CPU's device
        discipline tests run), but a recall target's, which is planned on the host; ``"auto"``:
        the host-planned rounds and their backends. A new executor takes
        ``$RECSERVE_INDEX_BACKEND``, else ``"auto"``; a load for serving sets the device's
        (:func:`backend_for`)."""

    def search(
        self,
        t: IndexTensors,
        q: torch.Tensor,
        fb: FilterBatch | None,
        params: SearchParams,
        positions: bool = False,
        live: LiveSegment | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` of ``q [B, D]`` (as given; scored inside) under ``fb`` (None: no clause,
        nothing excluded) -> ``(item ids [B, k], scores [B, k])``, or list-sorted positions
        instead of ids where ``positions`` (a fresh row ``j``: ``ntotal + j``); ``-1`` /
        ``-inf`` padded. ``live``: the index's live changes (None or empty: none); the device
        backend runs searches without them (with a live segment, the host's rounds run)."""
        live_rows = live is not None and live.size > 0
        if self.backend == "device" and params.target is None and not live_rows:
            pos, scores = graphed_search(self, t, q, fb, params)
            return (pos if positions else ids_of(t, pos)), scores
        plan = self.plans.plan(t, fb, params, q)
        if live_rows:
            assert live is not None
            return self._live_search(t, q, fb, plan, positions, live)
        if not positions:
            if plan.one_kind is RowKind.SHARED_EXACT:
                found = shared_exact_ids(t, q, fb, plan)
            else:
                found = lists_ids(t, q, fb, plan, whole=True)
            if found is not None:
                return found
        top = self.rounds(t, q, fb, plan)
        return (top.keys if positions else ids_at(t, top.keys)), top.scores

    def _live_search(
        self,
        t: IndexTensors,
        q: torch.Tensor,
        fb: FilterBatch | None,
        plan: SearchPlan,
        positions: bool,
        live: LiveSegment,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`search` of an index with live changes (``plan`` made)."""
        if not positions and not live.tomb_rows.numel():  # the one-call backends map ids
            found = shared_exact_ids(t, q, fb, plan)
            if found is None:
                found = lists_ids(t, q, fb, plan, whole=True)
            if found is not None:
                fresh = live.candidates(t.scored(q), fb, plan.k, t.ntotal)
                return take_top_k(found, live.by_id(fresh, t.ntotal, False, 0), plan.k)
        top = self.rounds(t, q, fb, plan, live)
        return (top.keys if positions else live.ids_at(t, top.keys)), top.scores

    def rounds(
        self,
        t: IndexTensors,
        q: torch.Tensor,
        fb: FilterBatch | None,
        plan: SearchPlan,
        live: LiveSegment | None = None,
    ) -> Candidates:
        """``plan``'s rounds over ``q [B, D]`` -> the top ``[B, k]`` (keys are positions; with
        ``live``, fresh row ``j`` is ``ntotal + j``)."""
        main_fb = fb
        if live is not None:
            main_fb = live.excluding_tombstones(t, fb, q.shape[0])
            scored = t.scored(q)

        def fetch(p: SearchPlan, rows: torch.Tensor | None) -> Candidates:
            if rows is None:
                c = candidates(t, q, main_fb, p)
            else:
                c = candidates(t, q[rows], None if main_fb is None else main_fb.rows(rows), p)
            if live is None:
                return c
            qq, ff = (scored, fb) if rows is None else (scored[rows], fb and fb.rows(rows))
            return merged(c, live.candidates(qq, ff, p.r, t.ntotal))

        first = plain_first_round(self, t, q, main_fb, plan)
        if first is not None and live is not None:
            first = merged(first, live.candidates(scored, fb, plan.r, t.ntotal))
        return run_search(plan, fetch, first)

    def item_candidates(
        self,
        t: IndexTensors,
        q: torch.Tensor,
        fb: FilterBatch | None,
        plan: SearchPlan,
        with_vectors: bool = False,
        live: LiveSegment | None = None,
    ) -> Candidates:
        """A document shard's candidates ``[B, r]`` for a router's ``plan``, keyed by item id
        with their vectors ``[B, r, D]`` when ``with_vectors``; in one C++ call where the plan
        allows. ``live``: the shard's live changes, whose fresh candidates join its main
        index's (the router's top-K merges them with every shard's)."""
        fresh = None
        main_fb = fb
        if live is not None and live.size:
            main_fb = live.excluding_tombstones(t, fb, q.shape[0])
            c = live.candidates(t.scored(q), fb, plan.r, t.ntotal)
            fresh = live.by_id(c, t.ntotal, with_vectors, t.centroids.shape[1])
        if not with_vectors and main_fb is fb:  # the one call maps excluded ids itself
            found = lists_ids(t, q, fb, plan, whole=False)
            if found is not None:
                return merged(Candidates(found[0], found[1], found[1]), fresh)
        return merged(keyed_by_id(t, candidates(t, q, main_fb, plan), with_vectors), fresh)
