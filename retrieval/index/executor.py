"""One executor runs any search plan on one index, choosing a backend by the plan's data.

    plan = plans.plan(tensors, filters, params, q)      planner.py (kept plans: PlanCache)
    keyed by id, a few CPU queries:  one C++ call      cpu_backend.py (where the plan allows)
    else: the rounds of search.run_search, each a      candidates.py (C++ scan on the CPU,
          fetch of candidates; a plain plan's first     Triton on a GPU); gpu_backend.py
          round on a GPU replayed from a CUDA graph

Every backend answers what the rounds answer, id for id: a one-call backend returns None
where a row would need a later round, and the rounds answer instead. The executor owns the
caches a search keeps (the planner's kept plans, the GPU's graphs), so nothing is written into
the index.
"""

from __future__ import annotations

import torch

from retrieval.filters import FilterBatch
from retrieval.index.candidates import candidates, keyed_by_id
from retrieval.index.cpu_backend import lists_ids, shared_exact_ids
from retrieval.index.gpu_backend import plain_first_round
from retrieval.index.plan import RowKind, SearchParams, SearchPlan
from retrieval.index.planner import PlanCache
from retrieval.index.readout import ids_at
from retrieval.index.search import Candidates, run_search
from retrieval.index.tensors import IndexTensors


class Executor:
    """Runs plans on one index's tensors (given per call: a live update or a reload changes
    them) and keeps what searches repeat (:class:`~retrieval.index.planner.PlanCache`; on a GPU
    the CUDA graphs, kept per executor by ``cuda_graphs.run_graphed``)."""

    def __init__(self) -> None:
        self.plans = PlanCache()

    def search(
        self,
        t: IndexTensors,
        q: torch.Tensor,
        fb: FilterBatch | None,
        params: SearchParams,
        positions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` of ``q [B, D]`` (as given; scored inside) under ``fb`` (None: no clause,
        nothing excluded) -> ``(item ids [B, k], scores [B, k])``, or list-sorted positions
        instead of ids where ``positions``; ``-1`` / ``-inf`` padded."""
        plan = self.plans.plan(t, fb, params, q)
        if not positions:
            if plan.one_kind is RowKind.SHARED_EXACT:
                found = shared_exact_ids(t, q, fb, plan)
            else:
                found = lists_ids(t, q, fb, plan, whole=True)
            if found is not None:
                return found
        top = self.rounds(t, q, fb, plan)
        return (top.keys if positions else ids_at(t, top.keys)), top.scores

    def rounds(
        self, t: IndexTensors, q: torch.Tensor, fb: FilterBatch | None, plan: SearchPlan
    ) -> Candidates:
        """``plan``'s rounds over ``q [B, D]`` -> the top ``[B, k]`` (keys are positions)."""

        def fetch(p: SearchPlan, rows: torch.Tensor | None) -> Candidates:
            if rows is None:
                return candidates(t, q, fb, p)
            return candidates(t, q[rows], None if fb is None else fb.rows(rows), p)

        return run_search(plan, fetch, plain_first_round(self, t, q, fb, plan))

    def item_candidates(
        self,
        t: IndexTensors,
        q: torch.Tensor,
        fb: FilterBatch | None,
        plan: SearchPlan,
        with_vectors: bool = False,
    ) -> Candidates:
        """A document shard's candidates ``[B, r]`` for a router's ``plan``, keyed by item id
        with their vectors ``[B, r, D]`` when ``with_vectors``; in one C++ call where the plan
        allows."""
        if not with_vectors:
            found = lists_ids(t, q, fb, plan, whole=False)
            if found is not None:
                return Candidates(found[0], found[1], found[1])
        return keyed_by_id(t, candidates(t, q, fb, plan), with_vectors)
