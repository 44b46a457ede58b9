"""When a filtered search has probed enough lists: a bound on what the lists it did not probe
could still give.

The plan probes a filtered row's nearest lists until they should *hold* ``2r`` eligible items
(judged by selectivity alone). Where the filter is anti-correlated with the query (its eligible
items sit away from the query's neighbourhood) those lists hold eligible items that are not the
best ones, and recall falls (``retrieval/data/anticorrelated.py`` makes such data).
So, after that first round, every filtered row compares its K-th best result with a bound on
each list it did not probe::

    bound[b, l] = q_b · c_l + slack * |q_b| * rmax_l       (-inf: the row's filter admits no
                                                             item the list may hold)

Any item ``x = c_l + r`` of list ``l`` scores ``q·x <= q·c_l + |q| |r|`` (Cauchy-Schwarz), so
with ``slack = 1`` no list left out can hold an item better than the K-th: a proof. That bound
is loose (a residual rarely points along the query: in 64-d the best item of a list reaches
about a third of it), so the build measures ``slack`` as a quantile of the share actually
reached by sample queries in their nearest lists (:func:`measure_slack`;
``IVFConfig.filter_bound``). A row whose K-th result is beaten by some bound probes every such
list in a second round (its K-th can only rise, so one round suffices), or scans its eligible
items exactly when that costs less (:meth:`BoundCheck.second_round`). The first round already
skips the lists a row's filter rules out (:func:`with_bounds`): on an anti-correlated filter the
nearest lists hold no eligible item, and probing the nearest that may hold one finds the best
eligible items at once.

Per-list statistics (buffers of the index, in its state dict): ``list_radius [nlist] f32``, the
largest residual norm (exact or decoded) of any item the list has held, and ``list_bits [nlist,
W] i64``, the OR of their filter signatures. Live updates only grow them (:func:`grown`), so they
stay valid bounds, and a router computes the same growth from the update batch alone: an
upserted item counts in every list it is (within rounding) nearest to, and a relabel makes its
new values possible in every list (a router does not know an item's list).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from retrieval.filters import FilterBatch
from retrieval.index.codes import dequantize, quantize
from retrieval.index.config import IVFConfig
from retrieval.index.costs import exact_codes, on_cpu
from retrieval.index.plan import BoundCheck, SearchPlan
from retrieval.index.probe import lists_holding
from retrieval.index.scan import list_bounds_cpu, scan, topk_rows
from retrieval.index.tensors import IndexTensors, Lists, ScanRows


class _Configured(Protocol):
    """Anything that carries an index config (an ``IVFIndex``, its ``IndexTensors``)."""

    @property
    def config(self) -> IVFConfig: ...


NEG_INF = float("-inf")
_CHUNK = 1 << 16  # rows decoded at a time, so statistics of a large catalog stay in bounded memory


# ---- per-list statistics -------------------------------------------------------------------------
def residual_norms(
    residuals: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """``max(|r|, |decoded r|)`` per item -> ``[N] float32`` (the bound must hold for the exact
    scores of a re-rank and for the approximate scores of the codes alike). ``residuals [N, D]``
    floats, ``codes [N, D]``, ``scales [N]``."""
    exact = torch.empty(residuals.shape[0])
    for s in range(0, residuals.shape[0], _CHUNK):
        exact[s : s + _CHUNK] = residuals[s : s + _CHUNK].float().norm(dim=1).cpu()
    return torch.maximum(exact, decoded_norms(codes, scales))


def decoded_norms(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``|decoded r|`` per item -> ``[N] float32`` on the CPU, ``_CHUNK`` rows at a time."""
    out = torch.empty(codes.shape[0])
    for s in range(0, codes.shape[0], _CHUNK):
        e = s + _CHUNK
        out[s:e] = dequantize(codes[s:e], scales[s:e]).norm(dim=1).cpu()
    return out


