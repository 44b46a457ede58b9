"""A whole search in fixed shapes, the plan decided on the device: what a CUDA graph records.

The executor's rounds (``search.run_search``) pick, on the host, the rows that take a second
round, widen or scan exactly, and run each for just those rows. Here every round runs for the
whole batch at a width fixed by the batch's shapes, the rows that do not take it probing no list
(``-1`` slots, which the scans skip), and ``torch.where`` keeps each row's answer::

    plan     device_plan.device_plan                  [B] lists, least / hold, exact rows, bound check
    first    probe (reachable lists where the bound   scan [B, r] (+ exact re-rank)  -> select [B, k]
             check is on), lists_holding
    second   rows a bound beats: those lists          merged with the first, unique -> select
    widen    rows left short (no bound check):        WIDEN x their lists            -> select
    exact    exact rows, second-round exact rows,     every item scored, filter and
             rows still short                         exclusions masked              -> top-k

Answers equal the executor's on the CPU path wherever both price exact scans alike (an index
without measured costs, as on a GPU: ``device_plan.py``): every row takes the same rounds with the
same lists. Scores may differ in float rounding where the CPU path reads them through another
kernel (its C++ probe, its exact scores off the int8 codes), so tied neighbours may swap. The
list scan is ``scan.scan``'s kernel: on a GPU the Triton kernel, whose first call per index state
reads the lists' sizes once (``gpu_scan.width_bound``: a warm-up before a capture makes it); on
the CPU the C++ kernel (a registered op with a fake, so a compiled graph keeps it as one node;
the device discipline sees its inputs and outputs, not its loop), which the Triton kernel is
tested against under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from retrieval.filter_verify import FilterVerify
from retrieval.filters import FilterBatch
from retrieval.index.codes import dequantize
from retrieval.index.cuda_graphs import bucket, run_graphed
from retrieval.index.device_plan import DevicePlan, device_plan, first_width
from retrieval.index.exclude import PAD, is_excluded
from retrieval.index.plan import SearchParams
from retrieval.index.probe import lists_holding, rescore
from retrieval.index.scan import scan
from retrieval.index.search import WIDEN, Candidates, select_top
from retrieval.index.tensors import IndexTensors, ScanRows
from retrieval.index.verified import extended

NEG_INF = float("-inf")


def device_search(
    t: IndexTensors, q: torch.Tensor, fb: FilterBatch | None, params: SearchParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``params.k`` of ``q [B, D]`` under ``fb`` (None: no clause, nothing excluded) ->
    ``(positions [B, k] int64, scores [B, k] float32)``, ``-1`` / ``-inf`` padded, with no host
    read and shapes fixed by ``B``, the clause count, the excluded width and ``params``. Recall
    targets are planned on the host (``params.target`` must be None)."""
    if params.target is not None:
        raise ValueError("recall targets are planned on the host: the device path takes none")
    b, dev = q.shape[0], q.device
    w = t.lists.sig.shape[1]
    masks = fb.masks if fb is not None else q.new_zeros((b, 0, w), dtype=torch.int64)
    negate = fb.negate if fb is not None else q.new_zeros((b, 0), dtype=torch.bool)
    none = fb.neg_masks if fb is not None else None
    verify = fb.verify if fb is not None else None
    ids = fb.exclude if fb is not None else None
    qs = t.scored(q).float().contiguous()
    excl = excluded_rows(t, ids) if ids is not None else None
    excluded = (ids >= 0).sum(dim=1) if ids is not None else q.new_zeros(b, dtype=torch.int64)
    r = max(params.k, params.rerank) if params.rerank and t.keeps_exact_copy else params.k
    s = 0 if ids is None else ids.shape[1]
    width = first_width(t, r, params.nprobe, masks.shape[1], s)
    forced = None if verify is None else verify.rows
    plan = device_plan(
        t,
        qs,
        masks,
        negate,
        excluded,
        params.k,
        r,
        params.nprobe,
        width,
        params.exact,
        none,
        forced,
    )
    ip = qs @ t.centroids.T  # [B, L]
    key = ip - t.half_norms[None, :] if t.config.probe == "l2" else ip
    lists_scan = _Scan(t, qs, ip, masks, negate, excl, plan, none)
    probes = _first_lists(t, key, plan)
    first = lists_scan(probes)
    top = select_top(first, plan.k, plan.r)
    top, second_exact = _second_round(t, ip, probes, plan, lists_scan, first, top)
    # rows short after their lists, with no bound check: WIDEN x their lists, every one
    short = (top.keys[:, -1] < 0) & ~plan.exact & ~plan.bounded
    wide = min(max(t.nlist, 1), width * WIDEN)
    order = key.topk(wide, dim=1).indices
    slot = torch.arange(wide, device=dev)
    wider = torch.where((slot < plan.nprobe[:, None] * WIDEN) & short[:, None], order, -1)
    top = _where(short, select_top(lists_scan(wider), plan.k, plan.r), top)
    exact = plan.exact | second_exact | ((top.keys[:, -1] < 0) & ~plan.exact)
    pos, scores = exact_all(t, qs, plan.k, masks, negate, excl, none, verify)
    pos = torch.where(exact[:, None], pos, top.keys)
    return pos, torch.where(exact[:, None], scores, top.scores)


