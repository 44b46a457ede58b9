"""The share of the catalog a filter admits, for the planner: the whole expression, with what its
clauses have to do with each other.

Two estimates meet, per row ``b`` of a :class:`~retrieval.filters.FilterBatch`::

    independent_b = prod_c frac_c        each clause's share off the bit counts (exact for a
                                         clause on one single-valued attribute), the clauses
                                         taken as independent: blind to correlation, so an
                                         AND of clauses that rarely meet reads far more than
                                         it admits, and one of clauses that go together less
    hits_b        = the items of a fixed sample of S signatures the row admits, evaluated
                    with the compiled clauses as the scans evaluate them: unbiased for the
                    whole expression (OR, ranges, negations, hashed attributes), but few
                    hits for a rare filter
    sel_b = clamp(independent_b, lo_b, hi_b), at most min_c frac_c
            lo_b, hi_b = (hits_b -/+ (Z sqrt(hits_b (1 - hits_b / S) (1 - f)) + RARE (1 - f))) / S

``f = S / N`` is the share sampled (a finite population: a catalog of at most S items is
sampled whole, and its estimate is exact). A filter many sample items pass reads its sample
share to within Z standard errors; a rare one the independent estimate as far as the sample
allows (none of S passing bounds it at ``RARE / S``, all of them likewise from below); no AND admits more than its narrowest
clause. The planner widens lists as the estimate narrows (``planner.lists_for``, with its
``FILL`` margin), so an estimate that reads too much loses recall and one that reads too little
costs time: the clamp keeps an anti-correlated AND's error within the margin.

The sample (:data:`SAMPLE_ITEMS` rows evenly spaced over the index's rows, so spread over its
lists: ``sample_rows``) is the buffer ``IVFIndex.filter_sample``, read again off the signatures
whenever the index refreshes (a live update builds a refreshed index), so a router's
statistics-only index, which holds no signatures, keeps the whole catalog's (its live updates
change its bit counts, not its sample). Evaluated on the host in C++ per distinct filter
(``scan.eligible_rows_cpu``), on the device in torch ops of fixed shapes (``device_plan``): the
same counts, so the same plans.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from retrieval.filters import FilterBatch, eligible
from retrieval.index.scan import bit_index_cpu, eligible_rows_cpu
from retrieval.index.tensors import FilterSample

SAMPLE_ITEMS = 4096
"""Signatures a sample holds (fewer in a smaller catalog: all of them). 4096 x W words is
32 KiB a signature word: a few microseconds of a C++ scan a filter on the host."""

Z = 2.0
"""Standard errors of the sample share the estimate may stray from it."""

RARE = 3.0
"""Hits a sample in which none passes still allows (the "rule of three": ~95 % that a share
this small would have shown one)."""

DEVICE_CHUNK = 512
"""Sample rows the device evaluates at once: ``[B, C, chunk, W]`` int64 for a batch's bits."""


def sample_rows(n: int, size: int = SAMPLE_ITEMS) -> torch.Tensor:
    """``[min(n, size)] int64``: positions evenly spaced over ``n`` rows (all of them when
    ``n <= size``); an index's rows are list-sorted, so these are spread over its lists."""
    s = min(n, size)
    return torch.arange(s, dtype=torch.int64) * n // max(s, 1)


def sample_of(sig: torch.Tensor, ntotal: int) -> FilterSample:
    """The sample ``sig [S, W]`` of a catalog of ``ntotal`` items with its host side: the rows on
    the CPU and their ``counts`` / ``postings`` over every bit (what the C++ evaluation drives
    from)."""
    host = sig.cpu().contiguous()
    if host.shape[0] and host.shape[1]:
        counts, postings = bit_index_cpu(host)
    else:
        counts = torch.zeros(host.shape[1] * 64, dtype=torch.int64)
        postings = torch.zeros(0, dtype=torch.int32)
    return FilterSample(sig, host, counts, postings, ntotal)


def estimate(
    sample: FilterSample, counts: torch.Tensor, num_items: int, fb: FilterBatch
) -> torch.Tensor:
    """Share of ``num_items`` items each row of ``fb`` admits -> ``[B] float32`` (module
    docstring), from the bit counts ``counts [W*64]`` and ``sample``; on the host, where the
    CPU planner runs. Plans only: no answer depends on it."""
    b = fb.masks.shape[0]
    if not fb.active:
        return torch.ones(b)
    masks, negate = fb.masks.cpu().numpy(), fb.negate.cpu().numpy()
    none = None if fb.neg_masks is None else fb.neg_masks.cpu().numpy()
    independent, narrowest = _independent_host(masks, negate, none, counts, num_items)
    if sample.size == 0:
        return torch.from_numpy(independent.astype(np.float32))
    hits = _hits_host(sample, fb)
    sel = _combine(independent, narrowest, hits, sample.size, max(num_items, 1), np)
    return torch.from_numpy(sel.astype(np.float32))


