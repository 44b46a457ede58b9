"""Live updates of a :class:`RetrievalModel` between full publishes: typed update batches and
the code that validates and applies them.

Five kinds of batch (:data:`UpdateBatch`):

* :class:`UpsertItems` — add items to the index, or replace them: a vector given, or computed by
  the item tower from the item's id and attributes (the id must then be a row of the item
  table, ``< config.num_items``); the attributes become its filter signature.
* :class:`RemoveItems` — drop items from the index.
* :class:`SetItemAttributes` — rewrite the listed attributes of items (their eligibility bits);
  other attributes and the vectors stay as they are.
* :class:`UpdateEmbeddings` — overwrite rows of an embedding table (float tables, and tiered
  tables in a local tier, re-packed in the table's dtype; remote and hashed tables are refused).
* :class:`AddSeen` — (user, item) pairs the model's seen store takes (``retrieval/seen_store.py``):
  what users consumed since the publish, never recommended to them again.

Applying is two steps so that a server can apply "between batches":
:func:`prepare_update` validates everything (raising :class:`UpdateError`, a ``ValueError``
naming the field, before anything changes), runs the item tower and builds the new index
(its live segment: upserted items land in fresh rows, removed ones become tombstones, relabelled
ones move to fresh rows with their new signatures, ``retrieval/index/fresh.py``; every main
buffer is shared and the old model is untouched, so an update costs O(batch)); :meth:`PreparedUpdate.commit` then runs the
in-place table row writes, which cannot fail, and returns the model to serve.
:func:`apply_update` does both. Updating table rows does not recompute item vectors already in
the index: upsert those items again to refresh them.

Example::

    batch = UpsertItems(torch.tensor([12]), ({"language": ("fr",), "available": ("true",)},))
    model = apply_update(model, batch)  # item 12's vector from the item tower
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from retrieval.filters import WORD_BITS, FilterSchema, pack_bits
from retrieval.index import live_index
from retrieval.index.ivf import IVFIndex
from retrieval.model import RetrievalModel
from retrieval.update_batches import (
    AddSeen,
    Attributes,
    RemoveItems,
    SetItemAttributes,
    UpdateBatch,
    UpdateEmbeddings,
    UpdateError,
    UpsertItems,
)
from sharded_tables.interface import RowUpdateRefusedError

Hold = Callable[[], AbstractContextManager[Any]]
"""A context to enter around reads of the model's tables (e.g. a server's batch gate)."""


@dataclass
class PreparedUpdate:
    """A validated update: the model to serve after it, the batch as it is replayed (every
    vector filled in), and in-place row writes that :meth:`commit` runs."""

    model: RetrievalModel
    resolved: UpdateBatch
    writes: list[Callable[[], None]] = field(default_factory=list)

    def commit(self) -> RetrievalModel:
        """Runs the row writes (the caller holds batches off while they run); -> the model."""
        for write in self.writes:
            write()
        self.writes = []
        return self.model


def prepare_update(
    model: RetrievalModel, batch: UpdateBatch, hold: Hold | None = None
) -> PreparedUpdate:
    """Validates ``batch`` against ``model`` and computes its result without changing
    ``model``; raises :class:`UpdateError` naming the field.

    ``hold()`` is entered around the item tower's table lookups: tables that change as they
    are read (hashed ids, hot-row caches) must not be read while a batch reads them, so a
    server passes its batch gate here."""
    if isinstance(batch, UpsertItems):
        return _prepare_upsert(model, batch, hold or nullcontext)
    if isinstance(batch, RemoveItems):
        ids = _check_ids(batch.ids)
        _known_positions(model, ids)
        if ids.numel() >= live_index.served(model.index):
            raise UpdateError("ids", "removing every item would leave the index empty")
        return PreparedUpdate(with_index(model, live_index.remove(model.index, ids)), batch)
    if isinstance(batch, SetItemAttributes):
        return _prepare_attributes(model, batch)
    if isinstance(batch, UpdateEmbeddings):
        return PreparedUpdate(model, batch, [_prepare_rows(model, batch)])
    if isinstance(batch, AddSeen):
        return PreparedUpdate(model, batch, [_prepare_seen(model, batch)])
    raise TypeError(f"not an update batch: {type(batch).__name__}")


def apply_update(model: RetrievalModel, batch: UpdateBatch) -> RetrievalModel:
    """:func:`prepare_update` then :meth:`PreparedUpdate.commit`: the updated model (it shares
    everything but the changed parts with ``model``; table row writes land in shared tables)."""
    return prepare_update(model, batch).commit()


def resolve_update(
    model: RetrievalModel, batch: UpdateBatch, hold: Hold | None = None
) -> PreparedUpdate:
    """:func:`prepare_update` for a model whose index holds no items (a router's statistics:
    the document shards hold them, ``retrieval/live_shards.py``): validates ``batch`` against
    the config, the filter schema and the tables, and fills in every upserted vector; the
    checks against the items (known ids) are the shards'. -> the model unchanged, the resolved
    batch, and the table row writes to commit."""
    if isinstance(batch, UpsertItems):
        resolved = resolve_upsert(model, batch, hold or nullcontext, learn=False)[0]
        return PreparedUpdate(model, resolved)  # new values learned at commit (stats_index)
    if isinstance(batch, RemoveItems):
        _check_ids(batch.ids)
        return PreparedUpdate(model, batch)
    if isinstance(batch, SetItemAttributes):
        _check_count(batch.attributes, _check_ids(batch.ids).numel())
        signatures(model.index.schema, batch.attributes, learn=False)  # learned at commit
        return PreparedUpdate(model, batch)
    if isinstance(batch, UpdateEmbeddings | AddSeen):
        return prepare_update(model, batch)  # the router's own tables and seen store
    raise TypeError(f"not an update batch: {type(batch).__name__}")


def _prepare_seen(model: RetrievalModel, batch: AddSeen) -> Callable[[], None]:
    """Validates the pairs (ids >= 0, one item per user) and builds the grown store now; the
    write swaps its arrays into the model's store (shared by every copy of the model) while
    batches are held off."""
    store = model.seen_store
    if store is None:
        raise UpdateError(
            "users", "the model keeps no seen store (model.seen_store): send seen lists instead"
        )
    users = _check_ids(batch.users, "users", unique=False)  # a user may consume several items
    items = _check_ids(batch.items, "items", unique=False)
    if users.numel() != items.numel():
        raise UpdateError(
            "items", f"expected one item per user ({users.numel()}), got {items.numel()}"
        )
    # the item and user bounds of a new call are the admin edge's (serving/live/messages.py):
    # a replayed log record was taken once and must apply again
    grown = store.with_pairs(users, items)
    return lambda: store.take(grown)


# ---- items ------------------------------------------------------------------------------------
def _prepare_upsert(model: RetrievalModel, batch: UpsertItems, hold: Hold) -> PreparedUpdate:
    resolved, sig = resolve_upsert(model, batch, hold)
    assert resolved.vectors is not None
    values = value_positions(model.index.schema, resolved.attributes)
    index = live_index.upsert(model.index, resolved.ids, resolved.vectors, sig, values)
    return PreparedUpdate(with_index(model, index), resolved)


def resolve_upsert(
    model: RetrievalModel, batch: UpsertItems, hold: Hold = nullcontext, learn: bool = True
) -> tuple[UpsertItems, torch.Tensor]:
    """Validates an upsert against ``model``'s config, filter schema and tables (not its
    index's items) and runs the item tower for the vectors not given; -> (the batch with every
    vector, the items' signatures ``[n, W] int64``; with ``learn`` False, a new hashed value's
    bits are those of the position it would take, and the schema is left as it was)."""
    ids = _check_ids(batch.ids)
    n, d = ids.numel(), model.index.dim
    _check_count(batch.attributes, n)
    sig = signatures(model.index.schema, batch.attributes, learn)
    given = batch.given()
    if tuple(given.shape) != (n,) or given.dtype != torch.bool:
        raise UpdateError(
            "has_vector", f"expected bool [{n}], got {given.dtype} {list(given.shape)}"
        )
    vectors = torch.zeros(n, d)
    if batch.vectors is not None:
        if tuple(batch.vectors.shape) != (n, d) or not batch.vectors.is_floating_point():
            raise UpdateError(
                "vectors",
                f"expected float [{n}, {d}] (the model's dim), got {list(batch.vectors.shape)}",
            )
        vectors = batch.vectors.detach().cpu().float().clone()
        bad = (~torch.isfinite(vectors).all(dim=1) & given).nonzero().flatten()
        if bad.numel():
            raise UpdateError("vectors", "contains NaN or infinity", item=int(bad[0]))
    tower = (~given).nonzero().flatten()
    rows = model.config.num_items
    beyond = tower[ids[tower] >= rows]
    if beyond.numel():
        i = int(beyond[0])
        raise UpdateError(
            "vectors",
            f"item {int(ids[i])} is beyond the item table (rows 0..{rows - 1}), so the item "
            "tower cannot embed it: give its vector",
            item=i,
        )
    if tower.numel():
        with hold():
            vectors[tower] = item_tower_vectors(
                model, ids[tower], [batch.attributes[int(i)] for i in tower]
            )
    resolved = UpsertItems(ids, tuple(batch.attributes), vectors, torch.ones(n, dtype=torch.bool))
    return resolved, sig


def signatures(
    schema: FilterSchema, attributes: Sequence[Attributes], learn: bool = True
) -> torch.Tensor:
    """Items' attributes -> their signatures ``[n, W] int64`` (:class:`UpdateError` naming
    the item for an unknown attribute or value). A hashed attribute's new values are learned
    (``FilterSchema.learn``) unless not ``learn`` (a check that changes nothing). An item
    not naming a multi-valued hashed attribute holds none of its values: its digits those of
    ``NO_VALUE`` (what ``FilterSchema.multi_bits`` gives no value), so the superset test
    admits it wherever it holds none (``retrieval/filter_verify.py`` checks it exactly)."""
    n = len(attributes)
    rows = []
    for i, attrs in enumerate(attributes):
        unnamed: Attributes = {a: [] for a in sorted(schema.multi_valued) if a not in attrs}
        rows.append(signature(schema, {**attrs, **unnamed}, i, learn))
    return torch.cat(rows).view(n, schema.num_words)


def value_positions(
    schema: FilterSchema, attributes: Sequence[Attributes]
) -> dict[str, list[list[int] | None]]:
    """Each multi-valued hashed attribute's value positions per item (None: the item does not
    name it), values known to ``schema`` (:func:`signatures` learned them): what the index's
    value lists take for these items (``live_index.upsert`` / ``relabel``)."""
    return {
        attr: [
            None if attr not in a else [schema.position[attr][v] for v in a[attr]]
            for a in attributes
        ]
        for attr in sorted(schema.multi_valued)
    }


def _prepare_attributes(model: RetrievalModel, batch: SetItemAttributes) -> PreparedUpdate:
    ids = _check_ids(batch.ids)
    _check_count(batch.attributes, ids.numel())
    _known_positions(model, ids)
    schema = model.index.schema
    sig = rewrite_attributes(schema, live_index.signatures_of(model.index, ids), batch.attributes)
    values = value_positions(schema, batch.attributes)
    index = live_index.relabel(model.index, ids, sig, values)
    return PreparedUpdate(with_index(model, index), batch)


def named_bits(schema: FilterSchema, attributes: Sequence[Attributes]) -> torch.Tensor:
    """The bits of every value a relabel names -> ``[W] int64``: what it makes possible in a
    list (``retrieval/index/bound.py``), known without the items' old signatures."""
    sig = signatures(schema, attributes)  # [n, W]
    out = torch.zeros(schema.num_words, dtype=torch.int64)
    for row in sig:
        out |= row
    return out


