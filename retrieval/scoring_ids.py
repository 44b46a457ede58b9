"""The user's own item ids in offline scoring's columns (``retrieval/batch_scoring.py``).

A model trained on imported data carries id maps (``RetrievalModel.id_maps``, the model folder's
``item_ids.parquet``). Scoring it, the input ``history`` holds the user's raw item ids
(``list<int64>`` or ``list<string>``, the type of the map) and the output ``item_ids`` holds raw
ids too (a pad where the filter admits fewer than K items: null). The optional ``seen`` column
(items never recommended) holds raw ids like ``history``. A model without maps reads and writes
dense ids, as before. ``user_id`` is echoed either way.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from retrieval.data.id_map import IdMap, IdMaps


def history_type_ok(t: pa.DataType, maps: IdMaps | None) -> bool:
    """Whether a ``history`` column of type ``t`` fits the model (raw ids: the map's type)."""
    if not pa.types.is_list(t):
        return False
    v = t.value_type
    if maps is None or maps.items.is_int:
        return bool(pa.types.is_integer(v))
    return bool(pa.types.is_string(v) or pa.types.is_large_string(v))


def history_expected(maps: IdMaps | None) -> str:
    """What ``history`` must be, in words."""
    if maps is None:
        return "list<int64> of item ids"
    kind = "int64" if maps.items.is_int else "string"
    return f"list<{kind}> of the model's raw item ids"


def first_unknown(lists: pa.Array, items: IdMap) -> tuple[int, object] | None:
    """The first ``(row, raw id)`` of ``lists`` (``[R]`` lists) the item map does not know."""
    values = pc.list_flatten(lists)
    if not len(values):
        return None
    missing = np.flatnonzero(items.lookup(values) < 0)
    if not missing.size:
        return None
    rows = pc.list_parent_indices(lists).to_numpy()
    at = int(missing[0])
    return int(rows[at]), values[at].as_py()


def dense_history(
    lists: pa.Array | pa.ChunkedArray, items: IdMap, where: str = "history"
) -> pa.ListArray:
    """``[R]`` lists of raw item ids -> ``[R]`` lists of dense ids (checked before: known;
    ``where``: the column, for the message if not)."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    lists = lists.fill_null(pa.scalar([], lists.type))  # a null history is empty
    dense = items.to_dense(pc.list_flatten(lists), where)
    return pa.ListArray.from_arrays(_offsets(lists), pa.array(dense, pa.int64()))


def _offsets(lists: pa.ListArray) -> pa.Array:
    """``[R + 1]`` offsets of ``lists`` counted from its first value."""
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
    return pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32))


def raw_answers(ids: np.ndarray, maps: IdMaps | None) -> pa.Array:
    """An answer ``[B, K]`` of dense ids (``-1`` pads) -> ``[B]`` lists: raw ids (null pads)
    with maps, else the dense ids as they are (``list<int64>``)."""
    if maps is None:
        return pa.array(ids.tolist(), type=pa.list_(pa.int64()))
    return maps.items.to_raw_lists(ids)
