"""``KeyedBag``: the float form of a hashed table, rows under raw 64-bit keys.

After training (:mod:`sharded_tables.hashed_training`) a hashed table is every id it learned and
its row. A float model holds them here, sorted by key, so a lookup is one ``searchsorted``; an id
it never learned reads a zero row (as a served model's hashed table does). The rows travel in the
module's extra state (their count changes with training), and publishing puts them on the
embedding servers in the served dtype (``keyed`` tables).

Example::

    bag = KeyedBag(dim=4)
    bag.load(torch.tensor([42, 7]), torch.randn(2, 4))
    bag(torch.tensor([[7, -1], [99, 42]]), mean=True)  # [2, 4]: row of 7; (0 + row of 42) / 2
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class KeyedBag(nn.Module):
    """Float rows ``[n, D]`` under sorted raw keys ``int64 [n]``; pooled lookups of ``[B, L]``."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.keys = torch.zeros(0, dtype=torch.int64)
        self.rows = torch.zeros(0, dim)

    @torch.no_grad()
    def load(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Takes ``keys int64 [n]`` (distinct, none -1) and ``rows [n, D]``."""
        if (
            keys.dim() != 1
            or keys.dtype != torch.int64
            or tuple(rows.shape) != (len(keys), self.dim)
        ):
            raise ValueError(
                f"expected keys int64 [n] and rows [n, {self.dim}], got {keys.dtype} "
                f"{list(keys.shape)} and {list(rows.shape)}"
            )
        order = torch.argsort(keys)
        keys = keys[order]
        if len(keys) and (bool((keys[1:] == keys[:-1]).any()) or bool((keys == -1).any())):
            raise ValueError("keys must be distinct and not -1 (padding)")
        self.keys, self.rows = keys.cpu(), rows[order].detach().float().cpu().contiguous()

    def forward(self, ids: torch.Tensor, mean: bool) -> torch.Tensor:
        """``ids int64 [B, L]`` (-1 pads) -> pooled ``[B, D]`` (sum, or mean over present ids)."""
        present = ids != -1
        if len(self.keys):
            at = torch.searchsorted(self.keys, ids.cpu()).clamp(max=len(self.keys) - 1)
            hit = present.cpu() & (self.keys[at] == ids.cpu())
            rows = self.rows[at] * hit[..., None]  # [B, L, D]
        else:
            rows = torch.zeros(*ids.shape, self.dim)
        out = rows.sum(dim=1)
        if mean:
            out = out / present.sum(dim=1, keepdim=True).clamp(min=1).cpu()
        return out.to(ids.device)

    def get_extra_state(self) -> dict[str, Any]:
        return {"keys": self.keys.clone(), "rows": self.rows.clone()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.load(state["keys"], state["rows"])
