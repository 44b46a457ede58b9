"""One round of a search on one index: its candidates for a plan's rows, step by step.

List rows are probed (or take the planner's lists), scanned with the filter and exclusions
inside the scan (the C++ kernel on the CPU, the Triton kernel on a GPU: ``scan.scan``) and, when
the plan re-ranks, re-scored with the exact copy; exact rows scan their eligible items
(``eligible_scan.py``). The executor's rounds (``search.run_search``) call :func:`candidates`
for every fetch; a document shard answers them :func:`keyed_by_id`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from retrieval.filters import FilterBatch
from retrieval.index.eligible_scan import exact_search
from retrieval.index.exclude import ExcludedRows, excluded_positions
from retrieval.index.plan import SearchPlan
from retrieval.index.probe import lists_holding, probe_lists, rescore
from retrieval.index.readout import ids_at, vectors_at
from retrieval.index.scan import scan
from retrieval.index.search import Candidates
from retrieval.index.tensors import IndexTensors, ScanRows


def candidates(
    t: IndexTensors, q: torch.Tensor, fb: FilterBatch | None, plan: SearchPlan
) -> Candidates:
    """This index's candidates for ``q [B, D]`` under ``plan``: ``[B, r]`` (keys are
    positions). List rows: the best ``r`` approximate scores of the probed lists, re-scored
    with the exact copy when the plan re-ranks. Exact rows: the best ``k`` eligible items.
    Items a row excludes (``fb.exclude``, item ids) are skipped in either; ``fb`` None: no
    clause, nothing excluded."""
    b, dev = q.shape[0], q.device
    q = t.scored(q)
    fb = excluding(t, no_filter(b, t.lists.sig.shape[1], dev) if fb is None else fb)
    # row numbers on the CPU, where plans live: they index the plan's tensors as well as q
    # and fb (a GPU row list indexing the plan failed every GPU batch mixing both kinds)
    exact_rows = plan.exact.cpu()
    if not bool(exact_rows.any()):  # every row probes lists: no scatter
        return list_candidates(t, q, plan, fb)
    out = Candidates.empty(b, plan.r, dev)
    rows = (~exact_rows).nonzero().flatten()
    if rows.numel():
        out.put(rows, list_candidates(t, q[rows], plan.rows(rows), fb.rows(rows)))
    rows = exact_rows.nonzero().flatten()
    f = fb.rows(rows)
    pos, s = exact_search(t, q[rows], plan.k, f.masks, f.negate, f.exclude, f.neg_masks, f.verify)
    out.put(rows, Candidates(pos, s, s))
    return out


def keyed_by_id(t: IndexTensors, c: Candidates, with_vectors: bool = False) -> Candidates:
    """Candidates keyed by position ``[B, r]`` -> keyed by item id (what a document shard
    answers), with the candidates' vectors ``[B, r, D]`` when ``with_vectors`` (for a scoring
    head; zeros where a row has none)."""
    pos = c.keys.clamp(min=0)
    vecs = None
    if with_vectors:
        vecs = vectors_at(t, pos.flatten()).view(*pos.shape, -1) if t.ntotal else None
        if vecs is None:
            vecs = c.approx.new_zeros(*pos.shape, t.centroids.shape[1])
    return Candidates(ids_at(t, c.keys), c.approx, c.scores, vecs)


def excluding(t: IndexTensors, fb: FilterBatch) -> FilterBatch:
    """``fb`` with its excluded item ids mapped to this index's rows (once per fetch; an
    :class:`ExcludedRows` holds rows already)."""
    if fb.exclude is None or isinstance(fb, ExcludedRows):
        return fb
    rows = excluded_positions(t.id_order, fb.exclude)  # the id order lives on the CPU
    return dataclasses.replace(fb, exclude=rows.to(fb.masks.device))


def probe(t: IndexTensors, q: torch.Tensor, nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coarse [B, P], lists [B, P])`` of ``q`` (as scored) by the index's probe rule."""
    return probe_lists(q, t.centroids, t.probe_half, nprobe, t.centroids_t, t.probe_table)


def list_candidates(
    t: IndexTensors, q: torch.Tensor, plan: SearchPlan, fb: FilterBatch
) -> Candidates:
    """Probe, scan (filter and exclusions inside the scan), and re-score the survivors
    exactly. ``q`` as scored; ``fb.exclude``: rows, not ids (:func:`excluding` mapped them)."""
    probes, coarse = first_lists(t, q, plan)
    rows = ScanRows(
        q.contiguous(),
        probes.contiguous(),
        coarse.contiguous(),
        fb.masks.contiguous(),
        fb.negate.contiguous(),
        fb.exclude,
        None if plan.reranks else plan.floor,  # re-ranked: approximate scores differ
        fb.neg_masks,
    )
    cand, approx = scan(t.lists, rows, plan.r)
    if not plan.reranks:
        return Candidates(cand, approx, approx)
    return Candidates(cand, approx, rescore(q, cand, t.exact))  # exact scores [b, r]


def first_lists(
    t: IndexTensors, q: torch.Tensor, plan: SearchPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probes [B, P], coarse [B, P])``: the lists each row of ``plan`` probes (``-1`` skips
    a slot) and their q·centroid: the planner's lists where it chose them, else each row's best
    ``nprobe``, cut to what its items need by the lists' sizes as built (``plan.least``)."""
    if plan.lists is not None:  # a second round, or lists the filter leaves: the planner's
        probes = plan.lists.to(q.device)
        return probes, (q @ t.centroids.T).gather(1, probes.clamp(min=0))  # [b, P]
    p_max = int(plan.nprobe.max()) if plan.nprobe.numel() else 1
    coarse, probes = probe(t, q, min(p_max, max(t.nlist, 1)))  # best first
    if bool((plan.nprobe != p_max).any()):  # per-row probe counts: skip (-1) unneeded slots
        slot = torch.arange(probes.shape[1], device=q.device)
        wanted = slot < plan.nprobe.to(q.device)[:, None]
        probes = torch.where(wanted, probes, torch.full_like(probes, -1))
    if plan.least is not None and plan.hold is not None and t.built_sizes.numel():
        probes = lists_holding(probes, t.built_sizes, plan.least, plan.hold)  # what each needs
    return probes, coarse


_CPU = torch.device("cpu")


@functools.cache
def _no_filter_cpu(b: int, w: int) -> FilterBatch:
    return FilterBatch(
        torch.empty((b, 0, w), dtype=torch.int64), torch.empty((b, 0), dtype=torch.bool)
    )


def no_filter(b: int, w: int, device: torch.device) -> FilterBatch:
    """``b`` rows without a clause or an exclusion (``masks [b, 0, w]``): empty tensors, so on
    the CPU one per shape serves every call."""
    if device == _CPU:  # a compare, cheaper than reading device.type (a new string each time)
        return _no_filter_cpu(b, w)
    return _no_filter_cpu(b, w).to(device)
