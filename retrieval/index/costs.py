"""The filtered plan's cost model: what the planner weighs when it picks, per query row, its
lists or an exact scan of the row's eligible items (``planner.py``), and what the bound check
weighs when it picks a second round of lists or the exact scan (``bound.py``).

The build times both plans on its own machine, at its dimension, with its kernels
(``calibrate.py``), for one query and for a batch, at a few selectivities; each
``IndexStats.plan_costs`` row is ``(batch, selectivity, exact seconds per eligible item, list
plan seconds per query, the lists its first round probed, the codes its rounds scanned)``.
A row of selectivity ``s`` wanting its first round to probe ``p`` lists then costs::

    exact = s * N * (seconds per eligible item at s)
    lists = (list plan seconds per query at s) * max(1, p / (first-round lists at s))

read off the rows of its batch regime (one query, or more than :data:`BATCHED`), interpolated
in ``log s`` (times in log scale too) and clamped to the measured range. The list plan's time
is what it took end to end, its bound check and second rounds included, so a filter that sends
most rows to a second round is priced as such. The bound check prices the exact scan in codes
of a list scan: the exact time over the list plan's seconds per code it scanned.

An index without measurements (``measure_costs = False``, no filter attributes, an index saved
before them, or one searched on another device than the CPU it was measured on) compares
``s * N * exact_cost`` with ``p`` lists' codes, as it always did.
"""

from __future__ import annotations

import bisect
import functools
import math

from retrieval.index.config import IVFConfig
from retrieval.index.stats import IndexStats
from retrieval.index.tensors import IndexTensors

BATCHED = 16
"""Rows above this many a search are priced by the batch measurements (the exact plan's scores
become one matmul above ``probe.FEW_QUERIES`` = 16 rows; fewer are scored row by row)."""

BATCH, SEL, EXACT_ITEM_S, LIST_QUERY_S, LIST_FIRST, LIST_CODES = range(6)
"""Columns of an ``IndexStats.plan_costs`` row."""


def on_cpu(index: IndexTensors) -> bool:
    """Whether the index searches on the CPU, where the build measured its costs."""
    return index.centroids.device.type == "cpu"


def plan_seconds(
    stats: IndexStats, ntotal: int, sel: float, first: float, batch: int, measured: bool = True
) -> tuple[float, float] | None:
    """``(exact, lists)`` seconds of one row of a search of ``batch`` rows: selectivity ``sel``,
    a first round of ``first`` lists. None where the index has no measurements (or
    ``measured`` is False: another device). Python floats: a batch has few distinct rows."""
    rows = _regime(stats.plan_costs, batch) if measured else ()
    if not rows:
        return None
    exact = sel * ntotal * _read(rows, EXACT_ITEM_S, sel)
    scale = max(1.0, first / _read(rows, LIST_FIRST, sel))
    return exact, _read(rows, LIST_QUERY_S, sel) * scale


def exact_codes(
    config: IVFConfig, stats: IndexStats, ntotal: int, sel: float, batch: int, measured: bool = True
) -> float:
    """One row's exact scan of its eligible items (``sel`` of ``ntotal``) in codes of a list
    scan: measured seconds over the list plan's seconds per code, else ``sel * N *
    exact_cost``."""
    rows = _regime(stats.plan_costs, batch) if measured else ()
    if not rows:
        return sel * ntotal * float(config.exact_cost)
    per_code = _read(rows, LIST_QUERY_S, sel) / max(_read(rows, LIST_CODES, sel), 1.0)
    return sel * ntotal * _read(rows, EXACT_ITEM_S, sel) / per_code


@functools.lru_cache(maxsize=64)
def _regime(costs: tuple[tuple[float, ...], ...], batch: int) -> tuple[tuple[float, ...], ...]:
    """The rows measured in ``batch``'s regime (one query, or a batch), by selectivity, with
    every value in log scale."""
    rows = [c for c in costs if len(c) > LIST_CODES and (c[BATCH] > BATCHED) == (batch > BATCHED)]
    return tuple(
        tuple(math.log(max(v, 1e-15)) for v in c) for c in sorted(rows, key=lambda c: c[SEL])
    )


def _read(rows: tuple[tuple[float, ...], ...], column: int, sel: float) -> float:
    """Column ``column`` at selectivity ``sel``: piecewise linear in log-log, clamped to the
    measured selectivities."""
    x = min(max(math.log(max(sel, 1e-12)), rows[0][SEL]), rows[-1][SEL])
    i = (
        min(max(bisect.bisect_left([r[SEL] for r in rows], x), 1), len(rows) - 1)
        if len(rows) > 1
        else 0
    )
    if len(rows) == 1:
        return math.exp(rows[0][column])
    x0, x1 = rows[i - 1][SEL], rows[i][SEL]
    w = 0.0 if x1 <= x0 else min(max((x - x0) / (x1 - x0), 0.0), 1.0)
    return math.exp(rows[i - 1][column] + w * (rows[i][column] - rows[i - 1][column]))
