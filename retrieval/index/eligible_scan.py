"""Exact search of a filter's eligible items: what the plan falls back to when scanning them costs
no more than the lists (``planner.py``), and the reference the index is measured against.

The items passing a filter are found from the postings of its most selective clause, or of
the buckets of a hashed attribute's values its clauses leave (:func:`value_drive`), whichever
hold fewer items (:func:`eligible_positions`), so the cost grows with those items, not the catalog;
with no selective clause, on CPU, from the signatures bit-sliced (one bitmap of the catalog per
bit, kept beside the signatures once a few such filters met them), which reads only the filter's
bits.
Rows sharing one filter are searched together (:func:`exact_search`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from retrieval.filter_verify import FilterVerify
from retrieval.filters import eligible
from retrieval.index.exact import exact_topk
from retrieval.index.readout import scores_at
from retrieval.index.scan import (
    bit_slices_cpu,
    eligible_rows_cpu,
    filter_mask,
    sliced_rows_cpu,
    value_drive_cpu,
)
from retrieval.index.tensors import IndexTensors
from retrieval.index.verified import verified_positions


def exact_search(
    t: IndexTensors,
    q: torch.Tensor,
    k: int,
    masks: torch.Tensor,
    negate: torch.Tensor,
    excl: torch.Tensor | None = None,
    none: torch.Tensor | None = None,
    verify: FilterVerify | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` of ``q [B, D]`` among the items passing each row's filter (``masks [B, C,
    W]``, ``negate [B, C]``, ``none [B, C, W]`` or None; ``verify``: exact clauses the
    candidates are checked against, ``verified.py``) less the rows it excludes (``excl [B,
    S]``), per group of rows sharing one filter -> ``(positions [B, k], scores [B, k])``,
    ``-1`` / ``-inf`` padded."""
    b = q.shape[0]
    pos = torch.full((b, k), -1, dtype=torch.int64, device=q.device)
    scores = torch.full((b, k), float("-inf"), device=q.device)
    if masks.shape[1] or verify is not None:
        key = torch.cat([masks.flatten(1), negate.long()], dim=1)
        if none is not None:
            key = torch.cat([key, none.flatten(1)], dim=1)
        if verify is not None:
            key = torch.cat([key, verify.key().to(key.device)], dim=1)
        inverse = torch.unique(key, dim=0, return_inverse=True)[1]
    else:  # no clauses: one group
        inverse = torch.zeros(b, dtype=torch.int64, device=q.device)
    for g in range(int(inverse.max()) + 1 if b else 0):
        rows = (inverse == g).nonzero().flatten()
        if masks.shape[1]:
            one = None if none is None else none[rows[0]]
            subset = eligible_positions(t, masks[rows[0]], negate[rows[0]], one)
        else:
            subset = torch.arange(t.ntotal, device=q.device)
        subset = verified_positions(t, subset, verify, int(rows[0]))
        ex = None if excl is None else excl[rows]
        p, s = exact_topk(q[rows], k, subset, _scorer(t), excl=ex)  # none eligible: empty
        pos[rows], scores[rows] = p, s
    return pos, scores


def eligible_positions(
    t: IndexTensors, masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None = None
) -> torch.Tensor:
    """Positions of the items passing one filter (``masks [C, W]``, ``negate [C]``, ``none [C,
    W]``: the clauses' "none of these bits" parts, None: none) -> ``[M]``.

    The most selective clause neither negated nor with a "none of" part drives: the postings of its values are the only
    candidates, and only they are checked against every clause. Cost grows with that
    clause's items, not with the catalog; with no selective clause, every item is checked.
    A clause on a bit the postings leave out (a hashed attribute's digit, counted ``-1`` in
    ``t.posting_counts``) never drives alone: a hashed attribute's clauses on its bucket
    digits drive together, through its values' postings (:func:`value_drive`), when their
    buckets hold fewer items.
    """
    sig = t.lists.sig
    if sig.device.type == "cpu":  # one C++ call, the same rule
        if _dense(t, masks, negate, none) and _sliced_cheaper(masks, negate, none):
            slices = _slices(sig)
            if slices is not None:
                return sliced_rows_cpu(slices, masks, negate, sig.shape[0], none)
        return eligible_rows_cpu(sig, masks, negate, t.posting_counts, t.postings, none, t.values)
    return eligible_positions_torch(t, masks, negate, none)


