"""The build's measurements of the filtered plan's costs (``costs.py`` reads them), taken on
the machine that builds, with the index's own kernels, codes and dimension:

* :func:`measure_plan_costs`: for one query and for a batch, at a few selectivities, the time
  of the list plan per code the cost model charges it, and of the exact plan (eligible rows
  from postings, their scores off the codes, top-k) per eligible item; the planner uses the
  ratio. Both run end to end under a synthetic filter, a random share of the catalog on one
  signature bit, so the measurement needs no attribute of the user's data.
* :func:`measure_coverage`: how many lists, in probe order, hold 95 % of a sample query's best
  ``m`` items, for ``m = k, 2k, 4k, ...``: the lists a list plan must reach at selectivity
  ``k / m``.

Both take well under a second at 60k x 784 and at 10M x 64; an index without filter attributes
skips them (its rows never choose between the plans).
"""

from __future__ import annotations

import copy as _copy
import math
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from retrieval.filters import FilterBatch
from retrieval.index.bound import as_scored
from retrieval.index.config import IVFConfig
from retrieval.index.costs import BATCHED
from retrieval.index.exact import exact_topk
from retrieval.index.ivf import IVFIndex
from retrieval.index.planner import list_codes
from retrieval.index.scan import bit_index_cpu

SELECTIVITIES = (0.5, 0.1, 0.02)
"""Where the costs are measured (the planner interpolates between them in log scale)."""
BATCH = 32
"""Rows of the batch measurement (above ``costs.BATCHED``)."""
MAX_EXACT = 1 << 13
"""Eligible items of a timed exact scan at most (its cost per item is flat past a few thousand)."""
COVERAGE_QUERIES = 16
COVERAGE_SHARE = 0.95
COVERAGE_SPAN = 64
"""The coverage curve reaches ``m = COVERAGE_SPAN * k`` (selectivity ``1 / COVERAGE_SPAN``)."""


def calibrates(index: IVFIndex) -> bool:
    """Whether the build measures costs: a CPU index with filter attributes and lists."""
    return (
        index.schema.num_words > 0
        and index.centroids.device.type == "cpu"
        and index.nlist > 1
        and index.codes.dtype == torch.int8
    )


def measure_plan_costs(
    index: IVFIndex, sample: torch.Tensor
) -> tuple[tuple[float, float, float], ...]:
    """``(batch, selectivity, ratio)`` rows: one exact-scan item's time over one list-plan
    code's, for ``batch`` 1 and :data:`BATCH` query rows of ``sample [Q, D]``.

    Both plans run end to end (``planned_positions``: the plan, its rounds and the bound
    check) under a synthetic filter installed on a copy of the index. The list plan's time is
    divided by the codes the cost model charges it (``costs.py``: its lists, or those that hold
    its best ``k / sel`` items by the coverage curve, so measure that first), the exact plan's
    by its eligible items."""
    n, k, nprobe = index.ntotal, min(index.config.tune_k, index.ntotal), index.config.nprobe
    q = as_scored(index, sample.float().cpu())
    gen = torch.Generator().manual_seed(index.config.seed)
    listed = replace(index.config, plan_costs=(), exact_cost=math.inf)  # never exact
    out = []
    for sel in SELECTIVITIES:
        lists = _filtered(index, torch.rand(n, generator=gen) < sel, listed)
        m = max(k, min(int(sel * n), MAX_EXACT))
        chosen = torch.zeros(n, dtype=torch.bool).index_fill_(
            0, torch.randperm(n, generator=gen)[:m], True
        )
        exact = _filtered(index, chosen, index.config)
        for batch in (1, BATCH):
            qb = q[:batch] if len(q) >= batch else q.repeat(math.ceil(batch / len(q)), 1)[:batch]
            fb = FilterBatch(
                torch.ones(batch, 1, 1, dtype=torch.int64), torch.zeros(batch, 1, dtype=torch.bool)
            )
            plan = lists.plan(fb, k, nprobe, 0)
            codes = list_codes(index, plan.nprobe, torch.full((batch,), sel), [k] * batch)
            list_s = _best_of(partial(lists.planned_positions, qb, k, fb, nprobe, 0))
            exact_s = _best_of(partial(exact.planned_positions, qb, k, fb, nprobe, 0, exact=True))
            per_code = list_s / float(codes.sum())
            out.append((float(batch), sel, (exact_s / (batch * m)) / per_code))
    return tuple(out)


def _filtered(index: IVFIndex, passing: torch.Tensor, config: IVFConfig) -> IVFIndex:
    """A copy of ``index`` (its tensors shared) whose only filter attribute is one bit, set on
    the rows where ``passing [N] bool``, searched with ``config``."""
    copy = _copy.copy(index)
    copy._buffers = dict(index._buffers)  # a fresh dict: the original keeps its own
    copy.config = config
    copy.sig = passing.long().unsqueeze(1).contiguous()
    copy.bit_counts, copy.postings = bit_index_cpu(copy.sig)
    held = torch.cat([torch.zeros(1, dtype=torch.int64), passing.long().cumsum(0)])[index.offsets]
    copy.list_bits = (held.diff() > 0).long().unsqueeze(1)
    return copy


def measure_coverage(index: IVFIndex, sample: torch.Tensor) -> tuple[tuple[int, float], ...]:
    """``(m, lists)``: the mean over sample queries of the lists, in each query's probe order,
    that hold :data:`COVERAGE_SHARE` of its best ``m`` items (scores off the codes), for ``m``
    = k, 2k, 4k, ... up to ``COVERAGE_SPAN * k`` or the catalog."""
    n, k = index.ntotal, min(index.config.tune_k, index.ntotal)
    q = as_scored(index, sample[:COVERAGE_QUERIES].float().cpu())
    top_m = min(n, COVERAGE_SPAN * k)
    pos, _ = exact_topk(q, top_m, torch.arange(n), index.scores_at)  # [Q, M], best first
    lists = torch.searchsorted(index.offsets, pos.clamp(min=0), right=True) - 1
    order = index.probe(q, index.nlist)[1]  # [Q, nlist], best first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(index.nlist).expand_as(order))
    ranks = rank.gather(1, lists)  # [Q, M]: each of the best items' list's probe rank
    curve, m = [], k
    while True:
        first = ranks[:, :m].sort(dim=1).values
        need = first[:, max(0, math.ceil(COVERAGE_SHARE * m) - 1)] + 1
        curve.append((m, round(float(need.double().mean()), 2)))
        if m >= top_m:
            return tuple(curve)
        m = min(2 * m, top_m)


def _best_of(run: Callable[[], object], repeats: int = 2) -> float:
    run()  # warm: scratch buffers, thread pool
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


assert BATCH > BATCHED  # the batch measurement must cost batches