def estimate_device(
    sample: FilterSample,
    counts: torch.Tensor,
    num_items: int,
    masks: torch.Tensor,
    negate: torch.Tensor,
    none: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`estimate` in tensor ops of fixed shapes, nothing read back: ``masks [B, C, W]``,
    ``negate [B, C]``, ``none [B, C, W]`` (None: no "none of" parts) -> ``[B] float32`` on their
    device, equal to the host's (the same hit counts, float64 arithmetic)."""
    b, c = masks.shape[:2]
    if c == 0:
        return torch.ones(b, device=masks.device)
    independent, narrowest = _independent_device(masks, negate, none, counts, num_items)
    if sample.size == 0:
        return independent.float()
    hits = _hits_device(sample.sig.to(masks.device), masks, negate, none)
    sel = _combine(independent, narrowest, hits.double(), sample.size, max(num_items, 1), torch)
    return sel.float()


def _combine(independent: Any, narrowest: Any, hits: Any, s: int, n: int, xp: Any) -> Any:
    """``clamp(independent, lo, hi)`` at most ``narrowest`` (module docstring), in ``xp``
    (NumPy or torch) float64 arrays ``[B]``."""
    unsampled = max(0.0, 1.0 - s / n)
    width = Z * xp.sqrt(hits * (1.0 - hits / s) * unsampled) + RARE * unsampled
    lo = (hits - width).clip(min=0.0) / s
    hi = (hits + width).clip(max=float(s)) / s
    return xp.minimum(xp.minimum(xp.maximum(independent, lo), hi), narrowest)


def _hits_host(sample: FilterSample, fb: FilterBatch) -> np.ndarray:
    """``[B] float64``: sample items each row admits, one C++ evaluation a distinct filter (a
    batch sharing one, the common case, costs one)."""
    masks, negate = fb.masks.cpu(), fb.negate.cpu()
    none = None if fb.neg_masks is None else fb.neg_masks.cpu()
    b = masks.shape[0]
    parts = [masks.numpy().reshape(b, -1), negate.numpy().reshape(b, -1).astype(np.int64)]
    if none is not None:
        parts.append(none.numpy().reshape(b, -1))
    keys = np.concatenate(parts, axis=1)  # [B, row's filter]
    if (keys == keys[:1]).all():
        firsts, inverse = np.zeros(1, dtype=np.int64), np.zeros(b, dtype=np.int64)
    else:
        _, firsts, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    hits = np.empty(len(firsts), dtype=np.float64)
    for i, row in enumerate(firsts.tolist()):
        nm = None if none is None else none[row]
        rows = eligible_rows_cpu(
            sample.host, masks[row], negate[row], sample.counts, sample.postings, nm
        )
        hits[i] = rows.numel()
    return hits[inverse.reshape(-1)]


def _hits_device(
    sig: torch.Tensor, masks: torch.Tensor, negate: torch.Tensor, none: torch.Tensor | None
) -> torch.Tensor:
    """``[B] int64``: items of ``sig [S, W]`` each row admits (``filters.eligible``), in chunks
    of :data:`DEVICE_CHUNK` rows so a batch's ``[B, C, chunk, W]`` stays small."""
    hits = torch.zeros(masks.shape[0], dtype=torch.int64, device=masks.device)
    for start in range(0, sig.shape[0], DEVICE_CHUNK):
        part = sig[start : start + DEVICE_CHUNK].unsqueeze(0)  # [1, s, W]
        hits += eligible(part, masks, negate, none).sum(dim=1)
    return hits


def _independent_host(
    masks: np.ndarray,
    negate: np.ndarray,
    none: np.ndarray | None,
    counts: torch.Tensor,
    num_items: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(prod_c frac_c, min_c frac_c)``, each ``[B] float64``, in NumPy (for a batch's few
    rows a handful of torch ops cost more in dispatch than the work)."""
    b, c = masks.shape[:2]
    as_bytes = np.ascontiguousarray(masks).view(np.uint8).reshape(b, c, -1)  # little-endian words
    bits = np.unpackbits(as_bytes, axis=2, bitorder="little")  # [B, C, W*64]
    per_bit = counts.cpu().numpy().astype(np.float64) / max(num_items, 1)
    frac = np.minimum(bits @ per_bit, 1.0)  # [B, C]
    frac = np.where(negate, 1.0 - frac, frac)
    if none is not None:  # "or none of these": at least the share holding none
        nb = np.ascontiguousarray(none).view(np.uint8).reshape(b, c, -1)
        nbits = np.unpackbits(nb, axis=2, bitorder="little")
        held = np.minimum(nbits @ per_bit, 1.0)
        frac = np.where(nbits.any(axis=2), frac + (1.0 - frac) * (1.0 - held), frac)
    return frac.prod(axis=1), frac.min(axis=1)


def _independent_device(
    masks: torch.Tensor,
    negate: torch.Tensor,
    none: torch.Tensor | None,
    counts: torch.Tensor,
    num_items: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_independent_host` in tensor ops (float64 sums, as the host's NumPy)."""
    shifts = torch.arange(64, device=masks.device)
    bits = ((masks.unsqueeze(-1) >> shifts) & 1).flatten(2).double()  # [B, C, W*64]
    per_bit = counts.to(masks.device).double() / max(num_items, 1)
    frac = (bits @ per_bit).clamp(max=1.0)  # [B, C]
    frac = torch.where(negate, 1.0 - frac, frac)
    if none is not None:
        nbits = ((none.unsqueeze(-1) >> shifts) & 1).flatten(2).double()
        held = (nbits @ per_bit).clamp(max=1.0)
        frac = torch.where(nbits.sum(-1) > 0, frac + (1.0 - frac) * (1.0 - held), frac)
    return frac.prod(dim=1), frac.amin(dim=1)
