"""The user's own id as a model feature (``raw_id``): raw int64 ids for a hashed table.

A hashed table takes ids from an unbounded space (``sharded_tables/hashed_training.py``). This
gives every user of a data set such an id:

* an imported log's raw user ids, when they are integers (``-1`` aside: it is padding);
* otherwise a stable 63-bit hash of the raw id's text (imported string ids) or of the dense user
  index (generated and MovieLens data): ids as sparse as a production system's.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from retrieval.data.schema import RecDataset
from sharded_tables.remote.routing import splitmix64

FEATURE = "raw_id"
"""The user feature's name (its table: ``user_raw_id``)."""
_MASK = np.uint64((1 << 63) - 1)


def raw_user_ids(ds: RecDataset) -> np.ndarray:
    """``int64 [U]``: each user's raw id (see the module doc), never ``-1``."""
    if ds.ids is not None:
        raw = ds.ids.users.raw
        if pa.types.is_integer(raw.type):
            ids = raw.to_numpy(zero_copy_only=False).astype(np.int64)
            if not (ids == -1).any():
                return ids
        text = [str(x).encode() for x in raw.to_pylist()]
        digest = [
            int.from_bytes(hashlib.blake2b(t, digest_size=8).digest(), "little") for t in text
        ]
        return (np.array(digest, np.uint64) & _MASK).astype(np.int64)
    return (splitmix64(np.arange(ds.num_users, dtype=np.int64)) & _MASK).astype(np.int64)


def with_raw_user_ids(ds: RecDataset, capacity: int) -> None:
    """Adds the feature ``raw_id`` to ``ds`` (in memory): its ``user_feature_sizes`` entry is
    the hashed table's working rows, ``capacity``."""
    if FEATURE in ds.user_features:
        raise ValueError(f"model.hashed_user_id: the data already has a user feature {FEATURE!r}")
    ds.user_features[FEATURE] = raw_user_ids(ds)
    ds.user_feature_sizes[FEATURE] = capacity
