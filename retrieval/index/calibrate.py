"""The build's measurement of the filtered plan's costs (``costs.py`` reads them), taken on
the machine that builds, with the index's own kernels, codes and dimension.

For one query and for a batch of :data:`BATCH`, at each of :data:`SELECTIVITIES`, both plans
run end to end on sample queries, as a search runs them (``run_search``: the plan, its bound
check and second rounds; and the exact scan: eligible rows from postings, their scores off the
codes, top-k), under a synthetic filter: one signature bit, set on a random share of the
catalog, installed on a copy of the index. So the measurement needs no attribute of the user's
data; each time is the fastest of a few runs (:data:`TIMED_RUNS`) on one thread, ~1 s in all at
60k x 784 and 100k x 64. An index without filter attributes skips it: its rows never choose between
the plans.
"""

from __future__ import annotations

import copy as _copy
import math
import time
from collections.abc import Callable
from functools import partial

import torch

from retrieval.filters import FilterBatch
from retrieval.index.bound import as_scored
from retrieval.index.config import BuiltIVFConfig
from retrieval.index.costs import BATCHED
from retrieval.index.ivf import IVFIndex
from retrieval.index.scan import bit_index_cpu
from retrieval.index.search import Candidates, SearchPlan, run_search
from retrieval.index.stats import IndexStats

SELECTIVITIES = (0.5, 0.1, 0.02, 0.004)
"""Where the costs are measured (the planner interpolates between them in log scale)."""
BATCH = 32
"""Rows of the batch measurement (above ``costs.BATCHED``)."""
MAX_EXACT = 1 << 13
"""Eligible items of a timed exact scan at most (its cost per item is flat past a few thousand)."""


def calibrates(index: IVFIndex) -> bool:
    """Whether the build measures costs: a CPU index with filter attributes and lists."""
    return (
        index.schema.num_words > 0
        and index.centroids.device.type == "cpu"
        and index.nlist > 1
        and index.codes.dtype == torch.int8
    )