def _first_lists(t: IndexTensors, key: torch.Tensor, plan: DevicePlan) -> torch.Tensor:
    """``[B, width]``: each list row's first-round lists (``candidates.first_lists``; where the
    bound check is on, ``bound.with_bounds``'s reachable lists), ``-1`` for exact rows."""
    slot = torch.arange(plan.width, device=key.device)
    wanted = slot < plan.nprobe[:, None]
    order = key.topk(plan.width, dim=1).indices
    plain = torch.where(wanted, order, -1)
    top, reached = key.masked_fill(~plan.reach, NEG_INF).topk(plan.width, dim=1)
    bounded = torch.where(wanted & (top > NEG_INF), reached, -1)
    probes = torch.where(plan.bounded, bounded, plain)
    if t.built_sizes.numel():
        probes = lists_holding(probes, t.built_sizes, plan.least, plan.hold)
    return torch.where(plan.exact[:, None], -1, probes)


def _second_round(
    t: IndexTensors,
    ip: torch.Tensor,
    probes: torch.Tensor,
    plan: DevicePlan,
    scan: _Scan,
    first: Candidates,
    top: Candidates,
) -> tuple[Candidates, torch.Tensor]:
    """``search._second_round`` for every row: checked rows whose K-th score some unprobed
    list's bound beats probe those lists (merged with the first round) or, where that costs
    more than their exact scan, are marked exact -> ``(top [B, k], exact [B] bool)``."""
    nlist, dev = t.nlist, ip.device
    probed = torch.zeros(ip.shape[0], nlist + 1, dtype=torch.bool, device=dev)
    probed = probed.scatter(1, probes.masked_fill(probes < 0, nlist), True)[:, :nlist]
    bounds = ip + plan.factor[:, None] * t.list_radius.to(dev)[None, :]
    off = probed | ~plan.reach | ~plan.checked[:, None]
    bounds = bounds.masked_fill(off, NEG_INF)
    kth = top.scores[:, -1]
    need = bounds > kth[:, None]  # [B, L]
    sizes = (t.lists.offsets[1:] - t.lists.offsets[:-1]).to(dev)
    todo = need.any(dim=1) & ~plan.exact & (top.keys[:, -1] >= 0)
    codes = (need.long() * sizes).sum(dim=1).float()
    exact = todo & (codes > plan.budget)
    listed = todo & ~exact
    lists = torch.where(need & listed[:, None], torch.arange(nlist, device=dev), -1)
    merged = Candidates.concat([first, scan(lists)]).unique()
    return _where(listed, select_top(merged, plan.k, plan.r), top), exact


