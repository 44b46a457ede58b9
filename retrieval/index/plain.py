"""The plain search: the common call without the planner.

Rows with no filter clause, no recall target, no re-rank, one list count (whatever each row
excludes): their plan is "``lists_for`` lists each" (``retrieval/index/planner.py``), each row
keeping those its items need by the lists' sizes (``probe.lists_holding``), so the
search is the probe and the scan (two C++ calls on the CPU; a matmul and the Triton scan on a
GPU, with one wait for the answer), with the planned path's lists and results. A row its lists
leave short of ``k`` goes through the planned path alone (which widens it). One query costs the
probe, the scan and a few tens of microseconds around them, where the planner and the search
rounds cost ~150 us (``bench/RESULTS.md``).

Keyed by item id, a few queries on the CPU are one C++ call (exclusions mapped, probe, scan,
ids): a document shard's plain plan (:func:`plain_item_candidates`: lists only, one list count,
no re-rank) and ``IVFIndex.search``'s plain search (:func:`plain_search_ids`), where Python
around two calls cost more than the calls.
"""

from __future__ import annotations

import functools
from typing import Protocol

import numpy as np
import torch

from retrieval.filters import FilterBatch, FilterSchema
from retrieval.index.bound import as_scored
from retrieval.index.cuda_graphs import bucket, run_graphed
from retrieval.index.exclude import PAD, IdOrder
from retrieval.index.planner import FILL, PlannedIndex, excluded_counts, hold_counts, lists_for
from retrieval.index.probe import FEW_QUERIES, lists_holding
from retrieval.index.scan import ProbeTable, scan, search_ids_cpu
from retrieval.index.search import WIDEN, Candidates, SearchPlan

KernelTensors = tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]
"""``(centroids_t, probe_half, codes, scales, offsets, sig)``: what the CPU kernels read of an
index (``IVFIndex.kernel_tensors``)."""