def measure_plan_costs(index: IVFIndex, sample: torch.Tensor) -> tuple[tuple[float, ...], ...]:
    """``IndexStats.plan_costs`` rows (``costs.py``): ``(batch, selectivity, exact seconds per
    eligible item, list plan seconds per query, its first round's lists, codes its rounds
    scanned per query)`` for ``batch`` 1 and :data:`BATCH` rows of ``sample [Q, D]``.

    Timed on one thread: the planner reads only the ratio of the two plans' times, which is
    their work where both spread over the threads alike, and a parallel run's time on a shared
    machine is mostly its threads waiting for each other (under load one point's times swung
    between builds far enough to price a faster exact scan above its lists: the journal,
    2026-12-03)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(index, sample)
    finally:
        torch.set_num_threads(threads)


def _measure(index: IVFIndex, sample: torch.Tensor) -> tuple[tuple[float, ...], ...]:
    """:func:`measure_plan_costs` on the threads it runs on."""
    n, k, nprobe = index.ntotal, min(index.config.tune_k, index.ntotal), index.config.nprobe
    q = as_scored(index, sample.float().cpu())
    gen = torch.Generator().manual_seed(index.config.seed)
    listed = index.config.model_copy(update={"exact_cost": math.inf})  # never exact
    # the build's other statistics (recall and slack curves, the filter bound's slack) shape
    # the list plan as a search plans it; only the costs being measured are left out
    unmeasured = index.stats.model_copy(update={"plan_costs": ()})
    out = []
    warmed: set[tuple[int, str]] = set()
    for sel in sorted(SELECTIVITIES):  # the cheapest runs first: they warm each plan
        lists = _filtered(index, torch.rand(n, generator=gen) < sel, listed, unmeasured)
        m = max(k, min(int(sel * n), MAX_EXACT))
        chosen = torch.zeros(n, dtype=torch.bool)
        exact = _filtered(
            index,
            chosen.index_fill_(0, torch.randperm(n, generator=gen)[:m], True),
            index.config,
            index.stats,
        )
        for batch in (1, BATCH):
            qb = q[:batch] if len(q) >= batch else q.repeat(math.ceil(batch / len(q)), 1)[:batch]
            fb = FilterBatch(
                torch.ones(batch, 1, 1, dtype=torch.int64), torch.zeros(batch, 1, dtype=torch.bool)
            )
            scanned: list[int] = []
            list_s = _timed(
                partial(_list_plan, lists, qb, k, fb, nprobe, scanned), warmed, (batch, "list")
            )
            exact_s = _timed(
                partial(exact.execute, qb, fb, exact.params(k, nprobe, 0, exact=True), True),
                warmed, (batch, "exact"),
            )  # fmt: skip
            first = float(lists.plan(fb, lists.params(k, nprobe, 0)).nprobe.double().mean())
            codes = scanned[-1] / batch
            out.append((float(batch), sel, exact_s / (batch * m), list_s / batch, first, codes))
    return tuple(sorted(out, key=lambda row: (-row[1], row[0])))  # SELECTIVITIES' order


def _list_plan(
    index: IVFIndex, q: torch.Tensor, k: int, fb: FilterBatch, nprobe: int, scanned: list[int]
) -> None:
    """The planned rounds of a list plan, appending the codes its rounds scanned."""
    plan = index.plan(fb, index.params(k, nprobe, 0), q=q)
    sizes, codes = index.offsets.diff(), 0

    def fetch(p: SearchPlan, rows: torch.Tensor | None) -> Candidates:
        nonlocal codes
        qq, f = (q, fb) if rows is None else (q[rows], fb.rows(rows))
        widest = min(int(p.nprobe.max()), index.nlist)  # a short row asks for WIDEN x its lists
        probed = p.lists if p.lists is not None else index.probe(qq, widest)[1]
        codes += int(sizes[probed.clamp(min=0)].masked_fill(probed < 0, 0).sum())
        return index.item_candidates(qq, f, p)

    run_search(plan, fetch)
    scanned.append(codes)


def _filtered(
    index: IVFIndex, passing: torch.Tensor, config: BuiltIVFConfig, stats: IndexStats
) -> IVFIndex:
    """A copy of ``index`` (its tensors shared) whose only filter attribute is one bit, set on
    the rows where ``passing [N] bool``, searched with ``config`` and ``stats``."""
    copy = _copy.copy(index)
    copy._buffers = dict(index._buffers)  # a fresh dict: the original keeps its own
    copy.config, copy.stats = config, stats
    copy.sig = passing.long().unsqueeze(1).contiguous()
    copy.bit_counts, copy.postings = bit_index_cpu(copy.sig)
    copy.sample_filters()  # the planner's estimate reads the one bit too
    # lists holding a passing row, from a prefix sum (``bound.list_bits`` ORs every signature
    # through NumPy's ufunc.at: seconds at 10M rows, for one bit)
    held = torch.cat([torch.zeros(1, dtype=torch.int64), passing.long().cumsum(0)])[index.offsets]
    copy.list_bits = (held.diff() > 0).long().unsqueeze(1)
    return copy


TIMED_RUNS = 3
"""Timed runs of each plan at each point; the fastest is kept: on a shared machine a run may
lose time slices to other processes (one slow run had priced a faster exact scan above its
lists)."""


def _timed(run: Callable[[], object], warmed: set[tuple[int, str]], kind: tuple[int, str]) -> float:
    """Seconds of the fastest of :data:`TIMED_RUNS` ``run()``, after an untimed one the first
    time ``kind`` (batch, plan) runs: its scratch buffers and the thread pool then serve every
    later selectivity (warming each run again had been a quarter of a small catalog's build)."""
    if kind not in warmed:
        run()
        warmed.add(kind)
    best = math.inf
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


assert BATCH > BATCHED  # the batch measurement must price batches
