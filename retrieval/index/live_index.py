"""Live updates of an :class:`IVFIndex` in O(batch): each returns a NEW index that shares every
main buffer with the old one and serves a new :class:`~retrieval.index.fresh.LiveSegment`.

* :func:`upsert`: items join the fresh segment (an id already served leaves its row);
* :func:`remove`: items stop being served (a main item's id becomes a tombstone);
* :func:`relabel`: items get new signatures (a main item moves to a fresh row, its vector kept).

Nothing here writes into a buffer an older index reads (``fresh.py``'s snapshot protocol), so a
search holding the old index never sees a half-applied update. Compaction folds the segment
into the main lists (``compaction.py``).

Example::

    index = upsert(index, torch.tensor([300, 301]), vectors, sig)  # vectors [2, D], sig [2, W]
    index = remove(index, torch.tensor([7]))
    served(index)  # items the index answers from
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from retrieval.index.fresh import LiveSegment
from retrieval.index.ivf import IVFIndex
from retrieval.index.update import _check_editable, _check_ids, _check_sig
from retrieval.value_lists import ValueLists


def segment(index: IVFIndex) -> LiveSegment:
    """``index``'s live segment (an empty one where it has none)."""
    return index.live if index.live is not None else LiveSegment.empty(index.tensors())


def served(index: IVFIndex) -> int:
    """Items ``index`` answers from: its main items less the tombstones, plus fresh rows (a
    router's statistics index: what its shards said they serve)."""
    if index.live is not None:
        return index.live.live_items(index.ntotal)
    return index.ntotal if index.served_items is None else index.served_items


def list_sizes(index: IVFIndex) -> torch.Tensor:
    """``[nlist] int64``: items per list once the live segment is folded in (the main lists
    less the tombstoned rows, plus each fresh row in the list it joins)."""
    sizes = (index.offsets[1:] - index.offsets[:-1]).cpu()
    live = index.live
    if live is None:
        return sizes
    if live.tombstones.numel():  # every tombstone names a main row
        rows = index.id_order.positions(live.tombstones.cpu()).cpu()
        lists = torch.searchsorted(index.offsets.cpu(), rows, right=True) - 1
        sizes = sizes - torch.bincount(lists, minlength=index.nlist)
    fresh = live.lists.cpu()[live.alive.cpu()]
    return sizes + torch.bincount(fresh, minlength=index.nlist)


def list_imbalance(index: IVFIndex) -> float:
    """Largest list over the mean once the live segment is folded in (``update.list_imbalance``
    of the compacted index; 0.0: empty)."""
    sizes = list_sizes(index).float()
    if sizes.numel() == 0 or float(sizes.sum()) == 0:
        return 0.0
    return float(sizes.max() / sizes.mean())


def largest_id(index: IVFIndex) -> int | None:
    """The largest item id ``index`` holds, main or fresh (None: none)."""
    ids = index.item_ids
    top = int(ids.max()) if ids.numel() else None
    live = index.live
    if live is not None and live.n:
        fresh = int(live.ids.max())
        top = fresh if top is None else max(top, fresh)
    return top


def served_ids(index: IVFIndex) -> torch.Tensor:
    """``[n] int64`` (CPU, ascending): every item ``index`` serves (O(N): for checks)."""
    ids = index.item_ids.cpu()
    live = index.live
    if live is None:
        return ids.sort().values
    ids = ids[~torch.isin(ids, live.tombstones.cpu())]
    return torch.cat([ids, live.ids.cpu()[live.alive.cpu()]]).sort().values


def positions(index: IVFIndex, ids: torch.Tensor) -> torch.Tensor:
    """Where items ``ids [n]`` are served -> ``[n] int64``: their main row, ``ntotal + row`` for
    a fresh row (what ``IVFIndex.vectors_at`` reads), ``-1`` where not served."""
    main, fresh = segment(index).locate(index.tensors(), ids.cpu())
    return torch.where(fresh >= 0, fresh + index.ntotal, main)


def locate(index: IVFIndex, ids: torch.Tensor) -> torch.Tensor:
    """``[n] bool``: which of items ``ids [n]`` the index serves."""
    main, fresh = segment(index).locate(index.tensors(), ids.cpu())
    return (main >= 0) | (fresh >= 0)


def _require_served(index: IVFIndex, ids: torch.Tensor, field: str) -> None:
    missing = ids[~locate(index, ids)]
    if missing.numel():
        shown = ", ".join(str(int(i)) for i in missing[:10])
        more = f" (and {missing.numel() - 10} more)" if missing.numel() > 10 else ""
        raise ValueError(f"{field}: items not in the index: {shown}{more}")


