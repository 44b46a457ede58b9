"""``KeyedBag``: a hashed table's rows held in the process, under raw 64-bit keys.

After training (:mod:`sharded_tables.hashed_training`) a hashed table is every id it learned and
its row. A model holds them here, sorted by key, so a lookup is one ``searchsorted``; an id it
never learned reads a zero row. The float model keeps FP32 rows; a tiered model packs them in
its plan's dtype (``int8``: a quarter of the bytes), unpacking only the rows a batch reads. The
rows travel in the module's extra state (their count changes), and live updates insert or
replace rows (:meth:`upsert`, copy-on-write: a lookup in flight keeps the arrays it read).

Example::

    bag = KeyedBag(dim=4)
    bag.load(torch.tensor([42, 7]), torch.randn(2, 4))
    bag(torch.tensor([[7, -1], [99, 42]]), mean=True)  # [2, 4]: row of 7; (0 + row of 42) / 2
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sharded_tables.quantize import pack_rows, unpack_rows
from sharded_tables.specs import DType, row_bytes


class KeyedBag(nn.Module):
    """Packed rows ``uint8 [n, row_bytes]`` under sorted raw keys ``int64 [n]``."""

    def __init__(self, dim: int, dtype: DType = DType.FP32):
        super().__init__()
        self.dim, self.dtype = dim, DType(dtype)
        self.keys = torch.zeros(0, dtype=torch.int64)
        self.packed = torch.zeros(0, row_bytes(dim, self.dtype), dtype=torch.uint8)

    @property
    def rows(self) -> torch.Tensor:
        """Every row as float32 ``[n, D]`` (in key order)."""
        return unpack_rows(self.packed, self.dtype, self.dim)

    def load(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Replaces the table with float ``rows [n, D]`` under ``keys int64 [n]`` (distinct,
        none -1), packed in the bag's dtype."""
        self._check(keys, rows)
        order = torch.argsort(keys)
        keys = keys[order].cpu()
        if len(keys) and bool((keys[1:] == keys[:-1]).any()):
            raise ValueError("keys must be distinct")
        self.keys, self.packed = keys, self._pack(rows[order])

    def upsert(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Inserts or replaces float ``rows [m, D]`` under ``keys [m]`` (the last of a key
        repeated wins); new arrays, so a lookup in flight keeps the ones it read."""
        self._check(keys, rows)
        self.upsert_packed(keys, self._pack(rows))

    def upsert_packed(self, keys: torch.Tensor, packed: torch.Tensor) -> None:
        """:meth:`upsert` of rows already packed in the bag's dtype ``uint8 [m, row_bytes]``."""
        keys = keys.cpu()
        _, last = _last_positions(keys)
        keys, packed = keys[last], packed[last]
        kept = ~torch.isin(self.keys, keys)
        all_keys = torch.cat([self.keys[kept], keys])
        order = torch.argsort(all_keys)
        self.keys, self.packed = all_keys[order], torch.cat([self.packed[kept], packed])[order]

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids int64 [n]`` -> (float rows ``[n, D]``, zeros where unknown; found ``bool [n]``)."""
        keys, packed = self.keys, self.packed  # one consistent pair (upsert swaps both)
        ids = ids.cpu().contiguous()
        if not len(keys):
            return torch.zeros(len(ids), self.dim), torch.zeros(len(ids), dtype=torch.bool)
        at = torch.searchsorted(keys, ids).clamp(max=len(keys) - 1)
        found = keys[at] == ids
        rows = unpack_rows(packed[at[found]], self.dtype, self.dim)
        out = torch.zeros(len(ids), self.dim)
        out[found] = rows
        return out, found

    def forward(self, ids: torch.Tensor, mean: bool) -> torch.Tensor:
        """``ids int64 [B, L]`` (-1 pads) -> pooled ``[B, D]`` (sum, or mean over present ids;
        an unknown id counts as a zero row)."""
        present = ids != -1
        rows, _ = self.lookup(ids.flatten())
        rows = rows.view(*ids.shape, self.dim) * present.cpu()[..., None]
        out = rows.sum(dim=1)
        if mean:
            out = out / present.sum(dim=1, keepdim=True).clamp(min=1).cpu()
        return out.to(ids.device)

    def get_extra_state(self) -> dict[str, Any]:
        return {"dtype": self.dtype.value, "keys": self.keys.clone(), "packed": self.packed.clone()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if DType(state["dtype"]) is not self.dtype:
            raise ValueError(
                f"saved keyed rows are {state['dtype']}, this table is {self.dtype.value}"
            )
        keys, packed = state["keys"], state["packed"]
        if packed.shape != (len(keys), self.packed.shape[1]) or packed.dtype != torch.uint8:
            raise ValueError(
                f"saved keyed rows: expected uint8 [{len(keys)}, {self.packed.shape[1]}]"
            )
        self.keys, self.packed = keys.clone(), packed.clone()

    def _check(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        if (
            keys.dim() != 1
            or keys.dtype != torch.int64
            or tuple(rows.shape) != (len(keys), self.dim)
        ):
            raise ValueError(
                f"expected keys int64 [n] and rows [n, {self.dim}], got {keys.dtype} "
                f"{list(keys.shape)} and {list(rows.shape)}"
            )
        if bool((keys == -1).any()):
            raise ValueError("keys must not be -1 (padding)")

    def _pack(self, rows: torch.Tensor) -> torch.Tensor:
        return pack_rows(rows.detach().float().cpu().contiguous(), self.dtype).clone()


def _last_positions(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys [m]`` -> (distinct keys, position of each one's last occurrence)."""
    uniq, inverse = torch.unique(keys, return_inverse=True)
    last = torch.full((len(uniq),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, torch.arange(len(keys)), reduce="amax")
    return uniq, last
