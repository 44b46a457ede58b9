"""The search plan decided on the device: ``planner.make_plan``'s per-row rules as tensor ops.

The CPU planner reads each batch's selectivities back to the host and plans in Python numbers
(a batch's few rows cost less so than in torch ops). On a GPU that read is a synchronisation per
batch, and a plan whose shapes follow the data cannot be recorded as a CUDA graph. Here every
row's decision is a tensor of the batch's fixed shape, with nothing read back::

    sel      [B]   estimated selectivity            (selectivity.estimate_device)
    nprobe   [B]   lists_for(sel, nprobe, r + S_b)  (planner.lists_for)
    least    [B]   nprobe where the row has no clause, else its lists; hold = FILL (r + S_b)
    exact    [B]   cheaper_exact(sel, lists), or every row where the plan is exact
    bounded  []    some row takes the bound check (bound.with_bounds): its rows then probe
                   the lists that may hold an admitted item, and carry bounds [B, nlist]

What stays on the host is what the shapes are made of (the batch bucket, the clause count, the
excluded width, ``k`` and ``r``, the index's config): Python numbers a caller knows before it
runs. A GPU prices exact against lists by ``exact_cost`` (``costs.py``: the build's timings are
the CPU's), so this plan does too wherever it runs; on an index built without measured costs it
decides as the CPU planner does, row for row. Recall targets are read off curves on the host and
are not planned here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retrieval.index.planner import FILL, lists_for, searched_exactly
from retrieval.index.selectivity import estimate_device
from retrieval.index.tensors import IndexTensors

NEG_INF = float("-inf")


@dataclass(frozen=True)
class DevicePlan:
    """A batch's plan as device tensors (B rows, L = nlist lists); the shapes are fixed by the
    batch, not by the plan.

    ``nprobe [B] int64`` lists each row probes at most, ``least [B]`` / ``hold [B]`` the rule
    that stops a row once its lists hold enough (``probe.lists_holding``), ``exact [B] bool``
    rows that scan their eligible items exactly, ``bounded [] bool`` whether the bound check
    applies to the batch, ``checked [B] bool`` its rows, ``reach [B, L] bool`` the lists each row
    may find an admitted item in, ``bounds [B, L] float32`` (``-inf``: none) and ``budget [B]``
    the bound check's (``bound.py``); ``width`` the first round's probe slots (a bound on any
    row's ``nprobe``, known on the host)."""

    k: int
    r: int
    width: int
    nprobe: torch.Tensor
    least: torch.Tensor
    hold: torch.Tensor
    exact: torch.Tensor
    bounded: torch.Tensor
    checked: torch.Tensor
    reach: torch.Tensor
    factor: torch.Tensor
    budget: torch.Tensor


def row_lists(t: IndexTensors, sel: torch.Tensor, base: int, need: torch.Tensor) -> torch.Tensor:
    """``planner.lists_for`` of every row: ``sel [B]``, ``need [B]`` -> ``[B] int64``, in
    float64 as the host's Python floats."""
    nlist = max(t.nlist, 1)
    s = sel.double().clamp(min=1e-9)
    widen = base * s.pow(-t.config.filter_nprobe_exponent)
    fill = FILL * need.double() / (t.ntotal / nlist * s)
    lists = torch.maximum(widen, fill).ceil().clamp(min=base)
    return lists.clamp(max=nlist).long()


def cheaper_exact(t: IndexTensors, sel: torch.Tensor, lists: torch.Tensor) -> torch.Tensor:
    """``[B] bool``: rows whose exact scan of ``sel`` of the items costs no more than the codes
    of ``lists`` average lists (``costs.exact_codes`` unmeasured); a row admitting every item
    takes lists (``planner.cheaper_exact``)."""
    n = t.ntotal
    per_list = n / max(t.nlist, 1)
    s = sel.double()
    return (s < 1.0) & (s * n * float(t.config.exact_cost) <= lists.double() * per_list)


def may_hold(
    t: IndexTensors, masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None = None
) -> torch.Tensor:
    """``bound._may_hold`` of every row at once: ``[B, L] bool``, lists that may hold an item
    passing each row's filter (every clause neither negated nor with a "none of" part, ``none
    [B, C, W]``, shares a bit with the list's bits)."""
    b, nlist = masks.shape[0], t.nlist
    if masks.shape[1] == 0 or t.list_bits.numel() == 0:
        return torch.ones(b, nlist, dtype=torch.bool, device=masks.device)
    bits = t.list_bits.to(masks.device)  # [L, W]
    hit = (masks[:, :, None, :] & bits[None, None]).ne(0).any(dim=-1)  # [B, C, L]
    free = negate if none is None else negate | none.ne(0).any(dim=-1)  # rule no list out
    return (hit | free[:, :, None]).all(dim=1)


def first_width(t: IndexTensors, r: int, nprobe: int, clauses: int, excluded: int) -> int:
    """Probe slots the first round needs at most (host numbers: the shapes' own), for rows
    needing ``r`` plus up to ``excluded`` items. Unfiltered: ``lists_for`` of the widest row.
    Filtered: a row takes lists only while they cost less than its exact scan, ``lists_for(s) <
    s * exact_cost * nlist`` (:func:`cheaper_exact`), the left side falling with ``s`` and the
    right rising; so the widest list row sits just above the crossing, found by bisection in
    ``log s``, and ``lists_for`` at a point below it bounds every list row's lists."""
    nlist, need = max(t.nlist, 1), r + excluded
    widest = lists_for(t, 1.0, nprobe, need)
    if not clauses or t.ntotal <= 0:
        return widest
    per_list, cost = t.ntotal / nlist, float(t.config.exact_cost)

    def takes_lists(sel: float) -> bool:
        return not sel * t.ntotal * cost <= lists_for(t, sel, nprobe, need) * per_list

    lo, hi = 1e-9, 1.0
    if takes_lists(lo):
        return nlist
    for _ in range(64):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if takes_lists(mid) else (mid, hi)
    return max(widest, lists_for(t, lo, nprobe, need))


def device_plan(
    t: IndexTensors,
    q: torch.Tensor,
    masks: torch.Tensor,
    negate: torch.Tensor,
    excluded: torch.Tensor,
    k: int,
    r: int,
    nprobe: int,
    width: int,
    exact: bool = False,
    none: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
) -> DevicePlan:
    """The plan of ``q [B, D]`` (as scored) under filters ``masks [B, C, W]`` / ``negate [B,
    C]``, rows excluding ``excluded [B]`` items, ``k`` results from ``r`` candidates probing at
    least ``nprobe`` lists in ``width`` slots (:func:`first_width`); ``exact``: every row scans
    exactly (as ``SearchParams.exact``); ``none [B, C, W]``: the clauses' "none of these bits"
    parts (None: none); ``forced [B] bool``: rows that scan exactly whatever they cost (exact
    clauses to verify: ``retrieval/filter_verify.py``; None: none)."""
    b, dev, c = q.shape[0], q.device, masks.shape[1]
    sel = estimate_device(t.filter_sample, t.bit_counts, t.ntotal, masks, negate, none)  # [B]
    need = r + excluded
    lists = row_lists(t, sel, nprobe, need)  # [B]
    least = torch.where(sel >= 1.0, torch.full_like(lists, nprobe), lists)
    hold = FILL * need
    all_exact = exact or searched_exactly(t)
    if all_exact:
        rows_exact = torch.ones(b, dtype=torch.bool, device=dev)
    elif c:
        rows_exact = cheaper_exact(t, sel, lists)
    else:
        rows_exact = torch.zeros(b, dtype=torch.bool, device=dev)
    if forced is not None:
        rows_exact = rows_exact | forced
    slack = float(t.stats.filter_bound_slack)
    bounds_on = c > 0 and t.config.filter_bound > 0 and slack > 0 and t.list_radius.numel() > 0
    checked = (sel < 1.0) & ~rows_exact & bounds_on
    reach = torch.ones(b, t.nlist, dtype=torch.bool, device=dev)
    if bounds_on:  # rows without a check may reach every list
        reach = torch.where(checked[:, None], may_hold(t, masks, negate, none), reach)
    reach &= (t.lists.offsets[1:] - t.lists.offsets[:-1]).to(dev)[None, :] > 0
    factor = slack * _norm_bound(t, q)  # [B]
    budget = (sel.double() * t.ntotal * float(t.config.exact_cost)).float()
    return DevicePlan(
        k, r, width, lists, least, hold, rows_exact, checked.any(), checked, reach, factor, budget
    )


def _norm_bound(t: IndexTensors, q: torch.Tensor) -> torch.Tensor:
    """``bound._norm_bound``: ``[B]``, at least ``|q|`` and the norm of the int8-quantized
    query."""
    n = q.norm(dim=1)
    if t.config.codes == "int8":
        n = n + q.shape[1] ** 0.5 * q.abs().amax(dim=1) / 254.0
    return n