Values = Mapping[str, Sequence[Sequence[int] | None]]
"""Multi-valued hashed attributes' value positions, one list per item of an update (None: the
item does not name the attribute)."""


def upsert(
    index: IVFIndex,
    ids: torch.Tensor | np.ndarray,
    vectors: torch.Tensor | np.ndarray,
    sig: torch.Tensor | np.ndarray,
    values: Values | None = None,
) -> IVFIndex:
    """A new index serving items ``ids [n]`` (vectors ``[n, D]`` floats, signatures ``[n, W]
    int64``) from fresh rows; an id already served is replaced. ``values``: what they hold of
    the multi-valued hashed attributes (an item naming none holds none: a replaced id forgets
    its old item's)."""
    _check_editable(index)
    ids = _check_ids(ids)
    x = torch.as_tensor(vectors)
    if x.dim() != 2 or tuple(x.shape) != (ids.numel(), index.dim):
        raise ValueError(f"vectors: expected [{ids.numel()}, {index.dim}], got {tuple(x.shape)}")
    if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
        raise ValueError("vectors: expected finite floats")
    s = _check_sig(index, sig, ids.numel())
    t = index.tensors()
    live = segment(index).upserted(t, ids, x.to(t.device), s)
    given, n = values or {}, ids.numel()
    held = {a: [list(p or ()) for p in given.get(a, [None] * n)] for a in index.value_lists}
    return with_live(index, live, _with_values(index, ids, held))


def remove(index: IVFIndex, ids: torch.Tensor | np.ndarray) -> IVFIndex:
    """A new index without items ``ids [n]``; ``ValueError`` naming any id it does not serve
    (then nothing is removed)."""
    _check_editable(index)
    ids = _check_ids(ids)
    _require_served(index, ids, "ids")
    return with_live(index, segment(index).removed(index.tensors(), ids))


def relabel(
    index: IVFIndex,
    ids: torch.Tensor | np.ndarray,
    sig: torch.Tensor | np.ndarray,
    values: Values | None = None,
) -> IVFIndex:
    """A new index where items ``ids [n]`` have signatures ``sig [n, W] int64`` (vectors kept);
    ``ValueError`` naming any id it does not serve. ``values``: the multi-valued hashed
    attributes' new values of the items naming them (the others keep theirs)."""
    _check_editable(index)
    ids = _check_ids(ids)
    s = _check_sig(index, sig, ids.numel())
    _require_served(index, ids, "ids")
    live = segment(index).relabeled(index.tensors(), ids, s)
    return with_live(index, live, _with_values(index, ids, values or {}))


def _with_values(
    index: IVFIndex, ids: torch.Tensor, values: Values
) -> dict[str, ValueLists] | None:
    """``index``'s value lists with items ``ids [n]`` holding ``values`` (per attribute, a list
    per item; None: kept) -> new lists by attribute, or None where nothing changes."""
    out, changed = dict(index.value_lists), False
    for attr, lists in values.items():
        held = out.get(attr)
        if held is None:
            continue
        rows = [i for i, p in enumerate(lists) if p is not None]
        ids_np = ids.cpu().numpy()[rows]
        new = [list(lists[i] or ()) for i in rows]
        if not any(new) and not np.isin(ids_np, held.ids).any():
            continue  # new items holding nothing: the lists already say so
        out[attr], changed = held.replaced(ids_np, new), True
    return out if changed else None


def signatures_of(index: IVFIndex, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Current signatures of served items ``ids [n]`` -> ``[n, W] int64`` (``ValueError`` if
    one is not served)."""
    ids = _check_ids(ids)
    _require_served(index, ids, "ids")
    return segment(index).signatures_of(index.tensors(), ids)


def with_live(
    index: IVFIndex,
    live: LiveSegment | None,
    value_lists: Mapping[str, ValueLists] | None = None,
) -> IVFIndex:
    """A shallow copy of ``index`` (an ``IVFIndex``: every main buffer shared) serving
    ``live``: the reference a server swaps in (``index`` keeps its own segment);
    ``value_lists``: what its items hold of the multi-valued hashed attributes by id, when an
    update changed them (None: ``index``'s), which its segment verifies fresh rows by."""
    new = copy.copy(index)
    new.__dict__["_buffers"] = dict(index._buffers)  # its own table: a later .to() is its own
    new.__dict__["_modules"] = dict(index._modules)
    if value_lists is not None:
        new.value_lists = dict(value_lists)
    if live is not None and new.value_lists:
        live = dataclasses.replace(live, value_lists=new.value_lists)
    new.live = live
    return new
