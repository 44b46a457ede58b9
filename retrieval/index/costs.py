"""The filtered plan's cost model: what the planner weighs when it picks, per query row, lists
or an exact scan of the row's eligible items (``planner.py``, and the bound check's second
round in ``bound.py``). Both costs are counted in *codes scanned by a list plan*:

    lists  = max(nprobe, lists_to_hold(need / sel)) * items per list
    exact  = sel * N * exact_cost(sel, batch)

``lists_to_hold(m)`` reads the build's ``coverage_curve``: how many lists, in probe order, hold
95 % of a query's best ``m`` items. A filter admitting ``sel`` of the catalog at random keeps
about ``sel * m`` of them, so a row wanting ``need`` results must reach its best ``need / sel``
before its results are the true ones; probing fewer lists sends it to a second round.
``exact_cost(sel, batch)``: the time of one eligible item in an exact scan over the time of one
code in a filtered list scan, both *measured* at build on this machine at this dimension
(``calibrate.py``) for one query and for a batch, at a few selectivities, and interpolated in
``log(sel)``. An index built without them (or searched on another device than it was
measured on) uses the constant ``IVFConfig.exact_cost`` and ``nprobe`` alone, as it did.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Protocol

import torch

from retrieval.index.config import IVFConfig

BATCHED = 16
"""Rows above this many a search are costed by the batch measurements (the exact plan's scores
become one matmul above ``probe.FEW_QUERIES`` = 16 rows; fewer are scored row by row)."""


class _Placed(Protocol):
    @property
    def centroids(self) -> torch.Tensor: ...


def on_cpu(index: _Placed) -> bool:
    """Whether the index searches on the CPU, where the build measured its costs."""
    return index.centroids.device.type == "cpu"


def exact_codes(
    config: IVFConfig, ntotal: int, sel: torch.Tensor, batch: int, measured: bool = True
) -> torch.Tensor:
    """``[B] float64``: each row's exact scan of its eligible items (``sel [B]`` of ``ntotal``)
    in list-scan codes, for a search of ``batch`` rows; ``measured`` False (another device than
    the build measured on): the constant ``exact_cost``."""
    costs = config.plan_costs if measured else ()
    return sel.double() * ntotal * exact_cost(costs, config.exact_cost, sel, batch)


def exact_cost(
    costs: Sequence[Sequence[float]], constant: float, sel: torch.Tensor, batch: int
) -> torch.Tensor:
    """Per row: one eligible item's exact-scan time in list-scan codes. ``costs``: the build's
    ``(batch, selectivity, ratio)`` rows (empty: ``constant`` for every row); ``sel [B]``."""
    rows = [(s, r) for b, s, r in costs if (b > BATCHED) == (batch > BATCHED)]
    if not rows:
        return torch.full(sel.shape, float(constant), dtype=torch.float64)
    rows.sort()
    xs = torch.tensor([math.log(s) for s, _ in rows], dtype=torch.float64)
    ys = torch.tensor([r for _, r in rows], dtype=torch.float64)
    x = sel.double().clamp(min=1e-9).log().clamp(float(xs[0]), float(xs[-1]))
    return _interp(x, xs, ys)


def lists_to_hold(curve: Sequence[Sequence[float]], m: float, nlist: int) -> float:
    """Lists a query probes, best first, to hold 95 % of its best ``m`` items, read off the
    build's ``(m, lists)`` coverage curve (interpolated in ``log m``); past the curve's last
    point, every list unless that point already was the whole catalog. 0 without a curve."""
    if not curve:
        return 0.0
    ms = [float(a) for a, _ in curve]
    ls = [float(b) for _, b in curve]
    if m <= ms[0]:
        return ls[0]
    if m > ms[-1]:
        return float(nlist)
    i = bisect.bisect_left(ms, m)  # ms[i - 1] < m <= ms[i]
    w = (math.log(m) - math.log(ms[i - 1])) / (math.log(ms[i]) - math.log(ms[i - 1]))
    return ls[i - 1] + w * (ls[i] - ls[i - 1])


def _interp(x: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear ``ys`` over ascending ``xs`` at ``x`` (clamped to the ends)."""
    if len(xs) == 1:
        return ys.expand(x.shape).clone()
    i = torch.searchsorted(xs, x).clamp(1, len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    w = ((x - x0) / (x1 - x0).clamp(min=1e-12)).clamp(0.0, 1.0)
    return y0 + w * (y1 - y0)