def rewrite_attributes(
    schema: FilterSchema, sig: torch.Tensor, attributes: Sequence[Attributes]
) -> torch.Tensor:
    """Items' signatures ``sig [n, W]`` with the attributes named in ``attributes`` (one
    mapping per item) replaced -> new ``[n, W] int64`` (``sig`` is not changed)."""
    sig = sig.clone()
    for i, attrs in enumerate(attributes):
        signature(schema, attrs, i)  # every name and value is known
        for name, values in attrs.items():
            new_bits = signature(schema, {name: values}, i)[0]
            sig[i] = (sig[i] & ~_attribute_mask(schema, name)) | new_bits
    return sig


def signature(
    schema: FilterSchema, attrs: Attributes, item: int = 0, learn: bool = True
) -> torch.Tensor:
    """One item's attributes -> its signature ``[1, W] int64``; :class:`UpdateError` naming
    ``attributes[item]`` for an unknown attribute or value."""
    bits = np.zeros((1, schema.num_words * WORD_BITS), dtype=bool)
    for name, values in attrs.items():
        vocab = schema.attribute_values.get(name)
        if vocab is None:
            known = ", ".join(schema.attribute_values) or "none"
            raise UpdateError("attributes", f"unknown attribute {name!r} (known: {known})", item)
        if isinstance(values, str):
            raise UpdateError("attributes", "expected a list of values", item, f".{name}")
        try:
            bits[0, schema.value_bits(name, list(values), learn)] = True
        except ValueError as e:
            if name in schema.numeric_base or name in schema.hashed_base:
                raise UpdateError("attributes", str(e), item, f".{name}") from None
            v = next(v for v in values if (name, v) not in schema.bit_of)
            raise UpdateError(
                "attributes",
                f"unknown value {v!r} (known: {', '.join(schema.vocabulary(name))})",
                item,
                f".{name}",
            ) from None
    return pack_bits(bits)


