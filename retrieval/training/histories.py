"""What the user tower reads for a training pair: the user's history at the pair's own time.

The test split holds each user's *latest* interactions and the served tower reads the items
consumed *before* a request. A pair trained with the user's whole (static) history sees items
consumed after the positive; training it with only the items before it (``causal``, the
default) asks the tower the question it answers at serving: what comes next. Causal histories
lift recall on MovieLens (``bench/quality.py`` measures it; the figures: ``bench/RESULTS.md``).

Pairs are kept in timeline order (by user, then time) so the history of pair ``j`` is the
``H`` pairs before it back to its user's first pair ``first[j]``; no ``[M, H]`` table is built::

    item_ids  = [5, 7, 9, | 2, 4]        two users' timelines, oldest first
    first     = [0, 0, 0, | 3, 3]
    causal_history(item_ids, first, idx=[2, 4], history_len=3)
              = [[7, 5, -1], [2, -1, -1]]   newest first, -1 padded
"""

from __future__ import annotations

import numpy as np


def timeline_first(user_ids: np.ndarray) -> np.ndarray:
    """``user_ids [M]`` of pairs in timeline order (a user's pairs contiguous) -> ``first
    [M] int64``: the position of each pair's user's first pair. Raises ``ValueError`` when a
    user's pairs are not contiguous."""
    users = np.asarray(user_ids, dtype=np.int64)
    if not len(users):
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    if len(np.unique(users[starts])) != len(starts):
        raise ValueError("user_ids: pairs are not in timeline order (a user's pairs are split)")
    return np.repeat(starts, np.diff(np.r_[starts, len(users)])).astype(np.int64)


def causal_history(
    item_ids: np.ndarray, first: np.ndarray, idx: np.ndarray, history_len: int
) -> np.ndarray:
    """The ``history_len`` items before each pair ``idx [B]`` in its user's timeline ->
    ``[B, H] int64``, newest first, ``-1`` padded (as the served tower reads)."""
    back = idx[:, None] - 1 - np.arange(history_len)[None, :]  # [B, H]
    return np.where(back >= first[idx][:, None], item_ids[np.maximum(back, 0)], -1)


def static_history(history: np.ndarray, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Each user's whole history ``history [U, H]`` with the pair's positive hidden -> ``[B, H]``
    (the positive must not be among the inputs that predict it)."""
    hist = history[users]
    return np.where(hist == items[:, None], -1, hist)