def eligible_positions_torch(
    t: IndexTensors, masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`eligible_positions` in torch ops (on a GPU), by the same rule."""
    sig = t.lists.sig
    bits, counts = _driving_counts(t, masks, negate, none)
    c = int(counts.argmin()) if counts.numel() else -1
    best = int(counts[c]) if c >= 0 and t.postings.numel() else t.ntotal + 1
    by_value = value_drive(t, masks, negate, none)
    if by_value is not None and by_value[0] < min(best, t.ntotal // 4 + 1):  # its buckets
        at = by_value[1].to(t.values.offsets.device)
        starts, ends = t.values.offsets[at].tolist(), t.values.offsets[at + 1].tolist()
        vp = t.values.postings
        parts = [vp[i:j] for i, j in zip(starts, ends, strict=True) if j > i]
    elif best > t.ntotal // 4:
        return filter_mask(sig, masks, negate, none).nonzero().flatten()
    else:
        off = t.posting_offsets
        parts = [t.postings[off[b] : off[b + 1]] for b in bits[c].nonzero().flatten().tolist()]
    cand = (
        torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.int64, device=masks.device)
    )
    if len(parts) > 1:
        cand = cand.unique()  # a multi-valued attribute may list an item under several values
    return cand[eligible(sig.index_select(0, cand), masks, negate, none)]


_SLICES = WeakIdKeyDictionary()
"""Signatures (by identity) -> ``[their version, their bit slices or None, dense filters seen at
that version]``; a live update replaces the signatures or bumps their version in place."""
SLICES_AFTER = 8
"""Dense filters one version of the signatures answers through the full check before its bit
slices are built: building reads every item's bits, a few full checks' worth, so signatures that
change between every few filters never pay for slices they would not reuse."""


def _slices(sig: torch.Tensor) -> torch.Tensor | None:
    """``sig [N, W]``'s bit slices ``[W * 64, ceil(N / 64)]`` once :data:`SLICES_AFTER` dense
    filters met this version of ``sig``; None before (the caller checks every row)."""
    kept = _SLICES.get(sig)
    if kept is None or kept[0] != sig._version:
        kept = [sig._version, None, 0]
        _SLICES[sig] = kept
    kept[2] += 1
    if kept[1] is None and kept[2] >= SLICES_AFTER:
        kept[1] = bit_slices_cpu(sig)
    return kept[1]


def _dense(
    t: IndexTensors, masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None
) -> bool:
    """No non-negated clause under a quarter of the catalog: the postings would not narrow the
    candidates (``eligible_rows`` then checks every row)."""
    if masks.shape[0] == 0:
        return True
    by_value = value_drive(t, masks, negate, none)
    if by_value is not None and by_value[0] <= t.ntotal // 4:
        return False
    if t.postings.numel() == 0:
        return True
    return int(_driving_counts(t, masks, negate, none)[1].min()) > t.ntotal // 4


def value_drive(
    t: IndexTensors, masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None = None
) -> tuple[int, torch.Tensor] | None:
    """The hashed attribute whose values' postings (``t.values``) hold the fewest candidates for
    one filter (``masks [C, W]``, ``negate [C]``, ``none [C, W]``) -> ``(items, slots [k]
    int64)``, or None when none narrows it: the buckets its clauses on the attribute's bucket
    digits leave, by the rule the C++ path applies itself (``csrc/ivf_scan/values.cpp``). On
    a GPU the filter and the offsets (8 bytes a bucket) are read on the host."""
    values = t.values
    if values.layout.shape[0] == 0 or values.offsets.numel() == 0:
        return None
    host = None if none is None else none.cpu()
    items, slots = value_drive_cpu(
        values.layout, values.offsets.cpu(), masks.cpu(), negate.cpu(), host
    )
    return None if items < 0 else (items, slots)


def _driving_counts(
    t: IndexTensors, masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each clause's bits ``[C, W*64]`` and the items its postings list ``[C]``; a negated
    clause, one with a "none of these bits" part (an item holding none passes whatever its
    postings), or one reading a bit without postings, counts ``ntotal + 1`` (it never drives)."""
    shifts = torch.arange(64, device=masks.device)
    bits = ((masks.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [C, W*64]
    listed = t.posting_counts.to(masks.device)
    unlisted = (bits & (listed < 0)).any(dim=1)  # [C]: reads a bit without postings
    counts = (bits.long() * listed.clamp(min=0)).sum(dim=1)
    never = negate | unlisted
    if none is not None:
        never = never | none.ne(0).any(dim=-1)
    return bits, counts.masked_fill(never, t.ntotal + 1)


def _sliced_cheaper(
    masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None = None
) -> bool:
    """Reading the filter's bits (a word of 64 items each) costs less than every row's whole
    signature against every clause (``C * W`` words an item)."""
    read = masks.flatten().tolist() + ([] if none is None else none.flatten().tolist())
    set_bits = sum(bin(int(m) & (2**64 - 1)).count("1") for m in read)
    return set_bits < 64 * masks.shape[0] * masks.shape[1]


def _scorer(t: IndexTensors) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``scores_at`` of ``t`` as ``exact_topk`` calls it: ``(q, positions) -> [B, m]``."""
    return lambda q, pos: scores_at(t, q, pos)
