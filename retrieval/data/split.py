"""Time-based train/test split per user, and each user's most recent history."""

from __future__ import annotations

import numpy as np

from retrieval.data.schema import Interactions


def _order_by_user_time(it: Interactions) -> np.ndarray:
    """Indices sorted by (user, timestamp, original position): ties broken deterministically."""
    return np.lexsort((np.arange(len(it)), it.timestamp, it.user_id))


def split_by_time(it: Interactions, test_fraction: float = 0.2, min_train: int = 1) -> tuple[Interactions, Interactions]:
    """Per user, the latest ``ceil(test_fraction * count)`` interactions go to test, keeping at
    least ``min_train`` in train (a user with fewer keeps everything in train)."""
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    order = _order_by_user_time(it)
    users = it.user_id[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    counts = np.diff(np.r_[starts, len(users)])
    n_test = np.ceil(counts * test_fraction).astype(np.int64)
    n_test = np.where(counts - n_test >= min_train, n_test, 0)
    rank = np.arange(len(users)) - np.repeat(starts, counts)  # position within the user's timeline
    is_test_sorted = rank >= np.repeat(counts - n_test, counts)
    is_test = np.zeros(len(it), dtype=bool)
    is_test[order] = is_test_sorted
    return it.select(~is_test), it.select(is_test)


def history_by_user(it: Interactions, num_users: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Each user's ``max_len`` most recent items, newest first -> ``(items [U, max_len] int64
    (-1 padded), lengths [U] int64)``."""
    order = _order_by_user_time(it)[::-1]  # newest first within each user (users descending)
    users, items = it.user_id[order], it.item_id[order]
    out = np.full((num_users, max_len), -1, dtype=np.int64)
    if len(users) == 0:
        return out, np.zeros(num_users, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    counts = np.diff(np.r_[starts, len(users)])
    rank = np.arange(len(users)) - np.repeat(starts, counts)
    keep = rank < max_len
    out[users[keep], rank[keep]] = items[keep]
    lengths = np.zeros(num_users, dtype=np.int64)
    lengths[users[starts]] = np.minimum(counts, max_len)
    return out, lengths