def _attribute_mask(schema: FilterSchema, name: str) -> torch.Tensor:
    """``[W] int64``: the bits of every value of attribute ``name``."""
    bits = np.zeros((1, schema.num_words * WORD_BITS), dtype=bool)
    bits[0, schema.attribute_bits(name)] = True
    return pack_bits(bits)[0]


@torch.no_grad()
def item_tower_vectors(
    model: RetrievalModel, ids: torch.Tensor, attributes: Sequence[Attributes]
) -> torch.Tensor:
    """The item tower over items ``ids [m]`` (rows of the item table) with their attributes
    (validated names) -> ``[m, D] float32`` on the CPU."""
    device = next(model.item_tower.parameters()).device
    features = {"item_id": ids.view(-1, 1)}
    for name, vocab in model.config.item_attributes.items():
        held = model.index.schema.position.get(name)  # a hashed attribute's, O(1) a value
        if held is None:
            codes = [[vocab.index(v) for v in a.get(name, ())] for a in attributes]
        else:  # a value learned since training has no row: the item goes without it
            codes = [
                [p for v in a.get(name, ()) if (p := held[v]) < len(vocab)] for a in attributes
            ]
        width = max((len(c) for c in codes), default=0) or 1
        padded = torch.full((len(codes), width), -1, dtype=torch.int64)
        for row, c in enumerate(codes):
            padded[row, : len(c)] = torch.tensor(c, dtype=torch.int64)
        features[f"item_{name}"] = padded
    model.tables.validate(features)
    return model.item_vectors({f: t.to(device) for f, t in features.items()}).float().cpu()


