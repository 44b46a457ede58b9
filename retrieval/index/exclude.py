"""Items a request excludes, applied inside the scan: the items its user has already seen.

A request names them by item id (``FilterBatch.exclude [B, S] int64``, ``-1`` pads): the
model's history window and the request's full seen list. An index maps them once per search
to its own rows (:func:`excluded_positions`: sorted, so a probed list's excluded rows are one
contiguous run found by a binary search) and every plan skips them where it skips ineligible
items: the list scan blanks them before its top-r (``csrc/ivf_scan.cpp``), the exact scan
before its top-k. So an index returns K items its user has not seen however long the seen
list, and the candidates it keeps do not grow with S.

Example::

    order = IdOrder.of(torch.tensor([30, 10, 20]))       # rows 0..2 hold items 30, 10, 20
    excl = excluded_positions(order, torch.tensor([[20, 30, -1, 99]]))
    # tensor([[0, 2, PAD, PAD]]): rows of items 30 and 20, ascending; -1 and unknown ids pad
    is_excluded(torch.tensor([[2, 1]]), excl)             # tensor([[True, False]])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrieval.filters import FilterBatch
from retrieval.index.kernels import extension

PAD = torch.iinfo(torch.int64).max
"""Pads a row of excluded positions (sorts after every real row, equals none)."""


@dataclass(frozen=True)
class IdOrder:
    """The lookup from item id to row: an index's ``item_ids [N] int64`` (row -> item id, the
    index's own buffer) and ``perm [N]``, its rows in ascending id order (built when the
    index's items change). A binary search through ``perm`` finds an id: on the CPU ``perm`` is
    int32 (an index holds under 2**31 items: its postings are int32 too), 4 bytes an item,
    where a sorted copy of the ids would take 8 more; on a GPU int64, as ``torch.searchsorted``
    takes it."""

    item_ids: torch.Tensor
    perm: torch.Tensor

    @classmethod
    def of(cls, item_ids: torch.Tensor) -> IdOrder:
        """From an index's ``item_ids [N] int64`` (row -> item id)."""
        perm = item_ids.argsort()
        return cls(item_ids, perm.int() if perm.device.type == "cpu" else perm)

    @property
    def nbytes(self) -> int:
        """What the lookup adds to the index (``perm``; the ids are the index's own)."""
        return self.perm.numel() * self.perm.element_size()

    def positions(
        self, ids: torch.Tensor, missing: int = -1, ascending: bool = False
    ) -> torch.Tensor:
        """Rows of ``ids [...] int64`` -> same shape, ``missing`` where an id is not in the
        index; ``ascending``: each last-dimension row sorted. On the CPU one C++ call (a
        request's few ids cost less than one torch op each)."""
        n = self.item_ids.numel()
        if n == 0:
            return torch.full_like(ids, missing)
        ids = ids.to(self.item_ids.device)
        if ids.device.type == "cpu":
            lookup = extension().id_rows
            return lookup(self.item_ids, self.perm, ids.long().contiguous(), missing, ascending)
        at = torch.searchsorted(self.item_ids, ids.contiguous(), sorter=self.perm)
        row = self.perm[at.clamp(max=n - 1)]
        rows_t = torch.where(self.item_ids[row] == ids, row, torch.full_like(ids, missing))
        return rows_t.sort(dim=-1).values if ascending else rows_t


@dataclass
class ExcludedRows(FilterBatch):
    """A filter batch whose ``exclude [B, S] int64`` holds rows of one index already (ascending,
    :data:`PAD` padded), not item ids: what a live index's tombstones add to each row's seen
    items without mapping thousands of ids per row on every search (``fresh.py``). The list
    scan and the exact scan take it as they take mapped ids; the one-call backends, which map
    ids themselves, are not given it."""

    def rows(self, rows: torch.Tensor) -> ExcludedRows:
        part = super().rows(rows)
        return ExcludedRows(part.masks, part.negate, part.exclude, part.neg_masks, part.verify)

    def to(self, device: torch.device | str) -> ExcludedRows:
        moved = super().to(device)
        return ExcludedRows(moved.masks, moved.negate, moved.exclude, moved.neg_masks, moved.verify)


def excluded_positions(order: IdOrder, exclude: torch.Tensor) -> torch.Tensor:
    """Item ids ``exclude [B, S]`` (``-1`` pads; ids the index does not hold are ignored) ->
    the rows they sit in, ``[B, S] int64`` ascending per row, :data:`PAD` padded at the end."""
    return order.positions(exclude, missing=PAD, ascending=True)


def is_excluded(pos: torch.Tensor, excl: torch.Tensor) -> torch.Tensor:
    """``[B, M] bool``: which rows ``pos [B, M]`` (``-1`` pads never match) are in their row of
    ``excl [B, S]`` (from :func:`excluded_positions`): a binary search, O(M log S) per row."""
    if excl.shape[1] == 0:
        return torch.zeros(pos.shape, dtype=torch.bool, device=pos.device)
    at = torch.searchsorted(excl, pos.contiguous()).clamp(max=excl.shape[1] - 1)
    return excl.gather(1, at) == pos
