"""Splitting an :class:`IVFIndex` into document shards, and the statistics a router plans with.

Every shard keeps the global centroids (so every shard probes the same lists a query would probe
in the whole index) and a disjoint part of every list: its items' codes, scales, exact copy and
filter signatures, in the same list-sorted order. The router keeps a statistics-only index
(centroids, global list offsets, per-bit counts, config and filter schema; no items), which is
all :meth:`IVFIndex.plan` reads. See ``retrieval/index/search.py`` for why the merged answer of
the shards equals the unsharded one.

    assignment = shard_of(index.item_ids, 4)          # stable: the same id, the same shard
    stats, shards = split_index(index, assignment, 4)
"""

from __future__ import annotations

import numpy as np
import torch

from retrieval.filters import bit_counts
from retrieval.index.build import postings
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
    out = IVFIndex(index.config, index.dim, index.schema.attribute_values)
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
    out.bit_counts = bit_counts(out.sig) if out.sig.shape[1] else index.bit_counts.clone()
    out.postings = postings(out.sig.cpu()).to(out.sig.device)
    out._refresh()
    return out


def _stats_only(index: IVFIndex) -> IVFIndex:
    """What the router plans with: centroids, global offsets and bit counts; no items."""
    out = _new_like(index)
    out.centroids = index.centroids.clone()
    out.offsets = index.offsets.clone()
    out.bit_counts = index.bit_counts.clone()
    out._refresh()
    return out
