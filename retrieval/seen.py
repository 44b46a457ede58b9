"""Every item each user consumed, as sorted ids: what a request excludes beyond the tower's window.

The user tower reads a user's ``history_len`` most recent items; a user who consumed more would
be recommended the older ones again. A request may therefore carry its full seen list
(``UserBatch.seen [B, S]``) and the index skips those items inside its scan
(``RetrievalModel.candidate_budget``, ``retrieval/index/exclude.py``). The store here holds the
lists of U users in CSR form and cuts the padded rows of a batch from it.

Sorted ids, not a Bloom bitset: the test is exact (no false positive ever hides an item the user
has not seen), it costs 8 bytes per seen item (:meth:`SeenSets.nbytes`; a request's list is
``[S] int64``); the index sorts the list's rows once and finds a probed list's seen items with
one binary search (``O(log S)`` per list, then one write per seen item in it). A Bloom filter
would fix the size per user but drop unseen items at its false-positive rate, and would need a
hash test per scanned item.

Example::

    seen = SeenSets.of(np.array([0, 0, 1]), np.array([5, 2, 5]), num_users=3)
    seen.rows(np.array([0, 2]))  # tensor([[2, 5], [-1, -1]])
    pad_lists([np.array([7, 3]), None])  # tensor([[7, 3], [-1, -1]]): requests' own lists
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def pad_lists(lists: Sequence[np.ndarray | None]) -> torch.Tensor | None:
    """B requests' seen lists (``int64 [S_b]`` each, any order, or None) -> ``[B, S] int64``,
    ``-1`` padded at the end, ``S`` the longest; None when no list holds an id, so a batch
    without seen lists costs the model nothing. One vectorised fill, no loop over the ids."""
    lengths = np.array([0 if s is None else len(s) for s in lists], dtype=np.int64)  # [B]
    width = int(lengths.max(initial=0))
    if width == 0:
        return None
    out = np.full((len(lists), width), -1, dtype=np.int64)
    filled = np.arange(width)[None, :] < lengths[:, None]  # [B, S], row-major like the concat
    out[filled] = np.concatenate([s for s in lists if s is not None and len(s)])
    return torch.from_numpy(out)


@dataclass(frozen=True)
class SeenSets:
    """Seen items of U users: ``indptr [U + 1] int64`` and ``items [M'] int64``, user u's
    distinct items ascending in ``items[indptr[u]:indptr[u + 1]]``."""

    indptr: np.ndarray
    items: np.ndarray

    @classmethod
    def of(cls, user_ids: np.ndarray, item_ids: np.ndarray, num_users: int) -> SeenSets:
        """From ``M`` (user, item) pairs (repeats allowed) of users ``0..num_users-1``."""
        users = np.asarray(user_ids, dtype=np.int64)
        items = np.asarray(item_ids, dtype=np.int64)
        if users.shape != items.shape or users.ndim != 1:
            raise ValueError(
                f"user_ids and item_ids: expected two [M] arrays, got {users.shape} and {items.shape}"
            )
        if len(users) and (users.min() < 0 or users.max() >= num_users):
            raise ValueError(
                f"user_ids: expected ids in [0, {num_users}), got {users.min()}..{users.max()}"
            )
        if len(items) and items.min() < 0:
            raise ValueError(f"item_ids: expected ids >= 0, got {items.min()}")
        # sorted by (user, item) and de-duplicated as two keys: one int64 key per pair
        # (user * (max item + 1) + item) overflows for large ids and scrambles the users
        order = np.lexsort((items, users))
        u, i = users[order], items[order]
        first = np.ones(len(u), dtype=bool)
        first[1:] = (u[1:] != u[:-1]) | (i[1:] != i[:-1])
        u, i = u[first], i[first]
        indptr = np.zeros(num_users + 1, dtype=np.int64)
        np.cumsum(np.bincount(u, minlength=num_users), out=indptr[1:])
        return cls(indptr, i.astype(np.int64))

    @property
    def num_users(self) -> int:
        return len(self.indptr) - 1

    def lengths(self, users: np.ndarray | None = None) -> np.ndarray:
        """Seen items per user ``[B] int64`` (default: all U)."""
        counts = np.diff(self.indptr)
        return counts if users is None else counts[np.asarray(users, dtype=np.int64)]

    def nbytes(self) -> int:
        """Bytes of the store (8 per seen item plus 8 per user)."""
        return int(self.indptr.nbytes + self.items.nbytes)

    def rows(self, users: np.ndarray, width: int | None = None) -> torch.Tensor:
        """The seen lists of ``users [B]`` -> ``[B, S] int64``, ascending, ``-1`` padded at the
        end; ``S`` is the longest list among them (or ``width``, which must hold it)."""
        users = np.asarray(users, dtype=np.int64)
        lengths = self.lengths(users)
        s = int(lengths.max(initial=0))
        if width is not None:
            if width < s:
                raise ValueError(f"width: {width} cannot hold a seen list of {s} items")
            s = width
        out = np.full((len(users), s), -1, dtype=np.int64)
        row = np.repeat(np.arange(len(users)), lengths)
        col = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[row, col] = self.items[np.repeat(self.indptr[users], lengths) + col]
        return torch.from_numpy(out)

    def indicator(self, users: np.ndarray, num_items: int) -> torch.Tensor:
        """``[B, N] float32``: 1 where user ``users[b]`` consumed item n (the baselines' input)."""
        users = np.asarray(users, dtype=np.int64)
        lengths = self.lengths(users)
        out = torch.zeros(len(users), num_items)
        row = torch.from_numpy(np.repeat(np.arange(len(users)), lengths))
        cols = self.rows(users)
        out[row, cols[cols >= 0]] = 1.0
        return out
