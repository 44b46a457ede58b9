"""The executor's GPU backend: a plain plan's first round replayed from a CUDA graph.

A one-query search on a GPU is short kernels behind many kernel launches of host time (probe,
query quantization, grouping the pairs, the Triton scan, top-K). A plan
whose rows are all ``PLAIN`` with one list count has a first round of fixed shapes (given the
batch bucket, ``k``, the lists and the width of the excluded rows), so it is recorded once and
replayed as one launch (``cuda_graphs.py``); the executor's later rounds (a short row's wider
lists, its exact scan) run as they would after any first round.
"""

from __future__ import annotations

import torch

from retrieval.filters import FilterBatch
from retrieval.index.candidates import excluding, probe
from retrieval.index.cuda_graphs import bucket, run_graphed
from retrieval.index.exclude import PAD
from retrieval.index.plan import RowKind, SearchPlan
from retrieval.index.probe import lists_holding
from retrieval.index.scan import scan
from retrieval.index.search import Candidates
from retrieval.index.tensors import IndexTensors, ScanRows


def plain_first_round(
    owner: object, t: IndexTensors, q: torch.Tensor, fb: FilterBatch | None, plan: SearchPlan
) -> Candidates | None:
    """The first round's candidates ``[B, k]`` (keys are positions) of a plain plan over CUDA
    queries ``q [B, D]``, from a graph kept for ``owner``; None for any other plan or device."""
    if not q.is_cuda or plan.one_kind is not RowKind.PLAIN:
        return None
    counts = plan.one_list_count
    if counts is None:
        return None
    p, least = min(counts[0], t.nlist), counts[1]
    ex = None
    if fb is not None and fb.exclude is not None and bool((fb.exclude >= 0).any()):
        ex = excluding(t, fb).exclude
    if ex is not None:  # a graph needs a fixed width: PAD sorts last, equals none
        width = bucket(ex.shape[1])
        ex = torch.cat([ex, ex.new_full((ex.shape[0], width - ex.shape[1]), PAD)], dim=1)
    hold = None  # [B]: items each row's lists must hold
    if least < p and plan.hold is not None and t.built_sizes.numel():
        hold = plan.hold.to(q.device)
    w = t.lists.sig.shape[1]

    def first_round(qq: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rest = list(more)
        excl = rest.pop(0) if ex is not None else None
        held = rest.pop(0) if hold is not None else None
        scored = t.scored(qq).contiguous()
        coarse, probes = probe(t, scored, p)
        if held is not None:  # the lists each row needs of the p
            probes = lists_holding(probes, t.built_sizes, least, held)
        b, d = qq.shape[0], qq.device
        masks = torch.empty((b, 0, w), dtype=torch.int64, device=d)
        negate = torch.empty((b, 0), dtype=torch.bool, device=d)
        return scan(t.lists, ScanRows(scored, probes, coarse, masks, negate, excl), plan.k)

    # a served request's excluded rows (its history) and what each row's lists must hold are
    # among the graph's inputs
    lists = t.lists
    kept = (t.centroids, lists.codes, lists.scales, lists.offsets, lists.sig, t.built_sizes)
    inputs = (q, *(x for x in (ex, hold) if x is not None))
    key = ("plain", plan.k, p, least if hold is not None else 0)
    pos, scores = run_graphed(owner, key, first_round, inputs, kept)
    return Candidates(pos, scores, scores)