class _Scan:
    """One round's list scan for every row (``-1`` slots skipped), re-ranked with the exact
    copy where the plan re-ranks: ``scan(probes [B, P]) -> Candidates [B, r]``."""

    def __init__(
        self,
        t: IndexTensors,
        q: torch.Tensor,
        ip: torch.Tensor,
        masks: torch.Tensor,
        negate: torch.Tensor,
        excl: torch.Tensor | None,
        plan: DevicePlan,
        none: torch.Tensor | None = None,
    ) -> None:
        self.t, self.q, self.ip, self.plan = t, q, ip, plan
        self.masks, self.negate, self.excl = masks.contiguous(), negate.contiguous(), excl
        self.none = None if none is None else none.contiguous()

    def __call__(self, probes: torch.Tensor) -> Candidates:
        coarse = self.ip.gather(1, probes.clamp(min=0))
        rows = ScanRows(
            self.q, probes.contiguous(), coarse, self.masks, self.negate, self.excl, None, self.none
        )
        pos, approx = scan(self.t.lists, rows, self.plan.r)
        if self.plan.r == self.plan.k:
            return Candidates(pos, approx, approx)
        return Candidates(pos, approx, rescore(self.q, pos, self.t.exact))


def _where(rows: torch.Tensor, a: Candidates, b: Candidates) -> Candidates:
    """Row by row: ``a`` where ``rows [B] bool``, else ``b`` (same widths)."""
    m = rows[:, None]
    return Candidates(
        torch.where(m, a.keys, b.keys),
        torch.where(m, a.approx, b.approx),
        torch.where(m, a.scores, b.scores),
    )


def excluded_rows(t: IndexTensors, ids: torch.Tensor) -> torch.Tensor:
    """``exclude.excluded_positions`` in tensor ops: item ids ``[B, S]`` (``-1`` pads) -> their
    rows ``[B, S]`` ascending, ``PAD`` padded (ids the index does not hold too)."""
    item_ids = t.item_ids
    n = item_ids.numel()
    perm = t.id_order.perm.long()
    at = torch.searchsorted(item_ids, ids.contiguous(), sorter=perm).clamp(max=max(n - 1, 0))
    row = perm[at]
    return torch.where(item_ids[row] == ids, row, PAD).sort(dim=1).values