def widened_radius(
    radius: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """``radius [nlist]`` widened to every list's decoded residuals under new ``scales`` (an
    index saved with float32 scales, loaded with 2-byte ones), one float step up: it must stay
    a bound. ``offsets [nlist + 1]`` delimit the lists in the row order of ``codes``."""
    sizes = (offsets[1:] - offsets[:-1]).cpu()
    lists = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    within = list_radius(lists, decoded_norms(codes, scales), sizes.numel())
    widened = torch.maximum(radius.cpu(), within)
    return torch.nextafter(widened, torch.full_like(widened, float("inf"))).to(radius.device)


def list_radius(lists: torch.Tensor, norms: torch.Tensor, nlist: int) -> torch.Tensor:
    """The largest of ``norms [N]`` in each list (``lists [N] int64``) -> ``[nlist] float32``
    (0 for an empty list)."""
    out = torch.zeros(nlist)
    return out.scatter_reduce(0, lists.cpu(), norms.float().cpu(), "amax", include_self=True)


def list_bits(lists: torch.Tensor, sig: torch.Tensor, nlist: int) -> torch.Tensor:
    """The OR of the signatures ``sig [N, W] int64`` in each list (``lists [N] int64``) ->
    ``[nlist, W] int64``."""
    out = np.zeros((nlist, sig.shape[1]), dtype=np.int64)
    np.bitwise_or.at(out, lists.cpu().numpy(), sig.cpu().numpy())
    return torch.from_numpy(out)


def grown(
    index: IndexTensors,
    vectors: torch.Tensor,
    sig: torch.Tensor,
    spread: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(list_radius, list_bits)`` of ``index`` grown by items ``vectors [n, D]`` (float, as the
    index stores them: normalised for "cosine") with signatures ``sig [n, W]``, and by
    ``spread [W]``: bits every list may now hold (a relabel). Statistics-only indexes (a
    router's) grow the same way, so a router and the unsharded index agree."""
    radius, bits = index.list_radius.cpu().clone(), index.list_bits.cpu().clone()
    if radius.numel() == 0:  # no statistics (an index saved before them): nothing to grow
        return radius, bits
    centroids = index.centroids.cpu().float()
    x = vectors.cpu().float()
    half = 0.5 * centroids.pow(2).sum(dim=1)
    for s in range(0, x.shape[0], 1024):
        xs = x[s : s + 1024]
        ip = xs @ centroids.T  # [n, nlist]
        # the build's rule: |x - c|^2 / 2 up to a per-row constant, or -x·c
        key = -ip if index.config.assign == "ip" else half - ip
        scale = xs.pow(2).sum(dim=1, keepdim=True) + 2 * half.max()
        near = key <= key.min(dim=1, keepdim=True).values + 1e-5 * scale  # the nearest, and ties
        item, lst = near.nonzero(as_tuple=True)  # every list the build's assign may pick
        res = xs[item] - centroids[lst]
        codes, scales = quantize(res, index.config.codes)
        radius = radius.scatter_reduce(
            0, lst, residual_norms(res, codes, scales), "amax", include_self=True
        )
        if bits.numel():
            bits |= list_bits(lst, sig[s : s + 1024].cpu()[item], index.nlist)
    if spread is not None and bits.numel():
        bits |= spread.cpu().view(1, -1)
    dev = index.centroids.device
    return radius.to(dev), bits.to(dev)


# ---- the slack, measured at build ------------------------------------------------------------------
def measure_slack(
    index: IndexTensors, queries: torch.Tensor, quantiles: Sequence[float], lists: int = 32
) -> list[float]:
    """Each of ``quantiles`` of ``max_x q·r_x / (|q| rmax_l)`` over sample ``queries [Q, D]``
    and the ``lists`` lists nearest each (after its first, which every search probes) -> a
    slack in ``[0, 1]`` per quantile; a quantile ``>= 1`` -> 1.0 (the proof).

    ``q·r_x`` is the scan's own score of the residual code (every (query, list) pair is a row
    of one scan that probes that list with a zero coarse score, keeping its best item): what a
    search ranks by, without decoding the lists' residuals."""
    if index.nlist < 2:
        return [1.0 for _ in quantiles]
    q = as_scored(index, queries.float().cpu())
    held = index.lists
    centroids, radius, offsets = index.centroids.cpu(), index.list_radius.cpu(), held.offsets.cpu()
    near = topk_rows(_probe_key(index, q @ centroids.T), min(lists + 1, index.nlist))[1][:, 1:]
    pairs = near.reshape(-1, 1).contiguous()  # [Q*L, 1]: one list a row
    rows = q.repeat_interleave(near.shape[1], dim=0).contiguous()  # [Q*L, D]
    w = held.sig.shape[1]
    no_clause = (
        torch.zeros(len(rows), 0, w, dtype=torch.int64),
        torch.zeros(len(rows), 0, dtype=torch.bool),
    )
    sizes = offsets[1:] - offsets[:-1]
    cpu = Lists.of(held.codes.cpu(), held.scales.cpu(), offsets, held.sig.cpu())
    _, best = scan(cpu, ScanRows(rows, pairs, torch.zeros(pairs.shape), *no_clause), 1)
    scale = (q.norm(dim=1)[:, None] * radius[near]).flatten()  # [Q*L]
    ok = (sizes[near].flatten() > 0) & (scale > 0)
    found = (best[:, 0][ok] / scale[ok]).clamp(0.0, 1.0)
    below = [q for q in quantiles if q < 1.0]
    if not below or not found.numel():
        return [1.0 for _ in quantiles]
    at = iter(torch.quantile(found, torch.tensor(below, dtype=found.dtype)).tolist())  # one sort
    return [next(at) if q < 1.0 else 1.0 for q in quantiles]


def as_scored(index: _Configured, q: torch.Tensor) -> torch.Tensor:
    """Queries as the index scores them (unit norm for "cosine")."""
    return torch.nn.functional.normalize(q, dim=1) if index.config.metric == "cosine" else q


def _probe_key(index: IndexTensors, ip: torch.Tensor) -> torch.Tensor:
    """``q·c [B, nlist]`` -> the key lists are probed by (``retrieval/index/probe.py``)."""
    return ip - index.half_norms.to(ip.device) if index.config.probe == "l2" else ip


# ---- the check ---------------------------------------------------------------------------------------
def with_bounds(
    index: IndexTensors,
    q: torch.Tensor,
    fb: FilterBatch,
    plan: SearchPlan,
    sel: torch.Tensor,
    slack: torch.Tensor | None = None,
) -> SearchPlan:
    """``plan`` for queries ``q [B, D]`` under filters ``fb`` (estimated selectivities ``sel
    [B]``) with its first round's lists chosen here (``plan.lists``: each filtered row's best
    ``nprobe`` lists *among those that may hold an item it admits*, the nearest lists of an
    anti-correlated filter holding none) and the :class:`BoundCheck` of its second round.
    ``slack [B]``: each row's (default: the measured ``filter_bound_slack``; 0: no check).
    ``plan`` as it is when no filtered row probes lists, or the index has no statistics or no
    measured slack."""
    if slack is None:
        slack = torch.full(sel.shape, index.stats.filter_bound_slack)
    slack = slack.cpu()
    checked = (sel.cpu() < 1.0) & ~plan.exact.cpu() & (slack > 0)  # [B]
    if index.list_radius.numel() == 0 or not bool(checked.any()):
        return plan
    dev, b, nlist = index.centroids.device, q.shape[0], index.nlist
    rows = (~plan.exact.cpu()).nonzero().flatten()  # every row that probes gets its lists here
    qr = as_scored(index, q[rows.to(q.device)].float())
    ip = qr @ index.centroids.T  # [b, nlist]
    sizes = index.lists.offsets.diff()
    mine = checked[rows]
    nprobe = plan.nprobe[rows].to(dev)
    factor = slack[rows].to(dev) * _norm_bound(index, qr)  # [b]
    p = min(int(nprobe.max()), nlist)
    if ip.device.type == "cpu":  # one C++ pass a row, where torch takes many [b, nlist] ops
        first, bounds = list_bounds_cpu(
            ip.contiguous(), index.half_norms if index.config.probe == "l2" else None,
            index.list_bits, fb.masks[rows].contiguous(), fb.negate[rows].contiguous(),
            sizes, nprobe, factor, index.list_radius, mine, p,
            None if fb.neg_masks is None else fb.neg_masks[rows].contiguous(),
        )  # fmt: skip
    else:
        reach = torch.ones_like(ip, dtype=torch.bool)  # [b, nlist]: may hold an admitted item
        some = rows[mine]
        none = None if fb.neg_masks is None else fb.neg_masks[some]
        reach[mine.to(dev)] = _may_hold(index, fb.masks[some], fb.negate[some], none)
        reach &= sizes[None, :] > 0
        first, bounds = _list_bounds(index, ip, reach, nprobe, factor, mine, p)
    if rows.numel() == b:
        full, lists = bounds, first
    else:
        full = torch.full((b, nlist), NEG_INF, device=dev)
        full[rows.to(dev)] = bounds
        lists = torch.full((b, first.shape[1]), -1, dtype=torch.int64, device=dev)
        lists[rows.to(dev)] = first
    if plan.least is not None and plan.hold is not None and index.built_sizes.numel():
        lists = lists_holding(lists, index.built_sizes, plan.least, plan.hold)  # unfiltered rows
    keys = sel.tolist()  # few distinct: one each
    cost = {
        s: exact_codes(index.config, index.stats, index.ntotal, s, b, on_cpu(index))
        for s in set(keys)
    }
    budget = torch.tensor([cost[s] for s in keys], dtype=torch.float32, device=dev)
    check = BoundCheck(full, sizes, budget)
    return replace(plan, lists=lists.cpu(), check=check, least=None, hold=None)


def _list_bounds(
    index: IndexTensors,
    ip: torch.Tensor,
    reach: torch.Tensor,
    nprobe: torch.Tensor,
    factor: torch.Tensor,
    mine: torch.Tensor,
    p: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scan.list_bounds_cpu`` in torch ops (a GPU's): ``ip [b, nlist]`` = q·c, ``reach [b,
    nlist]`` lists that may hold an admitted item -> ``(first [b, p]`` each row's best
    ``nprobe`` reachable lists, ``-1`` padded, ``bounds [b, nlist])``."""
    dev, nlist = ip.device, ip.shape[1]
    key = _probe_key(index, ip).masked_fill(~reach, NEG_INF)
    top, first = topk_rows(key, p)  # [b, P], best first
    slot = torch.arange(first.shape[1], device=dev)
    first = torch.where((slot < nprobe[:, None]) & (top > NEG_INF), first, -1)
    probed = torch.zeros(ip.shape[0], nlist + 1, dtype=torch.bool, device=dev)
    probed = probed.scatter_(1, first.masked_fill(first < 0, nlist), True)[:, :nlist]
    bounds = ip + factor[:, None] * index.list_radius[None, :]
    bounds = bounds.masked_fill(probed | ~reach | ~mine.to(dev)[:, None], NEG_INF)
    return first, bounds


def _norm_bound(index: IndexTensors, q: torch.Tensor) -> torch.Tensor:
    """``[b]``: at least ``|q|`` and the norm of the query as the int8 scan quantizes it
    (each entry off by at most ``max|q| / 254``)."""
    n = q.norm(dim=1)
    if index.config.codes == "int8":
        n = n + q.shape[1] ** 0.5 * q.abs().amax(dim=1) / 254.0
    return n


def _may_hold(
    index: IndexTensors,
    masks: torch.Tensor,
    negate: torch.Tensor,
    none: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b, nlist] bool``: lists that may hold an item passing each row's filter (``masks
    [b, C, W]``, ``negate [b, C]``): every non-negated clause shares a bit with ``list_bits``.
    Negated clauses cannot rule a list out (its bits say which values it holds, not that all
    its items hold them); nor can a clause with a "none of these bits" part (``none [b, C, W]``)."""
    b, nlist = masks.shape[0], index.nlist
    out = torch.ones(b, nlist, dtype=torch.bool, device=masks.device)
    if masks.shape[1] == 0 or index.list_bits.numel() == 0:
        return out
    bits = index.list_bits.to(masks.device)  # [nlist, W]
    rules = ~negate  # [b, C]: the clauses that may rule a list out
    if none is not None:
        rules &= none.eq(0).all(dim=-1)
    key = torch.cat([masks.flatten(1), rules.long()], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)  # few distinct filters a batch
    for g in range(uniq.shape[0]):
        row = int((inverse == g).nonzero()[0])
        ok = torch.ones(nlist, dtype=torch.bool, device=masks.device)
        for c in range(masks.shape[1]):
            if bool(rules[row, c]):
                ok &= (bits & masks[row, c][None, :]).ne(0).any(dim=1)
        out[inverse == g] = ok
    return out
