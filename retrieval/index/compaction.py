"""Compaction: the fresh segment folded into the main lists, off the request path.

A live index serves its main lists plus a :class:`~retrieval.index.fresh.LiveSegment` (fresh
rows, tombstones). The segment grows with every update and is searched exactly, so past a size
(``ServeConfig.compact_at``) it is folded in, in two steps:

    folded = fold(index)                 O(N * D), on a background thread, reading one snapshot:
                                         the tombstoned rows dropped, the fresh rows added to the
                                         lists they join (``update.remove_items`` / ``add_items``)
    index  = rebase(folded, base, now)   O(what changed since), between updates: the updates that
                                         arrived while ``fold`` ran, as a new segment of ``folded``

Requests keep reading the old index meanwhile, and updates keep landing in its segment (the
server holds its update lock only for :func:`rebase`). Compaction writes no log record: the
update log stays the one record of what was acknowledged, and a replay of it (after a kill
during a compaction too) serves the same items, vectors and signatures, folded or not.

Example::

    folded = fold(index)                        # index.live: the snapshot folded
    index = rebase(folded, index.live, latest)  # latest: the index served now
"""

from __future__ import annotations

import torch

from retrieval.index.fresh import FreshStore, LiveSegment
from retrieval.index.ivf import IVFIndex
from retrieval.index.live_index import with_live
from retrieval.index.update import add_items, remove_items


def fold(index: IVFIndex) -> IVFIndex:
    """A new main index holding what ``index`` serves (its live segment folded in), no live
    segment; ``index`` itself when it has nothing to fold."""
    live = index.live
    if live is None or not live.size:
        return index
    main = with_live(index, None)
    if live.tombstones.numel():
        main = remove_items(main, live.tombstones.cpu())
    alive = live.alive.cpu()
    if bool(alive.any()):
        rows = alive.nonzero().flatten().to(live.ids.device)
        ids, x, sig = live.ids[rows].cpu(), live.vectors[rows].cpu(), live.sig[rows].cpu()
        main = add_items(main, ids, x, sig, index.value_lists)  # by id: what each holds
    return main


def rebase(folded: IVFIndex, base: LiveSegment, now: IVFIndex) -> IVFIndex | None:
    """``folded`` (:func:`fold` of an index whose segment was ``base``) with what ``now``'s
    segment changed since ``base``, as a segment of its own -> the index to serve instead of
    ``now``; None where ``now`` does not descend from ``base`` (a reload, another branch: fold
    again).

    Since ``base``: fresh rows appended (they become the new segment's rows), fresh rows of
    ``base`` no longer alive (their items sit in ``folded``'s lists now: tombstones), and main
    items tombstoned (tombstones still)."""
    cur = now.live
    if cur is None or cur.store is not base.store or cur.n < base.n:
        return None
    old, new = base.tombstones.cpu(), cur.tombstones.cpu()
    if not bool(torch.isin(old, new).all()):
        return None
    t = folded.tensors()
    dead = base.alive.cpu() & ~cur.alive.cpu()[: base.n]  # folded, then removed or replaced
    tomb = torch.cat([base.ids.cpu()[dead], new[~torch.isin(new, old)]]).unique()
    seg = LiveSegment.empty(t)
    store, m = seg.store, cur.n - base.n
    if m:
        store = FreshStore(t.centroids.shape[1], t.lists.sig.shape[1], t.device, m)
        rows = slice(base.n, cur.n)
        store.claim(0, cur.ids[rows], cur.vectors[rows], cur.sig[rows], cur.lists[rows])
        alive = cur.alive[rows]  # an id's latest row is the one row_of names
    else:
        alive = seg.alive
    tomb_rows = folded.id_order.positions(tomb).cpu().sort().values  # each a main row
    segment = LiveSegment(store, m, alive.to(t.device), tomb.to(t.device), tomb_rows.to(t.device))
    # the values by id as ``now`` has them (updates since the snapshot changed some)
    out = with_live(folded, segment if segment.size else None, now.value_lists)
    out.schema = now.schema  # the values learned since the snapshot (a hashed attribute's new ones)
    return out
