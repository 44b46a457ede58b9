"""Per-user time split (leave-latest-out) and each user's most recent history.

Both order a user's events by ``(timestamp, row position)``: equal timestamps (MovieLens has
many ratings entered within the same second) keep their order in the log, so results are
deterministic. Both are vectorized (sorts and scatters, no loop over users).
"""

from __future__ import annotations

import numpy as np

from retrieval.data.schema import Interactions

_EPS = 1e-9  # 0.1 * 30 is 3.0000000000000004 in floating point: ceil must still give 3


def split_by_time(
    interactions: Interactions, test_fraction: float = 0.2, min_train: int = 1
) -> tuple[Interactions, Interactions]:
    """Per user, the latest ``ceil(test_fraction * count)`` interactions go to test.

    A user whose train part would keep fewer than ``min_train`` interactions keeps everything in
    train. Rows keep their original relative order in both parts.

    interactions: ``M`` events. Returns ``(train [M - T], test [T])``.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction: must be in [0, 1), got {test_fraction}")
    if min_train < 0:
        raise ValueError(f"min_train: must be >= 0, got {min_train}")
    interactions.validate()
    order, starts, counts = user_timelines(interactions)
    n_test = np.ceil(counts * test_fraction - _EPS).astype(np.int64)  # [users present]
    n_test = np.where(counts - n_test >= min_train, n_test, 0)
    rank = np.arange(len(order)) - np.repeat(starts, counts)  # position in the user's timeline
    is_test = np.zeros(len(interactions), dtype=bool)
    is_test[order] = rank >= np.repeat(counts - n_test, counts)
    return interactions.select(~is_test), interactions.select(is_test)


def history_by_user(
    interactions: Interactions, num_users: int, max_len: int, newest_first: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Each user's ``max_len`` most recent items, left-aligned and ``-1`` padded.

    With ``newest_first`` (the default, what the user tower and the demo read) column 0 is the
    latest item; otherwise the kept items are in chronological order.

    Returns ``items [U, max_len] int64`` and ``lengths [U] int64`` (= min(count, max_len)).
    """
    if max_len < 0:
        raise ValueError(f"max_len: must be >= 0, got {max_len}")
    interactions.validate(num_users=num_users)
    out = np.full((num_users, max_len), -1, dtype=np.int64)
    lengths = np.zeros(num_users, dtype=np.int64)
    if len(interactions) == 0 or max_len == 0:
        return out, lengths
    order, starts, counts = user_timelines(interactions)
    users = interactions.user_id[order[starts]]  # [users present]
    lengths[users] = np.minimum(counts, max_len)
    from_end = np.repeat(starts + counts, counts) - 1 - np.arange(len(order))  # 0 = newest
    keep = from_end < max_len
    rows = interactions.user_id[order[keep]]
    if newest_first:
        cols = from_end[keep]
    else:
        cols = np.repeat(lengths[users] - 1, counts)[keep] - from_end[keep]
    out[rows, cols] = interactions.item_id[order[keep]]
    return out, lengths


def user_timelines(it: Interactions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> ``order [M]`` (rows by user, then time, then row position), and per user present
    (ascending id) the ``starts`` and ``counts`` of its block in ``order``."""
    order = np.lexsort((np.arange(len(it)), it.timestamp, it.user_id))
    users = it.user_id[order]
    starts = (
        np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
        if len(users)
        else np.zeros(0, np.int64)
    )
    counts = np.diff(np.r_[starts, len(users)])
    return order, starts, counts