def exact_all(
    t: IndexTensors,
    q: torch.Tensor,
    k: int,
    masks: torch.Tensor,
    negate: torch.Tensor,
    excl: torch.Tensor | None,
    none: torch.Tensor | None = None,
    verify: FilterVerify | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` of ``q [B, D]`` over every item passing each row's filter (``none``: its
    clauses' "none of these bits" parts, None: none; ``verify``: the exact clauses of rows
    naming a multi-valued hashed attribute), less the rows
    it excludes -> ``(positions [B, k], scores [B, k])``, ``-1`` / ``-inf`` padded: every item
    scored (the exact copy, else the codes decoded), so the shape is the catalog's."""
    n = t.ntotal
    scores = q @ all_vectors(t).T  # [B, N]
    pos = torch.arange(n, device=q.device)
    if masks.shape[1]:
        scores = scores.masked_fill(~eligible_all(t.lists.sig, masks, negate, none), NEG_INF)
    if verify is not None:
        scores = scores.masked_fill(~verified_all(t, verify), NEG_INF)
    if excl is not None and excl.shape[1]:
        scores = scores.masked_fill(is_excluded(pos.expand(q.shape[0], -1), excl), NEG_INF)
    top, idx = scores.topk(min(k, n), dim=1)
    found = torch.where(top > NEG_INF, idx, -1)
    if k > n:
        found = torch.nn.functional.pad(found, (0, k - n), value=-1)
        top = torch.nn.functional.pad(top, (0, k - n), value=NEG_INF)
    return found, top


def verified_all(t: IndexTensors, v: FilterVerify) -> torch.Tensor:
    """Every item against every row's exact clauses (``verified.py``), in fixed shapes ->
    ``[B, N] bool`` (true for rows without them)."""
    pos = torch.arange(t.ntotal, device=t.lists.sig.device)
    ext = extended(t.value_keys, pos, t.lists.sig, v)  # [B, N, W2]
    return eligible_all(ext, v.masks, v.negate, v.neg_masks) | ~v.rows[:, None]


def eligible_all(
    sig: torch.Tensor, masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None = None
) -> torch.Tensor:
    """``filters.eligible`` of every item for every row: ``sig [N, W]`` (or each row's, ``[B, N,
    W]``), ``masks [B, C, W]``, ``negate [B, C]``, ``none [B, C, W]`` (None: no "none of"
    parts) -> ``[B, N] bool``, a clause and a word at a time, so the temporaries stay ``[B,
    N]`` (``eligible`` broadcasts to ``[B, C, N, W]``)."""
    b, c, w = masks.shape
    rows = sig if sig.dim() == 3 else sig.unsqueeze(0)  # [B or 1, N, W]
    ok = torch.ones(b, sig.shape[-2], dtype=torch.bool, device=sig.device)
    for ci in range(c):
        hit = torch.zeros_like(ok)
        held = torch.zeros_like(ok)
        for wi in range(w):
            hit |= (rows[:, :, wi] & masks[:, ci, wi, None]) != 0
            if none is not None:
                held |= (rows[:, :, wi] & none[:, ci, wi, None]) != 0
        clause = hit != negate[:, ci, None]
        if none is not None:
            clause |= none[:, ci].ne(0).any(dim=-1)[:, None] & ~held
        ok &= clause
    return ok


def all_vectors(t: IndexTensors) -> torch.Tensor:
    """Every item's float vector ``[N, D]``: the exact copy, else centroid + decoded code."""
    if t.exact.shape[0]:
        return t.exact.float()
    lists = t.lists
    sizes = lists.offsets[1:] - lists.offsets[:-1]
    listed = torch.repeat_interleave(
        torch.arange(t.nlist, device=sizes.device), sizes, output_size=t.ntotal
    )
    return t.centroids.index_select(0, listed) + dequantize(lists.codes, lists.scales)


def ids_of(t: IndexTensors, pos: torch.Tensor) -> torch.Tensor:
    """Positions ``[B, k]`` (``-1`` pads) -> item ids (``-1`` pads), in tensor ops."""
    return torch.where(pos >= 0, t.item_ids[pos.clamp(min=0)], pos)


def graphed_search(
    owner: object, t: IndexTensors, q: torch.Tensor, fb: FilterBatch | None, params: SearchParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`device_search`, replayed on a GPU from a CUDA graph kept for ``owner`` per batch
    bucket, clause count and excluded width (``cuda_graphs.run_graphed``; the excluded ids
    padded with ``-1`` to a bucketed width, which excludes nothing more); eager elsewhere."""
    b, w = q.shape[0], t.lists.sig.shape[1]
    masks = fb.masks if fb is not None else q.new_zeros((b, 0, w), dtype=torch.int64)
    negate = fb.negate if fb is not None else q.new_zeros((b, 0), dtype=torch.bool)
    inputs = [q, masks, negate]
    none = fb.neg_masks if fb is not None else None
    if none is not None:
        inputs.append(none)
    verify = fb.verify if fb is not None else None
    if verify is not None:
        inputs += [verify.masks, verify.negate, verify.atoms, verify.rows]
        if verify.neg_masks is not None:
            inputs.append(verify.neg_masks)
    ex = fb.exclude if fb is not None else None
    if ex is not None:
        width = bucket(ex.shape[1])
        inputs.append(torch.nn.functional.pad(ex, (0, width - ex.shape[1]), value=-1))

    def search(
        qq: torch.Tensor, mm: torch.Tensor, nn: torch.Tensor, *more: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rest = list(more)
        nm = rest.pop(0) if none is not None else None
        v = None
        if verify is not None:
            vm, vn, va, vr = rest[:4]
            del rest[:4]
            v = FilterVerify(vm, vn, rest.pop(0) if verify.neg_masks is not None else None, va, vr)
        return device_search(t, qq, FilterBatch(mm, nn, rest[0] if rest else None, nm, v), params)

    lists = t.lists
    kept = (t.centroids, lists.codes, lists.scales, lists.offsets, lists.sig, t.built_sizes,
            t.item_ids, t.exact, t.bit_counts, t.list_radius, t.list_bits, t.value_keys)  # fmt: skip
    key = (
        "device",
        params.k,
        params.nprobe,
        params.rerank,
        params.exact,
        ex is not None,
        none is not None,
        None if verify is None else verify.neg_masks is not None,
    )
    pos, scores = run_graphed(owner, key, search, tuple(inputs), kept)
    return pos, scores
