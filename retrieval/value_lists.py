"""Exact values of a multi-valued hashed attribute (tags: an item holds several of 10^5 values).

A hashed attribute's signature stores a value's position in ``D`` one-hot hexadecimal digits
(``retrieval/filters.py``). An item holding one value passes exactly the clauses naming it; an item
holding several sets every value's digits, which mix (``0x12`` and ``0x34`` also read as ``0x14``),
so its signature is a superset: no false negatives, some false positives. The index keeps, for
each such attribute, every item's value positions (:class:`ValueLists`, a CSR by item id: ids
survive the lists' reordering by builds and updates); a search finds its candidates by the
superset and verifies them against these values, kept at the items' positions as value keys
(``retrieval/filter_verify.py``), before its top-K is taken.

Bytes an item: 8 (its id) + 8 (its offset) + 4 a value it holds, beside its ``16 D`` signature bits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from retrieval.filter_expr import Clause, Compare, Expr, Not


@dataclass(frozen=True)
class ValueLists:
    """Items' value positions: ``ids [N] int64`` ascending, ``offsets [N+1] int64`` and
    ``positions [nnz] int32``: item ``ids[i]`` holds ``positions[offsets[i] : offsets[i+1]]``.
    An id not listed holds no value."""

    ids: np.ndarray
    offsets: np.ndarray
    positions: np.ndarray

    @staticmethod
    def of(ids: np.ndarray, lists: Sequence[Sequence[int]]) -> ValueLists:
        """Item ids ``[N]`` (distinct) and each one's value positions -> their lists."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(lists) != ids.shape[0]:
            raise ValueError(f"{len(lists)} value lists for {ids.shape[0]} items")
        sizes = np.fromiter((len(v) for v in lists), np.int64, len(lists))
        flat = np.fromiter((int(p) for v in lists for p in v), np.int32, int(sizes.sum()))
        return ValueLists._sorted(ids, sizes, flat)

    @staticmethod
    def _sorted(ids: np.ndarray, sizes: np.ndarray, flat: np.ndarray) -> ValueLists:
        """Items ``ids [N]`` (distinct, any order) holding ``sizes [N]`` values each, laid out
        one after the other in ``flat [nnz]`` -> their lists, sorted by id."""
        if np.unique(ids).shape[0] != ids.shape[0]:
            raise ValueError("value lists: item ids repeat")
        order = np.argsort(ids, kind="stable")
        starts = np.concatenate([[0], np.cumsum(sizes)])[:-1]
        offsets = np.concatenate([[0], np.cumsum(sizes[order])]).astype(np.int64)
        # each value's source: its item's old start plus its place in the item's list
        item = np.repeat(order, sizes[order])
        within = np.arange(item.shape[0]) - np.repeat(offsets[:-1], sizes[order])
        return ValueLists(ids[order], offsets, flat[starts[item] + within].astype(np.int32))

    def replaced(self, ids: np.ndarray, lists: Sequence[Sequence[int]]) -> ValueLists:
        """A copy where items ``ids [n]`` hold ``lists`` instead (new ids join)."""
        ids = np.asarray(ids, dtype=np.int64)
        keep = ~np.isin(self.ids, ids)  # [N]
        sizes = np.diff(self.offsets)
        kept = self.positions[np.repeat(keep, sizes)]
        new = ValueLists.of(ids, lists)  # sorted by id too
        return ValueLists._sorted(
            np.concatenate([self.ids[keep], new.ids]),
            np.concatenate([sizes[keep], np.diff(new.offsets)]),
            np.concatenate([kept, new.positions]),
        )

    def lists_of(self, ids: np.ndarray) -> list[list[int]]:
        """The value positions each of items ``ids [M]`` holds (``[]``: not listed)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.ids.size:
            return [[] for _ in range(ids.shape[0])]
        at = np.searchsorted(self.ids, ids).clip(max=self.ids.size - 1)
        listed = self.ids[at] == ids
        return [
            self.positions[self.offsets[j] : self.offsets[j + 1]].tolist() if ok else []
            for j, ok in zip(at.tolist(), listed.tolist(), strict=True)
        ]

    def nbytes(self) -> int:
        return self.ids.nbytes + self.offsets.nbytes + self.positions.nbytes

    def state(self) -> dict[str, torch.Tensor]:
        """What a saved index holds (tensors)."""
        return {
            "ids": torch.from_numpy(self.ids.copy()),
            "offsets": torch.from_numpy(self.offsets.copy()),
            "positions": torch.from_numpy(self.positions.copy()),
        }

    @staticmethod
    def from_state(state: Mapping[str, torch.Tensor]) -> ValueLists:
        return ValueLists(
            state["ids"].numpy().astype(np.int64),
            state["offsets"].numpy().astype(np.int64),
            state["positions"].numpy().astype(np.int32),
        )


def names_any(expr: Expr, attributes: Collection[str]) -> str | None:
    """The first of ``attributes`` that ``expr`` names, or None."""
    if isinstance(expr, Clause | Compare):
        return expr.attribute if expr.attribute in attributes else None
    if isinstance(expr, Not):
        return names_any(expr.child, attributes)
    for child in expr.children:
        found = names_any(child, attributes)
        if found is not None:
            return found
    return None
