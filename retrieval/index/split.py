"""Splitting an :class:`IVFIndex` into document shards, and the statistics a router plans with.

Every shard keeps the global centroids (so every shard probes the same lists a query would probe
in the whole index) and a disjoint part of every list: its items' codes, scales, exact copy and
filter signatures, in the same list-sorted order. The router keeps a statistics-only index
(centroids, global list offsets, per-bit counts, bound statistics, config and filter schema; no
items), which is all :meth:`IVFIndex.plan` reads. See ``retrieval/index/search.py`` for why the
merged answer of the shards equals the unsharded one.

    assignment = shard_of(index.item_ids, 4)          # stable: the same id, the same shard
    stats, shards = split_index(index, assignment, 4)
    rows = shard_rows(assignment, 4)                  # where each shard's rows were
    whole = merge_shards(shards, stats, rows)         # equals index, buffer for buffer

:func:`merge_shards` is the inverse, for a process that wants the whole catalog in one index
(offline batch scoring): the lists are rebuilt in their original order from the shards' rows,
so the merged index equals the unsharded one bit for bit and answers exactly as it does,
tie-breaking included.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from retrieval.index.build import bit_index
from retrieval.index.ivf import IVFIndex

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def shard_of(item_ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Stable shard of each item: a multiplicative hash of its id -> ``[N] int64`` in
    ``[0, num_shards)``. Depends only on the id and ``num_shards`` (not on order or process)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    ids = item_ids.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        h = (ids * _GOLDEN) >> np.uint64(32)  # Fibonacci hashing: the high bits mix best
    return torch.from_numpy((h % np.uint64(num_shards)).astype(np.int64))


def check_assignment(assignment: torch.Tensor, num_items: int, num_shards: int) -> None:
    """An assignment gives every item exactly one shard in ``[0, num_shards)``; raises
    ``ValueError`` saying which items are uncovered or claimed twice."""
    if assignment.shape != (num_items,):
        raise ValueError(
            f"shard assignment: expected one shard per item ([{num_items}]), got "
            f"{tuple(assignment.shape)}"
        )
    bad = ((assignment < 0) | (assignment >= num_shards)).nonzero().flatten()
    if bad.numel():
        raise ValueError(
            f"shard assignment: {bad.numel()} items have no shard in [0, {num_shards}) "
            f"(first at position {int(bad[0])}: {int(assignment[bad[0]])})"
        )


def check_cover(item_ids: torch.Tensor, shard_item_ids: list[torch.Tensor]) -> None:
    """The shards hold every item of the catalog exactly once; raises ``ValueError`` naming an
    item that is missing or held twice."""
    held = torch.cat(shard_item_ids) if shard_item_ids else item_ids[:0]
    ids, counts = held.unique(return_counts=True)
    twice = ids[counts > 1]
    if twice.numel():
        raise ValueError(f"shard map: item {int(twice[0])} is claimed by more than one shard")
    missing = item_ids[~torch.isin(item_ids, ids)]
    if missing.numel():
        raise ValueError(
            f"shard map: {missing.numel()} items are on no shard (first: item {int(missing[0])})"
        )
    extra = ids[~torch.isin(ids, item_ids)]
    if extra.numel():
        raise ValueError(f"shard map: item {int(extra[0])} is on a shard but not in the catalog")


def split_index(
    index: IVFIndex, assignment: torch.Tensor, num_shards: int
) -> tuple[IVFIndex, list[IVFIndex]]:
    """``index`` -> (statistics-only index for the router, ``num_shards`` shard indexes).

    ``assignment [N] int64``: the shard of each row of ``index`` (in its list-sorted order, e.g.
    ``shard_of(index.item_ids, S)``).
    """
    check_assignment(assignment, index.ntotal, num_shards)
    assignment = assignment.to(index.offsets.device)
    lists = torch.repeat_interleave(
        torch.arange(index.nlist, device=index.offsets.device), index.offsets.diff()
    )  # [N] the list of each row
    shards = [
        _subset(index, (assignment == s).nonzero().flatten(), lists) for s in range(num_shards)
    ]
    check_cover(index.item_ids, [s.item_ids for s in shards])
    return _stats_only(index), shards


def _new_like(index: IVFIndex) -> IVFIndex:
    out = IVFIndex(
        index.config,
        index.dim,
        index.schema.attribute_values,
        index.stats,
        index.schema.hashed_digits,
    )
    # the value lists are by id: each shard keeps them whole (its own items' are what it reads)
    out.value_lists = dict(index.value_lists)
    out.schema.multi_valued = set(index.value_lists)
    return out.to(index.centroids.device)


def _subset(index: IVFIndex, rows: torch.Tensor, lists: torch.Tensor) -> IVFIndex:
    """The rows ``rows`` (ascending, so still list-sorted) as an index with the same centroids."""
    out = _new_like(index)
    counts = torch.bincount(lists[rows], minlength=index.nlist)
    out.centroids = index.centroids.clone()
    out.offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    out.item_ids = index.item_ids[rows].clone()
    out.codes, out.scales = index.codes[rows].clone(), index.scales[rows].clone()
    out.exact = index.exact[rows].clone() if index.exact.shape[0] else index.exact.clone()
    out.sig = index.sig[rows].clone()
    out.bit_counts, out.postings = (
        t.to(out.sig.device) for t in bit_index(out.sig.cpu(), out.schema.unindexed_bits())
    )
    _copy_catalog_stats(out, index)  # the catalog's: still bounds for a part of it
    out._refresh()
    return out


def _copy_catalog_stats(out: IVFIndex, index: IVFIndex) -> None:
    """``index``'s bound statistics (``retrieval/index/bound.py``) and list sizes as built (what
    every shard reads a row's list count from, so all probe the lists the whole index would)
    into ``out``."""
    out.list_radius, out.list_bits = index.list_radius.clone(), index.list_bits.clone()
    out.built_sizes = index.built_sizes.clone()


def _stats_only(index: IVFIndex) -> IVFIndex:
    """What the router plans with: centroids, global offsets, bit counts and bound statistics;
    no items."""
    out = _new_like(index)
    out.centroids = index.centroids.clone()
    out.offsets = index.offsets.clone()
    out.bit_counts = index.bit_counts.clone()
    out.filter_sample = index.filter_sample.clone()  # the catalog's: what it plans from
    _copy_catalog_stats(out, index)
    out._refresh()
    return out


def shard_rows(assignment: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    """Each shard's rows in the unsharded index: ``assignment [N] int64`` (as given to
    :func:`split_index`) -> ``num_shards`` ascending ``[n_s] int64`` (what :func:`merge_shards`
    needs to restore the original order)."""
    return [(assignment == s).nonzero().flatten().cpu() for s in range(num_shards)]


def merge_shards(
    parts: Sequence[IVFIndex], router: IVFIndex, rows: Sequence[torch.Tensor] | None = None
) -> IVFIndex:
    """The shards' parts -> the unsharded index (the inverse of :func:`split_index`).

    ``parts``: the ``S`` shard indexes; ``router``: the statistics-only index (centroids, global
    list offsets, bit counts, config); ``rows``: each shard's rows in the unsharded index
    (:func:`shard_rows`). With them the merged index equals the original bit for bit. Without
    (versions published before the rows were saved), each list is ordered by item id, which is
    the original order of an index built in item-id order (``build_ivf``) but not after
    ``add_items``; then only items with equal scores may come back in another order.

    Raises ``ValueError`` naming the shard whose part does not fit the router.
    """
    if not parts:
        raise ValueError("merge_shards: no shard parts")
    if rows is not None and len(rows) != len(parts):
        raise ValueError(f"merge_shards: {len(rows)} row lists for {len(parts)} shards")
    counts = router.offsets.diff()  # [nlist] global list sizes
    held = torch.zeros_like(counts)
    for s, part in enumerate(parts):
        if part.nlist != router.nlist or not torch.equal(part.centroids, router.centroids):
            raise ValueError(f"shard {s}: its centroids differ from the router's")
        if part.dim != router.dim or part.config.codes != router.config.codes:
            raise ValueError(
                f"shard {s}: dim={part.dim} codes={part.config.codes!r}, the router has "
                f"dim={router.dim} codes={router.config.codes!r}"
            )
        held += part.offsets.diff()
    if not torch.equal(held, counts):
        lst = int((held != counts).nonzero()[0])
        raise ValueError(
            f"merge_shards: the shards hold {int(held[lst])} items of list {lst}, the router "
            f"counts {int(counts[lst])} (shards of another version or split?)"
        )
    n = router.ntotal
    part_lists = [_row_lists(p) for p in parts]
    if rows is None:
        ids = torch.cat([p.item_ids for p in parts])
        lists = torch.cat(part_lists)
        by_id = torch.argsort(ids, stable=True)
        order = by_id[torch.argsort(lists[by_id], stable=True)]  # by list, then by item id
        src = torch.empty(n, dtype=torch.int64)
        src[order] = torch.arange(n)
        dest = list(src.split([p.ntotal for p in parts]))  # merged row of each part's rows
    else:
        dest = [r.to(torch.int64).cpu() for r in rows]
        _check_rows(dest, parts, part_lists, _row_lists(router))
    out = _new_like(router)
    out.centroids = router.centroids.clone()
    out.offsets = router.offsets.clone()
    out.item_ids = _scatter([p.item_ids for p in parts], dest, n)
    out.codes = _scatter([p.codes for p in parts], dest, n)
    out.scales = _scatter([p.scales for p in parts], dest, n)
    has_exact = any(p.exact.shape[0] for p in parts)  # else no exact copy: [0, D] everywhere
    out.exact = _scatter([p.exact for p in parts], dest, n) if has_exact else parts[0].exact.clone()
    out.sig = _scatter([p.sig for p in parts], dest, n)
    out.bit_counts, out.postings = (
        t.to(out.sig.device) for t in bit_index(out.sig.cpu(), out.schema.unindexed_bits())
    )
    _copy_catalog_stats(out, router)
    out._refresh()
    return out


def _row_lists(index: IVFIndex) -> torch.Tensor:
    """The list of every row of ``index`` (list-sorted) -> ``[ntotal] int64`` (CPU)."""
    sizes = index.offsets.diff().cpu()
    return torch.repeat_interleave(torch.arange(index.nlist), sizes)


def _check_rows(
    dest: list[torch.Tensor],
    parts: Sequence[IVFIndex],
    part_lists: list[torch.Tensor],
    lists: torch.Tensor,
) -> None:
    """The shards' rows cover ``[0, N)`` once each and put every row in its own list."""
    for s, (d, part) in enumerate(zip(dest, parts, strict=True)):
        if d.shape != (part.ntotal,):
            raise ValueError(f"shard {s}: {tuple(d.shape)} rows for {part.ntotal} items")
    every = torch.cat(dest)
    if not torch.equal(every.sort().values, torch.arange(lists.numel())):
        raise ValueError("merge_shards: the shards' rows do not cover the index once each")
    for s, (d, pl) in enumerate(zip(dest, part_lists, strict=True)):
        if not torch.equal(lists[d], pl):
            raise ValueError(f"shard {s}: its rows put items in other lists than the router's")


def _scatter(values: list[torch.Tensor], dest: list[torch.Tensor], n: int) -> torch.Tensor:
    """``values[s][j]`` -> row ``dest[s][j]`` of one ``[n, ...]`` tensor."""
    first = values[0]
    out = first.new_empty((n, *first.shape[1:]))
    for v, d in zip(values, dest, strict=True):
        out[d.to(out.device)] = v
    return out
