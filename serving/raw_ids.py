"""The user's own item ids at the serving edge: requests name their history in raw ids, answers
carry the raw id of every recommended item.

A model trained on imported data carries id maps (``RetrievalModel.id_maps``, see
``docs/data.md``); the engine runs on dense ids ``0..N-1`` and only the edge maps:

* in: ``raw_history`` (text, so one field serves integer and string ids: ``"42"``, ``"sku-9"``)
  -> dense ``history`` by :func:`dense_history`, once per request against the item map of the
  version that runs it (the runner's edge check, so a hot swap to a version with another map
  maps again). ``""`` is a pad (like ``-1`` in ``history``). An id the map does not know is
  refused (:class:`~serving.types.RequestError` naming ``raw_history``, the id and its place):
  a request is answered for the history it gave, or not at all. ``raw_seen`` (the items the
  request excludes) is mapped the same way into ``seen``, and refused the same way
  (``dense_history(raw, items, "raw_seen")``).
* out: dense ids ``[B, K]`` -> ``raw_item_ids`` ``[B, K]`` text by :func:`raw_item_ids`, one
  vectorised take per batch of rows; ``""`` where the dense id is a pad (``-1``) or an item the
  map does not hold (one a live update added beyond the trained catalog).

Example::

    dense_history(["sku-9", "", "sku-1"], items)    # array([ 1, -1,  0])
    raw_item_ids(np.array([[1, 0, -1]]), items)     # array([['sku-9', 'sku-1', '']], dtype=object)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from retrieval.data.id_map import IdMap
from serving.types import RequestError

FIELD = "raw_history"
_LIST = {FIELD: "history", "raw_seen": "seen list"}
"""What each raw id field holds, for messages."""
PAD = ""
"""A pad in ``raw_history`` and ``raw_item_ids`` (``-1`` in the dense fields)."""


def decode_text(values: np.ndarray, where: str = FIELD) -> np.ndarray:
    """BYTES elements (any shape) -> the same shape of ``str`` (object); ``RequestError``
    naming ``where`` when one is not UTF-8. One arrow cast validates them all."""
    flat = pa.array(values.reshape(-1).tolist(), type=pa.binary())
    try:
        text = flat.cast(pa.string())
    except pa.ArrowInvalid:
        raise RequestError(f"{where}: an item id is not UTF-8 text") from None
    return np.asarray(text.to_numpy(zero_copy_only=False), dtype=object).reshape(values.shape)


def dense_history(raw: Sequence[str] | np.ndarray, items: IdMap, where: str = FIELD) -> np.ndarray:
    """Raw item ids ``[H]`` (text, newest first, ``""`` pads) -> dense ids ``int64 [H]``
    (``-1`` pads). Raises :class:`RequestError` naming ``where`` (``raw_history``, or
    ``raw_seen`` for a seen list) and the first id the map does not know (for an integer map:
    text that is no integer too)."""
    text = pa.array(list(raw), type=pa.string())  # [H]
    pad = np.asarray(pc.equal(text, PAD).to_numpy(zero_copy_only=False), dtype=bool)
    dense = np.full(len(text), -1, dtype=np.int64)
    given = np.flatnonzero(~pad)
    if not given.size:
        return dense
    wanted = text.take(pa.array(given))
    if items.is_int:
        try:
            wanted = wanted.cast(pa.int64())
        except pa.ArrowInvalid:
            bad = next(i for i in given if not _is_int_text(text[i].as_py()))
            raise _unknown(text[bad].as_py(), int(bad), "an integer item id", where) from None
    found = items.lookup(wanted)
    missing = np.flatnonzero(found < 0)
    if missing.size:
        at = int(given[missing[0]])
        why = f"one of the model's {len(items)} item ids"
        raise _unknown(text[at].as_py(), at, why, where, int(missing.size))
    dense[given] = found
    return dense


def _is_int_text(s: str) -> bool:
    try:
        pa.array([s]).cast(pa.int64())
    except pa.ArrowInvalid:
        return False
    return True


def _unknown(raw: str, at: int, why: str, where: str, count: int = 1) -> RequestError:
    return RequestError(
        f"{where}: item id {raw!r} (position {at}) is not {why}"
        + (f" ({count} ids of the {_LIST.get(where, where)} are unknown)" if count > 1 else "")
    )


def raw_item_ids(ids: np.ndarray, items: IdMap | None) -> np.ndarray:
    """Dense ids ``int64 [B, K]`` (``-1`` pads) -> their raw ids as text ``object [B, K]``;
    ``""`` for a pad, an id beyond the map, or every id when ``items`` is None (a version
    without maps answered)."""
    out = np.full(ids.shape, PAD, dtype=object)
    if items is None:
        return out
    flat = ids.reshape(-1)
    known = (flat >= 0) & (flat < len(items))
    raw = items.raw.take(pa.array(np.where(known, flat, 0), type=pa.int64()))  # [B * K]
    text = raw.cast(pa.string()) if items.is_int else raw
    values = np.asarray(text.to_numpy(zero_copy_only=False), dtype=object)
    out.reshape(-1)[known] = values[known]
    return out