def _check_ids(
    ids: torch.Tensor, field: str = "ids", unique: bool = True, keys: bool = False
) -> torch.Tensor:
    """``ids [n] int64``, each >= 0 (``keys``: raw keys of a hashed table, any but -1), none
    twice (``unique``) -> the ids on the CPU."""
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise UpdateError(field, f"expected int64 [n], got {ids.dtype} {list(ids.shape)}")
    ids = ids.cpu()
    if ids.numel() == 0:
        raise UpdateError(field, "empty: nothing to update")
    neg = (ids == -1 if keys else ids < 0).nonzero().flatten()
    if neg.numel():
        want = "a raw key, not -1 (padding)" if keys else "must be >= 0"
        raise UpdateError(field, f"{want}, got {int(ids[neg[0]])}", int(neg[0]))
    if not unique:
        return ids
    seen: set[int] = set()
    for i, v in enumerate(ids.tolist()):
        if v in seen:
            raise UpdateError(field, f"{v} appears more than once in the batch", i)
        seen.add(v)
    return ids


def _check_count(attributes: Sequence[Attributes], n: int) -> None:
    if len(attributes) != n:
        raise UpdateError(
            "attributes", f"expected one mapping per item ({n}), got {len(attributes)}"
        )


def _known_positions(model: RetrievalModel, ids: torch.Tensor) -> None:
    """Refuses (naming the first) items ``ids [n]`` the index does not serve."""
    missing = (~live_index.locate(model.index, ids)).nonzero().flatten()
    if missing.numel():
        i = int(missing[0])
        raise UpdateError("ids", f"item {int(ids[i])} is not in the index", i)


def with_index(model: RetrievalModel, index: IVFIndex) -> RetrievalModel:
    """A shallow copy of ``model`` whose ``index`` is ``index`` (``model`` keeps its own),
    searching on the backend ``model``'s index was served with (an update's index is new)."""
    index.executor.backend = model.index.executor.backend
    new = copy.copy(model)
    new._modules = dict(model._modules)  # its own module table: setting index leaves model's
    new.index = index
    return new


# ---- embedding rows ---------------------------------------------------------------------------
def table_shapes(model: RetrievalModel) -> dict[str, tuple[int, int]]:
    """``{table: (rows, E)}`` of every table of ``model.tables``."""
    return model.tables.table_shapes()


def _prepare_rows(model: RetrievalModel, batch: UpdateEmbeddings) -> Callable[[], None]:
    """Validates a row update; -> the write that applies it."""
    known = table_shapes(model)
    if batch.table not in known:
        raise UpdateError("table", f"unknown table {batch.table!r} (known: {', '.join(known)})")
    if model.tables.table_rows()[batch.table] is None:  # hashed: rows are raw keys
        rows = _check_ids(batch.rows, "rows", keys=True)
    else:
        rows = _check_ids(batch.rows, "rows")
        n_rows = known[batch.table][0]
        bad = (rows >= n_rows).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise UpdateError("rows", f"{int(rows[i])} is not in [0, {n_rows})", i)
    values = _check_values(batch.values, rows.numel(), known[batch.table][1])
    try:
        return model.tables.row_writer(batch.table, rows, values)
    except RowUpdateRefusedError as e:
        raise UpdateError("table", str(e)) from None
    except ValueError as e:  # the values do not fit the table's storage (dtype range)
        raise UpdateError("values", str(e)) from None


def _check_values(values: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if tuple(values.shape) != (n, dim) or not values.is_floating_point():
        raise UpdateError("values", f"expected float [{n}, {dim}], got {list(values.shape)}")
    values = values.detach().cpu().float()
    bad = (~torch.isfinite(values).all(dim=1)).nonzero().flatten()
    if bad.numel():
        raise UpdateError("values", "contains NaN or infinity", int(bad[0]))
    return values
