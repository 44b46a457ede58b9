"""Live updates of a document-sharded catalog: one resolved update batch applied to every shard's
part, and the router's planning statistics summed from the parts.

The router validates a batch against its model (:func:`retrieval.live_updates.resolve_update`:
the config, filter schema and tables; upserted vectors filled in by the item tower) and sends
the same resolved batch to every shard. Each shard applies it to the items it holds, without
asking any other shard, so every shard reaches the same decision on its own::

    upsert   an item joins the shard that owns its id (``shard_of(id, S)``) and leaves any other
             shard that held it (a version split by an explicit assignment converges to the hash)
    remove   the shard that holds the item drops it
    set      the shard that holds the item rewrites its signature
    tables   no change on the shards (the router's tables; the shard's sequence still advances)

Each shard reports which of the batch's items it held and its list sizes and bit counts after
the update; the router refuses the batch (on every shard) when an item to remove or re-label is
held by none (:func:`check_held`), and otherwise plans with the summed statistics
(:func:`stats_index`), whose bound statistics grow with the batch as the unsharded index's do
(``retrieval/index/bound.py``). Merging the updated parts gives the index that the same batch gives the
unsharded model (``tests/retrieval/test_live_shards.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from retrieval.index import update as index_update
from retrieval.index.bound import grown
from retrieval.index.ivf import IVFIndex
from retrieval.index.split import shard_of
from retrieval.live_updates import (
    RemoveItems,
    SetItemAttributes,
    UpdateBatch,
    UpdateError,
    UpsertItems,
    named_bits,
    rewrite_attributes,
    signatures,
)


@dataclass(frozen=True)
class ShardUpdate:
    """One shard's part after an update (a new index: the old one is untouched), and
    ``held [n] bool``: which of the batch's items the shard held before it (empty for a table
    update)."""

    index: IVFIndex
    held: torch.Tensor

    def list_sizes(self) -> torch.Tensor:
        """``[nlist] int64``: this part's list sizes."""
        return index_update.list_sizes(self.index)

    def bit_counts(self) -> torch.Tensor:
        """``[bits] int64``: this part's per-bit counts of the filter signatures."""
        return self.index.bit_counts.cpu()


def update_shard(index: IVFIndex, batch: UpdateBatch, shard: int, num_shards: int) -> ShardUpdate:
    """Applies a resolved ``batch`` (every upserted vector given) to shard ``shard`` of
    ``num_shards``; ``ValueError`` when the batch does not fit the index (dim, schema)."""
    if not isinstance(batch, UpsertItems | RemoveItems | SetItemAttributes):
        return ShardUpdate(index, torch.zeros(0, dtype=torch.bool))  # table rows: the router's
    ids = batch.ids.cpu()
    held = index_update.positions_of(index, ids) >= 0
    if isinstance(batch, UpsertItems):
        if batch.vectors is None or not bool(batch.given().all()):
            raise ValueError("upsert_items: a shard takes resolved batches (every vector given)")
        mine = shard_of(ids, num_shards) == shard
        leaving = held & ~mine
        if bool(leaving.any()):
            index = index_update.remove_items(index, ids[leaving])
        if bool(mine.any()):
            sig = signatures(index.schema, [batch.attributes[int(i)] for i in mine.nonzero()])
            index = index_update.add_items(index, ids[mine], batch.vectors[mine].float(), sig)
    elif isinstance(batch, RemoveItems):
        if bool(held.any()):
            index = index_update.remove_items(index, ids[held])
    elif bool(held.any()):
        mine_ids = ids[held]
        attrs = [batch.attributes[int(i)] for i in held.nonzero()]
        sig = rewrite_attributes(index.schema, index_update.signatures_of(index, mine_ids), attrs)
        index = index_update.set_signatures(index, mine_ids, sig)
    return ShardUpdate(index, held)


def check_held(batch: UpdateBatch, held: Sequence[torch.Tensor], ntotal: int) -> None:
    """Refuses (:class:`UpdateError`) a remove or re-label of an item no shard held, and a
    remove that would leave the catalog empty; ``held``: each shard's ``[n] bool``, ``ntotal``:
    the catalog's items after the update."""
    if isinstance(batch, RemoveItems | SetItemAttributes):
        anywhere = torch.stack(list(held)).any(dim=0)
        missing = (~anywhere).nonzero().flatten()
        if missing.numel():
            i = int(missing[0])
            raise UpdateError("ids", f"item {int(batch.ids[i])} is not in the index", i)
    if isinstance(batch, RemoveItems) and ntotal == 0:
        raise UpdateError("ids", "removing every item would leave the index empty")


def stats_index(
    index: IVFIndex,
    list_sizes: torch.Tensor,
    counts: torch.Tensor,
    batch: UpdateBatch | None = None,
) -> IVFIndex:
    """A new statistics-only index (``retrieval/index/split.py``) like ``index`` with the
    catalog's ``list_sizes [nlist]`` and filter ``counts [bits]`` (summed over the shards).
    ``batch``: the resolved update that led there, which grows the bound statistics as it grew
    the unsharded index's (:func:`bounds_after`); None drops them (no bound check)."""
    if tuple(list_sizes.shape) != (index.nlist,) or counts.shape != index.bit_counts.shape:
        raise ValueError(
            f"statistics: expected [{index.nlist}] list sizes and {list(index.bit_counts.shape)} "
            f"bit counts, got {list(list_sizes.shape)} and {list(counts.shape)}"
        )
    out = IVFIndex(index.config, index.dim, index.schema.attribute_values, index.stats)
    dev = index.centroids.device
    out.centroids = index.centroids
    sizes = list_sizes.to(torch.int64)
    out.offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).to(dev)
    out.bit_counts = counts.to(torch.int64).to(dev)
    out.built_sizes = index.built_sizes
    if batch is not None:
        out.list_radius, out.list_bits = bounds_after(index, batch)
    out._refresh()
    return out


def bounds_after(index: IVFIndex, batch: UpdateBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``index``'s ``(list_radius, list_bits)`` grown by a resolved ``batch`` without its items:
    an upsert by its vectors and signatures, a relabel by the values it names in every list."""
    if isinstance(batch, UpsertItems) and batch.vectors is not None:
        x = batch.vectors.detach().cpu().float()
        if index.config.metric == "cosine":  # as add_items stores them
            x = torch.nn.functional.normalize(x, dim=1)
        return grown(index.tensors(), x, signatures(index.schema, batch.attributes))
    if isinstance(batch, SetItemAttributes):
        return grown(
            index.tensors(),
            index.centroids[:0],
            index.sig[:0],
            named_bits(index.schema, batch.attributes),
        )
    return index.list_radius, index.list_bits
