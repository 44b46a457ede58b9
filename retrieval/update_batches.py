"""The update batches a live update carries (:data:`UpdateBatch`), and the refusal they raise
(:class:`UpdateError`): plain data, validated and applied by ``retrieval/live_updates.py``,
carried on the wire by ``serving/live/messages.py``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

Attributes = Mapping[str, Sequence[str]]
"""One item's attributes: attribute -> its values (names from ``config.item_attributes``)."""


class UpdateError(ValueError):
    """An update refused before anything changed. ``field`` is the batch field ("ids",
    "vectors", "attributes", "table", "rows", "values"), ``item`` the row of the batch it is
    about (or None), ``sub`` a path below it (".language"); ``str()`` reads
    ``attributes[2].language: unknown value 'xx' ...``."""

    def __init__(self, field: str, message: str, item: int | None = None, sub: str = ""):
        self.field, self.item, self.sub, self.reason = field, item, sub, message
        where = field + ("" if item is None else f"[{item}]") + sub
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class UpsertItems:
    """Add or replace items. ``ids [n] int64``; ``attributes``: one mapping per item (an
    attribute left out has no value); ``vectors [n, D] float32`` where ``has_vector [n] bool``
    (``vectors=None``: every vector from the item tower; ``has_vector=None``: all given)."""

    kind: ClassVar[str] = "upsert_items"
    ids: torch.Tensor
    attributes: Sequence[Attributes]
    vectors: torch.Tensor | None = None
    has_vector: torch.Tensor | None = None

    def given(self) -> torch.Tensor:
        """``[n] bool``: rows whose vector is given."""
        n = self.ids.shape[0]
        if self.vectors is None:
            return torch.zeros(n, dtype=torch.bool)
        return torch.ones(n, dtype=torch.bool) if self.has_vector is None else self.has_vector


@dataclass(frozen=True)
class RemoveItems:
    """Remove items ``ids [n] int64`` from the index."""

    kind: ClassVar[str] = "remove_items"
    ids: torch.Tensor


@dataclass(frozen=True)
class SetItemAttributes:
    """Items ``ids [n] int64`` get the attributes of ``attributes`` (one mapping per item; only
    the attributes named change, an empty value list clears one)."""

    kind: ClassVar[str] = "set_item_attributes"
    ids: torch.Tensor
    attributes: Sequence[Attributes]


@dataclass(frozen=True)
class UpdateEmbeddings:
    """Rows ``rows [n] int64`` of embedding table ``table`` become ``values [n, E] float32``."""

    kind: ClassVar[str] = "update_embeddings"
    table: str
    rows: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class AddSeen:
    """User ``users[j]`` consumed item ``items[j]`` (``[n] int64`` each): the seen store holds it
    from now on (a user beyond the store's grows it)."""

    kind: ClassVar[str] = "add_seen"
    users: torch.Tensor
    items: torch.Tensor


UpdateBatch = UpsertItems | RemoveItems | SetItemAttributes | UpdateEmbeddings | AddSeen
KINDS = tuple(
    c.kind for c in (UpsertItems, RemoveItems, SetItemAttributes, UpdateEmbeddings, AddSeen)
)
