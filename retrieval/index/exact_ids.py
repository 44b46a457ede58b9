"""A filtered search whose plan scans every row exactly, without the planner's rounds.

Rows that share one filter, with no recall target, no exclusions and no re-rank, all get the
same plan: when it is the exact scan of their eligible items (``planner.cheaper_exact``: a
selective filter), the planned path would plan, fetch, scan, select and check for short rows,
~0.5 ms of Python around a scan that may take 50 us. Here the same decision is made once for
the one filter, and the same scan answers every row (``eligible_scan``: rows from postings,
scores off the codes, top-k; over int8 codes on the CPU, one C++ call), so the
results are the planned path's, id for id.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

import torch

from retrieval.filters import COMPILED_FILTERS, FilterBatch, estimate_selectivity
from retrieval.index.bound import as_scored
from retrieval.index.costs import BATCHED
from retrieval.index.eligible_scan import SignedIndex, eligible_positions
from retrieval.index.exact import exact_topk
from retrieval.index.planner import PlannedIndex, cheaper_exact, lists_for
from retrieval.index.probe import FEW_QUERIES
from retrieval.index.scan import KERNEL_ENV, exact_search_ids_cpu

MAX_SCORES = 1 << 24
"""Scores (B x eligible rows) the one C++ call holds at most (64 MiB); past it, chunks."""


class ExactIndex(PlannedIndex, SignedIndex, Protocol):
    """What this search reads of an index (:class:`~retrieval.index.ivf.IVFIndex`)."""

    centroids: torch.Tensor
    centroids_t: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    item_ids: torch.Tensor
    exact: torch.Tensor

    def ids_at(self, pos: torch.Tensor) -> torch.Tensor: ...


def exact_search_ids(
    index: ExactIndex, q: torch.Tensor, k: int, fb: FilterBatch | None, nprobe: int, rerank: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(item_ids [B, k], scores [B, k])`` of rows ``q [B, D]`` sharing one filter ``fb``
    whose plan is the exact scan, ``-1`` / ``-inf`` padded; None where that does not apply (no
    filter clause, rows with different filters or exclusions, a re-rank, a GPU, or a plan that
    probes lists)."""
    if fb is None or not fb.active or fb.exclude is not None or q.device.type != "cpu":
        return None
    if rerank and index.keeps_exact_copy:
        return None
    masks, negate = fb.masks, fb.negate
    if masks.shape[0] > 1 and not (
        bool((masks == masks[:1]).all()) and bool((negate == negate[:1]).all())
    ):
        return None
    if not _exact_plan(index, masks[:1], negate[:1], k, nprobe, q.shape[0]):
        return None
    q = as_scored(index, q)
    if _one_call(index):
        index_args = (
            index.centroids_t,
            index.codes,
            index.scales,
            index.offsets,
            index.sig,
        )
        filter_args = (masks[0], negate[0], index.bit_counts, index.postings)
        found = exact_search_ids_cpu(
            q, *index_args, *filter_args, index.item_ids, k, FEW_QUERIES, MAX_SCORES
        )
        if found is not None:
            return found
    pos, scores = exact_topk(q, k, eligible_positions(index, masks[0], negate[0]), index.scores_at)
    return index.ids_at(pos), scores


_plans: weakref.WeakKeyDictionary[ExactIndex, tuple[tuple[Any, ...], dict[Any, bool]]] = (
    weakref.WeakKeyDictionary()
)
"""Per index: what its kept plan choices read (:func:`_reads`), and the choices by filter."""


def _exact_plan(
    index: ExactIndex, masks: torch.Tensor, negate: torch.Tensor, k: int, nprobe: int, batch: int
) -> bool:
    """Whether rows sharing the filter ``masks [1, C, W]``, ``negate [1, C]`` scan exactly:
    ``planner.cheaper_exact`` on the filter's estimated selectivity, as the planner decides.
    The choice is kept per distinct filter (served requests repeat a few), since estimating and
    pricing cost ~80 us a call, ~200 us inside a search whose scan leaves the caches cold. The
    kept choices are dropped whenever anything they read changes (:func:`_reads`)."""
    reads = _reads(index)
    kept = _plans.get(index)
    if kept is None or kept[0] != reads or len(kept[1]) >= COMPILED_FILTERS:
        kept = (reads, {})
        _plans[index] = kept
    key = (masks.numpy().tobytes(), negate.numpy().tobytes(), k, nprobe, batch > BATCHED)
    choice = kept[1].get(key)
    if choice is None:
        sel = estimate_selectivity(FilterBatch(masks, negate), index.bit_counts, index.ntotal)
        lists = torch.tensor([lists_for(index, float(sel[0]), nprobe, k)])
        choice = bool(cheaper_exact(index, sel, lists, batch)[0])
        kept[1][key] = choice
    return choice


def _reads(index: ExactIndex) -> tuple[Any, ...]:
    """What a plan choice reads of ``index`` besides the filter: the config's pricing, the
    catalog's size and lists, the bit counts (by identity and in-place version) and the device."""
    cfg, counts = index.config, index.bit_counts
    return (
        id(cfg), id(index.stats), cfg.exact_cost, cfg.filter_nprobe_exponent,
        index.ntotal, index.nlist, id(counts), counts._version, counts.device.type,
    )  # fmt: skip


def _one_call(index: ExactIndex) -> bool:
    """The C++ call scores what ``scores_at`` would: int8 codes, no exact copy."""
    return (
        index.codes.dtype == torch.int8
        and not index.exact.shape[0]
        and os.environ.get(KERNEL_ENV, "auto") == "auto"
        and not torch.compiler.is_compiling()
    )
