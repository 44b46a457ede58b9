"""The executor's CPU backend: plans a single C++ call answers, keyed by item id.

Where Python around two or three calls would cost more than the calls (a few queries), the
CPU answers some plans in one call from the query to item ids, with the results the
step-by-step rounds give, id for id:

* a plan whose rows all probe one list count (no exact row, no planner's lists, no re-rank):
  ``scan.search_ids_cpu`` maps the excluded ids to rows, probes, keeps the lists each row's
  items need, scans with its filter and maps the rows found to ids (:func:`lists_ids`);
* a ``SHARED_EXACT`` plan (the batch scans exactly under one filter): ``scan.exact_search_ids_cpu``
  takes the eligible rows from the postings, scores them off the int8 codes and keeps the top
  ``k`` (:func:`shared_exact_ids`).

Each returns None where it does not apply, and the executor then runs the rounds.
"""

from __future__ import annotations

import functools
import os

import torch

from retrieval.filters import FilterBatch
from retrieval.index.candidates import no_filter
from retrieval.index.eligible_scan import eligible_positions
from retrieval.index.exact import exact_topk
from retrieval.index.plan import RowKind, SearchPlan
from retrieval.index.probe import FEW_QUERIES
from retrieval.index.readout import ids_at, scores_at
from retrieval.index.scan import KERNEL_ENV, exact_search_ids_cpu, search_ids_cpu
from retrieval.index.tensors import IndexTensors
from retrieval.index.verified import verified_positions

MAX_SCORES = 1 << 24
"""Scores (B x eligible rows) the one exact call holds at most (64 MiB); past it, chunks."""

Found = tuple[torch.Tensor, torch.Tensor]
"""``(ids [B, r], scores [B, r])``, ``-1`` / ``-inf`` padded."""


def lists_ids(
    t: IndexTensors, q: torch.Tensor, fb: FilterBatch | None, plan: SearchPlan, whole: bool
) -> Found | None:
    """The first round of ``plan`` over ``q [B, D]`` in one C++ call, keyed by item id ->
    ``[B, r]``; ``whole``: only where no row came up short of ``r`` (the answer of the whole
    search; a short row's later rounds need the rounds). None where the call does not apply
    (more than ``FEW_QUERIES`` rows, where the probe as one matmul is faster; a GPU; a plan
    with rows of their own list counts, exact rows, the planner's lists or a re-rank)."""
    b = q.shape[0]
    if not q.is_cpu or not 0 < b <= FEW_QUERIES or not t.ntotal:
        return None
    counts = plan.one_list_count
    if counts is None:
        return None
    p, least = min(counts[0], t.nlist), counts[1]
    if fb is None:  # kept empty tensors, contiguous already
        masks, negate, excl = _unfiltered(b, t.lists.sig.shape[1])
    else:
        masks, negate = fb.masks.contiguous(), fb.negate.contiguous()
        excl = fb.exclude.contiguous() if fb.exclude is not None else _no_ids(b)
    scored = t.scored(q)
    scored = scored if scored.is_contiguous() else scored.contiguous()
    none = None if fb is None else fb.neg_masks
    found = search_ids_cpu(t, scored, masks, negate, excl, p, plan.r, least, plan.hold, none)
    if found is None or (whole and found[2]):
        return None
    return found[0], found[1]


def shared_exact_ids(
    t: IndexTensors, q: torch.Tensor, fb: FilterBatch | None, plan: SearchPlan
) -> Found | None:
    """A ``SHARED_EXACT`` plan over ``q [B, D]`` on the CPU: the exact top ``k`` of the items
    passing the batch's one filter, keyed by item id; None for any other plan."""
    if not q.is_cpu or plan.one_kind is not RowKind.SHARED_EXACT:
        return None
    f = no_filter(q.shape[0], t.lists.sig.shape[1], q.device) if fb is None else fb
    masks, negate = f.masks[0], f.negate[0]
    none = None if f.neg_masks is None else f.neg_masks[0]
    q = t.scored(q)
    if _one_call(t) and f.verify is None:  # the C++ call checks no exact clauses
        found = exact_search_ids_cpu(t, q, masks, negate, plan.k, FEW_QUERIES, MAX_SCORES, none)
        if found is not None:
            return found
    eligible = verified_positions(t, eligible_positions(t, masks, negate, none), f.verify, 0)
    pos, scores = exact_topk(q, plan.k, eligible, lambda qq, rows: scores_at(t, qq, rows))
    return ids_at(t, pos), scores


def _one_call(t: IndexTensors) -> bool:
    """The exact C++ call scores what ``readout.scores_at`` would: int8 codes, no exact copy."""
    return (
        t.lists.codes.dtype == torch.int8
        and not t.exact.shape[0]
        and os.environ.get(KERNEL_ENV, "auto") == "auto"
        and not torch.compiler.is_compiling()
    )


@functools.cache
def _unfiltered(b: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(masks [b, 0, w], negate [b, 0], exclude [b, 0])``: no clause, nothing excluded."""
    none = no_filter(b, w, torch.device("cpu"))
    return none.masks, none.negate, _no_ids(b)


_NO_IDS: dict[int, torch.Tensor] = {}


def _no_ids(b: int) -> torch.Tensor:
    """``[b, 0] int64``: nothing excluded (one per shape serves every call)."""
    held = _NO_IDS.get(b)
    if held is None:
        held = _NO_IDS[b] = torch.empty((b, 0), dtype=torch.int64)
    return held
