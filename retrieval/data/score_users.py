"""Every user of a data set in ``recserve score``'s input format, with the user's own ids.

``score_users.parquet`` (written by ``recserve data import``): ``user_id`` (raw), ``history``
(the user's most recent raw item ids, newest first), ``categorical`` (one code per user feature,
in the data set's order), ``dense``. A model trained with ``[model] user_features`` naming a
subset reads fewer codes: scoring refuses the file then, naming the column.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.data.schema import RecDataset
from retrieval.data.split import history_by_user

SCORE_USERS_FILE = "score_users.parquet"


def score_users_table(ds: RecDataset, history_len: int) -> pa.Table:
    """The input rows of all ``U`` users (raw ids when the data set has id maps)."""
    hist, lengths = history_by_user(ds.interactions, ds.num_users, history_len)  # [U, H], [U]
    flat = hist[hist >= 0]  # row-major: each user's items, newest first
    offsets = pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32))  # [U + 1]
    users = np.arange(ds.num_users, dtype=np.int64)
    if ds.ids is not None:
        items, user_ids = ds.ids.items.to_raw(flat), ds.ids.users.raw
    else:
        items, user_ids = pa.array(flat, pa.int64()), pa.array(users)
    u, f = ds.num_users, len(ds.user_features)
    cat = np.stack([ds.user_features[n] for n in ds.user_features], axis=1) if f else None
    cat_values = cat.reshape(-1) if cat is not None else np.zeros(0, np.int64)
    dense = ds.user_dense  # [U, F_dense]
    return pa.table(
        {
            "user_id": user_ids,
            "history": pa.ListArray.from_arrays(offsets, items),
            "categorical": _fixed_lists(cat_values.astype(np.int64), u, f, pa.int64()),
            "dense": _fixed_lists(dense.reshape(-1), u, dense.shape[1], pa.float32()),
        }
    )


def _fixed_lists(values: np.ndarray, rows: int, width: int, t: pa.DataType) -> pa.ListArray:
    """``[rows * width]`` values -> ``[rows]`` lists of ``width`` (typed even when empty)."""
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * width)
    return pa.ListArray.from_arrays(offsets, pa.array(values, t))


def write_score_users(ds: RecDataset, directory: Path, history_len: int) -> Path:
    """Writes ``score_users.parquet`` into ``directory``; returns its path."""
    path = Path(directory) / SCORE_USERS_FILE
    pq.write_table(score_users_table(ds, history_len), path)
    return path