class PlainIndex(PlannedIndex, Protocol):
    """What the plain search uses of an index (:class:`~retrieval.index.ivf.IVFIndex`; a protocol,
    so this module and the index do not import each other)."""

    sig: torch.Tensor
    schema: FilterSchema
    max_list: int
    dim: int
    centroids_t: torch.Tensor
    id_order: IdOrder
    lane_lists: dict[tuple[int, int], int]
    probe_table: ProbeTable | None
    built_sizes: torch.Tensor

    @property
    def probe_half(self) -> torch.Tensor | None: ...

    def kernel_tensors(self) -> KernelTensors: ...

    def probe(self, q: torch.Tensor, nprobe: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def excluding(self, fb: FilterBatch) -> FilterBatch: ...
    def planned_positions(
        self, q: torch.Tensor, k: int, fb: FilterBatch, nprobe: int, rerank: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def plain_search(
    index: PlainIndex,
    q: torch.Tensor,
    k: int,
    fb: FilterBatch | None,
    nprobe: int,
    rerank: int,
    exact: bool = False,
    target: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(positions [B, k], scores [B, k])`` of ``q [B, D]`` as the planned search gives them
    (``fb`` None: no filter at all); None where the plain search does not apply."""
    if exact or index.ntotal == 0:
        return None
    if (rerank and index.keeps_exact_copy) or (target is not None and bool(target.gt(0).any())):
        return None
    plain = _plain_lists(index, fb, k, nprobe)
    if plain is None:
        return None
    p, excluded = plain
    ex = index.excluding(fb).exclude if excluded and fb is not None else None
    dev = q.device
    hold = None  # [B]: items each row's lists must hold (planner.make_plan's SearchPlan.hold)
    if nprobe < p and index.built_sizes.numel():
        hold = _holds(fb, q.shape[0], k).to(dev)

    def probe_and_scan(
        qq: torch.Tensor,
        excl: torch.Tensor | None = None,
        held: torch.Tensor | None = None,
        lists: int = p,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scored = as_scored(index, qq).contiguous()
        coarse, probes = index.probe(scored, lists)
        if held is not None:  # the lists each row needs of the p (the widened rerun: all)
            probes = lists_holding(probes, index.built_sizes, nprobe, held)
        b, w, d = qq.shape[0], index.sig.shape[1], qq.device
        no_clause = (
            torch.empty((b, 0, w), dtype=torch.int64, device=d),
            torch.empty((b, 0), dtype=torch.bool, device=d),
        )
        return scan(
            scored, probes, coarse, index.codes, index.scales, index.offsets, index.sig,
            *no_clause, k, max_list=index.max_list, excl=excl,
        )  # fmt: skip

    if ex is not None and q.is_cuda:  # a graph needs a fixed width: PAD sorts last, equals none
        width = bucket(ex.shape[1])
        ex = torch.cat([ex, ex.new_full((ex.shape[0], width - ex.shape[1]), PAD)], dim=1)

    def first_round(qq: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rest = list(more)
        excl = rest.pop(0) if ex is not None else None
        return probe_and_scan(qq, excl, rest.pop(0) if hold is not None else None)

    # on a GPU, one graph replay (retrieval/index/cuda_graphs.py); a served request's excluded
    # rows (its history) and what each row's lists must hold are among the graph's inputs
    kept = (index.centroids, index.codes, index.scales, index.offsets, index.sig, index.built_sizes)
    inputs = (q, *(t for t in (ex, hold) if t is not None))
    key = ("plain", k, p, nprobe if hold is not None else 0)
    pos, scores = run_graphed(index, key, first_round, inputs, kept)
    short = pos[:, -1].lt(0).cpu().numpy()  # on a GPU: the search's one wait
    if short.any() and ex is None and p < index.nlist:
        # the planned path's next round, WIDEN x the lists, without planning (and without
        # repeating the first round, as planned_positions would): 1.4 ms of a 10 ms batch of
        # 1,000 at 256-d went to 6 short rows
        rows = torch.from_numpy(np.flatnonzero(short)).to(dev)
        pos[rows], scores[rows] = probe_and_scan(q[rows], lists=min(p * WIDEN, index.nlist))
        short = pos[:, -1].lt(0).cpu().numpy()
    if short.any():  # the planned path's later rounds, for those rows only
        rows = torch.from_numpy(np.flatnonzero(short)).to(dev)
        sub = index.schema.empty(len(rows)) if fb is None else fb.rows(rows)
        pos[rows], scores[rows] = index.planned_positions(q[rows], k, sub, nprobe, rerank)
    return pos, scores


def plain_search_ids(
    index: PlainIndex,
    q: torch.Tensor,
    k: int,
    fb: FilterBatch | None,
    nprobe: int,
    rerank: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:meth:`IVFIndex.search`'s plain search for a few queries on the CPU, keyed by item id in
    one C++ call -> ``(ids [B, k], scores [B, k])``, what :func:`plain_search` and the id
    mapping answer. None where it does not apply (filter clauses, re-rank, excluded counts that
    differ between rows, more than ``FEW_QUERIES`` rows, a GPU), or where a row's lists hold
    fewer than ``k`` items (the planned path widens them)."""
    b = q.shape[0]
    if not q.is_cpu or not 0 < b <= FEW_QUERIES or not index.ntotal:
        return None
    if rerank and index.keeps_exact_copy:
        return None
    plain = _plain_lists(index, fb, k, nprobe)
    if plain is None:
        return None
    found = _search_ids(index, q, plain[0], fb, k, nprobe, _holds(fb, b, k))
    if found is None or found[2]:
        return None
    return found[0], found[1]


def plain_query_ids(
    index: PlainIndex, q: object, k: object, nprobe: object, rerank: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | bool:
    """:meth:`IVFIndex.search` of a few unfiltered CPU queries without re-rank (``rerank`` 0, or
    None where the index's setting re-ranks nothing) straight from its public arguments ->
    ``(ids [B, k], scores [B, k])``: the same C++ call as :func:`plain_search_ids`, after checks
    of the plainest inputs only (a float32 CPU tensor, ``int`` k and nprobe in range, int8 codes
    on the CPU). False for anything else: the
    full path then checks, explains refusals and answers. True where the call ran and a row's
    lists came up short: the planned path answers, without calling again. The list count is
    kept per ``(nprobe, k)`` in ``index.lane_lists`` until the index's lists change."""
    if (
        type(q) is not torch.Tensor
        or type(k) is not int
        or not (nprobe is None or type(nprobe) is int)
    ):
        return False
    cfg, shape = index.config, q.shape
    if not (
        len(shape) == 2
        and 0 < shape[0] <= FEW_QUERIES
        and shape[1] == index.dim
        and q.dtype is torch.float32
        and q.is_cpu
    ):
        return False
    probe = cfg.nprobe if nprobe is None else nprobe
    reranks = rerank is None and cfg.rerank and index.keeps_exact_copy
    if not 0 < k <= index.ntotal or probe < 1 or reranks:
        return False
    if cfg.metric == "cosine":
        q = as_scored(index, q)  # unit rows, as the index scores them
    if not q.is_contiguous():  # a view (every other row): the kernels read rows in place
        q = q.contiguous()
    centroids_t, half, codes, scales, offsets, sig = index.kernel_tensors()
    if not centroids_t.is_cpu or codes.dtype != torch.int8:  # a GPU index (q moves); fp8 codes
        return False
    p = index.lane_lists.get((probe, k))
    if p is None:  # worked out again, ~5 us of a ~35 us query in a loop
        p = min(lists_for(index, 1.0, probe, k), index.nlist)
        if len(index.lane_lists) >= 1024:
            index.lane_lists.clear()
        index.lane_lists[(probe, k)] = p
    fmask, fneg, excl = _no_filter(shape[0], sig.shape[1])
    order = index.id_order
    found = search_ids_cpu(
        q, centroids_t, half, p, codes, scales, offsets, sig, fmask, fneg, excl,
        order.item_ids, order.perm, k, _sizes(index, probe, p), probe,
        _every_row(shape[0], FILL * k), index.probe_table,
    )  # fmt: skip
    if found is None:  # a forced kernel, a trace
        return False
    return True if found[2] else (found[0], found[1])


def _plain_lists(
    index: PlainIndex, fb: FilterBatch | None, k: int, nprobe: int
) -> tuple[int, bool] | None:
    """``(lists every row probes, whether any row excludes items)`` where the plain search
    applies to ``fb`` (None: no filter): no clause, and one planned list count for every row.
    Rows excluding different numbers of items usually share it (the count moves the lists only
    when ``k`` plus it outgrows ``nprobe`` lists), so a batch of users whose histories differ in
    length stays plain. Else None (the planner gives each row its own count)."""
    if fb is not None and fb.active:
        return None
    least = most = 0
    if fb is not None and fb.exclude is not None and fb.exclude.numel():
        held = fb.exclude.cpu().numpy() >= 0  # [B, S], NumPy: no torch op
        if held.shape[0] == 1:  # one row: one count (each NumPy reduction costs ~3 us)
            least = most = int(np.count_nonzero(held))
        else:
            counts = held.sum(axis=1)  # [B]
            least, most = int(counts.min()), int(counts.max())
    p = min(lists_for(index, 1.0, nprobe, k + most), index.nlist)
    if least != most and min(lists_for(index, 1.0, nprobe, k + least), index.nlist) != p:
        return None  # lists grow with the count: equal at both ends, equal between
    return p, most > 0


def plain_item_candidates(
    index: PlainIndex, q: torch.Tensor, fb: FilterBatch, plan: SearchPlan
) -> Candidates | None:
    """A shard's candidates keyed by item id, ``[B, r]``, in one C++ call on the CPU
    (``scan.search_ids_cpu``) for a plan that only probes: no exact row, no second round's
    lists, one list count, no re-rank. None otherwise, or where that call does not apply (the
    index's step-by-step path then answers the same)."""
    b = q.shape[0]
    if not q.is_cpu or plan.lists is not None or plan.reranks or not index.ntotal:
        return None
    if not 0 < b <= FEW_QUERIES:  # more: the probe as one matmul is faster (probe_lists)
        return None
    exact, nprobe = plan.exact.numpy(), plan.nprobe.numpy()  # a few values: no torch ops
    if exact.any() or not (nprobe == nprobe[0]).all():
        return None
    p = min(int(nprobe[0]), index.nlist)
    least = p
    if plan.least is not None and plan.hold is not None:  # lists by their sizes: one least a call
        fewest = plan.least.numpy()
        if not (fewest == fewest[0]).all():
            return None
        least = int(fewest[0])
    found = _search_ids(index, q, p, fb, plan.r, least, plan.hold)
    if found is None:
        return None
    ids, scores, _short = found
    return Candidates(ids, scores, scores)


def _search_ids(
    index: PlainIndex,
    q: torch.Tensor,
    nprobe: int,
    fb: FilterBatch | None,
    r: int,
    least: int,
    hold: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``scan.search_ids_cpu`` over this index: ``nprobe`` lists a row (those that hold its
    ``hold [B]`` items by their sizes, at least ``least``; None: all), its filter (None: no
    clause) and excluded item ids inside the scan -> ``(ids [B, r], scores [B, r], short)``."""
    centroids_t, half, codes, scales, offsets, sig = index.kernel_tensors()
    fmask, fneg, excl = _no_filter(q.shape[0], sig.shape[1])
    if fb is not None:
        fmask, fneg = fb.masks.contiguous(), fb.negate.contiguous()
        excl = excl if fb.exclude is None else fb.exclude.contiguous()
    return search_ids_cpu(
        as_scored(index, q).contiguous(),
        centroids_t, half, nprobe,
        codes, scales, offsets, sig,
        fmask, fneg, excl,
        index.id_order.item_ids, index.id_order.perm, r,
        _sizes(index, least, nprobe), least, hold, index.probe_table,
    )  # fmt: skip


def _holds(fb: FilterBatch | None, b: int, k: int) -> torch.Tensor:
    """``[B]``: the items each of ``b`` rows' lists must hold, as the planner counts them
    (``planner.FILL`` times ``k`` plus the ids the row excludes)."""
    if fb is None or fb.exclude is None or not fb.exclude.numel():
        return _every_row(b, FILL * k)  # one query's common case: no array made
    return torch.from_numpy(hold_counts(k, excluded_counts(fb, b)))


@functools.cache
def _every_row(b: int, hold: int) -> torch.Tensor:
    """``[b] int64`` of ``hold`` (read only: one per shape serves every call)."""
    return torch.full((b,), hold, dtype=torch.int64)


def _sizes(index: PlainIndex, least: int, nprobe: int) -> torch.Tensor | None:
    """The list sizes a one-call search cuts a row's ``nprobe`` lists by (at least ``least``:
    ``probe.lists_holding``), or None: every list (as many as least, or none as built)."""
    sizes = index.built_sizes
    return sizes if least < nprobe and sizes.numel() else None


@functools.cache
def _no_filter(b: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(masks [b, 0, w], negate [b, 0], exclude [b, 0])``: no clause, nothing excluded. Empty
    tensors, so one set per shape serves every call (a search costs ~2 us per allocation)."""
    return (
        torch.empty((b, 0, w), dtype=torch.int64),
        torch.empty((b, 0), dtype=torch.bool),
        torch.empty((b, 0), dtype=torch.int64),
    )
