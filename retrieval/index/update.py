"""In-place updates of an :class:`IVFIndex`, copy-on-write: every function returns a NEW index.

A search that holds the old index (a batch in flight) never sees a half-applied update; the
caller swaps the new one in between batches. Buffers an update does not change are shared
with the old index (nothing here writes into a buffer, so sharing is safe).

* :func:`add_items` assigns each new item to its nearest centroid's list (the centroids stay as
  built: no k-means, no rebuild) and quantizes its residual with the index's code format;
  an id already in the index is replaced.
* :func:`remove_items` drops items; :func:`set_signatures` rewrites items' filter signatures.
* :func:`list_imbalance` says how far the lists have drifted from balanced; above
  :data:`REBUILD_IMBALANCE` a full rebuild (k-means again) is worth its cost.

Items stay list-sorted (a new item goes after the existing items of its list), and ``sig``,
``bit_counts`` and ``postings`` are recomputed so that every buffer agrees. The bound statistics
``list_radius`` and ``list_bits`` only grow (``retrieval/index/bound.py``: a router grows its own
copy the same way from the update alone), so they stay valid bounds after any update. Cost: one pass over
the index's buffers per call (``O(N * D)`` copied), whatever the batch size: what compaction
runs in the background (``compaction.py``); live updates take the O(batch) fresh segment
(``live_index.py``).

Example::

    index = add_items(index, torch.tensor([300, 301]), vectors, sig)  # vectors [2, D], sig [2, W]
    index = remove_items(index, torch.tensor([7]))
    list_imbalance(index)  # 1.0 = every list the mean size
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from retrieval.filters import FilterSchema, pack_bits
from retrieval.index.bound import grown
from retrieval.index.build import bit_index
from retrieval.index.codes import quantize
from retrieval.index.inputs import as_tensor
from retrieval.index.ivf import EXACT_DTYPES, IVFIndex
from retrieval.index.kmeans import assign
from retrieval.value_lists import ValueLists

REBUILD_IMBALANCE = 4.0
"""A rebuild is recommended when the largest list holds more than this many times the mean.
The probe of a list costs its length, and nprobe is fixed, so a query that lands on a list
that many times the mean scans that many times the codes the build planned for: its latency (and the tail) grows, while
recall of items in the thin lists does not improve. Fresh k-means lists sit well under it."""


def _check_ids(ids: torch.Tensor | np.ndarray, field: str = "ids") -> torch.Tensor:
    """``ids [n]`` integers (tensor or NumPy), each >= 0 and distinct -> ``int64`` on the CPU."""
    ids = as_tensor(ids, field)
    integral = not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
    if ids.dim() != 1 or not integral:
        raise ValueError(f"{field}: expected integers [n], got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.cpu().long()
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"{field}: item ids must be >= 0, got {int(ids.min())}")
    uniq, counts = torch.unique(ids, return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"{field}: item {int(uniq[counts > 1][0])} appears more than once")
    return ids


def _check_editable(index: IVFIndex) -> None:
    if index.item_ids.shape[0] != index.ntotal:
        raise ValueError(
            "this index is the router part of a document-sharded version (statistics only, no "
            "items): it cannot be updated in place"
        )


def positions_of(index: IVFIndex, ids: torch.Tensor) -> torch.Tensor:
    """Rows of ``ids [n]`` in the index (list-sorted order) -> ``[n] int64``, ``-1`` where an id
    is not in the index."""
    return index.id_order.positions(ids).cpu()


def _require_known(index: IVFIndex, ids: torch.Tensor, field: str) -> torch.Tensor:
    """Positions of ``ids``; ``ValueError`` naming the ids that are not in the index."""
    pos = positions_of(index, ids)
    missing = ids[pos < 0]
    if missing.numel():
        shown = ", ".join(str(int(i)) for i in missing[:10])
        more = f" (and {missing.numel() - 10} more)" if missing.numel() > 10 else ""
        raise ValueError(f"{field}: items not in the index: {shown}{more}")
    return pos


def _check_sig(
    index: IVFIndex, sig: torch.Tensor | np.ndarray, n: int, field: str = "sig"
) -> torch.Tensor:
    """``sig [n, W] int64`` (tensor or NumPy) -> the tensor."""
    sig = as_tensor(sig, field)
    w = index.sig.shape[1]
    if sig.dtype != torch.int64 or tuple(sig.shape) != (n, w):
        raise ValueError(f"{field}: expected int64 [{n}, {w}], got {sig.dtype} {tuple(sig.shape)}")
    return sig


def _list_of_rows(index: IVFIndex) -> torch.Tensor:
    """The list of every stored row -> ``[N] int64`` (CPU)."""
    sizes = (index.offsets[1:] - index.offsets[:-1]).cpu()
    return torch.repeat_interleave(torch.arange(index.nlist), sizes)


def _rebuilt(
    index: IVFIndex,
    lists: torch.Tensor,
    item_ids: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    exact: torch.Tensor,
    sig: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> IVFIndex:
    """A new index with ``index``'s centroids and config over rows in any order (``lists [N]``
    says each row's list): sorts them by list (stable), recomputes offsets, counts, postings;
    ``bounds``: its ``(list_radius, list_bits)`` (None: ``index``'s)."""
    dev = index.centroids.device
    order = torch.argsort(lists, stable=True)
    counts = torch.bincount(lists, minlength=index.nlist)
    new = IVFIndex(
        index.config,
        index.dim,
        index.schema.attribute_values,
        index.stats,
        index.schema.hashed_digits,
    )
    new.centroids = index.centroids
    new.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(dev)
    new.item_ids = item_ids[order].contiguous().to(dev)
    new.codes = codes[order].contiguous().to(dev)
    new.scales = scales[order].contiguous().to(dev)
    new.exact = (exact[order] if _has_exact(index) else exact[:0]).contiguous().to(dev)
    new.list_radius, new.list_bits = bounds or (index.list_radius, index.list_bits)
    new.built_sizes = index.built_sizes  # as built: a shard's stay the catalog's
    _keep_value_lists(new, index)
    _set_signatures(new, sig[order].contiguous().to(dev))
    return new


def _keep_value_lists(new: IVFIndex, index: IVFIndex) -> None:
    """``new`` keeps ``index``'s multi-valued hashed attributes' value lists (by id: they hold
    through any reordering; an item added without them holds none of those values)."""
    new.value_lists = dict(index.value_lists)
    new.schema.multi_valued = set(index.value_lists)


def _has_exact(index: IVFIndex) -> bool:
    """The index keeps an exact copy of every vector (``exact [N, D]``, else ``[0, D]``)."""
    return EXACT_DTYPES[index.config.exact_copy] is not None


def _set_signatures(index: IVFIndex, sig: torch.Tensor) -> None:
    """Installs ``sig [N, W]`` with its per-bit counts and postings, then refreshes."""
    index.sig = sig
    index.bit_counts, index.postings = (
        t.to(sig.device) for t in bit_index(sig.cpu(), index.schema.unindexed_bits())
    )
    index._refresh()


def add_items(
    index: IVFIndex,
    ids: torch.Tensor | np.ndarray,
    vectors: torch.Tensor | np.ndarray,
    sig: torch.Tensor | np.ndarray,
    values: Mapping[str, ValueLists] | None = None,
) -> IVFIndex:
    """A new index with items ``ids [n]`` integers (vectors ``[n, D]`` floats, signatures
    ``[n, W] int64``; tensors or NumPy arrays) added; an id already in the index is replaced
    (its old row removed). ``values``: what the added items hold of the multi-valued hashed
    attributes, by id (a folded live segment's items keep theirs); None: none.

    Each item joins the list the build's rule gives it (``IVFConfig.assign``), after that
    list's existing items; its residual to the centroid is quantized like the build's codes
    (an index of metric "cosine" normalises the vectors first, as its build did).
    """
    _check_editable(index)
    ids = _check_ids(ids)
    n = ids.numel()
    vectors = as_tensor(vectors, "vectors")
    if vectors.dim() != 2 or tuple(vectors.shape) != (n, index.dim):
        raise ValueError(f"vectors: expected [{n}, {index.dim}], got {tuple(vectors.shape)}")
    if not vectors.is_floating_point() or not bool(torch.isfinite(vectors).all()):
        raise ValueError("vectors: expected finite floats")
    sig = _check_sig(index, sig, n)
    held: dict[str, list[list[int]]] = {}
    for attr in index.value_lists:  # an added item holds what ``values`` give it, else none
        given = values.get(attr) if values is not None else None
        held[attr] = given.lists_of(ids.numpy()) if given is not None else [[] for _ in range(n)]
        vocab = index.schema.vocabulary(attr)
        texts = [[vocab[p] for p in ps] for ps in held[attr]]
        sig = _with_values(index.schema, sig.cpu(), attr, texts)
    if index.nlist == 0:
        raise ValueError("the index has no centroids: build it before adding items")
    x = vectors.detach().cpu().float()
    if index.config.metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    centroids = index.centroids.cpu()
    by = index.config.assign if index.config.assign != "auto" else "l2"
    lists_new = assign(x, centroids, by)  # [n]: the build's rule
    codes_new, scales_new = quantize(x - centroids[lists_new], index.config.codes)
    keep = positions_of(index, ids)
    kept = torch.ones(index.ntotal, dtype=torch.bool)
    kept[keep[keep >= 0]] = False  # replaced items leave their old row
    old_exact = index.exact.cpu()
    exact = torch.cat([old_exact[kept], x.to(old_exact.dtype)]) if _has_exact(index) else old_exact
    new = _rebuilt(
        index,
        torch.cat([_list_of_rows(index)[kept], lists_new]),
        torch.cat([index.item_ids.cpu()[kept], ids]),
        torch.cat([index.codes.cpu()[kept], codes_new.to(index.codes.dtype)]),
        torch.cat([index.scales.cpu()[kept], scales_new]),
        exact,
        torch.cat([index.sig.cpu()[kept], sig.cpu()]),
        grown(index.tensors(), x, sig),
    )
    # a replaced id forgets its old values (they were the old item's) for those it is given
    new.value_lists = {a: v.replaced(ids.numpy(), held[a]) for a, v in index.value_lists.items()}
    return new


def remove_items(index: IVFIndex, ids: torch.Tensor | np.ndarray) -> IVFIndex:
    """A new index without items ``ids [n] int64``; ``ValueError`` naming any id that is not in
    the index (then nothing is removed)."""
    _check_editable(index)
    ids = _check_ids(ids)
    pos = _require_known(index, ids, "ids")
    kept = torch.ones(index.ntotal, dtype=torch.bool)
    kept[pos] = False
    exact = index.exact.cpu()
    return _rebuilt(
        index,
        _list_of_rows(index)[kept],
        index.item_ids.cpu()[kept],
        index.codes.cpu()[kept],
        index.scales.cpu()[kept],
        exact[kept] if _has_exact(index) else exact,
        index.sig.cpu()[kept],
    )


def set_signatures(
    index: IVFIndex,
    ids: torch.Tensor | np.ndarray,
    sig: torch.Tensor | np.ndarray,
    spread: torch.Tensor | None = None,
) -> IVFIndex:
    """A new index where items ``ids [n]`` have signatures ``sig [n, W] int64`` (codes, lists and
    vectors shared with ``index``); ``ValueError`` naming any id not in the index.

    ``spread [W] int64``: the bits every list may now hold (``list_bits``; a router, which does
    not know the items' lists, spreads the values an update names); None: every bit of ``sig``.
    """
    _check_editable(index)
    ids = _check_ids(ids)
    sig = _check_sig(index, sig, ids.numel())
    pos = _require_known(index, ids, "ids").to(index.sig.device)
    new = IVFIndex(
        index.config,
        index.dim,
        index.schema.attribute_values,
        index.stats,
        index.schema.hashed_digits,
    )
    kept = (
        "centroids",
        "offsets",
        "item_ids",
        "codes",
        "scales",
        "exact",
        "list_radius",
        "built_sizes",
    )
    for name in kept:
        setattr(new, name, getattr(index, name))
    if spread is None:
        spread = _or_rows(sig)
    new.list_bits = index.list_bits | spread.to(index.list_bits.device).view(1, -1)
    all_sig = index.sig.clone()
    all_sig[pos] = sig.to(all_sig.device)
    _keep_value_lists(new, index)
    _set_signatures(new, all_sig)
    return new


def _with_values(
    schema: FilterSchema, sig: torch.Tensor, attr: str, values: Sequence[Sequence[str]]
) -> torch.Tensor:
    """Signatures ``sig [n, W]`` with multi-valued hashed ``attr``'s digits those of ``values``
    (one list a row; new values learned) -> a new ``[n, W] int64``."""
    out = sig.numpy().view(np.uint64).copy()
    clear = np.zeros(schema.num_words * 64, dtype=bool)
    clear[schema.attribute_bits(attr)] = True
    out &= ~pack_bits(clear[None, :]).numpy().view(np.uint64)
    for row, vs in enumerate(values):
        for b in schema.multi_bits(attr, list(vs)):
            out[row, b // 64] |= np.uint64(1) << np.uint64(b % 64)
    return torch.from_numpy(out.view(np.int64))


def set_values(
    index: IVFIndex, ids: torch.Tensor | np.ndarray, attr: str, values: Sequence[Sequence[str]]
) -> IVFIndex:
    """A new index where items ``ids [n]`` hold ``values`` (one list each) of multi-valued
    hashed attribute ``attr``, new values learned: their signatures' digits of ``attr``
    rewritten (the superset of the new values) and their value lists replaced."""
    if attr not in index.value_lists:
        raise ValueError(f"{attr!r} is not a multi-valued hashed attribute of this index")
    ids = _check_ids(ids)
    if len(values) != ids.numel():
        raise ValueError(f"values: {len(values)} lists for {ids.numel()} ids")
    pos = _require_known(index, ids, "ids").to(index.sig.device)
    schema = index.schema
    sig = _with_values(schema, index.sig[pos].cpu(), attr, values)
    lists = [[schema.position[attr][v] for v in vs] for vs in values]
    new = set_signatures(index, ids, sig)
    new.value_lists = {
        **index.value_lists,
        attr: index.value_lists[attr].replaced(ids.numpy(), lists),
    }
    return new


def _or_rows(sig: torch.Tensor) -> torch.Tensor:
    """The OR of ``sig [n, W] int64``'s rows -> ``[W]``."""
    return torch.from_numpy(np.bitwise_or.reduce(sig.cpu().numpy(), axis=0).astype(np.int64))


def signatures_of(index: IVFIndex, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Current signatures of items ``ids [n]`` -> ``[n, W] int64`` (``ValueError`` if unknown)."""
    pos = _require_known(index, _check_ids(ids), "ids")
    return index.sig.cpu()[pos]


def list_sizes(index: IVFIndex) -> torch.Tensor:
    """Items per list -> ``[nlist] int64``."""
    return (index.offsets[1:] - index.offsets[:-1]).cpu()


def list_imbalance(index: IVFIndex) -> float:
    """Largest list over the mean list size (1.0: perfectly balanced; 0.0: empty index).
    Compare with :data:`REBUILD_IMBALANCE`."""
    sizes = list_sizes(index).float()
    if sizes.numel() == 0 or float(sizes.sum()) == 0:
        return 0.0
    return float(sizes.max() / sizes.mean())


def rebuild_recommended(index: IVFIndex, threshold: float = REBUILD_IMBALANCE) -> bool:
    """True when :func:`list_imbalance` exceeds ``threshold``."""
    return list_imbalance(index) > threshold
