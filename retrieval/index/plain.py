"""The plain search: the common call without the planner.

Rows with no filter clause, no recall target, no re-rank, one count of excluded items: their
plan is "``lists_for`` lists each" (``retrieval/index/planner.py``), so the search is the probe
and the scan (two C++ calls on the CPU; a matmul and the Triton scan on a GPU, with one wait for
the answer), with the planned path's lists and results. A row its
lists leave short of ``k`` goes through the planned path alone (which widens it). One query costs
the probe, the scan and a few tens of microseconds around them, where the planner and the search
rounds cost ~150 us (``bench/RESULTS.md``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from retrieval.filters import FilterBatch, FilterSchema
from retrieval.index.bound import as_scored
from retrieval.index.cuda_graphs import run_graphed
from retrieval.index.planner import PlannedIndex, lists_for
from retrieval.index.scan import scan


class PlainIndex(PlannedIndex, Protocol):
    """What the plain search uses of an index (:class:`~retrieval.index.ivf.IVFIndex`; a protocol,
    so this module and the index do not import each other)."""

    sig: torch.Tensor
    schema: FilterSchema
    max_list: int

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
    excluded, ex = 0, None
    if fb is not None:
        if fb.active:
            return None
        if fb.exclude is not None and fb.exclude.numel():
            counts = fb.exclude.ge(0).sum(dim=1)
            excluded = int(counts.max())
            if int(counts.min()) != excluded:
                return None  # rows of several counts plan several list counts
            ex = index.excluding(fb).exclude
    p = min(lists_for(index, 1.0, nprobe, k + excluded), index.nlist)

    def probe_and_scan(qq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scored = as_scored(index, qq).contiguous()
        coarse, probes = index.probe(scored, p)
        b, w, d = qq.shape[0], index.sig.shape[1], qq.device
        no_clause = (
            torch.empty((b, 0, w), dtype=torch.int64, device=d),
            torch.empty((b, 0), dtype=torch.bool, device=d),
        )
        return scan(
            scored, probes, coarse, index.codes, index.scales, index.offsets, index.sig,
            *no_clause, k, max_list=index.max_list, excl=ex,
        )  # fmt: skip

    dev = q.device
    if ex is None:  # a fixed shape: on a GPU, one graph replay (retrieval/index/cuda_graphs.py)
        held = (index.centroids, index.codes, index.scales, index.offsets, index.sig)
        pos, scores = run_graphed(index, ("plain", k, p), probe_and_scan, q, held)
    else:
        pos, scores = probe_and_scan(q)
    short = pos[:, -1].lt(0).cpu().numpy()  # on a GPU: the search's one wait
    if short.any():  # the planned path's later rounds, for those rows only
        rows = torch.from_numpy(np.flatnonzero(short)).to(dev)
        sub = index.schema.empty(len(rows)) if fb is None else fb.rows(rows)
        pos[rows], scores[rows] = index.planned_positions(q[rows], k, sub, nprobe, rerank)
    return pos, scores
