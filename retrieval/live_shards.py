"""Live updates of a document-sharded catalog: one resolved update batch applied to every shard's
part, and the router's planning statistics summed from the parts.

The router validates a batch against its model (:func:`retrieval.live_updates.resolve_update`:
the config, filter schema and tables; upserted vectors filled in by the item tower) and sends
the same resolved batch to every shard. Each shard applies it to the items it holds, without
asking any other shard, so every shard reaches the same decision on its own::

    upsert   an item joins the fresh rows of the shard that owns its id (``shard_of(id, S)``)
             and leaves any other shard that held it (a version split by an explicit
             assignment converges to the hash)
    remove   the shard that holds the item stops serving it (a tombstone or a dead fresh row)
    set      the shard that holds the item serves it from a fresh row with its new signature
    tables   no change on the shards (the router's tables; the shard's sequence still advances)

Each shard reports which of the batch's items it held, the items it serves, and its main
index's list sizes and bit counts (which a live update leaves as they are: its changes live in
the shard's fresh segment, ``retrieval/index/fresh.py``); the router refuses the batch (on every
shard) when an item to remove or re-label is held by none, or a remove would leave no item
(:func:`check_held`), and otherwise plans with the summed statistics (:func:`stats_index`), the
unsharded main index's. Every shard's candidates take its fresh rows' beside its main lists', so
the router's merge answers as the unsharded model updated with the same batches
(``tests/retrieval/test_live_shards.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from retrieval.index import live_index
from retrieval.index import update as index_update
from retrieval.index.ivf import IVFIndex
from retrieval.index.split import shard_of
from retrieval.live_updates import (
    RemoveItems,
    SetItemAttributes,
    UpdateBatch,
    UpdateError,
    UpsertItems,
    rewrite_attributes,
    signatures,
    value_positions,
)


@dataclass(frozen=True)
class ShardUpdate:
    """One shard's part after an update (a new index: the old one is untouched), and
    ``held [n] bool``: which of the batch's items the shard held before it (empty for a table
    update). ``learned_from``: the hashed attributes' sizes before the update learned its new
    values (``FilterSchema.forget`` them if it is not applied)."""

    index: IVFIndex
    held: torch.Tensor
    learned_from: dict[str, int] = field(default_factory=dict)

    def list_sizes(self) -> torch.Tensor:
        """``[nlist] int64``: this part's list sizes."""
        return index_update.list_sizes(self.index)

    def bit_counts(self) -> torch.Tensor:
        """``[bits] int64``: this part's per-bit counts of the filter signatures."""
        return self.index.bit_counts.cpu()

    def served(self) -> int:
        """Items this part serves after the update (main less tombstones, plus fresh rows)."""
        return live_index.served(self.index)


def update_shard(index: IVFIndex, batch: UpdateBatch, shard: int, num_shards: int) -> ShardUpdate:
    """Applies a resolved ``batch`` (every upserted vector given) to shard ``shard`` of
    ``num_shards``; ``ValueError`` when the batch does not fit the index (dim, schema)."""
    if not isinstance(batch, UpsertItems | RemoveItems | SetItemAttributes):
        return ShardUpdate(index, torch.zeros(0, dtype=torch.bool))  # table rows: the router's
    before = index.schema.hashed_sizes()
    try:
        return _update_shard(index, batch, shard, num_shards, before)
    except BaseException:
        index.schema.forget(before)  # not applied: nor are its new values
        raise


def _update_shard(
    index: IVFIndex,
    batch: UpsertItems | RemoveItems | SetItemAttributes,
    shard: int,
    num_shards: int,
    before: dict[str, int],
) -> ShardUpdate:
    """:func:`update_shard` of an item batch (``before``: the schema's hashed sizes)."""
    ids = batch.ids.cpu()
    held = live_index.locate(index, ids)
    if not isinstance(batch, RemoveItems):
        # every value the batch names, in its order, as the router learns them at commit
        # (stats_index): a hashed attribute's new value takes the same position everywhere
        signatures(index.schema, batch.attributes)
    if isinstance(batch, UpsertItems):
        if batch.vectors is None or not bool(batch.given().all()):
            raise ValueError("upsert_items: a shard takes resolved batches (every vector given)")
        mine = shard_of(ids, num_shards) == shard
        leaving = held & ~mine
        if bool(leaving.any()):
            index = live_index.remove(index, ids[leaving])
        if bool(mine.any()):
            attrs = [batch.attributes[int(i)] for i in mine.nonzero()]
            sig = signatures(index.schema, attrs)
            values = value_positions(index.schema, attrs)
            index = live_index.upsert(index, ids[mine], batch.vectors[mine].float(), sig, values)
    elif isinstance(batch, RemoveItems):
        if bool(held.any()):
            index = live_index.remove(index, ids[held])
    elif bool(held.any()):
        mine_ids = ids[held]
        attrs = [batch.attributes[int(i)] for i in held.nonzero()]
        sig = rewrite_attributes(index.schema, live_index.signatures_of(index, mine_ids), attrs)
        index = live_index.relabel(index, mine_ids, sig, value_positions(index.schema, attrs))
    return ShardUpdate(index, held, before)


def check_held(batch: UpdateBatch, held: Sequence[torch.Tensor], ntotal: int) -> None:
    """Refuses (:class:`UpdateError`) a remove or re-label of an item no shard held, and a
    remove that would leave the catalog empty; ``held``: each shard's ``[n] bool``, ``ntotal``:
    the items the shards serve after the update (``ShardUpdate.served``)."""
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
    served: int | None = None,
) -> IVFIndex:
    """A new statistics-only index (``retrieval/index/split.py``) like ``index`` with the
    catalog's ``list_sizes [nlist]`` and filter ``counts [bits]`` (summed over the shards).
    ``batch``: the resolved update that led there, which grows the bound statistics as it grew
    the unsharded index's (:func:`bounds_after`); None drops them (no bound check). ``served``:
    the items the shards serve (None: the list sizes' sum)."""
    if tuple(list_sizes.shape) != (index.nlist,) or counts.shape != index.bit_counts.shape:
        raise ValueError(
            f"statistics: expected [{index.nlist}] list sizes and {list(index.bit_counts.shape)} "
            f"bit counts, got {list(list_sizes.shape)} and {list(counts.shape)}"
        )
    out = IVFIndex(
        index.config,
        index.dim,
        index.schema.attribute_values,
        index.stats,
        index.schema.hashed_digits,
    )
    dev = index.centroids.device
    out.centroids = index.centroids
    sizes = list_sizes.to(torch.int64)
    out.offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).to(dev)
    out.bit_counts = counts.to(torch.int64).to(dev)
    out.built_sizes = index.built_sizes
    if batch is not None:
        out.list_radius, out.list_bits = bounds_after(index, batch)
        if isinstance(batch, UpsertItems | SetItemAttributes):  # its new values, in order
            signatures(out.schema, batch.attributes)
    out._refresh()
    out.served_items = served
    return out


def bounds_after(index: IVFIndex, batch: UpdateBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``index``'s ``(list_radius, list_bits)`` after a resolved ``batch``: as they are, for a
    live update changes only the fresh segments, which the bound statistics do not cover (the
    unsharded index's stay as built too)."""
    del batch
    return index.list_radius, index.list_bits
