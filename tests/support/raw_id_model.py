"""A serving test model with the user's own ids: a shallow copy of a tiny model given id maps
(``RetrievalModel.id_maps``), as ``recserve train`` on imported data leaves one."""

from __future__ import annotations

import copy

import pyarrow as pa

from retrieval.data.id_map import IdMap, IdMaps
from retrieval.model import RetrievalModel


def raw_item(dense: int, int_ids: bool = False) -> str:
    """The raw id (as text) of dense item ``dense``: not in dense order (7 and 1000 are coprime,
    so the ids stay distinct for up to 1000 items)."""
    n = (7 * dense) % 1000
    return str(10_000 + n) if int_ids else f"sku-{n:03d}"


def with_id_maps(model: RetrievalModel, int_ids: bool = False) -> RetrievalModel:
    """``model`` (untouched) with string (or integer) raw item ids; users ``u0, u1, ...``."""
    n = model.config.num_items
    raw = [raw_item(i, int_ids) for i in range(n)]
    items = pa.array([int(r) for r in raw] if int_ids else raw)
    users = pa.array([f"u{i}" for i in range(8)])
    out = copy.copy(model)
    out.id_maps = IdMaps(IdMap("user_id", users), IdMap("item_id", items))
    return out
