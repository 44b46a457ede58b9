"""Wire messages (``serving/protos/admin.proto``) <-> update batches (``retrieval.live_updates``).

The admin service parses calls with these, and the update log stores the resolved batches as
``LogRecord`` messages, so a replayed record goes through the same parser as a call did. The
bounds a new call's ids must keep (:class:`CallBounds`, from ``[limits]``) are checked here,
for calls only: a record in the log was taken once, under the bounds of its day, and must apply
again when the log is replayed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from retrieval.live_updates import (
    AddSeen,
    Attributes,
    RemoveItems,
    SetItemAttributes,
    UpdateBatch,
    UpdateEmbeddings,
    UpdateError,
    UpsertItems,
    table_shapes,
)
from retrieval.model import RetrievalModel
from serving.protos import admin_pb2 as pb
from serving.types import RequestError

MAX_VECTOR_NORM = 1e18
"""Longest item vector an update may give: the index compares squared L2 distances in float32
(at most ~3.4e38), so a much longer vector has no nearest list at all."""


def _attributes(attrs: Sequence[pb.Attribute], where: str) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for a in attrs:
        if a.name in out:
            raise RequestError(f"{where}.{a.name}: given twice")
        out[a.name] = tuple(a.values)
    return out


def id_tensor(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


@dataclass(frozen=True)
class CallBounds:
    """The ids a new admin call may name: an item bound for ``UpsertItems`` (the same on an
    unsharded server and a router), and for ``AddSeen`` the items the server knows of where it
    holds them (a router's index holds none: there, the upsert bound)."""

    catalog: int
    """The item table's rows (``config.num_items``)."""
    item_growth: int
    """``limits.max_item_id_growth``: item ids below ``catalog + item_growth`` are taken."""
    store_users: int | None = None
    """The users the model's seen store holds (None: no store, the model refuses ``AddSeen``)."""
    user_growth: int = 0
    """``limits.max_seen_user_growth``: user ids below ``store_users + user_growth``."""
    known_items: int | None = None
    """One past the largest item id the served index holds (at least ``catalog``): a seen pair
    names an item of the catalog or one upserted since. None: the server holds no items (a
    router), and seen items take the upsert bound."""

    def check_seen_items(self, ids: torch.Tensor) -> None:
        """``ids [n] int64`` of an ``AddSeen``: RequestError naming ``items[j]`` for the first
        item the server does not know of (past ``known_items``, else past the upsert bound)."""
        if self.known_items is None:
            self.check_items(ids, "items[{}]")
            return
        past = (ids >= self.known_items).nonzero().flatten()
        if past.numel():
            j = int(past[0])
            raise RequestError(
                f"items[{j}]: item {int(ids[j])} is past the catalog (item ids "
                f"0..{self.known_items - 1}, the item table's and those upserted since)"
            )

    def check_items(self, ids: torch.Tensor, where: str) -> None:
        """``ids [n] int64``: RequestError naming ``where.format(i)`` for the first id at or past
        the bound (negative ids are the model's to refuse)."""
        bound = self.catalog + self.item_growth
        past = (ids >= bound).nonzero().flatten()
        if past.numel():
            i = int(past[0])
            raise RequestError(
                f"{where.format(i)}: item {int(ids[i])} is past the catalog's {self.catalog} "
                f"items + {self.item_growth} (limits.max_item_id_growth): ids up to "
                f"{bound - 1} are taken"
            )

    def check_users(self, users: torch.Tensor) -> None:
        """``users [n] int64`` of an ``AddSeen``: RequestError naming ``users[j]`` for the first
        past the store's users + growth (no store: nothing to check, the model refuses)."""
        if self.store_users is None:
            return
        bound = self.store_users + self.user_growth
        past = (users >= bound).nonzero().flatten()
        if past.numel():
            j = int(past[0])
            raise RequestError(
                f"users[{j}]: user {int(users[j])} is past the seen store's {self.store_users} "
                f"users + {self.user_growth} (limits.max_seen_user_growth): ids up to "
                f"{bound - 1} are taken"
            )


def parse_upsert(
    msg: pb.UpsertItemsRequest,
    dim: int,
    bounds: CallBounds | None,
    max_norm: float | None = MAX_VECTOR_NORM,
) -> UpsertItems:
    """``UpsertItems`` message -> batch; ``dim``: the model's vector width D; ``bounds``: the
    item ids a call may name, checked before anything is built; ``max_norm``: the longest
    vector taken (None for both: any, for a log's records, which were taken once)."""
    n = len(msg.items)
    ids = id_tensor([it.id for it in msg.items])
    if bounds is not None:
        bounds.check_items(ids, "items[{}].id")
    vectors, given = torch.zeros(n, dim), torch.zeros(n, dtype=torch.bool)
    for i, item in enumerate(msg.items):
        if len(item.vector) not in (0, dim):
            raise RequestError(
                f"items[{i}].vector: expected {dim} floats (the model's vector width) or none "
                f"(computed by the item tower), got {len(item.vector)}"
            )
        if len(item.vector):
            vector = np.asarray(item.vector, dtype=np.float32)
            norm = float(np.linalg.norm(vector.astype(np.float64)))
            if max_norm is not None and math.isfinite(norm) and norm > max_norm:  # NaN: later
                raise RequestError(
                    f"items[{i}].vector: its length {norm:.3g} is over {max_norm:g} (the "
                    "index compares squared distances in float32)"
                )
            vectors[i] = torch.from_numpy(vector)
            given[i] = True
    attrs = [_attributes(it.attributes, f"items[{i}].attributes") for i, it in enumerate(msg.items)]
    return UpsertItems(ids, attrs, vectors if bool(given.any()) else None, given)


def parse_add_seen(msg: pb.AddSeenRequest, bounds: CallBounds | None) -> AddSeen:
    """``AddSeen`` message -> batch. ``bounds``: the users and items a call may name, checked
    before the store grows (None: any, for a log's records, which were taken once)."""
    if len(msg.users) != len(msg.items):
        raise RequestError(
            f"items: expected one item per user ({len(msg.users)}), got {len(msg.items)}"
        )
    users, items = id_tensor(msg.users), id_tensor(msg.items)
    if bounds is not None:
        bounds.check_users(users)
        bounds.check_seen_items(items)
    return AddSeen(users, items)


def parse_set_attributes(msg: pb.SetItemAttributesRequest) -> SetItemAttributes:
    attrs = [_attributes(it.attributes, f"items[{i}].attributes") for i, it in enumerate(msg.items)]
    return SetItemAttributes(id_tensor([it.id for it in msg.items]), attrs)


def table_widths(model: RetrievalModel) -> dict[str, int]:
    return {name: dim for name, (_, dim) in table_shapes(model).items()}


def parse_embeddings(msg: pb.UpdateEmbeddingsRequest, widths: dict[str, int]) -> UpdateEmbeddings:
    """``UpdateEmbeddings`` message -> batch; ``widths``: ``{table: E}``."""
    n = len(msg.rows)
    width = widths.get(msg.table)
    if width is None:
        known = ", ".join(widths)
        raise RequestError(f"table: unknown table {msg.table!r} (known: {known})")
    if len(msg.values) != n * width:
        raise RequestError(
            f"values: expected {n} rows x {width} (table {msg.table!r}'s width) = {n * width} "
            f"floats, got {len(msg.values)}"
        )
    values = torch.from_numpy(np.asarray(msg.values, dtype=np.float32)).view(n, width)
    return UpdateEmbeddings(msg.table, id_tensor(msg.rows), values)


def _attribute_messages(attrs: Attributes) -> list[pb.Attribute]:
    return [pb.Attribute(name=k, values=list(v)) for k, v in attrs.items()]


def to_record(batch: UpdateBatch, sequence: int) -> pb.LogRecord:
    """A resolved batch (every vector given) -> its log record."""
    if isinstance(batch, UpsertItems):
        assert batch.vectors is not None and bool(batch.given().all()), "log resolved batches"
        items = [
            pb.Item(id=int(i), vector=v.tolist(), attributes=_attribute_messages(a))
            for i, v, a in zip(batch.ids.tolist(), batch.vectors, batch.attributes, strict=True)
        ]
        return pb.LogRecord(sequence=sequence, upsert_items=pb.UpsertItemsRequest(items=items))
    if isinstance(batch, RemoveItems):
        return pb.LogRecord(
            sequence=sequence, remove_items=pb.RemoveItemsRequest(ids=batch.ids.tolist())
        )
    if isinstance(batch, SetItemAttributes):
        items_a = [
            pb.ItemAttributes(id=int(i), attributes=_attribute_messages(a))
            for i, a in zip(batch.ids.tolist(), batch.attributes, strict=True)
        ]
        return pb.LogRecord(
            sequence=sequence, set_item_attributes=pb.SetItemAttributesRequest(items=items_a)
        )
    if isinstance(batch, AddSeen):
        return pb.LogRecord(
            sequence=sequence,
            add_seen=pb.AddSeenRequest(users=batch.users.tolist(), items=batch.items.tolist()),
        )
    return pb.LogRecord(
        sequence=sequence,
        update_embeddings=pb.UpdateEmbeddingsRequest(
            table=batch.table, rows=batch.rows.tolist(), values=batch.values.flatten().tolist()
        ),
    )


def from_record(
    record: pb.LogRecord, dim: int, widths: dict[str, int] | None
) -> UpdateBatch | None:
    """A log record -> the batch it logged; ``dim``: the index's vector width D, ``widths``:
    ``{table: E}`` of the model's tables (None: a document shard, which has no tables: a table
    update is then None)."""
    which = record.WhichOneof("update")
    if which == "upsert_items":
        return parse_upsert(record.upsert_items, dim, None, max_norm=None)
    if which == "remove_items":
        return RemoveItems(id_tensor(record.remove_items.ids))
    if which == "set_item_attributes":
        return parse_set_attributes(record.set_item_attributes)
    if which == "update_embeddings":
        if widths is None:
            return None
        return parse_embeddings(record.update_embeddings, widths)
    if which == "add_seen":  # a shard keeps no store: it only counts the record
        return None if widths is None else parse_add_seen(record.add_seen, None)
    raise ValueError(f"log record {record.sequence}: no update in it")


_ITEM_FIELDS = {"ids": "id", "vectors": "vector", "attributes": "attributes"}


def wire_error(kind: str, e: UpdateError) -> RequestError:
    """A model-level refusal -> INVALID_ARGUMENT naming the field of the wire message."""
    if kind in ("upsert_items", "set_item_attributes") and e.field in _ITEM_FIELDS:
        where = "items" if e.item is None else f"items[{e.item}].{_ITEM_FIELDS[e.field]}{e.sub}"
    elif e.field == "values" and e.item is not None:  # the wire's values are flat [n * E]
        where = f"values (row {e.item})"
    else:
        where = e.field + ("" if e.item is None else f"[{e.item}]") + e.sub
    return RequestError(f"{where}: {e.reason}")
